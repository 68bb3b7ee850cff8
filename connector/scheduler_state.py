"""What the scheduler half keeps per request: its last lookup (planned from in the
step it was made, its S3 answer reused while the request waits) and its block tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .group_lookup import GroupS3Answer, GroupTiers

if TYPE_CHECKING:
    from vllm.v1.request import Request

# How long a waiting request's S3 lookup (one Redis round trip, which also touches
# the blocks' last-access scores) is reused while vLLM asks again each step. Its local
# tiers are looked up afresh every time; a block whose load failed since is left out
# at once; what this bounds is an S3 object removed by the service's GC meanwhile,
# which the touch made moments ago keeps at the far end of its order.
S3_LOOKUP_REUSE_SECONDS = 2.0


@dataclass
class S3Answer:
    """What Redis said of a request's blocks from `start` on: the next `found` are
    in S3 (the one after, if any before `limit`, is not)."""

    start: int
    limit: int
    found: int
    asked_at: float

    def found_from(self, rest: int, limit: int, now: float) -> int | None:
        """Blocks in S3 from block `rest` on, by this answer; None where it does not
        say (it looked from elsewhere, up to another limit, or too long ago)."""
        if limit != self.limit or now - self.asked_at > S3_LOOKUP_REUSE_SECONDS:
            return None
        if not self.start <= rest <= self.start + self.found:
            return None
        return self.start + self.found - rest


@dataclass
class PeerAnswer:
    """What presence said of a request's blocks from `start` on: live instance
    `instance` holds the next `held` in its CPU tier (None: no instance held any)."""

    start: int
    limit: int
    instance: str | None
    held: int
    asked_at: float

    def says(self, rest: int, limit: int, now: float) -> bool:
        """Whether this answer says who holds the blocks from block `rest` on: it looked
        from there (or from before, and the holder's run reaches it), up to `limit`,
        lately."""
        if limit != self.limit or now - self.asked_at > S3_LOOKUP_REUSE_SECONDS:
            return False
        if self.instance is None:
            return rest == self.start
        return self.start <= rest < self.start + self.held

    def holder_from(self, rest: int) -> tuple[str, int] | None:
        """(instance, blocks it holds from block `rest` on), where `says` it."""
        if self.instance is None:
            return None
        return self.instance, self.start + self.held - rest


@dataclass
class Lookup:
    num_computed_tokens: int
    tiers: list[str]  # tier of each block past the local hit, in order
    step: int = 0  # the scheduler step it was made in: plans use only that step's
    # The hit as last answered: the tier of each block it could load (CPU room
    # allowing); the cost model loads a prefix of it.
    hit: list[str] = field(default_factory=list)
    # How many blocks of `hit` the CPU tier had slots to stage (None: all of it); the
    # blocks past it are counted as a "no_room" decision, not dropped silently.
    fits: int | None = None
    # Several KV cache groups: the tier of each (group, block index) looked at, and
    # the blocks of every group the answered hit loads, as (group, index, tier).
    group_tiers: GroupTiers = field(default_factory=dict)
    plan: list[tuple[int, int, str]] = field(default_factory=list)
    load_async: bool = False  # what vLLM was told: the plan keeps to it
    peer: str = ""  # the instance whose CPU tier holds the hit's peer blocks
    # What presence said, kept while the request waits (S3_LOOKUP_REUSE_SECONDS).
    peer_answer: PeerAnswer | None = None
    s3: S3Answer | None = None  # kept while the request waits (S3_LOOKUP_REUSE_SECONDS)
    # Several KV cache groups: what S3 holds of their blocks, reused alike.
    group_s3: GroupS3Answer | None = None


@dataclass
class RequestState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    next_block: int = 0  # blocks before this one are cached or planned
    # Every KV cache group's block table (the first is `block_ids`).
    group_block_ids: list[list[int]] = field(default_factory=list)

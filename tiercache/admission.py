"""What the `selective` mover policy keeps, and where: admission and eviction from
evidence of reuse, so that a node writes down only what is likely to be read again.

Under write-through every block a request computes goes to the CPU tier, the disk and
S3; in production traces most of them are never asked for again. Here:

- Every request's blocks are counted once, when the scheduler first looks it up, in a
  small frequency sketch (`FrequencySketch`, a count-min sketch of 4-bit counters
  that halves itself every `sample` counts, so old popularity fades).
- The CPU tier is a segmented LRU: a block enters on probation; a CPU hit moves it to
  the protected segment (at most `protected_share` of the slots, its oldest falling
  back to probation). Evictions take probation's oldest first, so one long prompt
  read once cycles through probation and never flushes what conversations reuse.
- A block the CPU tier evicts goes down only where it earns it (`down_tiers`): to
  disk while the disk has room, and once it is full only if the block was asked for
  by at least `disk_min_requests` requests and is no less popular than the disk's
  least recently used block, which it then displaces (TinyLFU's comparison, so the
  bar rises and falls with the capacity); to S3 if it was asked for by at least
  `s3_min_requests` requests, on this node or across the fleet (`fleet`, counts kept
  in Redis with a TTL: tiercache/index/request_counts.py).
- A block asked for by at least `everywhere_min_requests` requests (a system prompt
  every request shares) goes to the disk and S3 as soon as its CPU slot is filled
  (`take_popular`), rather than when the CPU tier evicts it.

All of it lives in the connector's scheduler half, which sees every request; the
worker is told per victim which tiers to write (`TierCacheMetadata.write_back_tiers`)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING

from tiercache.object_shape import ObjectShape
from tiercache.tiers import DISK, S3

if TYPE_CHECKING:
    from tiercache.config import TierCacheConfig
    from tiercache.index.request_counts import FleetRequestCounts

__all__ = ["Admission", "FrequencySketch", "admission_for"]

_ROWS = 4
_MAX_COUNT = 15  # 4-bit counters: enough to tell hot from cold, cheap to age
_HALVED = bytes(count >> 1 for count in range(256))


class FrequencySketch:
    """How many times each key was counted lately, estimated: never under the true
    count since the last ageing, over it only by collisions. Every `sample` counts each
    counter is halved, so a block popular an hour ago does not outrank one popular now.

    Admission compares estimates with a threshold (asked for twice), so collisions must
    stay rare: each row has at least twice as many counters as counts between two
    ageings, and a key's estimate is its least counter of four rows (80 to 160 bytes
    per block of capacity with the default sample)."""

    def __init__(self, capacity: int, sample_factor: int = 10):
        self.sample = max(sample_factor * capacity, 64)
        width = 64
        while width < 2 * self.sample:
            width *= 2
        self.width = width
        self._mask = width - 1
        self._counts = bytearray(_ROWS * width)
        self._added = 0

    def _cells(self, key: bytes) -> list[int]:
        digest = hashlib.blake2b(key, digest_size=4 * _ROWS).digest()
        return [
            row * self.width + (int.from_bytes(digest[4 * row : 4 * row + 4], "little") & self._mask)
            for row in range(_ROWS)
        ]

    def add(self, key: bytes) -> None:
        counts = self._counts
        for cell in self._cells(key):
            if counts[cell] < _MAX_COUNT:
                counts[cell] += 1
        self._added += 1
        if self._added >= self.sample:
            self._age()

    def estimate(self, key: bytes) -> int:
        counts = self._counts
        return min(counts[cell] for cell in self._cells(key))

    def _age(self) -> None:
        self._counts = bytearray(self._counts.translate(_HALVED))
        self._added //= 2


class Admission:
    """The selective policy's state for one scheduler: the sketch and the CPU tier's
    protected segment. `cpu_slots` and `disk_blocks` size them (`disk_blocks` 0: no
    disk tier)."""

    def __init__(
        self,
        cpu_slots: int,
        disk_blocks: int,
        *,
        protected_share: float,
        disk_min_requests: int,
        s3_min_requests: int,
        everywhere_min_requests: int = 0,
        lower_tiers: tuple[str, ...] = (DISK, S3),
    ):
        self.lower_tiers = lower_tiers
        self.sketch = FrequencySketch(cpu_slots + disk_blocks)
        self.protected_limit = int(cpu_slots * protected_share)
        self.disk_blocks = disk_blocks
        self.disk_min_requests = disk_min_requests
        self.s3_min_requests = s3_min_requests
        self.protected: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        # 0: never at once (nor with no tier below the CPU tier's to go to).
        self.everywhere_min_requests = everywhere_min_requests if lower_tiers else 0
        # The fleet's counts (set by the scheduler where Redis and S3 are configured).
        self.fleet: FleetRequestCounts | None = None
        # Blocks popular enough to go everywhere at once, and the steps each has waited
        # for its CPU slot to be filled; and those sent (not sent again while remembered).
        self.popular: OrderedDict[bytes, int] = OrderedDict()
        self._sent_everywhere: OrderedDict[bytes, None] = OrderedDict()
        self._remembered = max(64, cpu_slots)

    # -- evidence -------------------------------------------------------------------
    def requested(self, blocks: list[bytes]) -> None:
        """A request asks for these blocks (counted once per request)."""
        sketch, popular_at = self.sketch, self.everywhere_min_requests
        for block in blocks:
            sketch.add(block)
            if popular_at and sketch.estimate(block) == popular_at:
                self._popular(block)
        if self.fleet is not None:
            self.fleet.requested(blocks)

    def requests_for(self, block: bytes) -> int:
        """Requests that asked for `block` lately, on this node."""
        return self.sketch.estimate(block)

    def fleet_requests_for(self, block: bytes) -> int:
        """The same across the fleet, as far as this node knows (never less than its own)."""
        local = self.sketch.estimate(block)
        return max(local, self.fleet.count(block)) if self.fleet is not None else local

    # -- everywhere at once ---------------------------------------------------------
    def _popular(self, block: bytes) -> None:
        if block not in self._sent_everywhere and block not in self.popular:
            self.popular[block] = 0
            while len(self.popular) > self._remembered:
                self.popular.popitem(last=False)

    def take_popular(self) -> list[bytes]:
        """The popular blocks to look at this step (the fleet's newly popular joined)."""
        if self.fleet is not None:
            for block in self.fleet.take_popular():
                self._popular(block)
        return list(self.popular)

    def sent_everywhere(self, block: bytes) -> None:
        self.popular.pop(block, None)
        self._sent_everywhere[block] = None
        while len(self._sent_everywhere) > self._remembered:
            self._sent_everywhere.popitem(last=False)

    def still_waiting(self, block: bytes, most_steps: int) -> None:
        """`block` is not in a filled CPU slot yet: given up after `most_steps` steps."""
        waited = self.popular.get(block)
        if waited is None:
            return
        if waited >= most_steps:
            del self.popular[block]
        else:
            self.popular[block] = waited + 1

    # -- the CPU tier ----------------------------------------------------------------
    def hit(self, block: bytes) -> list[bytes]:
        """A CPU hit: `block` is protected now. Returns the blocks that fell back to
        probation (the protected segment's oldest, past its limit), which the caller
        marks recently used so they are not the very next victims."""
        self.protected[block] = None
        self.protected.move_to_end(block)
        demoted = []
        while len(self.protected) > self.protected_limit:
            oldest, _ = self.protected.popitem(last=False)
            demoted.append(oldest)
        return demoted

    def on_probation(self, block: bytes) -> bool:
        """Evict it before any protected block."""
        return block not in self.protected

    def left_cpu(self, block: bytes) -> None:
        self.protected.pop(block, None)

    # -- writing down -------------------------------------------------------------------
    def down_tiers(self, block: bytes, disk_held: int, disk_victim: bytes | None) -> tuple[str, ...]:
        """Where a block the CPU tier evicts is written: `disk_held` blocks are on the
        disk now, `disk_victim` is the one it would evict next (None: unknown)."""
        asked = self.requests_for(block)
        tiers: list[str] = []
        if self.disk_blocks and (disk_held < self.disk_blocks or self._displaces(asked, disk_victim)):
            tiers.append(DISK)
        if S3 in self.lower_tiers and self.fleet_requests_for(block) >= self.s3_min_requests:
            tiers.append(S3)
        return tuple(tiers)

    def _displaces(self, asked: int, disk_victim: bytes | None) -> bool:
        """A full disk takes a block asked for often enough, and no less than the block
        it evicts for it."""
        if asked < self.disk_min_requests:
            return False
        return disk_victim is None or asked >= self.requests_for(disk_victim)

    def clear(self) -> None:
        self.protected.clear()
        self.popular.clear()
        self._sent_everywhere.clear()


def admission_for(config: TierCacheConfig, cpu_slots: int, slot_bytes: int) -> Admission | None:
    """The scheduler's admission under the `selective` policy; None under the others.
    The disk's capacity in blocks counts each object's header (a plain model's; the
    disk's own evictions, which the scheduler hears of, keep its count of what the disk
    holds true either way)."""
    movers = config.movers
    if movers.policy != "selective":
        return None
    object_bytes = ObjectShape("0" * 16, "0" * 16, slot_bytes).object_bytes
    disk_blocks = config.disk.capacity // object_bytes if config.disk is not None else 0
    lower = ((DISK,) if config.disk is not None else ()) + ((S3,) if config.s3 is not None else ())
    return Admission(
        cpu_slots,
        disk_blocks,
        protected_share=movers.selective_protected_share,
        disk_min_requests=movers.selective_disk_min_requests,
        s3_min_requests=movers.selective_s3_min_requests,
        everywhere_min_requests=movers.selective_everywhere_min_requests,
        lower_tiers=lower,
    )

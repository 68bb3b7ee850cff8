"""Lookups for a model with several KV cache groups (vLLM's hybrid manager), or a lone
sliding-window or Mamba group: the longest hit every group can serve (groups.py),
cut to what the cost model loads and the CPU tier has slots to stage.

Every group's blocks are looked up in the local tiers afresh at each ask, and in S3 in
one Redis round trip (RedisIndex.presence) whose answer is reused while the request
waits, as a one-group model's is (lookup.py). Blocks of the groups that need only some
of them (a window, a state) are asked about all at once: which of them a hit needs
depends on where it ends, and asking block by block cost a round trip each.

With the peer tier, presence (one round trip, reused alike) names the live instance
whose CPU tier holds the longest run of the presence group's blocks (the first
full-attention group's: presence lists no other, connector/events.py) from where this
instance's local run of that group ends. The other groups' blocks at those indexes
are planned from that instance too, unasked: it computed the same prefix, so it
stored them, though its CPU tier may have evicted one since. Asking would cost
presence entries (and Redis memory) for every group of every block; a block the
holder lacks instead costs one verified miss: the reader checks the holder's
directory row, slot generation and checksum before it takes a byte, the request's
load fails whole (a model of several groups cannot fail block by block) and vLLM
recomputes it, and the block stays out of lookups for a while (load_failures.py), so
the next lookup plans it from elsewhere or ends the hit before it."""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

from tiercache.index.redis_conn import RedisUnavailable
from tiercache.index.redis_index import RedisIndex
from tiercache.metrics import LOOKUP_BLOCKS
from tiercache.policy import BlockPolicy
from tiercache.tiers import CPU, DISK, PEER, S3

from .cost_model import LoadCostModel
from .groups import FULL, NONE, STATE, GroupRule, best_end, group_key
from .load_failures import RecentLoadFailures

if TYPE_CHECKING:
    from .scheduler_state import PeerAnswer

    # Lookups._peer_ask_from and Lookups._ask_peers (lookup.py): a hybrid lookup asks
    # peers from the same point and reuses presence's answers the same way.
    PeerAskFrom = Callable[[list[str], int], int]
    PeerFound = tuple[PeerAnswer, tuple[str, int] | None]
    AskPeers = Callable[[PeerAnswer | None, Sequence[bytes], int, int], PeerFound]

# (group, index) -> the tier it was found in, None where it was looked for and is not.
GroupTiers = dict[tuple[int, int], str | None]
# (group, index, tier) of each block a hit loads.
GroupPlan = list[tuple[int, int, str]]


@dataclass
class GroupS3Answer:
    """What Redis said of a request's blocks: (group, index) -> in S3. A full-attention
    group's blocks were asked up to their first miss only, the others' one by one."""

    limit: int
    asked_at: float
    found: dict[tuple[int, int], bool] = field(default_factory=dict)
    prefix_groups: frozenset[int] = frozenset()  # the full-attention groups

    def covers(self, wanted: dict[int, list[int]], limit: int, now: float, reuse_seconds: float) -> bool:
        """Whether this answer says, fresh enough, all that `wanted` asks: per group,
        the indexes to look up in S3 (a full-attention group's as a prefix)."""
        if limit != self.limit or now - self.asked_at > reuse_seconds:
            return False
        for group, indexes in wanted.items():
            for index in indexes:
                found = self.found.get((group, index))
                if found is None:
                    return False
                if not found and group in self.prefix_groups:
                    break  # the rest of a prefix is not needed
        return True


@dataclass
class PeerSpan:
    """The blocks a peer's CPU tier is planned to serve: indexes [start, stop) of every
    group, from `instance`; in place of this instance's disk blocks there too where
    `over_disk` (the cost model expects the peer sooner). A state group's block only
    at `stop - 1`: a holder keeps a state only where its prefill stopped, and its run
    of this request's blocks ends where its own prompt did or left this one's."""

    instance: str
    start: int
    stop: int
    over_disk: bool

    def serves(self, kind: str, index: int, local: str | None) -> bool:
        if not self.start <= index < self.stop or (kind == STATE and index != self.stop - 1):
            return False
        return local is None or (local == DISK and self.over_disk)


@dataclass
class GroupHit:
    """One ask's answer: the hit ends at `end` (`first` when there is none)."""

    end: int
    tiers: list[str]  # the tier of each block of the hit, by the group it is counted in
    plan: GroupPlan
    group_tiers: GroupTiers
    s3: GroupS3Answer | None
    peer_answer: PeerAnswer | None = None  # presence's answer, reused while the request waits
    peer: str = ""  # the instance the plan's peer blocks are read from

    def __post_init__(self) -> None:
        if not any(tier == PEER for _, _, tier in self.plan):
            self.peer = ""


class GroupLookup:
    """The scheduler's lookups of a model with several KV cache groups (lookup.py asks)."""

    def __init__(
        self,
        rules: list[GroupRule],
        block_size: int,
        policy: BlockPolicy,
        load_failures: RecentLoadFailures,
        s3_index: RedisIndex | None,
        model_digest: str,
        rank_digests: list[str],
        cost: LoadCostModel | None,
        reuse_seconds: float,
        *,
        presence_group: int = 0,
        peer_ask_from: PeerAskFrom | None = None,
        ask_peers: AskPeers | None = None,
    ):
        """`presence_group`: the group whose blocks presence lists; `peer_ask_from` and
        `ask_peers`: how a peer is asked (lookup.py), None without the peer tier."""
        self.rules = rules
        self.block_size = block_size
        self.policy = policy
        self.load_failures = load_failures
        self.s3_index = s3_index
        self.model_digest = model_digest
        self.rank_digests = rank_digests
        self.cost = cost
        self.reuse_seconds = reuse_seconds
        self.full_groups = [g for g, rule in enumerate(rules) if rule.kind == FULL]
        # The group whose blocks the cost model counts: one block per index.
        self.primary = next((g for g, rule in enumerate(rules) if rule.kind != STATE), 0)
        self.presence_group = presence_group
        self.peer_ask_from = peer_ask_from
        self.ask_peers = ask_peers

    def look_up(
        self,
        hashes,
        first: int,
        limit: int,
        earlier: GroupS3Answer | None,
        *,
        names: Sequence[bytes] | None = None,
        earlier_peer: PeerAnswer | None = None,
    ) -> GroupHit:
        """The hit from block `first` on, below `limit`; `earlier`: this request's last
        S3 answer, reused if it still says all this ask needs. `names`: the blocks as
        presence names them (vLLM's hashes; `hashes` by default); `earlier_peer`: the
        request's last presence answer, reused alike."""
        LOOKUP_BLOCKS.inc(limit - first)
        group_tiers: GroupTiers = {}
        if any(rule.kind == NONE for rule in self.rules):
            return GroupHit(first, [], [], group_tiers, None)  # a group that can serve nothing
        keys: dict[tuple[int, int], bytes] = {}
        s3 = None
        if self.s3_index is not None:
            s3 = self._s3_answer(hashes, first, limit, group_tiers, keys, earlier)
        peer_answer, span = self._peer_span(hashes, names, first, limit, earlier_peer)
        if span is not None:
            self._peer_over_full_groups(span, hashes, group_tiers)

        def holds(group: int, index: int) -> bool:
            if (group, index) not in group_tiers:
                key = keys.get((group, index)) or group_key(bytes(hashes[index]), group)
                tier = self.policy.local_tier(key)
                if span is not None and span.serves(self.rules[group].kind, index, tier):
                    tier = PEER  # past the local tiers, before S3
                elif tier is None and s3 is not None and s3.found.get((group, index)):
                    tier = S3
                group_tiers[(group, index)] = None if key in self.load_failures else tier
            return group_tiers[(group, index)] is not None

        def hit(end: int, tiers: list[str], plan: GroupPlan) -> GroupHit:
            return GroupHit(end, tiers, plan, group_tiers, s3, peer_answer, span.instance if span else "")

        end = best_end(self.rules, first, limit, self.block_size, holds)
        if end == first:
            return hit(first, [], [])
        tiers = [group_tiers.get((self.primary, i)) or S3 for i in range(first, end)]
        load = len(tiers) if self.cost is None else self.cost.blocks_to_load(tiers, self.block_size)
        plan = self.plan(group_tiers, first, end)
        if load == end - first and self.fits_cpu_tier(plan, hashes):
            return hit(end, tiers, plan)
        end = self._cut(hashes, first, end, tiers, group_tiers, holds)
        if end == first:
            return hit(first, [], [])
        return hit(end, tiers[: end - first], self.plan(group_tiers, first, end))

    def plan(self, group_tiers: GroupTiers, first: int, end: int) -> GroupPlan:
        """(group, index, tier) of every block a hit ending at `end` loads, by index
        then group: a lost block fails every group's blocks after it (worker.py)."""
        plan = [
            (group, index, group_tiers[(group, index)] or "")  # "": not held, lost (vLLM chose the end)
            for group, rule in enumerate(self.rules)
            for index in rule.needs(first, end, self.block_size)
        ]
        return sorted(plan, key=lambda entry: (entry[1], entry[0]))

    def fits_cpu_tier(self, plan: GroupPlan, hashes) -> bool:
        """Whether the CPU tier has a slot free for each disk or S3 block `plan` stages."""
        cpu_blocks = [group_key(bytes(hashes[i]), g) for g, i, tier in plan if tier == CPU]
        return sum(tier != CPU for _, _, tier in plan) <= self.policy.room_for_staging(cpu_blocks)

    # -- the cut ----------------------------------------------------------------------
    def _cut(
        self, hashes, first: int, end: int, tiers: list[str], group_tiers: GroupTiers, holds: Callable
    ) -> int:
        """Where a hit that the cost model or the CPU tier's room cuts ends: starting
        from `end`, the cost model's cut (never past a lacking slot) is rounded down to
        an end every group can serve, until the cost model loads all of one whose
        blocks fit. Every shorter end's groups and slots are counted in one pass, so
        each step down costs a lookup, not a new plan of the whole hit."""
        if self.cost is None:
            loads = list(range(1, len(tiers) + 1))
        else:
            loads = self.cost.blocks_to_load_by_prefix(tiers, self.block_size)
        ends, fits = self._ends_that_fit(hashes, first, end, group_tiers, holds)
        while end > first:
            count = end - first
            load = loads[count - 1] if fits[end] else min(loads[count - 1], count - 1)
            if load == count:
                return end
            below = bisect_right(ends, first + load)
            end = ends[below - 1] if below else first
        return first

    def _ends_that_fit(
        self, hashes, first: int, last: int, group_tiers: GroupTiers, holds: Callable
    ) -> tuple[list[int], dict[int, bool]]:
        """The ends in (first, last] that every group can serve (best_end's answer for
        each), and for each whether the CPU tier has slots for all its plan stages
        (fits_cpu_tier), from running sums of each group's blocks held and of the
        unpinned slots each would take: a staged block one, a CPU block not pinned yet
        one (the hit pins it), a pinned one none."""
        free = self.policy.slots.unpinned()
        span = range(first, last)
        held: list[list[int]] = []
        taken: list[list[int]] = []
        for group in range(len(self.rules)):
            flags = [holds(group, index) for index in span]
            slots = [
                self._slots_taken(group, index, group_tiers, hashes) if held_here else 0
                for index, held_here in zip(span, flags, strict=True)
            ]
            held.append([0, *accumulate(flags)])
            taken.append([0, *accumulate(slots)])
        ends: list[int] = []
        fits: dict[int, bool] = {}
        for end in range(first + 1, last + 1):
            need = 0
            for group, rule in enumerate(self.rules):
                needs = rule.needs(first, end, self.block_size)
                start, stop = needs.start - first, needs.stop - first
                if held[group][stop] - held[group][start] != stop - start:
                    break
                need += taken[group][stop] - taken[group][start]
            else:
                ends.append(end)
                fits[end] = need <= free
        return ends, fits

    def _slots_taken(self, group: int, index: int, group_tiers: GroupTiers, hashes) -> int:
        if group_tiers[(group, index)] != CPU:
            return 1
        return self.policy.slots.unpinned_among((group_key(bytes(hashes[index]), group),))

    # -- tiers ------------------------------------------------------------------------
    def _peer_span(
        self, hashes, names: Sequence[bytes] | None, first: int, limit: int, earlier: PeerAnswer | None
    ) -> tuple[PeerAnswer | None, PeerSpan | None]:
        """(presence's answer, the blocks a peer serves) for this ask. The presence
        group's local run from `first` says where a peer is asked from, as a one-group
        model's local run does (Lookups._peer_ask_from): where it ends, or at its
        first disk block where the cost model may expect the peer sooner; or before,
        at the first block another group lacks of those a hit ending with that run
        needs (an instance that loaded a hit holds only its window's last blocks)."""
        if self.ask_peers is None or self.peer_ask_from is None:
            return earlier, None
        group = self.presence_group
        keys = (group_key(bytes(hashes[index]), group) for index in range(first, limit))
        run = self.policy.local_run(keys, self.load_failures)
        ask_from = self.peer_ask_from(run, first)
        for other, rule in enumerate(self.rules):
            if rule.kind == FULL or not run:
                continue
            for index in rule.needs(first, first + len(run), self.block_size):
                key = group_key(bytes(hashes[index]), other)
                if self.policy.local_tier(key) is None and key not in self.load_failures:
                    ask_from = min(ask_from, index)
                    break
        if ask_from >= limit:
            return earlier, None
        answer, found_at = self.ask_peers(earlier, hashes if names is None else names, ask_from, limit)
        if found_at is None:
            return answer, None
        instance, held = found_at
        stop = ask_from + held
        on_disk = run[ask_from - first : stop - first].count(DISK)
        over_disk = bool(on_disk) and self.cost is not None and self.cost.faster(PEER, DISK, on_disk)
        return answer, PeerSpan(instance, ask_from, stop, over_disk)

    def _peer_over_full_groups(self, span: PeerSpan, hashes, group_tiers: GroupTiers) -> None:
        """The full-attention groups' blocks `_s3_answer` placed already (their local
        run, then S3 up to its first miss): a peer's serve those it covers instead of
        S3, and of disk where it is expected sooner; past the first block that no tier
        holds, their blocks are looked up afresh."""
        for group in self.full_groups:
            for index in range(span.start, span.stop):
                if (group, index) not in group_tiers:
                    break
                tier = group_tiers[(group, index)]
                if tier is None:
                    key = group_key(bytes(hashes[index]), group)
                    if key in self.load_failures:
                        break  # failed lately: it still ends the prefix
                    del group_tiers[(group, index)]  # holds() asks again, the peer included
                    break
                if tier == S3 or span.serves(FULL, index, tier):
                    group_tiers[(group, index)] = PEER

    def _s3_answer(
        self,
        hashes,
        first: int,
        limit: int,
        group_tiers: GroupTiers,
        keys: dict[tuple[int, int], bytes],
        earlier: GroupS3Answer | None,
    ) -> GroupS3Answer | None:
        """Each full-attention group's blocks from `first` on as far as the local tiers
        hold them (into `group_tiers`), then what S3 holds of the rest of its prefix and
        of every other group's blocks no local tier holds: `earlier` where it says all
        of that, else one round trip. None when Redis does not answer (S3 is a miss)."""
        assert self.s3_index is not None  # asked only with an S3 tier
        wanted: dict[int, list[int]] = {}
        for group, rule in enumerate(self.rules):
            indexes = wanted[group] = []
            for index in range(first, limit):
                key = keys[(group, index)] = group_key(bytes(hashes[index]), group)
                tier = self.policy.local_tier(key)
                if rule.kind == FULL:
                    if indexes or tier is None or key in self.load_failures:
                        indexes.append(index)  # past its local run: the rest is asked as a prefix
                    else:
                        group_tiers[(group, index)] = tier
                elif tier is None and key not in self.load_failures:
                    indexes.append(index)
        prefix_groups = frozenset(self.full_groups)
        now = time.monotonic()
        if earlier is not None and earlier.covers(wanted, limit, now, self.reuse_seconds):
            answer = earlier
        else:
            probes = [([keys[(g, i)] for i in indexes], g in prefix_groups) for g, indexes in wanted.items()]
            try:
                found = self.s3_index.presence(self.model_digest, self.rank_digests, probes)
            except RedisUnavailable:
                return None
            answer = GroupS3Answer(limit, now, prefix_groups=prefix_groups)
            for (group, indexes), held in zip(wanted.items(), found, strict=True):
                answer.found.update(zip(((group, i) for i in indexes), held, strict=False))
        for group in self.full_groups:
            # Past the local run: in S3 as far as the answer says and no load of them
            # failed since; the first block that is not ends the group's prefix.
            for index in wanted[group]:
                if not answer.found.get((group, index)) or keys[(group, index)] in self.load_failures:
                    group_tiers[(group, index)] = None
                    break
                group_tiers[(group, index)] = S3
        return answer

"""The scheduler half's lookups (get_num_new_matched_tokens): the longest cached
prefix of a request across the tiers, cut to what the cost model loads and the CPU
tier has slots to stage. A model with several KV cache groups is looked up group by
group (group_lookup.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tiercache.index.redis_conn import RedisUnavailable
from tiercache.metrics import LOOKUP_BLOCKS
from tiercache.tiers import CPU, DISK, PEER, S3

from .groups import group_key
from .scheduler_base import SchedulerBase
from .scheduler_state import Lookup, PeerAnswer, S3Answer

if TYPE_CHECKING:
    from vllm.v1.request import Request


class Lookups(SchedulerBase):
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        hashes = self._block_keys(request)
        limit = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        first = num_computed_tokens // self.block_size
        if first >= limit:
            return 0, False
        if self.policy.admission is not None and request.request_id not in self._lookups:
            # The selective policy's evidence of reuse: each request's blocks, once.
            keys = [bytes(h) for h in hashes[first:limit]]
            if self.hybrid:
                keys = [group_key(key, group) for group in range(len(self.group_rules)) for key in keys]
            self.policy.requested(keys)
        if self.hybrid:
            return self._lookup_groups(request, hashes, first, limit, num_computed_tokens)
        # The local tiers afresh every time (a block evicted, failed or filled since
        # the last ask is seen); the S3 part from the request's last answer while
        # that still says (a waiting request is asked about every step).
        earlier = self._lookups.get(request.request_id)
        tiers = self.policy.local_run((bytes(hashes[i]) for i in range(first, limit)), self.load_failures)
        rest = first + len(tiers)
        # Then another live instance's CPU tier (the peer tier), in place of this
        # instance's disk where the cost model expects the peer faster, then S3.
        peer = ""
        peer_answer = earlier.peer_answer if earlier is not None else None
        if self.peers is not None:
            ask_from = self._peer_ask_from(tiers, first)
            if ask_from < limit:
                # Presence names blocks by vLLM's hash, before and after a reset (events.py).
                peer_answer, found_at = self._ask_peers(peer_answer, request.block_hashes, ask_from, limit)
                if found_at is not None:
                    peer = found_at[0]
                    tiers = self._with_peer_blocks(tiers, hashes, first, ask_from, found_at[1])
                    rest = first + len(tiers)
        s3 = earlier.s3 if earlier is not None else None
        if rest < limit and self.s3_index is not None:
            wanted = [bytes(h) for h in hashes[rest:limit]]
            found = s3.found_from(rest, limit, time.monotonic()) if s3 is not None else None
            if found is None:
                s3 = None
                try:
                    found = self.s3_index.longest_prefix(self.model_digest, self.rank_digests, wanted)
                    s3 = S3Answer(rest, limit, found, time.monotonic())
                except RedisUnavailable:
                    found = 0
            else:
                LOOKUP_BLOCKS.inc(limit - first)
            tiers.extend([S3] * self.load_failures.leading_clear(wanted[:found]))
        else:
            LOOKUP_BLOCKS.inc(limit - first)
        lookup = self._lookups[request.request_id] = Lookup(
            num_computed_tokens,
            tiers,
            self._step,
            s3=s3,
            peer=peer if PEER in tiers else "",
            peer_answer=peer_answer,
        )
        held = hashes[first : first + len(tiers)]
        # Counted once vLLM acts on it (update_state_after_alloc): it may ask again.
        lookup.hit = tiers
        if self._is_async(tiers, held):
            tiers = self._fit_to_cpu_tier(tiers, held)
            lookup.fits = len(tiers)
        load = len(tiers) if self.cost is None else self.cost.blocks_to_load(tiers, self.block_size)
        if not load:
            return 0, False
        lookup.load_async = self._is_async(tiers[:load], held[:load])
        return load * self.block_size, lookup.load_async

    def _peer_ask_from(self, tiers: list[str], first: int) -> int:
        """The block from which a peer's CPU tier is asked about: the first of this
        instance's disk blocks where a peer may load them faster (by the cost model's
        measures), else the first block no local tier holds."""
        if DISK in tiers and self.cost is not None:
            disk_at = tiers.index(DISK)
            if self.cost.faster(PEER, DISK, tiers[disk_at:].count(DISK)):
                return first + disk_at
        return first + len(tiers)

    def _ask_peers(
        self, answer: PeerAnswer | None, names, ask_from: int, limit: int
    ) -> tuple[PeerAnswer, tuple[str, int] | None]:
        """(the answer, (instance, blocks it holds from `ask_from` on) or None), from
        the blocks' `names` as presence knows them: vLLM's hashes. After a weights
        reset an instance on other weights may be named for them too; reading its
        slots by this instance's epoch keys then misses, never takes its KV. A
        waiting request is asked about every step: presence's answer is reused while
        it says, as S3's is."""
        now = time.monotonic()
        if answer is not None and answer.says(ask_from, limit, now):
            return answer, answer.holder_from(ask_from)
        found_at = self.peers.holder([bytes(h) for h in names[ask_from:limit]]) if self.peers else None
        instance, held = found_at if found_at is not None else (None, 0)
        return PeerAnswer(ask_from, limit, instance, held, now), found_at

    def _with_peer_blocks(self, tiers: list[str], hashes, first: int, ask_from: int, held: int) -> list[str]:
        """`tiers` with a peer's `held` blocks from `ask_from` on: in place of this
        instance's disk blocks among them when the peer is expected faster for that
        many (its CPU blocks stay: a local copy beats any transfer), and past the
        local hit for as long as no recent load of them failed."""
        start, end = ask_from - first, ask_from - first + held
        tiers = list(tiers)
        on_disk = tiers[start:end].count(DISK)
        if on_disk and self.cost is not None and self.cost.faster(PEER, DISK, on_disk):
            tiers[start:end] = [PEER if tier == DISK else tier for tier in tiers[start:end]]
        if end > len(tiers):
            past = [bytes(h) for h in hashes[first + len(tiers) : first + end]]
            tiers.extend([PEER] * self.load_failures.leading_clear(past))
        return tiers

    def _lookup_groups(
        self, request: Request, hashes, first: int, limit: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """get_num_new_matched_tokens with several KV cache groups: the longest hit
        every group can serve (group_lookup.py), cut by the cost model and the CPU slots
        staging needs, each cut rounded down to an end every group can still serve."""
        # The local tiers afresh at each ask, like a plain model's: the plan is made
        # from this step's answer only; the S3 part from the request's last answer
        # while that still says.
        earlier = self._lookups.get(request.request_id)
        hit = self.groups.look_up(
            hashes,
            first,
            limit,
            earlier.group_s3 if earlier is not None else None,
            # Presence names a hybrid model's blocks by vLLM's hash (events.py).
            names=request.block_hashes,
            earlier_peer=earlier.peer_answer if earlier is not None else None,
        )
        cached = self._lookups[request.request_id] = Lookup(
            num_computed_tokens,
            hit.tiers,
            self._step,
            group_tiers=hit.group_tiers,
            group_s3=hit.s3,
            peer=hit.peer,
            peer_answer=hit.peer_answer,
        )
        cached.hit, cached.plan = hit.tiers, hit.plan
        if hit.end == first:
            return 0, False
        cached.load_async = True
        return (hit.end - first) * self.block_size, self._is_async([tier for _, _, tier in hit.plan], ())

    def _fit_to_cpu_tier(self, tiers: list[str], hashes) -> list[str]:
        """Each disk, peer or S3 block is staged through a CPU slot of its own. A hit that
        needs more slots than transfers leave free is cut where they run out: the
        rest is computed, rather than planned, failed and recovered by vLLM."""
        # A staging evicts an unpinned slot, and the hit pins its own CPU blocks first
        # so that none of them is the one evicted: up to the cut, each staged block and
        # each CPU block no transfer holds yet take one of the unpinned slots. CPU
        # blocks past the cut take none (one may be evicted by the staging).
        free = self.slots.unpinned()
        taken = 0
        for i, tier in enumerate(tiers):
            block = bytes(hashes[i])
            if tier == CPU:
                taken += self.slots.unpinned_among((block,))
            elif not self.policy.filling(block):  # a fill shared needs no slot
                taken += 1
            if taken > free:
                return tiers[:i]
        return tiers

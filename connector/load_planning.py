"""The scheduler half's load plans (update_state_after_alloc): which CPU slot each
block of a hit vLLM acts on is copied from or staged into, and what was decided per
tier, for vLLM's stats."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from tiercache.metrics import LOAD_DECISIONS, LOOKUP_HITS
from tiercache.policy import CpuTierFull
from tiercache.tiers import CPU, DISK, PEER, S3

from .groups import NULL_BLOCK, group_key
from .metadata import BlockOp, LoadJob
from .scheduler_base import SchedulerBase
from .scheduler_state import Lookup, RequestState

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("tiercache.connector")


class LoadPlanning(SchedulerBase):
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = RequestState(request)
        state.request = request
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None and lookup.step != self._step:
            lookup = None  # vLLM asked in an earlier step and did not act on it then
        if lookup is not None:
            self._count_decisions(lookup, num_external_tokens // self.block_size)
        if num_external_tokens == 0 or lookup is None:
            return
        if self.hybrid:
            self._plan_group_loads(state, lookup, blocks.get_block_ids(), num_external_tokens)
            return
        block_ids = blocks.get_block_ids()[0]
        first = lookup.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        # vLLM waits for the kind of load the lookup announced (an async one until the
        # worker reports the request finished receiving): a block lost since the
        # lookup fails and is recomputed, but never changes that kind.
        is_async = lookup.load_async
        self._hit_tiers[req_id] = Counter(lookup.tiers[:count])
        hit: list[tuple[bytes, int, str]] = []
        for i, tier in enumerate(lookup.tiers[:count]):
            block_hash = self._block_key(request.block_hashes[first + i])
            self._name(block_hash, request.block_hashes[first + i])
            hit.append((block_hash, block_ids[first + i], tier))
        ops = self._plan_hit(hit, may_stage=is_async)
        peer = lookup.peer if any(op.tier == PEER for op in ops) else ""
        self._queue_load(state, LoadJob(req_id, ops, is_async, peer=peer), first + count)

    def _plan_group_loads(
        self, state: RequestState, lookup: Lookup, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """update_state_after_alloc with several KV cache groups: each group's blocks
        of the hit go into that group's blocks, as planned at the lookup."""
        request = state.request
        req_id = request.request_id
        first = lookup.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        plan = lookup.plan
        if count != len(lookup.tiers):
            # vLLM loads what the lookup answered; anything else is planned anew.
            plan = self.groups.plan(lookup.group_tiers, first, first + count)
        tiers = [tier for _, _, tier in plan]
        is_async = self._is_async(tiers, ())
        self._hit_tiers[req_id] = Counter(lookup.tiers[:count])
        hit: list[tuple[bytes, int, str]] = []
        lost = False
        for group, index, tier in plan:
            gpu_block = block_ids[group][index] if index < len(block_ids[group]) else NULL_BLOCK
            if gpu_block == NULL_BLOCK:
                # vLLM gave this group no block where the plan loads one: the hit
                # cannot be whole, so every block of it is recomputed.
                lost = True
                continue
            block_hash = group_key(self._block_key(request.block_hashes[index]), group)
            self._name(block_hash, request.block_hashes[index], group)
            hit.append((block_hash, gpu_block, tier or ""))
        ops = self._plan_hit(hit, may_stage=is_async)
        if lost:
            log.warning("tiercache: request %s: a KV cache group lacks a block of its hit", req_id)
            for op in ops:
                self._unplan(op)
        peer = lookup.peer if any(op.tier == PEER for op in ops) else ""
        self._queue_load(state, LoadJob(req_id, ops, is_async, peer=peer), first + count)

    def _queue_load(self, state: RequestState, job: LoadJob, end: int) -> None:
        """The load goes to the workers with the next step's metadata; the request
        stores from block `end` on."""
        self._pending_loads.append(job)
        if job.is_async:
            self._load_slots[job.req_id] = job.ops
        state.next_block = max(state.next_block, end)
        for op in job.ops:
            if op.tier:
                self.stats[f"hit_{op.tier}"] += 1
                LOOKUP_HITS.labels(op.tier).inc()

    def _plan_hit(self, hit: list[tuple[bytes, int, str]], may_stage: bool) -> list[BlockOp]:
        """`_plan_load` for each (name, paged-KV block, tier) of a hit, in its order.
        The hit's ready CPU blocks are pinned before any slot is claimed to stage a
        lower-tier block into: a claim evicts the least recently used unpinned block,
        and the hit's own CPU blocks, pinned only later, were often those (the oldest
        blocks of a long prompt whose front had already gone to disk). The slots
        checked for staging (`_fit_to_cpu_tier`) already leave them out."""
        ops: list[BlockOp | None] = [None] * len(hit)
        pinned_first = [tier == CPU and block_hash in self.policy.ready for block_hash, _, tier in hit]
        for first_pass in (True, False):
            for i, (block_hash, gpu_block, tier) in enumerate(hit):
                if pinned_first[i] == first_pass:
                    ops[i] = self._plan_load(block_hash, gpu_block, tier, may_stage)
        return [op for op in ops if op is not None]

    def _unplan(self, op: BlockOp) -> None:
        """Undo `_plan_load` for `op` and leave it lost: the worker reports it failed."""
        if op.slot >= 0:
            if op.tier in (DISK, PEER, S3):
                self.policy.fill_failed(op.block_hash, op.slot)  # the slot claimed to stage it
            self.policy.release(op.slot)
        op.slot, op.tier = -1, ""

    def _count_decisions(self, lookup: Lookup, loaded: int) -> None:
        """One decision per tier holding part of this request's hit: loaded, skipped
        (the cost model cut the hit before that tier's blocks), or no_room (every CPU
        slot it could have been staged through was held by a transfer)."""
        fits = len(lookup.hit) if lookup.fits is None else lookup.fits
        for tier in dict.fromkeys(lookup.hit):
            if tier in lookup.hit[:loaded]:
                decision = "load"
            elif tier in lookup.hit[:fits]:
                decision = "skip"
            else:
                decision = "no_room"
            if decision == "load" and self.cost is not None:
                self.cost.loading(tier)
            LOAD_DECISIONS.labels(tier, decision).inc()
            self.stats[f"decision_{decision}_{tier}"] += 1
            self._decisions[(tier, decision)] += 1

    def take_decisions(self) -> Counter:
        """(tier, decision) -> requests since the last call, for vLLM's connector stats."""
        decisions, self._decisions = self._decisions, Counter()
        return decisions

    def hit_tiers(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """Tokens of this request's planned hit, by the tier each block was found in
        (a block lost since is still counted where it was found: vLLM recomputes it
        and counts the recompute apart). Asked once, right after the plan is made."""
        blocks = self._hit_tiers.pop(req_id, None)
        if not blocks or sum(blocks.values()) * self.block_size != num_external_tokens:
            return {}
        return {tier: count * self.block_size for tier, count in blocks.items()}

    def _plan_load(self, block_hash: bytes, gpu_block: int, tier: str, may_stage: bool) -> BlockOp:
        """Pin the block's CPU slot (or a new one to stage it into). A block lost since
        the lookup gets tier "" and the worker reports it as failed: vLLM recomputes it.
        A disk block of a synchronous load is read in the forward, through no slot.
        A block gone from the CPU tier falls back to disk where its load can read it.
        A block whose slot another transfer is filling (a staging planned for another
        request, a store) is copied from that slot once the fill is done: an
        asynchronous load waits for it, pinning the slot meanwhile."""
        if may_stage and self.policy.filling(block_hash):
            slot = self.slots.pin(block_hash)
            assert slot is not None  # filling: it holds a slot
            return BlockOp(block_hash, gpu_block, slot, CPU, after_fill=True)
        if tier == CPU:
            slot = self.policy.pin_ready(block_hash)
            if slot is not None:
                return BlockOp(block_hash, gpu_block, slot, CPU)
            reads_disk = may_stage or self.disk_in_forward
            tier = DISK if reads_disk and block_hash in self.policy.on_disk else ""
        if not tier:
            return BlockOp(block_hash, gpu_block, -1, "")
        if tier == DISK and not may_stage:
            return BlockOp(block_hash, gpu_block, -1, DISK)
        if tier == PEER and not may_stage:  # read from a peer only into a staging slot
            return BlockOp(block_hash, gpu_block, -1, "")
        if block_hash in self.slots:  # a store or another load is filling it right now
            return BlockOp(block_hash, gpu_block, -1, "")
        try:
            slot = self.policy.claim(block_hash)
        except CpuTierFull:
            return BlockOp(block_hash, gpu_block, -1, "")
        return BlockOp(block_hash, gpu_block, slot, tier)

    def plan_failed_load(self, req_id: str, gpu_blocks: list[int], is_async: bool) -> None:
        """`update_state_after_alloc` raised for a request vLLM now expects `gpu_blocks`
        loaded into: a load whose every block fails, so vLLM recomputes them."""
        ops = [BlockOp(b"", block, -1, "") for block in gpu_blocks]
        self._pending_loads.append(LoadJob(req_id, ops, is_async))

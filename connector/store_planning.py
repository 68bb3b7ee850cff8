"""The scheduler half's store plans: which blocks each step computed are copied into
which CPU slot, and what the workers need to order those copies without waiting."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.policy import CpuTierFull
from tiercache.tiers import CPU

from .groups import NULL_BLOCK, group_key
from .metadata import BlockOp, TierCacheMetadata
from .scheduler_base import SchedulerBase
from .scheduler_state import RequestState

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


class StorePlanning(SchedulerBase):
    def _plan_stores(
        self,
        state: RequestState,
        req_id: str,
        computed: int,
        output: SchedulerOutput,
        meta: TierCacheMetadata,
    ) -> None:
        if self._stores_held:
            return  # see reset_cache
        request = state.request
        done_tokens = computed + output.num_scheduled_tokens.get(req_id, 0)
        limit = min(done_tokens // self.block_size, len(request.block_hashes))
        if not self.hybrid:
            limit = min(limit, len(state.block_ids))
        if not self.config.store_decode:
            limit = min(limit, request.num_prompt_tokens // self.block_size)
        # vLLM computes blocks again that it had counted as computed after a load
        # failed (from the lost block on) or a preemption: they are stored as they come,
        # unless a tier holds them.
        state.next_block = min(state.next_block, computed // self.block_size)
        tier_full = False
        for block_hash, gpu_block, vllm_hash, group in self._store_candidates(state, limit, done_tokens):
            if block_hash in self.slots or block_hash in self.policy.on_disk:
                continue
            if not tier_full:
                try:
                    slot = self.policy.claim(block_hash)
                except CpuTierFull:
                    tier_full = True
            if tier_full:
                # Every slot is held by a transfer (none frees during this loop): the
                # rest of the range is not stored (a later request for it recomputes),
                # and the operator sees it counted.
                self._dropped_stores += 1
                continue
            self._name(block_hash, vllm_hash, group)
            meta.stores.append(BlockOp(block_hash, gpu_block, slot, CPU, req_id))
        planned = limit > state.next_block
        state.next_block = max(state.next_block, limit)
        if planned and not self.config.store_decode and limit >= request.num_prompt_tokens // self.block_size:
            # The prompt's last full block is stored now: nothing more of this request
            # will come, so its S3 run need not wait for the request to finish.
            meta.stores_done.append(req_id)

    def _store_candidates(self, state: RequestState, limit: int, done_tokens: int):
        """(name, paged-KV block, vLLM's hash, group) of each block computed up to
        `limit` that a later hit may need: one per block, or with several KV cache
        groups, each group's that its rule keeps (groups.py), under its group's name."""
        request = state.request
        for i in range(state.next_block, limit):
            vllm_hash = request.block_hashes[i]
            if not self.hybrid:
                yield self._block_key(vllm_hash), state.block_ids[i], vllm_hash, 0
                continue
            for group, rule in enumerate(self.group_rules):
                ids = state.group_block_ids[group] if group < len(state.group_block_ids) else []
                if i >= len(ids) or ids[i] == NULL_BLOCK or not rule.stores(i, done_tokens, self.block_size):
                    continue
                yield group_key(self._block_key(vllm_hash), group), ids[i], vllm_hash, group

    def _note_store_reads(self, meta: TierCacheMetadata) -> None:
        """Which of this step's synchronous loads each storing request reads. vLLM's
        prefix cache shares a block being loaded with every request scheduled after
        its loader in the same step, so a request that loads nothing may still compute
        its blocks over a load that fails: vLLM recomputes them then, and the workers
        must not store what this step made of them."""
        loading = {op.gpu_block for job in meta.loads if not job.is_async for op in job.ops}
        if not loading:
            return
        for req_id in {op.req_id for op in meta.stores}:
            state = self._requests.get(req_id)
            tables = (state.group_block_ids or [state.block_ids]) if state is not None else []
            reads = sorted(loading.intersection(block for ids in tables for block in ids))
            if reads:
                meta.store_reads[req_id] = reads

    def _order_copies(self, output: SchedulerOutput, meta: TierCacheMetadata) -> None:
        """What the workers need to order this step's copies on the GPU without
        waiting for them (connector/sync.py)."""
        meta.full_graph = self.full_graphs is not None and self.full_graphs.may_replay(
            output.num_scheduled_tokens
        )
        if self.kv_in_host_memory:
            return  # every copy is over when its hook returns
        # vLLM frees a preempted request's blocks at once, with no say for the
        # connector (Scheduler._preempt_request calls no connector hook that could
        # delay it): this step's forward may write them, so it waits on the GPU for
        # the store copies still reading them. The same holds when a sliding window
        # or Mamba group frees blocks of a running request.
        preempted = self._storing.intersection(getattr(output, "preempted_req_ids", None) or ())
        meta.fence_stores = bool(preempted) or (self.hybrid and self._stored_last_step)
        self._storing -= preempted  # their copies are fenced: nothing left to delay
        self._storing.update(op.req_id for op in meta.stores)
        self._stored_last_step = bool(meta.stores)
        meta.finished_storing, self._finished_storing = self._finished_storing, []

    def take_finished_storing(self) -> list[str]:
        """The requests whose blocks vLLM keeps for the workers and not yet told them
        of (a step whose plan failed carries them instead)."""
        finished, self._finished_storing = self._finished_storing, []
        return finished

    def take_dropped_stores(self) -> int:
        """Blocks not stored since the last call because every CPU slot was held by a
        transfer, for vLLM's connector stats."""
        dropped, self._dropped_stores = self._dropped_stores, 0
        return dropped

    def drop_stores(self, stores: list[BlockOp]) -> None:
        """These planned stores will not be made: forget their blocks, free their slots."""
        for op in stores:
            self.policy.fill_failed(op.block_hash, op.slot)
            self.policy.release(op.slot)

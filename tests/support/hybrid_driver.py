"""`ConnectorDriver` for a hybrid model: two KV cache groups (vLLM's hybrid KV cache
manager), full attention and a sliding window of two blocks, each with one layer.
The layers view one paged KV, as vLLM lays hybrid groups out: a block number belongs
to one group at a time, and a request takes blocks of each group.

Every hit of such a model is an asynchronous load that ends whole: with several groups
vLLM takes no block-level failure, so a load that loses any block fails the request,
which is then computed from its start (connector/load_lifecycle.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from tiercache.config import TierCacheConfig
from tiercache.connector.driver import (
    BLOCK_SIZE,
    ConnectorDriver,
    _KVCacheGroup,
    _NewRequest,
    _Request,
    _SchedulerOutput,
)
from tiercache.connector.groups import NULL_BLOCK, group_key
from tiercache.connector.metadata import TierCacheMetadata

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]  # full, window
WINDOW_TOKENS = 2 * BLOCK_SIZE
GROUPS = 2


@dataclass
class _GroupBlocks:
    tables: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.tables


@dataclass
class HybridServed:
    """One request's outcome: per group, per block, the tier its load was planned from
    (None: not loaded into that group); whether that load failed (vLLM then computed
    the whole request); per group, its blocks' bytes in the paged KV."""

    tiers: list[list[str | None]]
    failed: bool
    kv: list[list[memoryview]]


def group_specs(block_bytes: int) -> list:
    """vLLM's specs of the two groups, whose page is `block_bytes` (uint8 K and V)."""
    head_size = block_bytes // (2 * BLOCK_SIZE)
    common = {"block_size": BLOCK_SIZE, "num_kv_heads": 1, "head_size": head_size, "dtype": torch.uint8}
    return [FullAttentionSpec(**common), SlidingWindowSpec(**common, sliding_window=WINDOW_TOKENS)]


class HybridDriver(ConnectorDriver):
    # vLLM's null block stands for a group's blocks outside its window: no request takes it.
    _first_free_block = NULL_BLOCK + 1

    def __init__(self, config: TierCacheConfig, block_bytes: int, *, model: str, num_blocks: int = 16):
        if block_bytes % (2 * BLOCK_SIZE * 64):
            raise ValueError(f"block_bytes must be a multiple of {2 * BLOCK_SIZE * 64}, got {block_bytes}")
        super().__init__(config, block_bytes, model=model, num_blocks=num_blocks)

    def _kv_cache_groups(self, block_bytes: int) -> list[_KVCacheGroup]:
        specs = zip(group_specs(block_bytes), LAYERS, strict=True)
        return [_KVCacheGroup(group_spec, [layer]) for group_spec, layer in specs]

    def serve_groups(self, hashes: list[bytes], pages: list[list[bytes]] | None = None) -> HybridServed:
        """Run one request of these blocks to its end. `pages[g][i]`: what the forward
        computes into group g's block i where it is not loaded; None: the request only
        loads (nothing is computed, nothing stored)."""
        with self._lock:
            self._release_held()
            self._deliver_reports()
            return self._serve_groups([bytes(h) for h in hashes], pages)

    def _serve_groups(self, hashes: list[bytes], pages: list[list[bytes]] | None) -> HybridServed:
        sched, size, count = self.scheduler, BLOCK_SIZE, len(hashes)
        if GROUPS * (count + 1) > len(self._free):
            needed = GROUPS * (count + 1)
            raise ValueError(f"a request of {count} blocks needs {needed} of the paged KV's blocks")
        tables = tuple([self._free.pop() for _ in range(count + 1)] for _ in range(GROUPS))
        self._held = [b for table in tables for b in table]
        request = _Request(f"hybrid-{next(self._ids)}", hashes, count * size + 1, count * size + 1)
        req_id = request.request_id
        tokens, is_async = sched.get_num_new_matched_tokens(request, 0)
        sched.update_state_after_alloc(request, _GroupBlocks(tables), tokens)
        tiers: list[list[str | None]] = [[None] * count for _ in range(GROUPS)]
        failed = False
        if tokens:
            assert is_async, "a hybrid model's hit is always an asynchronous load"
            failed = self._wait_for_group_load(req_id, tables, tiers)
            sched.update_state_after_alloc(request, _GroupBlocks(tables), 0)
        good = 0 if failed else tokens // size
        if pages is not None:
            for group, table in enumerate(tables):
                for i in range(good, count):
                    self._kv_rows[table[i]][:] = memoryview(pages[group][i]).cast("B")
        scheduled = request.num_tokens - good * size if pages is not None else 1
        output = _SchedulerOutput(
            [_NewRequest(req_id, tables, good * size)], num_scheduled_tokens={req_id: scheduled}
        )
        self._execute_groups(sched.build_connector_meta(output), req_id, tables, tiers)
        sched.request_finished(request)
        self._finished.add(req_id)
        kv = [[self.kv_block(table[i]) for i in range(count)] for table in tables]
        return HybridServed(tiers, failed, kv)

    def _wait_for_group_load(self, req_id: str, tables, tiers) -> bool:
        """Empty steps until the worker reports the load received; whether it failed."""
        for _ in range(10_000):
            done, failed = self._execute_groups(
                self.scheduler.build_connector_meta(_SchedulerOutput()), req_id, tables, tiers
            )
            if done:
                return failed
            time.sleep(0.005)
        raise RuntimeError(f"the worker never reported the load of request {req_id} received")

    def _execute_groups(self, meta: TierCacheMetadata, req_id: str, tables, tiers) -> tuple[bool, bool]:
        """One step on the worker in vLLM's hook order, then its output to the scheduler;
        (the request's load reported received, it failed)."""
        for job in meta.loads:
            if job.req_id == req_id:
                for op in job.ops:
                    for group, table in enumerate(tables):
                        if op.gpu_block in table:
                            tiers[group][table.index(op.gpu_block)] = op.tier or None
        done, failed, failed_blocks = self._hooks(meta)
        assert not failed_blocks, "a model of several groups fails whole requests only"
        return req_id in done, req_id in failed


def keys(hashes: list[bytes], group: int) -> list[bytes]:
    """What the connector names group `group`'s blocks of `hashes`."""
    return [group_key(h, group) for h in hashes]

"""The connector's two halves in one process, driven as vLLM drives them, without vLLM.

`ConnectorDriver` holds the scheduler half (`TierCacheScheduler`: lookups, load and
store plans, the CPU tier's slot map and `BlockPolicy`) and one worker half
(`TierCacheWorker`: the copies, and the `TierEngine` that moves blocks to and from
disk and S3) over a paged KV of its own in host memory. It plays vLLM's part and
nothing more: each request is looked up, allocated, scheduled and finished, and each
step's metadata goes through the worker's hooks in vLLM's order, its reports back to
the scheduler. Every decision (what hits, what is loaded, stored, evicted, written
back or promoted) is the connector's own. The tier benchmark, the soak and the tests
that exercise the tiers without an engine run through it.

A request is a list of block hashes (vLLM's chained prefix hashes) of whole blocks,
plus one more token, which vLLM always computes. `serve` runs one to its end: the
longest cached prefix is loaded into the paged KV (a CPU hit in the step that
computes the rest; a disk or S3 hit staged first, as an asynchronous load), and the
blocks it computes are stored. What the forward computes is the caller's: the bytes
of each block not loaded (`pages`), or nothing at all (a lookup that only loads)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from tiercache.config import TierCacheConfig
from tiercache.index.keys import KVSpec
from tiercache.tiers.cpu import CpuBuffer, SlotAllocator

from .metadata import TierCacheMetadata
from .scheduler import TierCacheScheduler
from .worker import TierCacheWorker

LAYER = "model.layers.0.self_attn.attn"
BLOCK_SIZE = 16  # tokens per block: any size serves, the KV is the caller's bytes
# How much longer than the load deadline a request waits for its staged load to be
# reported before the driver gives up on the worker (which gives up at the deadline).
_REPORT_GRACE_SECONDS = 30.0


# -- stand-ins for what vLLM hands the connector (the fields the halves read) ---------
@dataclass
class _Request:
    request_id: str
    block_hashes: list[bytes]
    num_tokens: int
    num_prompt_tokens: int


@dataclass
class _NewRequest:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class _CachedRequests:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class _SchedulerOutput:
    scheduled_new_reqs: list[_NewRequest] = field(default_factory=list)
    scheduled_cached_reqs: _CachedRequests = field(default_factory=_CachedRequests)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class _Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class _ConnectorOutput:
    kv_connector_worker_meta: object
    finished_recving: set[str] = field(default_factory=set)


@dataclass
class _KVSpecOfGroup:
    page_size_bytes: int


@dataclass
class _KVCacheGroup:
    kv_cache_spec: _KVSpecOfGroup
    layer_names: list[str]


@dataclass
class _KVCacheConfig:
    kv_cache_groups: list[_KVCacheGroup]
    num_blocks: int


@dataclass
class Served:
    """One request's outcome: per block, the tier its load came from (None: computed
    or missed), and its bytes in the paged KV once the request ended (valid until the
    driver's next call)."""

    tiers: list[str | None]
    kv: list[memoryview]

    @property
    def hits(self) -> int:
        """Blocks loaded from a tier (a prefix of the request)."""
        return sum(tier is not None for tier in self.tiers)


def byte_block_spec(model: str, block_bytes: int, namespace: str) -> KVSpec:
    """The KV layout a ConnectorDriver's worker has: one layer whose page is a block's
    bytes. Another process building a worker of the same deployment (a peer) needs
    the same spec to share its digests."""
    return KVSpec(
        model=model,
        revision="",
        dtype="uint8",
        kv_dtype="auto",
        block_size=BLOCK_SIZE,
        layout="bytes",
        num_layers=1,
        num_kv_heads=1,
        head_size=block_bytes,
        tp_size=1,
        tp_rank=0,
        namespace=namespace,
        page_bytes=block_bytes,
    )


class ConnectorDriver:
    def __init__(
        self,
        config: TierCacheConfig,
        block_bytes: int,
        *,
        model: str = "tiercache-driver",
        num_blocks: int = 16,
        kv_in_host_memory: bool = False,
    ):
        """`block_bytes`: the KV bytes of one block (a multiple of 64, as a slot lays
        out a layer's page); `model`: drivers of one model name share objects in S3
        and on disk, as two instances of one model do; `num_blocks`: the paged KV's
        blocks (a request takes one per block, plus one for its last token);
        `kv_in_host_memory`: plan as on vLLM's CPU backend, where a disk hit may be
        read into the paged KV during the forward (else staged through a CPU slot, as
        on GPUs)."""
        if block_bytes <= 0 or block_bytes % 64:
            raise ValueError(f"block_bytes must be a positive multiple of 64, got {block_bytes}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {num_blocks}")
        self.config = config
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        spec = byte_block_spec(model, block_bytes, config.namespace)
        groups = self._kv_cache_groups(block_bytes)
        self._layers = [layer for group in groups for layer in group.layer_names]
        kv_cache_config = _KVCacheConfig(groups, num_blocks)
        # Typed as Any: the driver hands the scheduler duck-typed stand-ins for vLLM's
        # request, block, scheduler-output and connector-output objects.
        self.scheduler: Any = TierCacheScheduler(
            config, [spec], cast(Any, kv_cache_config), worker_count=1, kv_in_host_memory=kv_in_host_memory
        )
        disk_share = config.disk.capacity if config.disk else 0
        self.worker = TierCacheWorker(
            config,
            spec,
            spec.model_digest(),
            num_blocks,
            tp_rank=0,
            writes_lower_tiers=True,
            disk_share=disk_share,
            group_layers=[list(group.layer_names) for group in groups],
        )
        # The paged KV, one for every layer (the groups' layers overlay each other).
        self.kv = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)
        self.worker.register_kv_caches(
            {layer: self.kv for group in groups for layer in group.layer_names}, block_bytes
        )
        if self.worker.engine is None:
            raise RuntimeError(f"the worker did not start: {self.worker.disabled_reason}")
        self._kv_rows = self.kv.numpy()
        self._free = list(range(self._first_free_block, num_blocks))
        self._held: list[int] = []  # the last request's blocks, whose bytes the caller may read
        self._finished: set[str] = set()  # requests finished since the worker's last step
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one request at a time, as one engine core schedules

    # The paged KV's first block a request may take (a hybrid model's driver keeps
    # vLLM's null block, 0, out of requests).
    _first_free_block = 0

    def _kv_cache_groups(self, block_bytes: int) -> list[_KVCacheGroup]:
        """The KV cache groups of the driver's model: one full-attention layer."""
        return [_KVCacheGroup(_KVSpecOfGroup(block_bytes), [LAYER])]

    # -- what the connector holds ----------------------------------------------------
    @property
    def engine(self):
        assert self.worker.engine is not None  # checked at start; closed only by close()
        return self.worker.engine

    @property
    def shape(self):
        return self.engine.shape

    @property
    def buffer(self) -> CpuBuffer:
        assert self.worker.buffer is not None  # set with the engine
        return self.worker.buffer

    @property
    def policy(self):
        return self.scheduler.policy

    @property
    def slots(self) -> SlotAllocator[bytes]:
        return self.scheduler.slots

    def kv_block(self, gpu_block: int) -> memoryview:
        """A block of the paged KV, writable: what a forward computes lands here."""
        return memoryview(self._kv_rows[gpu_block])

    # -- requests ----------------------------------------------------------------------
    def serve(
        self,
        hashes: Sequence[bytes],
        pages: Sequence[bytes | memoryview] | None = None,
        *,
        gpu_blocks: Sequence[int] | None = None,
        computes: bool | None = None,
    ) -> Served:
        """Run one request of these blocks to its end. `pages`: what the forward
        computes into each block not loaded; `computes`: whether the request computes
        the blocks not loaded (default: when `pages` is given), which are then stored;
        a request that does not ends after its load. `gpu_blocks`: the paged-KV blocks
        its blocks take (default: free ones); with `computes` and no `pages`, they
        already hold what the forward would compute."""
        hashes = [bytes(h) for h in hashes]
        computes = pages is not None if computes is None else computes
        if pages is not None and len(pages) != len(hashes):
            raise ValueError(f"pages: {len(pages)} given for {len(hashes)} blocks")
        with self._lock:
            self._release_held()
            self._deliver_reports()
            return self._serve(hashes, pages, gpu_blocks, computes)

    def _serve(self, hashes, pages, gpu_blocks, computes: bool) -> Served:
        sched, size = self.scheduler, BLOCK_SIZE
        count = len(hashes)
        if gpu_blocks is None:
            if count + 1 > len(self._free):
                raise ValueError(f"a request of {count} blocks needs {count + 1} of the paged KV's blocks")
            blocks = [self._free.pop() for _ in range(count + 1)]
        else:
            if len(gpu_blocks) != count:
                raise ValueError(f"gpu_blocks: {len(gpu_blocks)} given for {count} blocks")
            blocks = [*gpu_blocks, self._free.pop()]
        self._held = blocks if gpu_blocks is None else blocks[-1:]
        request = _Request(f"driver-{next(self._ids)}", hashes, count * size + 1, count * size + 1)
        req_id = request.request_id
        tokens, is_async = sched.get_num_new_matched_tokens(request, 0)
        sched.update_state_after_alloc(request, _Blocks(blocks), tokens)
        hit = tokens // size
        tiers: list[str | None] = [None] * count
        failed: set[int] = set()
        if is_async:
            failed |= self._wait_for_load(req_id, tiers)
            good = self._good(blocks[:hit], failed)
            # Received, the request is scheduled: its forward waits for the staged
            # blocks' copy into the paged KV, and computes from the first lost one.
            sched.update_state_after_alloc(request, _Blocks(blocks), 0)
            if computes:
                self._compute(blocks, pages, good)
            scheduled = request.num_tokens - good * size if computes else 1
            output = _SchedulerOutput(
                [_NewRequest(req_id, (blocks,), good * size)], num_scheduled_tokens={req_id: scheduled}
            )
            self._step(output, [], req_id)
        elif computes or hit:
            self._compute(blocks, pages, hit)
            # A request that only loads computes the one token after its hit: no
            # block past the hit is full, so none is stored.
            scheduled = request.num_tokens - tokens if computes else 1
            output = _SchedulerOutput(
                [_NewRequest(req_id, (blocks,), tokens)], num_scheduled_tokens={req_id: scheduled}
            )
            failed |= self._step(output, tiers, req_id)
            good = self._good(blocks[:hit], failed)
            if computes and good < hit:
                # vLLM computes again from the block that failed to load, and the
                # connector stores what it computes then.
                self._compute(blocks, pages, good)
                again = _CachedRequests([req_id], set(), [None], [good * size])
                output = _SchedulerOutput(
                    scheduled_cached_reqs=again,
                    num_scheduled_tokens={req_id: request.num_tokens - good * size},
                )
                self._step(output, [], req_id)
        else:
            good = 0  # a miss that computes nothing: never scheduled
        for i in range(good, count):
            tiers[i] = None
        sched.request_finished(request)
        self._finished.add(req_id)
        return Served(tiers, [self.kv_block(b) for b in blocks[:count]])

    def _good(self, blocks: list[int], failed: set[int]) -> int:
        """How many blocks of the hit, from the first, loaded."""
        for i, block in enumerate(blocks):
            if block in failed:
                return i
        return len(blocks)

    def _compute(self, blocks: list[int], pages, first: int) -> None:
        """The forward computes the blocks from `first` on."""
        if pages is None:
            return
        for i in range(first, len(pages)):
            self._kv_rows[blocks[i]][:] = memoryview(pages[i]).cast("B")

    def _wait_for_load(self, req_id: str, tiers: list[str | None]) -> set[int]:
        """An asynchronous load: steps that schedule nothing (as vLLM's while the
        request waits) until the worker reports it received; the blocks that failed."""
        failed: set[int] = set()
        deadline = time.monotonic() + self.config.movers.load_deadline_seconds + _REPORT_GRACE_SECONDS
        while True:
            done, lost = self._execute(self.scheduler.build_connector_meta(_SchedulerOutput()), tiers, req_id)
            failed |= lost
            if req_id in done:
                return failed
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker never reported the load of request {req_id} received")

    def _step(self, output: _SchedulerOutput, tiers: list[str | None], req_id: str) -> set[int]:
        return self._execute(self.scheduler.build_connector_meta(output), tiers, req_id)[1]

    def _execute(
        self, meta: TierCacheMetadata, tiers: list[str | None], req_id: str
    ) -> tuple[set[str], set[int]]:
        """One step on the worker, in the order vLLM's model runner calls its hooks
        (the forward is not timed: it computes nothing the cost model could learn
        from), then its output to the scheduler. The request's planned loads name the
        tier of each block of its hit."""
        for job in meta.loads:
            if job.req_id == req_id:
                for i, op in enumerate(job.ops[: len(tiers)]):
                    tiers[i] = op.tier or None
        done, _, failed = self._hooks(meta)
        return done, failed

    def _hooks(self, meta: TierCacheMetadata) -> tuple[set[str], set[str], set[int]]:
        """The step's hooks on the worker, every layer's, then its output to the
        scheduler: (requests whose load is over, those failed whole, blocks failed)."""
        worker = self.worker
        worker.track(meta)
        worker.step_arrives(meta)
        worker.start_load_kv(meta)
        for layer in self._layers:
            worker.wait_for_layer(layer)
            worker.save_layer(layer, meta)
        worker.wait_for_save(meta)
        finished, self._finished = self._finished, set()
        done = worker.get_finished(finished)  # ends the loads whose staging is over
        failed_requests = worker.take_failed_requests()
        done |= failed_requests
        failed = worker.take_failed_blocks()
        self.scheduler.update_connector_output(_ConnectorOutput(worker.take_worker_meta(), done))
        return done, failed_requests, failed

    def _release_held(self) -> None:
        self._free.extend(self._held)
        self._held = []

    def deliver_reports(self) -> None:
        """Hand the worker's reports since its last step (write-downs ended, slots
        freed, blocks gone from disk) to the scheduler, as the next step would."""
        with self._lock:
            self._deliver_reports()

    def _deliver_reports(self) -> None:
        meta = self.worker.take_worker_meta()
        if meta is not None:
            self.scheduler.update_connector_output(_ConnectorOutput(meta))

    # -- one block at a time ---------------------------------------------------------------
    def put(self, block_hash: bytes, data: bytes | memoryview) -> int | None:
        """A request that computes one block: the CPU slot holding it once stored, or
        None where the connector dropped the store (no slot was free) or holds it only
        below the CPU tier."""
        self.serve([block_hash], [data])
        return self.slots.slot_of(bytes(block_hash))

    def get(self, block_hash: bytes) -> tuple[str, memoryview] | None:
        """A request that only loads one block: (the tier it came from, its bytes in
        the paged KV), or None on a miss."""
        served = self.serve([block_hash])
        tier = served.tiers[0]
        return None if tier is None else (tier, served.kv[0])

    # -- lifecycle -------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the write-downs in flight, then report them to the scheduler (and,
        under the selective policy, for the fleet's request counts to answer)."""
        flushed = self.engine.flush(timeout)
        self.deliver_reports()
        fleet = self.policy.admission.fleet if self.policy.admission is not None else None
        if fleet is not None:  # the fleet's counts of the requests so far, answered
            flushed = fleet.wait(5.0 if timeout is None else timeout) and flushed
        return flushed

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.close()

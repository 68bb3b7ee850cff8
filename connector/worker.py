"""The worker half of the connector (one per TP rank): copies blocks between vLLM's
paged KV and this rank's CPU slots, and runs the tier engine that moves them to and
from disk and S3. Everything it does is reported back as events; a load that cannot
be served is reported as failed blocks, which vLLM recomputes."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from tiercache.config import TierCacheConfig
from tiercache.engine import ObjectShape, TierEngine, WriteResult
from tiercache.index.keys import KVSpec
from tiercache.metrics import LOADS_TIMED_OUT as LOADS_TIMED_OUT_METRIC
from tiercache.policy import promotes_to_disk, reads_disk_in_forward
from tiercache.tiers import CPU, DISK, S3
from tiercache.tiers.cpu import CpuBuffer, slots_for

from . import sync
from .copier import PagedKVCopier
from .disk_reads import DiskRead, DiskReads
from .forward_timer import ForwardTimer
from .layerwise import LayerwiseLoad
from .layerwise_gpu import StreamLayerwiseLoad, StreamLayerwiseSave
from .metadata import (
    FILL_FAILED,
    FILLED,
    FORWARD,
    OFF_DISK,
    ON_DISK,
    READ_FAILED,
    RELEASED,
    STORE_VOID,
    BlockOp,
    LoadJob,
    Report,
    TierCacheMetadata,
    TierCacheWorkerMetadata,
    Timing,
)
from .stats import LOADS_TIMED_OUT, GaugeReport, TierCacheStats

log = logging.getLogger("tiercache.connector")

# While a request waits for a disk or S3 load and nothing else runs, vLLM polls the
# connector in a tight loop of empty steps. That loop holds the interpreter lock the
# staging threads need after every read, so on a machine with few cores a disk hit's
# load took several times longer (docs/design.md, "Threads and the idle step"). An idle
# step instead sleeps on the loads, this long at most: the delay a request arriving
# meanwhile can see before it is scheduled.
IDLE_STEP_WAIT_SECONDS = 0.01


def _settled(filled: bool) -> Future:
    future: Future = Future()
    future.set_result([filled])
    return future


# The fill of a slot by a store made void (its block computed over a failed load).
_VOID = _settled(False)


@dataclass
class _Fill:
    """The last fill of a CPU slot on this rank: its block, and the future whose
    result list says at `index` whether the copy in succeeded."""

    block_hash: bytes
    future: Future
    index: int = 0

    def done(self) -> bool:
        return self.future.done()

    def ok(self) -> bool:
        if self.future.exception() is not None:
            return False
        return bool(self.future.result()[self.index])


@dataclass
class _AsyncLoad:
    job: LoadJob
    # Per lower tier: its blocks, and the staging of them (results in that order).
    staged: list[tuple[str, list[BlockOp], Future]]
    started: float
    staged_at: dict[str, float]  # tier -> when its last block was staged
    # Blocks another transfer is filling the slot of, and that fill (None: this rank
    # knows of no such fill, and the block fails).
    after_fills: list[tuple[BlockOp, _Fill | None]] = field(default_factory=list)

    def waits_on(self) -> list[Future]:
        fills = [fill.future for _, fill in self.after_fills if fill is not None]
        return [future for _, _, future in self.staged] + fills


@dataclass
class _InFlight:
    """Copies queued on the copy stream up to `event`, and what waits for them to be
    over: `settle` (hand store slots to the movers, give load slots back), the
    requests whose blocks they read, and those requests' S3 runs to end after."""

    event: sync.Event
    settle: Callable[[], None]
    req_ids: set[str] = field(default_factory=set)
    ends: list[str] = field(default_factory=list)


@dataclass
class _LayerwiseStep:
    load: LayerwiseLoad | StreamLayerwiseLoad
    ops: list[BlockOp]
    started: float | None  # set for CPU hits, whose load time ends with the copy
    staged_ok: dict[int, bool]
    disk: DiskReads | None = None  # disk blocks read into the paged KV by this load


def reads_in_forward(op: BlockOp) -> bool:
    """A disk block of a synchronous load: read from its object into the paged KV
    during the forward, through no CPU slot (disk_reads.py)."""
    return op.tier == DISK and op.slot < 0


class TierCacheWorker:
    def __init__(
        self,
        config: TierCacheConfig,
        spec: KVSpec,
        model_digest: str,
        num_blocks: int,
        tp_rank: int,
        writes_lower_tiers: bool,
        disk_share: int,
        group_layers: list[list[str]] | None = None,
    ):
        """`group_layers`: the layer names of each KV cache group (vLLM's hybrid KV
        cache manager makes several), checked against the registered tensors."""
        self.config = config
        self.group_layers = group_layers or []
        self.spec = spec
        self.model_digest = model_digest
        self.num_blocks = num_blocks
        self.tp_rank = tp_rank
        self.writes_lower_tiers = writes_lower_tiers
        self.disk_share = disk_share
        self.copier: PagedKVCopier | None = None
        self.buffer: CpuBuffer | None = None
        self.engine: TierEngine | None = None
        self.disabled_reason: str | None = None
        self._lock = threading.Lock()
        self._reports: list[Report] = []  # (rank, kind, value), in the order they happened
        self._hits: Counter = Counter()
        self._timings: list[Timing] = []  # for the scheduler's cost model
        self._forward_timer: ForwardTimer | None = None
        self._async: list[_AsyncLoad] = []
        # Per CPU slot, its last fill (a staging or a store): a load planned to share a
        # fill under way (BlockOp.after_fill) waits for it here.
        self._fills: dict[int, _Fill] = {}
        self._finished_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        # With several KV cache groups vLLM cannot map a failed block back to its
        # request (block numbers are per group) and refuses such reports: a hit that
        # cannot be served whole fails its request instead (reported as failed
        # receiving, which vLLM recomputes from the start). The scheduler makes every
        # such hit an asynchronous load, whose failures are known before vLLM is told.
        self.fails_whole_requests = len(self.group_layers) > 1
        self._failed_recving: set[str] = set()
        self._idle_step = False
        self._stats = TierCacheStats()
        self._gauges = GaugeReport(f"rank{tp_rank}")
        # Layer-by-layer loads (see layerwise.py): on once a whole step has shown the
        # forward calling wait_for_layer_load for every registered layer, in this order.
        self._layer_order: list[str] | None = None
        self._layers_this_step: list[str] = []
        # Copies the next forward waits for layer by layer: this step's CPU hits, and
        # staged hits reported finished at the end of the step before.
        self._layerwise: list[_LayerwiseStep] = []
        self._layer_helper: ThreadPoolExecutor | None = None
        # This step's stores being copied out layer by layer (CUDA), if any.
        self._saving: StreamLayerwiseSave | None = None
        # The metadata of the step whose write-backs have been taken (see _begin_step).
        self._begun: TierCacheMetadata | None = None
        # The metadata of the step whose synchronous loads have started (step_arrives or
        # start_load_kv, whichever came first).
        self._loads_started: TierCacheMetadata | None = None
        # Load and store ops of the steps seen (`track`) whose slot, or whose report
        # as failed, is still owed, by id: what `fail_step` settles after an error.
        self._owed: dict[int, BlockOp] = {}
        self._tracked: TierCacheMetadata | None = None
        # The KV tensors vLLM registered, kept to rebuild the copier on
        # `restore_kv_caches` (sleep mode), and how the dropped copier copied.
        self._registered_kv: dict[str, torch.Tensor] | None = None
        self._unregistered_copier: tuple[bool, bool, tuple[str, str, str]] | None = None
        # Copies on the copy stream whose end is yet to be seen, oldest first (CUDA):
        # polled in the hooks, never waited for on the step path (sync.py).
        self._in_flight: list[_InFlight] = []
        # Requests vLLM keeps the blocks of until reported in finished_sending.
        self._awaiting_sending: set[str] = set()
        self._noted: TierCacheMetadata | None = None  # the step _note_step saw last
        self._fenced: TierCacheMetadata | None = None  # the step _fence_before_forward saw last
        # The old way, for benchmarks/gpu_step.py's comparison only: hold the host until
        # each copy is over, in the hook that queued it.
        self._host_waits_for_copies = False

    # -- setup --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], expected_slot_bytes: int) -> None:
        self._registered_kv = kv_caches
        try:
            copier = PagedKVCopier(kv_caches, self.num_blocks)
            copier.check_groups(self.group_layers)
        except ValueError as error:
            # Copying would mix blocks or groups: serve without the cache instead.
            self.disabled_reason = f"{error}: tiercache is off for this engine"
            log.error("tiercache: %s", self.disabled_reason)
            return
        if copier.slot_bytes != expected_slot_bytes:
            # The scheduler sized slots from the KV cache config; if the tensors say
            # otherwise, copying would mix blocks. Serve without the cache instead.
            self.disabled_reason = (
                f"KV tensors hold {copier.slot_bytes} bytes per block, the KV cache config says "
                f"{expected_slot_bytes}: tiercache is off for this engine"
            )
            log.error("tiercache: %s", self.disabled_reason)
            return
        self.copier = copier
        if self.tp_rank == 0:  # every rank runs the same forward: one sample a step
            self._forward_timer = ForwardTimer(copier.on_cuda)
        if not copier.on_cuda and not copier.staged:
            # CUDA copies are already asynchronous on their own stream.
            self._layer_helper = ThreadPoolExecutor(1, thread_name_prefix="tiercache-layers")
        num_slots = slots_for(self.config.cpu.capacity, copier.slot_bytes)
        self.buffer = CpuBuffer(num_slots, copier.slot_bytes)
        copier.warm_up(self.buffer)
        layout, dtype, shapes = copier.describe()
        # Objects this rank may read layer by layer into the paged KV carry a checksum
        # per layer's page, so each is verified while still in cache (disk_reads.py).
        reads_by_layer = reads_disk_in_forward(
            self.config, kv_in_host_memory=not copier.on_cuda, tp_size=self.spec.tp_size
        )
        offsets = tuple(region.offset for region in copier.regions) if reads_by_layer else ()
        shape = ObjectShape(
            self.model_digest, self.spec.digest(), copier.slot_bytes, layout, dtype, shapes, offsets
        )
        self.engine = TierEngine(
            self.config,
            shape,
            self.buffer,
            disk_capacity=self.disk_share,
            on_disk_remove=self._on_disk_remove,
        )
        log.info(
            "tiercache: rank %d, %d CPU slots of %d bytes (%s), disk=%s, s3=%s",
            self.tp_rank,
            num_slots,
            copier.slot_bytes,
            "pinned" if self.buffer.pinned else "pageable",
            self.engine.disk is not None,
            self.engine.s3 is not None,
        )

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33 calls this before sleep mode unmaps the paged KV (and before it
        discards the KV cache): every copy that touches the paged KV ends now, and the
        copier, with its views of the KV and the one-launch kernel's table of their
        addresses, is dropped. Until `restore_kv_caches`, a step's loads fail (vLLM
        recomputes them) and its stores are dropped; disk and S3 loads staged meanwhile
        wait in their slots. Idempotent."""
        copier = self.copier
        if copier is None:
            return
        # Staged hits waiting for the next forward: into the paged KV while it is mapped.
        steps, self._layerwise = self._layerwise, []
        for step in steps:
            self._end_load(step)
        self._drain_copies()  # not a step: sleep mode unmaps the memory they touch
        self._unregistered_copier = (copier.staged, copier.fused is not None, copier.describe())
        self.copier = None

    def restore_kv_caches(self) -> None:
        """vLLM 0.33 calls this once the paged KV is mapped again (after a wake-up that
        includes the KV cache): the copier is rebuilt from the tensors vLLM registered,
        so every copy from now on reads and writes the memory they hold now. The copy
        kernel was built and checked at start; its table is built anew here. Idempotent."""
        if self.copier is not None or self._unregistered_copier is None or self._registered_kv is None:
            return
        staged, fused, described = self._unregistered_copier
        copier = PagedKVCopier(self._registered_kv, self.num_blocks, staged=staged, fused=fused)
        assert self.buffer is not None  # set with the copier that was dropped
        if copier.slot_bytes != self.buffer.slot_bytes or copier.describe() != described:
            self.disabled_reason = (
                "the KV tensors after sleep mode's wake-up differ from those registered: "
                "tiercache is off for this engine"
            )
            log.error("tiercache: %s", self.disabled_reason)
            return
        self._unregistered_copier = None
        self.copier = copier

    def _on_disk_remove(self, key: str) -> None:
        self._emit(OFF_DISK, bytes.fromhex(key.split("/")[1]))

    def _emit(self, kind: str, value) -> None:
        with self._lock:
            self._reports.append((self.tp_rank, kind, value))

    # -- loads ----------------------------------------------------------------------
    def _begin_step(self, meta: TierCacheMetadata) -> None:
        """Once per step, before anything of the step is copied into a CPU slot: take
        the write-back victims' bytes while their slots still hold them.

        It runs from whichever hook comes first. vLLM calls `start_load_kv` after the
        forward when the step has no synchronous loads, and by then `save_layer` has
        queued (on CUDA) or `wait_for_save` has made the step's store copies, some of
        them into a victim's reused slot: a copy taken there would mix the new block's
        bytes into the old key's object, under a checksum that matches."""
        if meta is self._begun:
            return
        self._begun = meta
        if self.engine is None or not meta.write_backs:
            return
        assert self.copier is not None and self.buffer is not None  # set with the engine
        # No copy still touches a victim's slot: a slot is reported filled or released
        # only once the copy into or out of it has been seen over (_poll_copies), and
        # the scheduler evicts only slots so reported.
        if self._host_waits_for_copies and self.copier.stream is not None:
            sync.host_wait(self.copier.stream)
        for block_hash, slot in meta.write_backs:
            # The slot is reused this step: write the old block down from a copy.
            data = bytes(self.buffer.view(slot))
            tiers = meta.write_back_tiers.get(block_hash, (DISK, S3))
            self.engine.write_down(block_hash, None, self._after_write, data=data, tiers=tiers)

    def step_arrives(self, meta: TierCacheMetadata) -> None:
        """vLLM handed the worker this step, before preparing its inputs.

        On the CPU backend the step's CPU-tier hits start copying here, layer by
        layer on the helper thread, while vLLM prepares the inputs on the model's core
        (about 2 ms, of which the helper gets about 1): less of the copy then shares the
        memory bus with the forward."""
        self._note_step(meta)
        self._fence_before_forward(meta)
        if self.engine is None:
            return
        if meta.loads_early and self._layer_helper is not None and self._layerwise_ready():
            self._begin_step(meta)
            self._start_sync_loads(meta)

    def _start_sync_loads(self, meta: TierCacheMetadata) -> None:
        """The step's synchronous loads, once per step from whichever hook comes first."""
        if meta is self._loads_started:
            return
        self._loads_started = meta
        cpu_hits = [job for job in meta.loads if not job.is_async]
        if cpu_hits:
            self._load_cpu_hits(cpu_hits, whole=meta.full_graph)

    def forward_begins(self, meta: TierCacheMetadata) -> None:
        """vLLM bound this step's metadata: its forward starts now."""
        if self._forward_timer is not None:
            self._forward_timer.begin(meta.timed_tokens)
        self._note_step(meta)
        self._fence_before_forward(meta)

    def start_load_kv(self, meta: TierCacheMetadata) -> None:
        self._idle_step = meta.idle
        self._note_step(meta)
        self._poll_copies()
        if self.engine is None or self.copier is None:  # no KV, or unmapped for sleep mode
            self._fail_all(meta)
            return
        self._begin_step(meta)
        for job in meta.loads:
            if job.is_async:
                self._async.append(self._stage(job))
        self._start_sync_loads(meta)
        self._poll_async()

    def _stage(self, job: LoadJob) -> _AsyncLoad:
        """Stage a load's disk and S3 blocks into their slots, each tier apart (they
        run in parallel), noting when each tier's last block is in."""
        load = _AsyncLoad(job, [], time.perf_counter(), {})
        assert self.engine is not None  # start_load_kv stages only with an engine
        for tier in (DISK, S3):
            ops = [op for op in job.ops if op.tier == tier]
            if not ops:
                continue
            future = self.engine.stage_many([(op.block_hash, op.slot, tier) for op in ops])
            # (mypy cannot infer a lambda with a default argument: misc)
            future.add_done_callback(lambda _, t=tier: load.staged_at.setdefault(t, time.perf_counter()))  # type: ignore[misc]
            load.staged.append((tier, ops, future))
            for index, op in enumerate(ops):
                self._fills[op.slot] = _Fill(op.block_hash, future, index)
        for op in job.ops:
            if op.after_fill:
                fill = self._fills.get(op.slot)
                known = fill is not None and fill.block_hash == op.block_hash
                load.after_fills.append((op, fill if known else None))
        return load

    def _load_cpu_hits(self, jobs: list[LoadJob], whole: bool = False) -> None:
        """This step's synchronous hits: in the CPU tier, and on disk where read in the
        forward. Layer by layer beside the forward when that is known to be safe, else
        now, before the forward. `whole`: the forward may be a full CUDA graph replay,
        which calls no layer hook: copied whole, the forward's stream waiting for it."""
        started = time.perf_counter()
        opened = self._open_disk_reads(jobs)
        staged_ok = {id(op): id(op) in opened for job in jobs for op in job.ops if reads_in_forward(op)}
        if (whole or not self._layerwise_ready()) and not opened:
            for job in jobs:
                self._finish_load(job.ops, staged_ok)
            self._stats.observe_load(CPU, time.perf_counter() - started)
            return
        self._load_layerwise(
            [job.ops for job in jobs],
            staged_ok,
            started=started,
            opened=opened,
            now=not self._layerwise_ready(),
        )

    def _open_disk_reads(self, jobs: list[LoadJob]) -> dict[int, DiskRead]:
        """The disk blocks to read in the forward, each object opened with its header
        checked, by id of their op. A block that cannot be opened is missing here, so
        it fails (and so does the rest of its prefix)."""
        wanted = [op for job in jobs for op in job.ops if reads_in_forward(op)]
        if not wanted:
            return {}
        assert self.engine is not None  # loads are planned only with an engine
        opened: dict[int, DiskRead] = {}
        # Reads need the helper thread's layer-by-layer load, which the CPU backend has;
        # the scheduler plans them nowhere else.
        if self._layer_helper is None:
            return opened
        for op in wanted:
            pages = self.engine.open_disk_pages(op.block_hash)
            if pages is None:
                self._emit(READ_FAILED, op.block_hash)
            else:
                opened[id(op)] = DiskRead(op.gpu_block, pages)
        return opened

    def _layerwise_ready(self) -> bool:
        if self._layer_order is None or self.copier is None:
            return False
        # Threads copy on the CPU backend; on CUDA the copy stream does (layerwise_gpu.py).
        return self._layer_helper is not None or self._stream_copies()

    def _load_layerwise(
        self,
        jobs_ops: list[list[BlockOp]],
        staged_ok: dict[int, bool],
        started: float | None,
        opened: dict[int, DiskRead] | None = None,
        now: bool = False,
    ) -> None:
        """Start copying the good blocks of these loads in the background; the next
        forward waits for each layer before its attention reads it. `opened`: disk
        objects to read in with them; `now`: the layer order is not known yet, so the
        load is done before the forward instead."""
        opened = opened or {}
        ops = [op for job_ops in jobs_ops for op in job_ops]
        # Each request's prefix must be whole; one request's lost block fails only its own.
        good = [op for job_ops in jobs_ops for op in self._good_prefix(job_ops, staged_ok)]
        for op_id in opened.keys() - {id(op) for op in good}:
            opened[op_id].pages.close()  # past a failed block: not read
        if not good:
            self._release(ops, staged_ok)
            return
        from_slots = [op for op in good if not reads_in_forward(op)]
        slots, blocks = [op.slot for op in from_slots], [op.gpu_block for op in from_slots]
        assert self.copier is not None and self.buffer is not None and self.engine is not None
        disk = None
        if opened.keys() & {id(op) for op in good}:
            assert self.engine.disk is not None  # blocks were opened from it
            reads = [opened[id(op)] for op in good if id(op) in opened]
            disk = DiskReads(self.copier.regions, reads, self.engine.disk, self.engine.integrity_key)
        order = self._layer_order or [region.name for region in self.copier.regions]
        load: LayerwiseLoad | StreamLayerwiseLoad
        if self._layer_helper is None:
            load = StreamLayerwiseLoad(self.copier, self.buffer, slots, blocks, order)
        else:
            load = LayerwiseLoad(self.copier, self.buffer, slots, blocks, order, self._layer_helper, disk)
        step = _LayerwiseStep(load, ops, started, staged_ok, disk)
        if now:
            self._end_load(step)
        else:
            self._layerwise.append(step)

    def wait_for_layer(self, layer_name: str) -> None:
        """vLLM calls this before each attention layer of a step's forward."""
        self._layers_this_step.append(layer_name)
        # A hybrid model's layers of different groups share regions (copier.py).
        region = self.copier.region_of.get(layer_name, layer_name) if self.copier is not None else layer_name
        for step in self._layerwise:
            step.load.wait(region)

    def _end_of_forward(self) -> None:
        steps, self._layerwise = self._layerwise, []
        for step in steps:
            self._end_load(step)
        seen, self._layers_this_step = self._layers_this_step, []
        # Every layer must wait, not only one per region: a layer that never calls the
        # hook (a Mamba layer) could read its region before another layer sharing it
        # had waited for the copy.
        if self._layer_order is None and self.copier is not None and set(self.copier.region_of) <= set(seen):
            regions = [self.copier.region_of[name] for name in seen if name in self.copier.region_of]
            self._layer_order = list(dict.fromkeys(regions))
            log.info("tiercache: loading hits into the paged KV layer by layer during the forward")

    def _end_load(self, step: _LayerwiseStep) -> None:
        """A layer-by-layer load's forward is queued: the rest of the forward's stream
        waits for the whole load (CUDA), and its slots go back once it is over; report
        its disk blocks that did not load as failed (vLLM recomputes them, and drops
        what this step computed from them)."""
        done = step.load.end()
        if step.disk is not None:
            failed = step.disk.failed()
            step.disk.close()
            for read in step.disk.reads:
                self._count_loaded(DISK, ok=read.gpu_block not in failed)
            for op in step.ops:
                if reads_in_forward(op) and op.gpu_block in failed:
                    self._failed_blocks.add(op.gpu_block)
                    self._emit(READ_FAILED, op.block_hash)
        if step.started is not None:
            self._stats.observe_load(CPU, time.perf_counter() - step.started)
        self._after_copy(done, lambda: self._release(step.ops, step.staged_ok))

    def _poll_async(self) -> None:
        """Load what staging finished; give up on loads past their deadline. Each load
        apart: one that raises fails alone (its blocks recomputed), and the first such
        error is raised once every load has been seen to."""
        if self.copier is None:
            return  # the paged KV is unmapped (sleep mode): loads copy in after restore
        still = []
        error: Exception | None = None
        deadline = self.config.movers.load_deadline_seconds
        for load in self._async:
            if all(future.done() for future in load.waits_on()):
                try:
                    self._end_async(load)
                except Exception as failure:
                    error = error or failure
                    self._give_up(load)
            elif time.perf_counter() - load.started > deadline:
                log.warning(
                    "tiercache: a load of %d blocks was not staged within movers.load_deadline_seconds "
                    "(%.1f s): recomputed instead",
                    len(load.job.ops),
                    deadline,
                )
                self._stats.add(LOADS_TIMED_OUT, 1)
                LOADS_TIMED_OUT_METRIC.inc()
                self._give_up(load)
            else:
                still.append(load)
        self._async = still
        if error is not None:
            raise error

    def _end_async(self, load: _AsyncLoad) -> None:
        """A load whose staging is over: copy it into the paged KV (now, or beside the
        next forward) and report its request finished receiving."""
        now = time.perf_counter()
        staged_ok = {id(op): fill is not None and fill.ok() for op, fill in load.after_fills}
        for tier, ops, future in load.staged:
            staged_ok.update({id(op): ok for op, ok in zip(ops, future.result(), strict=True)})
            # A failed read counts too: the request waited for it all the same.
            # (The done-callback may not have run yet when the future reads done.)
            self._timings.append((tier, len(ops), load.staged_at.get(tier, now) - load.started))
        tiers = {op.tier for op in load.job.ops}
        # (A hybrid model's CPU hits are asynchronous loads too: scheduler.py.)
        slowest = S3 if S3 in tiers else DISK if DISK in tiers else CPU
        self._stats.observe_load(slowest, now - load.started)
        if self.fails_whole_requests and not all(
            op.tier == CPU or staged_ok.get(id(op), False) for op in load.job.ops
        ):
            self._fail_request(load.job, staged_ok)
        elif self._layerwise_ready():
            # vLLM schedules the request no earlier than the next step, whose
            # forward waits for each layer: the copy overlaps that forward.
            self._load_layerwise([load.job.ops], staged_ok, started=None)
        else:
            self._finish_load(load.job.ops, staged_ok)
        self._finished_recving.add(load.job.req_id)

    def _give_up(self, load: _AsyncLoad) -> None:
        """Report a staged load's blocks failed (vLLM recomputes them) and its request
        finished receiving. A staging still reading keeps its slots pinned until it
        ends, so nothing it writes late lands in a slot given to another block, and
        its blocks are reported failed now, so the scheduler never serves them."""
        now = time.perf_counter()
        late: set[int] = set()
        for tier, ops, future in load.staged:
            if not future.done():
                future.cancel()  # not started yet: it never will
            # What the tier cost the request, finished or not: the cost model learns it.
            self._timings.append((tier, len(ops), load.staged_at.get(tier, now) - load.started))
            if not future.done():
                for op in ops:
                    self._owed.pop(id(op), None)
                    self._failed_blocks.add(op.gpu_block)
                    self._count_loaded(op.tier, ok=False)
                    self._fills[op.slot] = _Fill(op.block_hash, _VOID)  # a load sharing it fails too
                    self._emit(FILL_FAILED, (op.block_hash, op.slot))
                late.update(id(op) for op in ops)
                slots = [op.slot for op in ops]
                future.add_done_callback(lambda _, slots=slots: self._release_slots(slots))  # type: ignore[misc]
        self._fail_ops([op for op in load.job.ops if id(op) not in late])
        self._fail_whole(load.job)
        self._finished_recving.add(load.job.req_id)

    def _fail_whole(self, job: LoadJob) -> None:
        """With several KV cache groups vLLM takes no block-level failures (block ids
        repeat across groups): a failed load fails its request, which vLLM recomputes."""
        if self.fails_whole_requests:
            self._failed_blocks.difference_update(op.gpu_block for op in job.ops)
            self._failed_recving.add(job.req_id)

    def _release_slots(self, slots: list[int]) -> None:
        for slot in slots:
            self._emit(RELEASED, slot)

    def _fail_ops(self, ops: list[BlockOp]) -> None:
        """Loads not made: their blocks reported failed, the slots they still pin
        released. Where the connector tracks the steps, an op it settled already is
        passed over; without it, the ops are taken to be all unsettled."""
        for op in ops:
            self._failed_blocks.add(op.gpu_block)
            if self._owed.pop(id(op), None) is None and self._tracked is not None:
                continue
            self._count_loaded(op.tier, ok=False)
            if op.slot >= 0:
                if op.tier != CPU:  # a slot claimed to stage into, never filled
                    self._fills[op.slot] = _Fill(op.block_hash, _VOID)  # a load sharing it fails too
                    self._emit(FILL_FAILED, (op.block_hash, op.slot))
                self._emit(RELEASED, op.slot)

    def _fail_request(self, job: LoadJob, staged_ok: dict[int, bool]) -> None:
        """A hit of several KV cache groups lost a block: none of it is copied, and
        vLLM recomputes the request (see `fails_whole_requests`)."""
        self._good_prefix(job.ops, staged_ok)  # the fill reports and counts
        self._failed_blocks.difference_update(op.gpu_block for op in job.ops)
        self._release(job.ops, staged_ok)
        self._failed_recving.add(job.req_id)

    def _finish_load(self, ops: list[BlockOp], staged_ok: dict[int, bool]) -> None:
        """Copy the good blocks into the paged KV; report the rest as failed."""
        good = self._good_prefix(ops, staged_ok)
        done = None
        if good:
            assert self.copier is not None and self.buffer is not None  # loads run with an engine
            slots, blocks = [op.slot for op in good], [op.gpu_block for op in good]
            done = self.copier.queue_from_slots(slots, blocks, self.buffer)
        self._after_copy(done, lambda: self._release(ops, staged_ok))

    def _good_prefix(self, ops: list[BlockOp], staged_ok: dict[int, bool]) -> list[BlockOp]:
        """The blocks to load, counted; the rest reported as failed. Blocks after a
        failed one are failed too: a prefix must be whole."""
        good: list[BlockOp] = []
        failed = False
        for op in ops:
            ok = staged_ok.get(id(op), False) or (op.tier == CPU and not op.after_fill)
            if op.tier in (DISK, S3) and op.slot >= 0:
                self._emit(FILLED if ok else FILL_FAILED, (op.block_hash, op.slot))
            if ok and not failed:
                good.append(op)
                if not reads_in_forward(op):  # those count once read (_end_load)
                    self._count_loaded(op.tier, ok=True)
            else:
                failed = True
                self._failed_blocks.add(op.gpu_block)
                self._count_loaded(op.tier, ok=False)
        return good

    def _count_loaded(self, tier: str, ok: bool) -> None:
        if not ok:
            self._stats.add(f"failed_blocks_{tier or 'cpu'}", 1)
            return
        self._hits[tier] += 1
        self._stats.add(f"loaded_blocks_{tier}", 1)
        assert self.buffer is not None  # loads run with an engine
        self._stats.add(f"loaded_bytes_{tier}", self.buffer.slot_bytes)

    def _release(self, ops: list[BlockOp], staged_ok: dict[int, bool]) -> None:
        """The load is in the paged KV: give the slots back (or promote to disk)."""
        for op in ops:
            self._owed.pop(id(op), None)
            if op.slot < 0:
                continue
            if staged_ok.get(id(op)) and self._promotes_to_disk(op.tier):
                assert self.engine is not None  # loads run with an engine
                self.engine.write_down(op.block_hash, op.slot, self._after_write, tiers=(DISK,))
            else:
                self._emit(RELEASED, op.slot)

    def _promotes_to_disk(self, tier: str) -> bool:
        has_disk = self.engine is not None and self.engine.disk is not None
        return self.writes_lower_tiers and promotes_to_disk(
            tier, has_disk, write_back=self.config.movers.policy != "write_through"
        )

    def _fail_all(self, meta: TierCacheMetadata) -> None:
        for job in meta.loads:
            if self.fails_whole_requests:
                self._failed_recving.add(job.req_id)
            for op in job.ops:
                self._owed.pop(id(op), None)
                if not self.fails_whole_requests:
                    self._failed_blocks.add(op.gpu_block)
                if reads_in_forward(op):
                    self._emit(READ_FAILED, op.block_hash)
                elif op.tier in (DISK, S3):
                    self._fills[op.slot] = _Fill(op.block_hash, _VOID)  # a load sharing it fails too
                    self._emit(FILL_FAILED, (op.block_hash, op.slot))
                if op.slot >= 0:
                    self._emit(RELEASED, op.slot)
            if job.is_async:
                self._finished_recving.add(job.req_id)
        for op in meta.stores:
            self._owed.pop(id(op), None)
            self._fills[op.slot] = _Fill(op.block_hash, _VOID)
            self._emit(FILL_FAILED, (op.block_hash, op.slot))
            self._emit(RELEASED, op.slot)

    # -- after a failure (connector/guard.py) -----------------------------------------
    def track(self, meta: TierCacheMetadata) -> None:
        """The connector hands each step's metadata here before any hook of the step
        runs: its ops are owed a release (or a failure report) until settled."""
        self._note_step(meta)
        if meta is self._tracked:
            return
        self._tracked = meta
        for job in meta.loads:
            for op in job.ops:
                self._owed[id(op)] = op
        for op in meta.stores:
            self._owed[id(op)] = op

    def fail_step(self, meta: TierCacheMetadata) -> None:
        """A hook of this step raised: settle what the step left undone as a miss. The
        copies beside the forward end first (nothing may touch a slot or block after
        this); then its loads, and the earlier hits this forward was copying in, are
        reported failed where not yet in the paged KV (vLLM recomputes them), its async
        loads finished receiving, the slots they pin released, and its stores that
        were not handed to the movers dropped (never reported filled alone)."""
        steps, self._layerwise = self._layerwise, []
        saving, self._saving = self._saving, None
        for step in steps:
            self._quietly(step.load.finish)
            if step.disk is not None:
                self._quietly(step.disk.close)
        if saving is not None:
            self._quietly(saving.finish)
        # Not a step that went well: the host may wait, and settles every copy first.
        self._quietly(self._drain_copies)
        self._layers_this_step = []
        jobs = {id(job) for job in meta.loads}
        for load in [load for load in self._async if id(load.job) in jobs]:
            self._async.remove(load)
            self._give_up(load)
        self._fail_ops(
            [op for job in meta.loads for op in job.ops] + [op for step in steps for op in step.ops]
        )
        for job in meta.loads:
            self._fail_whole(job)
            if job.is_async:
                self._finished_recving.add(job.req_id)
        for op in meta.stores:
            if self._owed.pop(id(op), None) is not None:
                self._fills[op.slot] = _Fill(op.block_hash, _VOID)  # a load sharing it fails too
                self._emit(FILL_FAILED, (op.block_hash, op.slot))
                self._emit(RELEASED, op.slot)

    @staticmethod
    def _quietly(call) -> None:
        """Part of undoing a failed step: one more error must not stop the rest."""
        try:
            call()
        except Exception:
            log.exception("tiercache: while settling a failed step")

    def fail_loads_in_flight(self) -> set[str]:
        """get_finished raised: every load still staging is given up (reported failed),
        lest a request wait on a poll that keeps failing; the loads reported done."""
        loads, self._async = self._async, []
        for load in loads:
            self._give_up(load)
        done, self._finished_recving = self._finished_recving, set()
        return done

    def disable(self, reason: str) -> None:
        """Serve without the cache from now on: every load fails, nothing is stored
        (loads in flight are given up, so no request waits for them)."""
        self.disabled_reason = reason
        log.error("tiercache: %s", reason)
        loads, self._async = self._async, []
        for load in loads:
            self._quietly(lambda load=load: self._give_up(load))
        engine, self.engine = self.engine, None
        if engine is not None:
            self._quietly(engine.close)

    # -- stores ---------------------------------------------------------------------
    def save_layer(self, layer_name: str, meta: TierCacheMetadata) -> None:
        """vLLM calls this after each attention layer. On CUDA that layer's share of the
        step's stores starts for the CPU tier now, beside the rest of the forward
        (layerwise_gpu.py); elsewhere stores are copied whole in `wait_for_save`."""
        if self.engine is None or not meta.stores or not self._stream_copies() or meta.full_graph:
            return
        self._begin_step(meta)
        if self._saving is None:
            assert self.copier is not None and self.buffer is not None  # set with the engine
            ops = meta.stores
            self._saving = StreamLayerwiseSave(
                self.copier, self.buffer, [op.gpu_block for op in ops], [op.slot for op in ops]
            )
        self._saving.save(layer_name)

    def _stream_copies(self) -> bool:
        return (
            self._layer_helper is None
            and self.copier is not None
            # Layers of several groups share a region, each writing its own blocks at
            # its own point of the forward: copy out once the forward is over.
            and not self.copier.aliased
            and self.buffer is not None  # set right after the copier
            and self.copier.one_launch(self.buffer)
        )

    def wait_for_save(self, meta: TierCacheMetadata) -> None:
        """The step's forward is over: finish its loads, then copy out its stores."""
        if self._forward_timer is not None:
            self._forward_timer.end()
        self._note_step(meta)
        self._end_of_forward()
        saving, self._saving = self._saving, None
        if self.engine is None or self.copier is None:
            return
        if not meta.stores:
            self._end_groups(meta)
            self._poll_copies()
            return
        self._begin_step(meta)
        void = self._computed_over_failed_loads(meta)
        ops = [op for op in meta.stores if op.req_id not in void]
        done = None
        if saving is not None:
            done = saving.end()
        elif ops:
            assert self.copier is not None and self.buffer is not None  # set with the engine
            blocks, slots = [op.gpu_block for op in ops], [op.slot for op in ops]
            done = self.copier.queue_to_slots(blocks, slots, self.buffer)
        # A load planned to share one of these fills waits for it (_AsyncLoad.waits_on).
        stored: Future = Future()
        for op in meta.stores:
            self._fills[op.slot] = _Fill(op.block_hash, _VOID if op.req_id in void else stored)
        self._stats.add("stored_blocks", len(ops))
        requests = {op.req_id for op in meta.stores}
        self._after_copy(done, lambda: self._hand_over_stores(meta, ops, void, stored), requests)
        self._poll_copies()

    def _hand_over_stores(
        self, meta: TierCacheMetadata, ops: list[BlockOp], void: set[str], stored: Future
    ) -> None:
        """The step's store copies are over: each slot goes to the movers (or back)."""
        stored.set_result([True])
        for op in meta.stores:
            if op.req_id in void:
                self._owed.pop(id(op), None)
                self._emit(STORE_VOID, (op.block_hash, op.slot))
                self._emit(RELEASED, op.slot)
        assert self.engine is not None  # copies are queued only with an engine
        # Under write-back a stored block goes down only when the CPU tier evicts it
        # (the scheduler's write-backs, `_begin_step`).
        writes_through = self.writes_lower_tiers and self.config.movers.policy == "write_through"
        for op in ops:
            self._emit(FILLED, (op.block_hash, op.slot))
            if writes_through:
                self.engine.write_down(
                    op.block_hash,
                    op.slot,
                    self._after_write,
                    group=op.req_id or None,
                    on_slot_free=self._slot_free,
                )
            else:
                self._emit(RELEASED, op.slot)
            self._owed.pop(id(op), None)
        self._end_groups(meta)

    # -- copies in flight (CUDA) --------------------------------------------------------
    def _after_copy(self, done: sync.Event | None, settle: Callable[[], None], req_ids=()) -> None:
        """Run `settle` once the copies queued up to `done` are over: now if they are
        (no event: the CPU backend's copies end as they return), else from the hook that
        first sees the event done (_poll_copies)."""
        if done is None:
            settle()
        elif self._host_waits_for_copies:
            sync.host_wait(done)
            settle()
        else:
            self._in_flight.append(_InFlight(done, settle, set(req_ids)))

    def _poll_copies(self) -> None:
        """Settle the copies seen over, oldest first (the copy stream runs them in
        order, so the first not over ends the look)."""
        while self._in_flight and self._in_flight[0].event.query():
            self._settle(self._in_flight.pop(0))

    def _settle(self, copy: _InFlight) -> None:
        copy.settle()
        for req_id in copy.ends:
            self._end_group(req_id)

    def _drain_copies(self) -> None:
        """Wait for every copy in flight and settle it: never on the step path (sleep
        mode's unmapping, a failed step, shutdown)."""
        while self._in_flight:
            copy = self._in_flight.pop(0)
            sync.host_wait(copy.event)
            self._settle(copy)

    def _note_step(self, meta: TierCacheMetadata) -> None:
        """Once per step, from its first hook: the requests vLLM now keeps the blocks of
        until this worker reports them (finished_sending)."""
        if meta is self._noted:
            return
        self._noted = meta
        self._awaiting_sending.update(meta.finished_storing)

    def _fence_before_forward(self, meta: TierCacheMetadata) -> None:
        """Before the step's forward is queued (and before vLLM prepares its inputs):
        where blocks a store copy still reads may be written by it, the forward's stream
        waits for the copies in flight; where it may be a full CUDA graph replay, for
        the hits staged for it layer by layer (a replay calls no layer hook)."""
        if meta is self._fenced or self.copier is None or self.copier.stream is None:
            return
        self._fenced = meta
        if meta.fence_stores and self._in_flight:
            # The copy stream runs in order: its newest event covers the older ones.
            self.copier.stream.forward_waits(self._in_flight[-1].event)
        if meta.full_graph:
            for step in self._layerwise:
                step.load.wait_all()

    def drain_finished_sending(self) -> set[str]:
        """`take_finished_sending` raised: wait for every copy (not a step that went
        well) and report every request waiting for them."""
        while self._in_flight:
            copy = self._in_flight.pop(0)
            self._quietly(lambda copy=copy: sync.host_wait(copy.event))
            self._quietly(lambda copy=copy: self._settle(copy))
        done, self._awaiting_sending = self._awaiting_sending, set()
        return done

    def take_finished_sending(self) -> set[str]:
        """Requests vLLM kept the blocks of that no store copy reads any more."""
        self._poll_copies()
        reading = {req_id for copy in self._in_flight for req_id in copy.req_ids}
        done = self._awaiting_sending - reading
        self._awaiting_sending -= done
        return done

    def _computed_over_failed_loads(self, meta: TierCacheMetadata) -> set[str]:
        """Requests of this step that read a block whose synchronous load failed (a
        disk read that failed its check, a block gone before the step), whether they
        loaded it or share it through vLLM's prefix cache. The forward that just ran
        computed their blocks over what that block's pages held, garbage or stale:
        vLLM drops that output and recomputes from the lost block, and those blocks
        must not be stored either, or a later hit would serve them."""
        failed = self._failed_blocks  # this step's, until vLLM takes them after the save
        return {req_id for req_id, reads in meta.store_reads.items() if failed.intersection(reads)}

    def _end_groups(self, meta: TierCacheMetadata) -> None:
        """Requests whose stores are all queued now: their partial S3 runs may ship."""
        for req_id in meta.stores_done:
            self._end_group(req_id)

    def _end_group(self, req_id: str) -> None:
        """The request's partial S3 run ships once its last blocks reach the movers:
        now, or when the copies out of its blocks are over."""
        copying = [copy for copy in self._in_flight if req_id in copy.req_ids]
        if copying:
            copying[-1].ends.append(req_id)
        elif self.engine is not None:
            self.engine.end_group(req_id)

    def _after_write(self, result: WriteResult) -> None:
        """Runs on a mover thread when a block's write-down ended, stored or not."""
        if not result.slot_freed:  # else _slot_free reported all the scheduler tracks
            self._slot_free(result)

    def _slot_free(self, result: WriteResult) -> None:
        """The movers read the block's slot for the last time (an S3 run it waits for
        uploads from a copy): the disk's answer and the slot go to the scheduler now."""
        if result.stored.get(DISK):
            self._emit(ON_DISK, result.block_hash)
        if result.slot is not None:
            self._emit(RELEASED, result.slot)

    # -- reporting ------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str] | frozenset[str] = frozenset()) -> set[str]:
        """Loads done since the last call. `finished_req_ids`: requests vLLM finished,
        whose partial S3 runs go now rather than when their flush timer says."""
        if self.engine is not None:
            for req_id in finished_req_ids:
                self._end_group(req_id)
        if self._idle_step:
            self._idle_step = False
            staging = [future for load in self._async for future in load.waits_on()]
            if staging:
                wait(staging, timeout=IDLE_STEP_WAIT_SECONDS, return_when=FIRST_COMPLETED)
        self._poll_copies()
        self._poll_async()
        done, self._finished_recving = self._finished_recving, set()
        return done

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed as a whole since the last call (they are in
        `get_finished`'s answer too)."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_worker_meta(self) -> TierCacheWorkerMetadata | None:
        timings, self._timings = self._timings, []
        if self._forward_timer is not None:
            timings += [(FORWARD, tokens, seconds) for tokens, seconds in self._forward_timer.take()]
        with self._lock:
            if not self._reports and not self._hits and not timings:
                return None
            meta = TierCacheWorkerMetadata(self._reports, self._hits, timings)
            self._reports, self._hits = [], Counter()
        return meta

    def take_stats(self) -> TierCacheStats | None:
        if self.engine is not None:
            self._gauges.add_to(self._stats, {"stores_in_flight": self.engine.writes_in_flight})
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, TierCacheStats()
        return stats

    def shutdown(self) -> None:
        self._drain_copies()
        if self._layer_helper is not None:
            self._layer_helper.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()

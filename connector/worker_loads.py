"""The worker's loads: each request's load taken through its lifecycle
(load_lifecycle.py), from the step that plans it to the one report of its end.

Synchronous loads (CPU-tier hits of a one-group model, with disk blocks read during
the forward on the CPU backend) copy into the paged KV in the step that computes
their request: layer by layer beside the forward once the layer order is known
(layerwise.py, layerwise_gpu.py), else before it. Asynchronous loads stage their disk
and S3 blocks into CPU slots first; once staged, their good prefix is copied in and
only then is vLLM told (see load_lifecycle.py for why)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.metrics import LOADS_TIMED_OUT as LOADS_TIMED_OUT_METRIC
from tiercache.policy import promotes_to_disk
from tiercache.tiers import CPU, DISK, PEER, S3

from .disk_reads import DiskRead, DiskReads
from .layerwise import LayerwiseLoad
from .layerwise_gpu import StreamLayerwiseLoad
from .load_lifecycle import (
    VOID,
    Fill,
    Load,
    LoadEnds,
    LoadState,
    good_prefix,
    reads_in_forward,
    stages_into_slot,
)
from .metadata import FILL_FAILED, FILLED, READ_FAILED, RELEASED, BlockOp, LoadJob, TierCacheMetadata
from .stats import LOADS_TIMED_OUT

if TYPE_CHECKING:
    from .worker import TierCacheWorker

log = logging.getLogger("tiercache.connector")


@dataclass
class _LayerwiseStep:
    """Loads copied in layer by layer beside one forward, each with its blocks to
    load and those failed already."""

    copy: LayerwiseLoad | StreamLayerwiseLoad
    loads: list[tuple[Load, list[BlockOp], list[BlockOp]]]
    staged_ok: dict[int, bool]
    started: float
    disk: DiskReads | None = None  # disk blocks read into the paged KV by this copy


class WorkerLoads:
    def __init__(self, worker: TierCacheWorker):
        self._worker = worker
        self.ends = LoadEnds(fails_whole_requests=len(worker.group_layers) > 1)
        # Every load of a recent step by id of its job, kept (with its job, so the id
        # stays its own) until it ended and gave back its slots.
        self._loads: dict[int, Load] = {}
        self._staging: list[Load] = []  # asynchronous loads whose staging is not over
        # Per CPU slot, its last fill (a staging or a store): a load planned to share a
        # fill under way (BlockOp.after_fill) waits for it here.
        self.fills: dict[int, Fill] = {}
        # Layer-by-layer loads: on once a whole step has shown the forward calling
        # wait_for_layer_load for every registered layer, in this order.
        self.layer_order: list[str] | None = None
        self._layers_this_step: list[str] = []
        self.layerwise: list[_LayerwiseStep] = []  # what the forward waits for, layer by layer
        self.layer_helper: ThreadPoolExecutor | None = None  # the CPU backend's copy thread
        self._started: TierCacheMetadata | None = None  # the step whose sync loads started
        # Errors one load raised while ending: that load failed alone; the connector
        # counts them as hook failures.
        self.contained_errors: list[BaseException] = []

    # -- the registry ---------------------------------------------------------------
    def load_of(self, job: LoadJob) -> Load:
        load = self._loads.get(id(job))
        if load is None:
            load = self._loads[id(job)] = Load(job)
        return load

    def new_step(self) -> None:
        """Forget the loads that are over: ended, every slot given back."""
        over = [key for key, load in self._loads.items() if load.ended and not load.slots_owed]
        for key in over:
            del self._loads[key]

    def staging_futures(self) -> list:
        return [future for load in self._staging for future in load.waits_on()]

    # -- ends: every path a load takes out goes through `_end` --------------------------
    def _end(self, load: Load, loaded: list[BlockOp], failed: list[BlockOp]) -> None:
        if not self.ends.end(load, failed):
            return
        for op in loaded:
            self._count(op.tier, ok=True)
        for op in failed:
            self._count(op.tier, ok=False)

    def _count(self, tier: str, ok: bool) -> None:
        stats = self._worker.stats
        if not ok:
            stats.add(f"failed_blocks_{tier or 'cpu'}", 1)
            return
        self._worker.hits[tier] += 1
        stats.add(f"loaded_blocks_{tier}", 1)
        assert self._worker.buffer is not None  # loads run with an engine
        stats.add(f"loaded_bytes_{tier}", self._worker.buffer.slot_bytes)

    def fail(self, load: Load, late: frozenset[int] = frozenset(), reads_lost: bool = False) -> None:
        """End `load` as not loaded, and give back the slots it still holds (but `late`
        ones: a staging still writes into them). `reads_lost`: its disk objects to be
        read in the forward count as unreadable."""
        emit = self._worker.emit
        for op in load.job.ops:
            if reads_lost and reads_in_forward(op) and not load.ended:
                emit(READ_FAILED, op.block_hash)
            if id(op) not in load.slots_owed or id(op) in late:
                continue
            load.slots_owed.discard(id(op))
            if stages_into_slot(op) and load.state in (LoadState.PLANNED, LoadState.STAGING):
                self.fills[op.slot] = Fill(op.block_hash, VOID)  # a load sharing it fails too
                emit(FILL_FAILED, (op.block_hash, op.slot))
            emit(RELEASED, op.slot)
        self._end(load, [], list(load.job.ops))

    def give_up(self, load: Load) -> None:
        """Stop waiting for a load's staging: it ends now, as not loaded. A staging
        still reading keeps its slots until it ends, so nothing it writes late lands in
        a slot given to another block; its blocks are reported failed now, so the
        scheduler never serves them."""
        if load in self._staging:
            self._staging.remove(load)
        now = time.perf_counter()
        late: set[int] = set()
        for tier, ops, future in load.staged:
            if not future.done():
                future.cancel()  # not started yet: it never will
            # What the tier cost the request, finished or not: the cost model learns it.
            self._worker.timings.append((tier, len(ops), load.staged_at.get(tier, now) - load.started))
            if future.done():
                continue
            for op in ops:
                self.fills[op.slot] = Fill(op.block_hash, VOID)
                self._worker.emit(FILL_FAILED, (op.block_hash, op.slot))
            late.update(id(op) for op in ops)
            future.add_done_callback(lambda _, ops=ops: self._release_late(load, ops))  # type: ignore[misc]
        self.fail(load, late=frozenset(late))

    def _release_late(self, load: Load, ops: list[BlockOp]) -> None:
        for op in ops:
            if id(op) in load.slots_owed:
                load.slots_owed.discard(id(op))
                self._worker.emit(RELEASED, op.slot)

    def give_up_all(self) -> None:
        """Every load still staging ends now (the connector is turned off, or polling
        failed): no request waits for a poll that may not come."""
        for load in list(self._staging):
            self._worker.quietly(lambda load=load: self.give_up(load))

    def fail_step(self, meta: TierCacheMetadata) -> None:
        """A hook of the step raised: its loads that have not ended end as not loaded.
        The copies beside its forward are over (the worker finished them first)."""
        steps, self.layerwise = self.layerwise, []
        for step in steps:
            if step.disk is not None:
                self._worker.quietly(step.disk.close)
        self._layers_this_step = []
        loads = [self.load_of(job) for job in meta.loads]
        loads += [load for step in steps for load, _, _ in step.loads]
        for load in loads:
            if load in self._staging:
                self.give_up(load)
            else:
                self.fail(load)

    def fail_all(self, meta: TierCacheMetadata) -> None:
        """No KV to load into (none registered, or unmapped for sleep mode): the step's
        loads fail at once."""
        for job in meta.loads:
            self.fail(self.load_of(job), reads_lost=True)

    # -- synchronous loads --------------------------------------------------------------
    def start_sync(self, meta: TierCacheMetadata, whole: bool) -> None:
        """The step's synchronous loads, once per step from whichever hook comes first.
        `whole`: the forward may be a full CUDA graph replay, which calls no layer
        hook: copied whole, the forward's stream waiting for it."""
        if meta is self._started:
            return
        self._started = meta
        loads = [self.load_of(job) for job in meta.loads if not job.is_async]
        loads = [load for load in loads if load.state is LoadState.PLANNED]
        if not loads:
            return
        started = time.perf_counter()
        opened = self._open_disk_reads(loads)
        ops = [op for load in loads for op in load.job.ops]
        staged_ok = {id(op): id(op) in opened for op in ops if reads_in_forward(op)}
        if (whole or not self.layerwise_ready()) and not opened:
            for load in loads:
                self._copy_in(load, staged_ok, *good_prefix(load.job.ops, staged_ok))
            self._worker.stats.observe_load(CPU, time.perf_counter() - started)
            return
        self._load_layerwise(loads, staged_ok, started, opened, now=not self.layerwise_ready())

    def _open_disk_reads(self, loads: list[Load]) -> dict[int, DiskRead]:
        """The disk blocks to read in the forward, each object opened with its header
        checked, by id of their op. A block that cannot be opened is missing here, so
        it fails (and so does the rest of its prefix)."""
        wanted = [op for load in loads for op in load.job.ops if reads_in_forward(op)]
        engine = self._worker.engine
        # Reads need the helper thread's layer-by-layer load, which the CPU backend has;
        # the scheduler plans them nowhere else.
        if not wanted or engine is None or self.layer_helper is None:
            return {}
        opened: dict[int, DiskRead] = {}
        for op in wanted:
            pages = engine.open_disk_pages(op.block_hash)
            if pages is None:
                self._worker.emit(READ_FAILED, op.block_hash)
            else:
                opened[id(op)] = DiskRead(op.gpu_block, pages)
        return opened

    def layerwise_ready(self) -> bool:
        if self.layer_order is None or self._worker.copier is None:
            return False
        # Threads copy on the CPU backend; on CUDA the copy stream does (layerwise_gpu.py).
        return self.layer_helper is not None or self._worker.stream_copies()

    def _load_layerwise(
        self,
        loads: list[Load],
        staged_ok: dict[int, bool],
        started: float,
        opened: dict[int, DiskRead],
        now: bool,
    ) -> None:
        """Start copying the good blocks of these loads in the background; the next
        forward waits for each layer before its attention reads it. `opened`: disk
        objects to read in with them; `now`: the layer order is not known yet, so the
        copy is done before the forward instead."""
        # Each request's prefix must be whole; one request's lost block fails only its own.
        split = [(load, *good_prefix(load.job.ops, staged_ok)) for load in loads]
        good = [op for _, ops, _ in split for op in ops]
        for op_id in opened.keys() - {id(op) for op in good}:
            opened[op_id].pages.close()  # past a failed block: not read
        if not good:
            for load, loaded, failed in split:
                self._end(load, loaded, failed)
                self._settle_slots(load, staged_ok)
            return
        worker = self._worker
        copier, buffer, engine = worker.copier, worker.buffer, worker.engine
        assert copier is not None and buffer is not None and engine is not None  # loads run with them
        from_slots = [op for op in good if not reads_in_forward(op)]
        slots, blocks = [op.slot for op in from_slots], [op.gpu_block for op in from_slots]
        disk = None
        if opened.keys() & {id(op) for op in good}:
            assert engine.disk is not None  # blocks were opened from it
            reads = [opened[id(op)] for op in good if id(op) in opened]
            disk = DiskReads(copier.regions, reads, engine.disk, engine.integrity_key)
        order = self.layer_order or [region.name for region in copier.regions]
        copy: LayerwiseLoad | StreamLayerwiseLoad
        if self.layer_helper is None:
            copy = StreamLayerwiseLoad(copier, buffer, slots, blocks, order)
        else:
            copy = LayerwiseLoad(copier, buffer, slots, blocks, order, self.layer_helper, disk)
        for load, _, _ in split:
            load.state = LoadState.COPYING
        step = _LayerwiseStep(copy, split, staged_ok, started, disk)
        if now:
            self.end_layerwise(step)
        else:
            self.layerwise.append(step)

    def wait_for_layer(self, layer_name: str) -> None:
        self._layers_this_step.append(layer_name)
        copier = self._worker.copier
        # A hybrid model's layers of different groups share regions (copier.py).
        region = copier.region_of.get(layer_name, layer_name) if copier is not None else layer_name
        for step in self.layerwise:
            step.copy.wait(region)

    def end_of_forward(self) -> None:
        steps, self.layerwise = self.layerwise, []
        for step in steps:
            self.end_layerwise(step)
        seen, self._layers_this_step = self._layers_this_step, []
        copier = self._worker.copier
        # Every layer must wait, not only one per region: a layer that never calls the
        # hook (a Mamba layer) could read its region before another layer sharing it
        # had waited for the copy.
        if self.layer_order is None and copier is not None and set(copier.region_of) <= set(seen):
            regions = [copier.region_of[name] for name in seen if name in copier.region_of]
            self.layer_order = list(dict.fromkeys(regions))
            log.info("tiercache: loading hits into the paged KV layer by layer during the forward")

    def end_layerwise(self, step: _LayerwiseStep) -> None:
        """A layer-by-layer copy's forward is queued: the rest of the forward's stream
        waits for the whole copy (CUDA), and its slots go back once it is over. Disk
        blocks that did not read in fail (vLLM recomputes them, and drops what this
        step computed from them)."""
        done = step.copy.end()
        lost: set[int] = set()
        if step.disk is not None:
            lost = step.disk.failed()
            step.disk.close()
        for load, loaded, failed in step.loads:
            bad = [op for op in loaded if reads_in_forward(op) and op.gpu_block in lost]
            for op in bad:
                self._worker.emit(READ_FAILED, op.block_hash)
            self._end(load, [op for op in loaded if op not in bad], bad + failed)
        self._worker.stats.observe_load(CPU, time.perf_counter() - step.started)

        def settle() -> None:
            for load, _, _ in step.loads:
                self._settle_slots(load, step.staged_ok)

        self._worker.copies.after(done, settle)

    # -- copying in, giving slots back ----------------------------------------------
    def _copy_in(
        self, load: Load, staged_ok: dict[int, bool], loaded: list[BlockOp], failed: list[BlockOp]
    ) -> None:
        """Copy `loaded` into the paged KV and end the load; its slots go back once
        the copy is over. The copy is done (CPU) or queued ahead of every later forward
        (CUDA) before vLLM hears of it."""
        load.state = LoadState.COPYING
        done = None
        from_slots = [op for op in loaded if not reads_in_forward(op)]
        if from_slots:
            copier, buffer = self._worker.copier, self._worker.buffer
            assert copier is not None and buffer is not None  # loads run with an engine
            slots, blocks = [op.slot for op in from_slots], [op.gpu_block for op in from_slots]
            done = copier.queue_from_slots(slots, blocks, buffer)
        self._end(load, loaded, failed)
        self._worker.copies.after(done, lambda: self._settle_slots(load, staged_ok))

    def _settle_slots(self, load: Load, staged_ok: dict[int, bool]) -> None:
        """The copy out of the load's slots is over: each goes back, or to the disk
        (a block staged from S3 is kept on the node's disk too)."""
        for op in load.job.ops:
            if id(op) not in load.slots_owed:
                continue
            load.slots_owed.discard(id(op))
            if staged_ok.get(id(op)) and self._promotes_to_disk(op.tier):
                engine = self._worker.engine
                assert engine is not None  # loads run with an engine
                engine.write_down(op.block_hash, op.slot, self._worker.after_write, tiers=(DISK,))
            else:
                self._worker.emit(RELEASED, op.slot)

    def _promotes_to_disk(self, tier: str) -> bool:
        worker = self._worker
        has_disk = worker.engine is not None and worker.engine.disk is not None
        return worker.writes_lower_tiers and promotes_to_disk(
            tier, has_disk, write_back=worker.config.movers.policy != "write_through"
        )

    # -- asynchronous loads -------------------------------------------------------------
    def start_async(self, job: LoadJob) -> None:
        """Stage a load's disk, S3 and peer blocks into their slots, each tier apart
        (they run in parallel), noting when each tier's last block is in."""
        load = self.load_of(job)
        if load.state is not LoadState.PLANNED:
            return
        engine = self._worker.engine
        assert engine is not None  # start_load_kv stages only with an engine
        load.state = LoadState.STAGING
        for tier in (DISK, S3):
            ops = [op for op in job.ops if op.tier == tier]
            if not ops:
                continue
            future = engine.stage_many([(op.block_hash, op.slot, tier) for op in ops])
            # (mypy cannot infer a lambda with a default argument: misc)
            future.add_done_callback(lambda _, t=tier: load.staged_at.setdefault(t, time.perf_counter()))  # type: ignore[misc]
            load.staged.append((tier, ops, future))
            for index, op in enumerate(ops):
                self.fills[op.slot] = Fill(op.block_hash, future, index)
        peer_ops = [op for op in job.ops if op.tier == PEER and op.slot >= 0]
        if peer_ops:
            # The same deadline as every staging (poll gives up on the load past it),
            # on the clock the peer tier keeps.
            left = self._worker.config.movers.load_deadline_seconds - (time.perf_counter() - load.started)
            future = self._worker.read_from_peer(job.peer, peer_ops, time.monotonic() + max(left, 0.0))
            future.add_done_callback(lambda _: load.staged_at.setdefault(PEER, time.perf_counter()))
            load.staged.append((PEER, peer_ops, future))
            for index, op in enumerate(peer_ops):
                self.fills[op.slot] = Fill(op.block_hash, future, index)
        for op in job.ops:
            if op.after_fill:
                fill = self.fills.get(op.slot)
                known = fill is not None and fill.block_hash == op.block_hash
                load.after_fills.append((op, fill if known else None))
        self._staging.append(load)

    def poll(self) -> None:
        """Copy in what staging finished; give up on loads past their deadline. Each
        load apart: one that raises fails alone (its blocks recomputed), its error kept
        for the connector to count."""
        if self._worker.copier is None:
            return  # the paged KV is unmapped (sleep mode): loads copy in after restore
        deadline = self._worker.config.movers.load_deadline_seconds
        for load in list(self._staging):
            if load.ended:
                self._staging.remove(load)
            elif load.staging_over():
                self._staging.remove(load)
                try:
                    self._staged(load)
                except Exception as error:
                    log.exception("tiercache: a staged load failed to copy in; recomputed instead")
                    self.contained_errors.append(error)
                    self._worker.quietly(lambda load=load: self.fail(load))
            elif time.perf_counter() - load.started > deadline:
                log.warning(
                    "tiercache: a load of %d blocks was not staged within movers.load_deadline_seconds "
                    "(%.1f s): recomputed instead",
                    len(load.job.ops),
                    deadline,
                )
                self._worker.stats.add(LOADS_TIMED_OUT, 1)
                LOADS_TIMED_OUT_METRIC.inc()
                self.give_up(load)

    def _staged(self, load: Load) -> None:
        """A load whose staging is over: its good prefix goes into the paged KV, and
        it ends (whole for a model with several KV cache groups)."""
        now = time.perf_counter()
        load.state = LoadState.STAGED
        staged_ok = load.staged_ok()
        for tier, ops, _ in load.staged:
            # A failed read counts too: the request waited for it all the same.
            # (The done-callback may not have run yet when the future reads done.)
            self._worker.timings.append((tier, len(ops), load.staged_at.get(tier, now) - load.started))
        tiers = {op.tier for op in load.job.ops}
        # (A hybrid model's CPU hits are asynchronous loads too: scheduler.py.)
        slowest = next((tier for tier in (S3, DISK, PEER) if tier in tiers), CPU)
        self._worker.stats.observe_load(slowest, now - load.started)
        for op in load.job.ops:
            if stages_into_slot(op):
                if staged_ok.get(id(op)):
                    self._worker.published(op.block_hash, op.slot)  # the slot holds it, verified
                self._worker.emit(FILLED if staged_ok.get(id(op)) else FILL_FAILED, (op.block_hash, op.slot))
        loaded, failed = good_prefix(load.job.ops, staged_ok)
        if failed and self.ends.fails_whole_requests:
            loaded, failed = [], list(load.job.ops)
        self._copy_in(load, staged_ok, loaded, failed)

"""The worker half of the connector (one per TP rank): copies blocks between vLLM's
paged KV and this rank's CPU slots, and runs the tier engine that moves them to and
from disk and S3. Everything it does is reported back as events. Its loads are in
worker_loads.py (each through the one lifecycle of load_lifecycle.py); its copies on
the CUDA copy stream in copies.py; the stores, sleep mode and reporting here."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from tiercache.config import TierCacheConfig
from tiercache.engine import ObjectShape, TierEngine, WriteResult
from tiercache.index.keys import KVSpec
from tiercache.policy import reads_disk_in_forward
from tiercache.tiers import DISK, S3
from tiercache.tiers.cpu import CpuBuffer, slots_for

from . import sync
from .copier import PagedKVCopier
from .copies import CopiesInFlight
from .forward_timer import ForwardTimer
from .layerwise_gpu import StreamLayerwiseSave
from .load_lifecycle import VOID, Fill
from .metadata import (
    FILL_FAILED,
    FILLED,
    FORWARD,
    OFF_DISK,
    ON_DISK,
    RELEASED,
    STORE_VOID,
    BlockOp,
    Report,
    TierCacheMetadata,
    TierCacheWorkerMetadata,
    Timing,
)
from .stats import GaugeReport, TierCacheStats
from .worker_loads import WorkerLoads
from .worker_peer import WorkerPeer, missed

log = logging.getLogger("tiercache.connector")

# While a request waits for a disk or S3 load and nothing else runs, vLLM polls the
# connector in a tight loop of empty steps. That loop holds the interpreter lock the
# staging threads need after every read, so on a machine with few cores a disk hit's
# load took several times longer (docs/design.md, "Threads and the idle step"). An idle
# step instead sleeps on the loads, this long at most: the delay a request arriving
# meanwhile can see before it is scheduled.
IDLE_STEP_WAIT_SECONDS = 0.01


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
        # Other instances read this rank's CPU tier, and it reads theirs (tiers/peer):
        # started once a step names this instance (TierCacheMetadata.instance).
        self.peer: WorkerPeer | None = None
        self._peer_started = False
        self.disabled_reason: str | None = None
        self._lock = threading.Lock()
        self._reports: list[Report] = []  # (rank, kind, value), in the order they happened
        self.hits: Counter = Counter()
        self.timings: list[Timing] = []  # for the scheduler's cost model
        self._forward_timer: ForwardTimer | None = None
        self.stats = TierCacheStats()
        self._gauges = GaugeReport(f"rank{tp_rank}")
        self._loads = WorkerLoads(self)
        self.copies = CopiesInFlight(self._end_group_now)
        self._idle_step = False
        # This step's stores being copied out layer by layer (CUDA), if any.
        self._saving: StreamLayerwiseSave | None = None
        # The metadata of the step whose write-backs have been taken (see _begin_step).
        self._begun: TierCacheMetadata | None = None
        # Store ops of the steps seen (`track`) whose slot, or whose report as void,
        # is still owed, by id: what `fail_step` settles after an error.
        self._stores_owed: dict[int, BlockOp] = {}
        self._tracked: TierCacheMetadata | None = None
        # The KV tensors vLLM registered, kept to rebuild the copier on
        # `restore_kv_caches` (sleep mode), and how the dropped copier copied.
        self._registered_kv: dict[str, torch.Tensor] | None = None
        self._unregistered_copier: tuple[bool, bool, tuple[str, str, str]] | None = None
        # Requests vLLM keeps the blocks of until reported in finished_sending.
        self._awaiting_sending: set[str] = set()
        self._noted: TierCacheMetadata | None = None  # the step _note_step saw last
        self._fenced: TierCacheMetadata | None = None  # the step _fence_before_forward saw last

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
            self._loads.layer_helper = ThreadPoolExecutor(1, thread_name_prefix="tiercache-layers")
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
        # Hits being copied in beside a forward: into the paged KV while it is mapped.
        steps, self._loads.layerwise = self._loads.layerwise, []
        for step in steps:
            self._loads.end_layerwise(step)
        self.copies.drain()  # not a step: sleep mode unmaps the memory they touch
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
            # Off for good: the loads that waited across the sleep end now, failed.
            self.disable(
                "the KV tensors after sleep mode's wake-up differ from those registered: "
                "tiercache is off for this engine"
            )
            return
        self._unregistered_copier = None
        self.copier = copier

    def _on_disk_remove(self, key: str) -> None:
        self.emit(OFF_DISK, bytes.fromhex(key.split("/")[1]))

    def emit(self, kind: str, value) -> None:
        """Report an event to the scheduler half (through the worker metadata)."""
        with self._lock:
            self._reports.append((self.tp_rank, kind, value))

    # -- the step's hooks -------------------------------------------------------------
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
        self._loads.new_step()
        if self.peer is not None:
            self.peer.retire(meta)
        if self.engine is None or not meta.write_backs:
            return
        assert self.copier is not None and self.buffer is not None  # set with the engine
        # No copy still touches a victim's slot: a slot is reported filled or released
        # only once the copy into or out of it has been seen over (copies.poll), and
        # the scheduler evicts only slots so reported.
        if self.copies.host_waits and self.copier.stream is not None:
            sync.host_wait(self.copier.stream)
        for block_hash, slot in meta.write_backs:
            # The slot is reused this step: write the old block down from a copy.
            data = bytes(self.buffer.view(slot))
            tiers = meta.write_back_tiers.get(block_hash, (DISK, S3))
            self.engine.write_down(block_hash, None, self.after_write, data=data, tiers=tiers)

    # -- the peer tier -------------------------------------------------------------------
    def _start_peer(self, instance: str) -> None:
        """Share this rank's CPU tier under `instance` and read other instances' (once)."""
        self._peer_started = True
        if self.engine is not None and self.buffer is not None:
            self.peer = WorkerPeer.start(self.config, self.engine, self.buffer, instance, self.tp_rank)

    def published(self, block_hash: bytes, slot: int) -> None:
        """`slot` holds `block_hash` now: other instances may read it."""
        if self.peer is not None:
            self.peer.published(block_hash, slot)

    def read_from_peer(self, instance: str, ops: list[BlockOp], deadline: float) -> Future:
        """WorkerPeer.read, or all missed without a peer tier or a holder."""
        if self.peer is None or not instance:
            return missed(ops)
        return self.peer.read(instance, ops, deadline)

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
        loads = self._loads
        if meta.loads_early and loads.layer_helper is not None and loads.layerwise_ready():
            self._begin_step(meta)
            loads.start_sync(meta, whole=meta.full_graph)

    def forward_begins(self, meta: TierCacheMetadata) -> None:
        """vLLM bound this step's metadata: its forward starts now."""
        if self._forward_timer is not None:
            self._forward_timer.begin(meta.timed_tokens)
        self._note_step(meta)
        self._fence_before_forward(meta)

    def start_load_kv(self, meta: TierCacheMetadata) -> None:
        self._idle_step = meta.idle
        self._note_step(meta)
        self.copies.poll()
        if self.engine is None or self.copier is None:  # no KV, or unmapped for sleep mode
            self._fail_all(meta)
            return
        self._begin_step(meta)
        for job in meta.loads:
            if job.is_async:
                self._loads.start_async(job)
        self._loads.start_sync(meta, whole=meta.full_graph)
        self._loads.poll()

    def wait_for_layer(self, layer_name: str) -> None:
        """vLLM calls this before each attention layer of a step's forward."""
        self._loads.wait_for_layer(layer_name)

    def _fail_all(self, meta: TierCacheMetadata) -> None:
        self._loads.new_step()
        self._loads.fail_all(meta)
        for op in meta.stores:
            self._stores_owed.pop(id(op), None)
            self._loads.fills[op.slot] = Fill(op.block_hash, VOID)
            self.emit(FILL_FAILED, (op.block_hash, op.slot))
            self.emit(RELEASED, op.slot)

    # -- after a failure (connector/guard.py) -----------------------------------------
    def track(self, meta: TierCacheMetadata) -> None:
        """The connector hands each step's metadata here before any hook of the step
        runs: its stores are owed a release (or a report as void) until settled."""
        self._note_step(meta)
        if meta is self._tracked:
            return
        self._tracked = meta
        for op in meta.stores:
            self._stores_owed[id(op)] = op

    def fail_step(self, meta: TierCacheMetadata) -> None:
        """A hook of this step raised: settle what the step left undone as a miss. The
        copies beside the forward end first (nothing may touch a slot or block after
        this); then its loads that have not ended end as not loaded (vLLM recomputes
        them), the slots they pin released, and its stores that were not handed to the
        movers dropped (never reported filled alone)."""
        for step in self._loads.layerwise:
            self.quietly(step.copy.finish)
        saving, self._saving = self._saving, None
        if saving is not None:
            self.quietly(saving.finish)
        # Not a step that went well: the host may wait, and settles every copy first.
        self.quietly(self.copies.drain)
        self.quietly(lambda: self._loads.fail_step(meta))
        for op in meta.stores:
            if self._stores_owed.pop(id(op), None) is not None:
                self._loads.fills[op.slot] = Fill(op.block_hash, VOID)  # a load sharing it fails too
                self.emit(FILL_FAILED, (op.block_hash, op.slot))
                self.emit(RELEASED, op.slot)

    @staticmethod
    def quietly(call) -> None:
        """Part of undoing a failure: one more error must not stop the rest."""
        try:
            call()
        except Exception:
            log.exception("tiercache: while settling a failed step")

    def fail_loads_in_flight(self) -> set[str]:
        """get_finished raised: every load still staging is given up (reported failed),
        lest a request wait on a poll that keeps failing; the loads reported done."""
        self._loads.give_up_all()
        return self._loads.ends.take_finished()

    def disable(self, reason: str) -> None:
        """Serve without the cache from now on: every load fails, nothing is stored
        (loads in flight are given up, so no request waits for them)."""
        self.disabled_reason = reason
        log.error("tiercache: %s", reason)
        self._loads.give_up_all()
        engine, self.engine = self.engine, None
        if engine is not None:
            self.quietly(engine.close)
        peer, self.peer = self.peer, None
        if peer is not None:  # its record leaves Redis: no one reads this CPU tier any more
            self.quietly(peer.close)

    # -- stores ---------------------------------------------------------------------
    def save_layer(self, layer_name: str, meta: TierCacheMetadata) -> None:
        """vLLM calls this after each attention layer. On CUDA that layer's share of the
        step's stores starts for the CPU tier now, beside the rest of the forward
        (layerwise_gpu.py); elsewhere stores are copied whole in `wait_for_save`."""
        if self.engine is None or not meta.stores or not self.stream_copies() or meta.full_graph:
            return
        self._begin_step(meta)
        if self._saving is None:
            assert self.copier is not None and self.buffer is not None  # set with the engine
            ops = meta.stores
            self._saving = StreamLayerwiseSave(
                self.copier, self.buffer, [op.gpu_block for op in ops], [op.slot for op in ops]
            )
        self._saving.save(layer_name)

    def stream_copies(self) -> bool:
        return (
            self._loads.layer_helper is None
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
        self._loads.end_of_forward()
        saving, self._saving = self._saving, None
        if self.engine is None or self.copier is None:
            return
        if not meta.stores:
            self._end_groups(meta)
            self.copies.poll()
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
        # A load planned to share one of these fills waits for it (load_lifecycle.Load.waits_on).
        stored: Future = Future()
        for op in meta.stores:
            self._loads.fills[op.slot] = Fill(op.block_hash, VOID if op.req_id in void else stored)
        self.stats.add("stored_blocks", len(ops))
        requests = {op.req_id for op in meta.stores}
        self.copies.after(done, lambda: self._hand_over_stores(meta, ops, void, stored), requests)
        self.copies.poll()

    def _hand_over_stores(
        self, meta: TierCacheMetadata, ops: list[BlockOp], void: set[str], stored: Future
    ) -> None:
        """The step's store copies are over: each slot goes to the movers (or back)."""
        stored.set_result([True])
        for op in meta.stores:
            if op.req_id in void:
                self._stores_owed.pop(id(op), None)
                self.emit(STORE_VOID, (op.block_hash, op.slot))
                self.emit(RELEASED, op.slot)
        assert self.engine is not None  # copies are queued only with an engine
        # Under write-back a stored block goes down only when the CPU tier evicts it
        # (the scheduler's write-backs, `_begin_step`).
        writes_through = self.writes_lower_tiers and self.config.movers.policy == "write_through"
        for op in ops:
            self.published(op.block_hash, op.slot)
            self.emit(FILLED, (op.block_hash, op.slot))
            if writes_through:
                self.engine.write_down(
                    op.block_hash,
                    op.slot,
                    self.after_write,
                    group=op.req_id or None,
                    on_slot_free=self._slot_free,
                )
            else:
                self.emit(RELEASED, op.slot)
            self._stores_owed.pop(id(op), None)
        self._end_groups(meta)

    # -- copies and sending ------------------------------------------------------------
    def _note_step(self, meta: TierCacheMetadata) -> None:
        """Once per step, from its first hook: the requests vLLM now keeps the blocks of
        until this worker reports them (finished_sending)."""
        if meta is self._noted:
            return
        self._noted = meta
        if meta.instance and not self._peer_started:
            self._start_peer(meta.instance)
        self._awaiting_sending.update(meta.finished_storing)

    def _fence_before_forward(self, meta: TierCacheMetadata) -> None:
        """Before the step's forward is queued (and before vLLM prepares its inputs):
        where blocks a store copy still reads may be written by it, the forward's stream
        waits for the copies in flight; where it may be a full CUDA graph replay, for
        the hits staged for it layer by layer (a replay calls no layer hook)."""
        if meta is self._fenced or self.copier is None or self.copier.stream is None:
            return
        self._fenced = meta
        if meta.fence_stores and self.copies:
            # The copy stream runs in order: its newest event covers the older ones.
            self.copier.stream.forward_waits(self.copies.newest)
        if meta.full_graph:
            for step in self._loads.layerwise:
                step.copy.wait_all()

    def drain_finished_sending(self) -> set[str]:
        """`take_finished_sending` raised: wait for every copy (not a step that went
        well) and report every request waiting for them."""
        self.copies.drain(quietly=self.quietly)
        done, self._awaiting_sending = self._awaiting_sending, set()
        return done

    def take_finished_sending(self) -> set[str]:
        """Requests vLLM kept the blocks of that no store copy reads any more."""
        self.copies.poll()
        done = self._awaiting_sending - self.copies.reading()
        self._awaiting_sending -= done
        return done

    def _computed_over_failed_loads(self, meta: TierCacheMetadata) -> set[str]:
        """Requests of this step that read a block whose synchronous load failed (a
        disk read that failed its check, a block gone before the step), whether they
        loaded it or share it through vLLM's prefix cache. The forward that just ran
        computed their blocks over what that block's pages held, garbage or stale:
        vLLM drops that output and recomputes from the lost block, and those blocks
        must not be stored either, or a later hit would serve them."""
        failed = self._loads.ends.failed_blocks  # this step's, until vLLM takes them after the save
        return {req_id for req_id, reads in meta.store_reads.items() if failed.intersection(reads)}

    def _end_groups(self, meta: TierCacheMetadata) -> None:
        """Requests whose stores are all queued now: their partial S3 runs may ship."""
        for req_id in meta.stores_done:
            self._end_group(req_id)

    def _end_group(self, req_id: str) -> None:
        """The request's partial S3 run ships once its last blocks reach the movers:
        now, or when the copies out of its blocks are over."""
        if not self.copies.end_group_after(req_id):
            self._end_group_now(req_id)

    def _end_group_now(self, req_id: str) -> None:
        if self.engine is not None:
            self.engine.end_group(req_id)

    def after_write(self, result: WriteResult) -> None:
        """Runs on a mover thread when a block's write-down ended, stored or not."""
        if not result.slot_freed:  # else _slot_free reported all the scheduler tracks
            self._slot_free(result)

    def _slot_free(self, result: WriteResult) -> None:
        """The movers read the block's slot for the last time (an S3 run it waits for
        uploads from a copy): the disk's answer and the slot go to the scheduler now."""
        if result.stored.get(DISK):
            self.emit(ON_DISK, result.block_hash)
        if result.slot is not None:
            self.emit(RELEASED, result.slot)

    # -- reporting ------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str] | frozenset[str] = frozenset()) -> set[str]:
        """Loads done since the last call. `finished_req_ids`: requests vLLM finished,
        whose partial S3 runs go now rather than when their flush timer says."""
        if self.engine is not None:
            for req_id in finished_req_ids:
                self._end_group(req_id)
        if self._idle_step:
            self._idle_step = False
            staging = self._loads.staging_futures()
            if staging:
                wait(staging, timeout=IDLE_STEP_WAIT_SECONDS, return_when=FIRST_COMPLETED)
        self.copies.poll()
        self._loads.poll()
        return self._loads.ends.take_finished()

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed as a whole since the last call (they are in
        `get_finished`'s answer too)."""
        return self._loads.ends.take_failed_requests()

    def take_failed_blocks(self) -> set[int]:
        return self._loads.ends.take_failed_blocks()

    def take_contained_errors(self) -> list[BaseException]:
        """Errors that failed one load each (and nothing else) since the last call."""
        errors, self._loads.contained_errors = self._loads.contained_errors, []
        return errors

    def take_worker_meta(self) -> TierCacheWorkerMetadata | None:
        timings, self.timings = self.timings, []
        if self._forward_timer is not None:
            timings += [(FORWARD, tokens, seconds) for tokens, seconds in self._forward_timer.take()]
        with self._lock:
            if not self._reports and not self.hits and not timings:
                return None
            meta = TierCacheWorkerMetadata(self._reports, self.hits, timings)
            self._reports, self.hits = [], Counter()
        return meta

    def take_stats(self) -> TierCacheStats | None:
        if self.engine is not None:
            self._gauges.add_to(self.stats, {"stores_in_flight": self.engine.writes_in_flight})
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, TierCacheStats()
        return stats

    def shutdown(self) -> None:
        self.copies.drain()
        peer, self.peer = self.peer, None
        if peer is not None:
            peer.close()
        if self._loads.layer_helper is not None:
            self._loads.layer_helper.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()

"""TierCacheConnector: the class vLLM loads through `kv_connector_module_path`.

It holds the scheduler half in the engine core and the worker half in each worker,
and forwards vLLM's calls to the half that exists in this process."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiercache.config import ConfigError, build_config
from tiercache.index.block_hashing import BlockHashing, shareable_seed
from tiercache.tiers import CPU, DISK, PEER, S3
from tiercache.tiers.disk.layout import disk_root_problem

from .graphs import full_graphs
from .guard import HookGuard
from .metadata import TierCacheMetadata, TierCacheWorkerMetadata
from .prefix_reset import follow_prefix_cache_resets
from .scheduler import TierCacheScheduler, slot_bytes_for
from .spec import kv_specs, refuse_unsupported
from .stats import STORES_DROPPED, GaugeReport, TierCachePromMetrics, TierCacheStats, decision_key
from .worker import TierCacheWorker

if TYPE_CHECKING:
    # For annotations only, as vLLM's own base class imports them.
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("tiercache.connector")

T = TypeVar("T")

_HIT_SOURCES = {
    CPU: CacheHitSource.HOST,
    DISK: CacheHitSource.DISK,
    S3: CacheHitSource.EXTERNAL_UNSPECIFIED,
    PEER: CacheHitSource.P2P,
}


class _ToVllmLogs(logging.Handler):
    """Hands tiercache's records to vLLM's logger, whatever handlers it has now."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def log_through_vllm() -> None:
    """tiercache's loggers print nothing below WARNING unless the host configures
    them. Inside vLLM, send their records through vLLM's logging at vLLM's level, so
    the tier set-up, the layer-by-layer switch and dropped writes show up beside
    vLLM's own lines. vLLM configures its logging when an engine starts, so this runs
    when the connector is built, not on import."""
    ours = logging.getLogger("tiercache")
    if not any(isinstance(h, _ToVllmLogs) for h in ours.handlers):
        if ours.handlers:
            return  # the host configured tiercache's logging itself
        ours.addHandler(_ToVllmLogs())
        ours.propagate = False
    ours.setLevel(logging.getLogger("vllm").getEffectiveLevel())


def block_hashing(vllm_config: VllmConfig, block_size: int) -> BlockHashing | None:
    """How this engine names blocks, for the service to hash a router's token ids the
    same way; None where the engine's seed is random (xxhash without PYTHONHASHSEED),
    which no other process can reproduce."""
    algorithm = vllm_config.cache_config.prefix_caching_hash_algo
    seed = shareable_seed(algorithm)
    if seed is None:
        log.info(
            "tiercache: %s block hashes use a random seed (PYTHONHASHSEED unset): "
            "lookups by token ids are not answered for this deployment",
            algorithm,
        )
        return None
    return BlockHashing(algorithm, block_size, seed)


class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        refuse_unsupported(vllm_config)
        assert kv_cache_config is not None, "vLLM passes its KV cache config to connectors"
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_through_vllm()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        try:
            self.config = build_config(extra, source="kv_connector_extra_config")
        except ConfigError as error:
            # Raised at engine start, before any request: a clear message, not a trace.
            raise ValueError(str(error)) from None
        if self.config.disk is not None:
            problem = disk_root_problem(self.config.disk.path)
            if problem is not None:
                # Serving without the disk tier beats an engine that cannot start.
                log.error("tiercache: %s: the disk tier is off (the CPU and S3 tiers still serve)", problem)
                self.config = self.config.model_copy(update={"disk": None})
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # A cache that cannot serve a block must cost a recompute, never a failed
            # request; vLLM reads this policy after it builds the connector.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        specs = kv_specs(vllm_config, kv_cache_config, self.config)
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.slot_bytes = slot_bytes_for(kv_cache_config)
        self.scheduler: TierCacheScheduler | None = None
        self.worker: TierCacheWorker | None = None
        # The running reset_prefix_cache call has reset the tiers already (see
        # bind_kv_cache_manager); its reset_cache, if the caller asked for one, is done.
        self._reset_followed = False
        # No exception of tiercache's reaches vLLM: each hook below runs under the guard.
        self.guard = HookGuard("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        self._failed_step: TierCacheMetadata | None = None  # the worker's step settled as a miss
        # Per request: (num_computed_tokens, async) of the last hit announced to vLLM.
        self._announced: dict[str, tuple[int, bool]] = {}
        if role == KVConnectorRole.SCHEDULER:
            from vllm.platforms import current_platform

            events = vllm_config.kv_events_config
            self.scheduler = TierCacheScheduler(
                self.config,
                specs,
                kv_cache_config,
                worker_count=self.tp_size,
                hashing=block_hashing(vllm_config, specs[0].block_size),
                kv_events=bool(events is not None and events.enable_kv_cache_events),
                kv_in_host_memory=current_platform.device_type == "cpu",
                full_graphs=full_graphs(vllm_config),
            )
            self._gauges = GaugeReport("scheduler")
            self._guard_gauges = GaugeReport("scheduler-guard")
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
            spec = specs[rank] if len(specs) > 1 else specs[0]
            # The capacity is the disk root's, one budget shared by every rank (and
            # every engine) on it: each rank's tier evicts across all of them.
            disk_share = self.config.disk.capacity if self.config.disk else 0
            self.worker = TierCacheWorker(
                self.config,
                spec,
                model_digest=specs[0].model_digest(),
                num_blocks=kv_cache_config.num_blocks,
                tp_rank=rank,
                writes_lower_tiers=len(specs) > 1 or rank == 0,
                disk_share=disk_share,
                group_layers=[list(group.layer_names) for group in kv_cache_config.kv_cache_groups],
            )
            self._guard_gauges = GaugeReport(f"rank{rank}-guard")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # No configuration needs a layer hook inside a full CUDA graph replay: the
        # scheduler marks each step that may be one (graphs.py), and the worker copies
        # its hits in whole before the forward (the forward's stream waiting for them)
        # and its stores out whole in `wait_for_save`, which vLLM calls outside the
        # graph. Layer by layer copies stay for the piecewise steps (prefills), where
        # vLLM calls the hooks. So vLLM keeps its full graphs for decode batches.
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # vLLM 0.33 asks before it starts an engine with sleep mode. The worker
        # follows the remap: `unregister_kv_caches` ends its copies and drops every
        # reference to the paged KV, `restore_kv_caches` rebuilds them from the
        # tensors vLLM registered. (vLLM also resets the connector's cache when it
        # sleeps, so the tiers start anew after a wake-up.)
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped store is a later miss, never lost work.
        return False

    # -- the guard ------------------------------------------------------------------
    def _guarded(self, hook: str, call: Callable[[], T], recover: Callable[[], T] | None, default: T) -> T:
        """`call`'s answer; should it raise, the error is logged and counted (the guard
        may turn the connector off) and the hook answers `recover()` (or `default`)
        instead: the answer of a miss."""
        try:
            return call()
        except Exception as error:
            self.guard.failed(hook, error)
        if recover is not None:
            try:
                return recover()
            except Exception:
                log.exception("tiercache: recovering from a failed %s failed too", hook)
        return default

    def _worker_step(
        self,
        hook: str,
        meta: TierCacheMetadata | None,
        work: Callable[[TierCacheWorker, TierCacheMetadata], None],
    ) -> None:
        """A worker hook of the step `meta`. A step with a hook that raised, or begun
        while the connector is off, is settled as a miss (`TierCacheWorker.fail_step`),
        and the rest of its hooks do nothing."""
        worker = self.worker
        if worker is None or meta is None or meta is self._failed_step:
            return
        try:
            worker.track(meta)
            if not self.guard.off:
                work(worker, meta)
                return
        except Exception as error:
            self.guard.failed(hook, error)
        self._failed_step = meta
        try:
            worker.fail_step(meta)
        except Exception:
            log.exception("tiercache: settling a failed step failed too")

    # -- worker side --------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self.worker
        if worker is not None:
            self._guarded(
                "register_kv_caches",
                lambda: worker.register_kv_caches(kv_caches, self.slot_bytes),
                lambda: worker.disable("registering the KV caches failed: tiercache is off for this engine"),
                None,
            )

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33, before sleep mode unmaps the paged KV.
        worker = self.worker
        if worker is not None:
            self._guarded(
                "unregister_kv_caches",
                worker.unregister_kv_caches,
                lambda: worker.disable("dropping the KV caches for sleep mode failed: tiercache is off"),
                None,
            )

    def restore_kv_caches(self) -> None:
        # vLLM 0.33, once a wake-up has mapped the paged KV again.
        worker = self.worker
        if worker is not None:
            self._guarded(
                "restore_kv_caches",
                worker.restore_kv_caches,
                lambda: worker.disable("restoring the KV caches after sleep mode failed: tiercache is off"),
                None,
            )

    def _meta(self) -> TierCacheMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, TierCacheMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM's first call with each step's metadata, before it prepares the inputs.
        if isinstance(kv_connector_metadata, TierCacheMetadata):
            self._worker_step(
                "handle_preemptions", kv_connector_metadata, lambda worker, meta: worker.step_arrives(meta)
            )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds each step's metadata right before the step's forward.
        super().bind_connector_metadata(connector_metadata)
        self._worker_step(
            "bind_connector_metadata", self._meta(), lambda worker, meta: worker.forward_begins(meta)
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_step("start_load_kv", self._meta(), lambda worker, meta: worker.start_load_kv(meta))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_step(
            "wait_for_layer_load", self._meta(), lambda worker, _: worker.wait_for_layer(layer_name)
        )

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self._worker_step(
            "save_kv_layer", self._meta(), lambda worker, meta: worker.save_layer(layer_name, meta)
        )

    def wait_for_save(self) -> None:
        self._worker_step("wait_for_save", self._meta(), lambda worker, meta: worker.wait_for_save(meta))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self.worker
        if worker is None:
            return None, None
        # Failed, the loads in flight are given up: vLLM must not wait for them for ever.
        nothing: set[str] = set()
        done = self._guarded(
            "get_finished",
            lambda: worker.get_finished(finished_req_ids),
            worker.fail_loads_in_flight,
            nothing,
        )
        # A load that raised while ending failed alone: counted, nothing else given up.
        for error in worker.take_contained_errors():
            self.guard.failed("get_finished", error)
        # Failed, every request vLLM keeps blocks for is reported once the copies are
        # over (a host wait, off the path of a step that went well): none is kept for ever.
        sending = self._guarded(
            "get_finished", worker.take_finished_sending, worker.drain_finished_sending, nothing
        )
        return sending or None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        # A hybrid model's failed hits are reported per request (worker.py).
        worker = self.worker
        failed: set[str] = set()
        if worker is not None:
            failed = self._guarded("get_transfer_results", worker.take_failed_requests, None, set())
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.worker
        if worker is None:
            return set()
        return self._guarded("get_block_ids_with_load_errors", worker.take_failed_blocks, None, set())

    def build_connector_worker_meta(self) -> TierCacheWorkerMetadata | None:
        worker = self.worker
        if worker is None:
            return None
        return self._guarded("build_connector_worker_meta", worker.take_worker_meta, None, None)

    def get_kv_connector_stats(self) -> TierCacheStats | None:
        stats = self._guarded("get_kv_connector_stats", self._half_stats, None, None) or TierCacheStats()
        for key, count in self.guard.take_counts().items():
            stats.add(key, count)
        self._guard_gauges.add_to(stats, {"connector_off": int(self.guard.off)})
        return None if stats.is_empty() else stats

    def _half_stats(self) -> TierCacheStats | None:
        if self.scheduler is not None:
            # vLLM asks the scheduler side too, after each step's update.
            stats = TierCacheStats()
            self._gauges.add_to(stats, self.scheduler.gauges())
            for (tier, decision), count in self.scheduler.take_decisions().items():
                stats.add(decision_key(tier, decision), count)
            stats.add(STORES_DROPPED, self.scheduler.take_dropped_stores())
            return None if stats.is_empty() else stats
        if self.worker is None:
            return None
        return self.worker.take_stats()

    def shutdown(self) -> None:
        worker, scheduler = self.worker, self.scheduler
        if worker is not None:
            self._guarded("shutdown", worker.shutdown, None, None)
        if scheduler is not None:
            self._guarded("shutdown", scheduler.close, None, None)

    # -- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        scheduler = self.scheduler
        assert scheduler is not None
        if self.guard.off:
            return 0, False
        tokens, is_async = self._guarded(
            "get_num_new_matched_tokens",
            lambda: scheduler.get_num_new_matched_tokens(request, num_computed_tokens),
            None,
            (0, False),
        )
        if tokens:
            self._announced[request.request_id] = (num_computed_tokens, is_async)
        return tokens, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        announced = self._announced.pop(request.request_id, None)

        def plan_failed_load() -> None:
            # vLLM counts the announced tokens as loaded (or waits for them): a load
            # whose every block fails makes it recompute them instead.
            if num_external_tokens and announced is not None:
                computed, is_async = announced
                first = computed // scheduler.block_size
                count = num_external_tokens // scheduler.block_size
                gpu_blocks = list(blocks.get_block_ids()[0][first : first + count])
                scheduler.plan_failed_load(request.request_id, gpu_blocks, is_async)

        self._guarded(
            "update_state_after_alloc",
            lambda: scheduler.update_state_after_alloc(request, blocks, num_external_tokens),
            plan_failed_load,
            None,
        )

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        # vLLM's metrics know host memory, disk and another engine's memory (p2p: the
        # peer tier); S3 is a remote store, which vLLM files under "external_unspecified".
        # A split that does not add up is left to vLLM's own fallback.
        scheduler = self.scheduler
        assert scheduler is not None

        def sources() -> dict[CacheHitSource, int]:
            tiers = scheduler.hit_tiers(request.request_id, num_external_tokens)
            return {_HIT_SOURCES[tier]: tokens for tier, tokens in tiers.items() if tokens}

        return self._guarded("get_external_cache_hit_sources", sources, None, {})

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TierCacheMetadata:
        scheduler = self.scheduler
        assert scheduler is not None
        self._reset_followed = False  # a step between: any later reset_cache is a reset of its own
        # Failed, the step's plan is its loads, each failed (vLLM has scheduled them).
        meta = self._guarded(
            "build_connector_meta",
            lambda: scheduler.build_connector_meta(scheduler_output),
            scheduler.fail_step,
            TierCacheMetadata(),
        )
        if not meta.finished_storing:  # a plan that failed may not have taken them
            meta.finished_storing = scheduler.take_finished_storing()
        if self.guard.off and meta.stores:
            # Off: nothing is stored. (The loads go on: vLLM waits for those planned.)
            stores, meta.stores, meta.store_reads = meta.stores, [], {}
            self._guarded("build_connector_meta", lambda: scheduler.drop_stores(stores), None, None)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        self._guarded(
            "update_connector_output", lambda: scheduler.update_connector_output(connector_output), None, None
        )

    def take_events(self) -> Iterable[KVCacheEvent]:
        # vLLM drains this after every step and publishes it with its own GPU block
        # events (--kv-events-config); see connector/events.py.
        scheduler = self.scheduler
        if scheduler is None:
            return ()
        return self._guarded("take_events", scheduler.take_events, None, [])

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is None:
            return
        # vLLM's default reset_prefix_cache(), what RL frameworks call after new
        # weights, never calls reset_cache: follow vLLM's own reset instead.
        follow_prefix_cache_resets(kv_cache_manager, self._follow_prefix_cache_reset)

    def _follow_prefix_cache_reset(self, cleared: bool) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        # Called from inside vLLM's reset_prefix_cache: guarded like every hook. Only a
        # reset that happened makes a following reset_cache(reset_connector=True) moot.
        self._reset_followed = self._guarded(
            "reset_cache", lambda: scheduler.reset_cache(vllm_cache_cleared=cleared), None, False
        )

    def reset_cache(self) -> bool | None:
        scheduler = self.scheduler
        if scheduler is None:
            return None
        if self._reset_followed:
            # reset_prefix_cache(reset_connector=True): vLLM's reset of its own prefix
            # cache, just before this call, reset the tiers already.
            self._reset_followed = False
            return True
        return self._guarded("reset_cache", scheduler.reset_cache, None, False)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        scheduler = self.scheduler
        assert scheduler is not None
        self._announced.pop(request.request_id, None)
        return self._guarded(
            "request_finished", lambda: scheduler.request_finished(request), None, (False, None)
        )

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's hybrid KV cache manager calls this instead of request_finished: every
        # group's blocks are kept alike while a store copy may read them.
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- metrics ----------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierCacheStats:
        return TierCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TierCachePromMetrics:
        return TierCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

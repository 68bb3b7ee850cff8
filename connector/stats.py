"""Connector statistics as vLLM collects them: each worker reports counts per step,
vLLM sums them, logs them, and shows them on its own /metrics.

Gauges (state now, not counts) come from both halves: the scheduler's pinned CPU
slots and loads in flight, each worker's write-downs in flight. vLLM carries
connector stats only in steps, and sums what several workers send, so each source
sends its gauges under its own name, only when they changed; /metrics shows the sum
of every source's latest value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .vllm_compat import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

TIERS = ("cpu", "disk", "s3", "peer")  # the tiers loads come from (tiercache.tiers)
LATENCIES = "load_seconds"  # list of (tier, seconds), one per load job
# counter name in vLLM's /metrics -> (stats key prefix, help)
_COUNTERS = {
    "vllm:tiercache_loaded_blocks": ("loaded_blocks_", "Blocks loaded from a tiercache tier"),
    "vllm:tiercache_loaded_bytes": ("loaded_bytes_", "Bytes loaded from a tiercache tier"),
    "vllm:tiercache_failed_blocks": ("failed_blocks_", "Blocks a tiercache load could not serve"),
}
# counter name in vLLM's /metrics -> (stats key, help), without labels of their own
STORES_DROPPED = "stores_dropped"
LOADS_TIMED_OUT = "loads_timed_out"
_PLAIN_COUNTERS = {
    "vllm:tiercache_stored_blocks": ("stored_blocks", "Blocks copied into the tiercache CPU tier"),
    "vllm:tiercache_stores_dropped": (
        STORES_DROPPED,
        "Blocks not stored because every tiercache CPU slot was held by a transfer "
        "(the CPU tier is too small for the pace of the write-down to disk and S3)",
    ),
    "vllm:tiercache_hook_failures": (
        "hook_failures",
        "Connector hooks that raised: the step's loads were recomputed and its stores dropped",
    ),
    "vllm:tiercache_connector_off_trips": (
        "connector_off_trips",
        "Times the connector turned itself off for a while after repeated failures",
    ),
    "vllm:tiercache_loads_timed_out": (
        LOADS_TIMED_OUT,
        "Loads from disk or S3 not staged by movers.load_deadline_seconds, recomputed instead",
    ),
}
# The scheduler's decisions on each hit (cost_model.py), one per request and tier:
# no_room is a hit that needed CPU slots to stage through while transfers held them all.
DECISIONS = ("load", "skip", "no_room")
_DECISIONS = (
    "vllm:tiercache_load_decisions",
    "Requests whose hit in a tiercache tier was loaded, skipped as slower than recomputing it, "
    "or not loaded for want of a free CPU slot to stage it through (no_room)",
)


def decision_key(tier: str, decision: str) -> str:
    return f"load_decision_{decision}_{tier}"


GAUGES_KEY = "gauges"  # {source: {gauge: value}}, source "scheduler" or "rank<N>"
# gauge -> (name in vLLM's /metrics, help)
GAUGES = {
    "pinned_slots": (
        "vllm:tiercache_pinned_slots",
        "tiercache CPU-tier slots held by a load or store in flight",
    ),
    "loads_in_flight": (
        "vllm:tiercache_loads_in_flight",
        "Requests waiting for a tiercache load from disk or S3",
    ),
    "stores_in_flight": (
        "vllm:tiercache_stores_in_flight",
        "tiercache blocks queued or being written down to disk or S3",
    ),
    "connector_off": (
        "vllm:tiercache_connector_off",
        "Halves of the tiercache connector (scheduler, each worker) turned off for a while after "
        "repeated failures",
    ),
}


@dataclass
class TierCacheStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, amount: int) -> None:
        if amount:
            self.data[key] = self.data.get(key, 0) + amount

    def observe_load(self, tier: str, seconds: float) -> None:
        """One load job's latency, from plan to blocks in the paged KV, by its slowest tier."""
        self.data.setdefault(LATENCIES, []).append((tier, seconds))

    def set_gauges(self, source: str, values: dict[str, int]) -> None:
        self.data.setdefault(GAUGES_KEY, {})[source] = dict(values)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key == LATENCIES:
                self.data.setdefault(LATENCIES, []).extend(value)
            elif key == GAUGES_KEY:
                # Another source, or a later report of the same one: the latest holds.
                self.data.setdefault(GAUGES_KEY, {}).update(value)
            else:
                self.add(key, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {
            k: v for k, v in self.data.items() if k not in (LATENCIES, GAUGES_KEY)
        }
        for source_values in self.data.get(GAUGES_KEY, {}).values():
            for gauge, value in source_values.items():
                summary[gauge] = summary.get(gauge, 0) + value
        for tier in TIERS:
            seconds = sorted(s for t, s in self.data.get(LATENCIES, ()) if t == tier)
            if seconds:
                summary[f"load_p50_ms_{tier}"] = round(seconds[len(seconds) // 2] * 1000, 2)
        return summary

    def is_empty(self) -> bool:
        return not self.data


class GaugeReport:
    """One source's gauges, added to its stats only when they changed since the
    last report (a report each step would make every step's stats non-empty)."""

    def __init__(self, source: str):
        self.source = source
        self._last: dict[str, int] | None = None

    def add_to(self, stats: TierCacheStats, values: dict[str, int]) -> None:
        if values != self._last:
            stats.set_gauges(self.source, values)
            self._last = dict(values)


class TierCachePromMetrics(KVConnectorPromMetrics):
    # vLLM's base takes one class per kind from `metric_types`, keyed by that kind, but
    # types all three as type[PromMetricT], a TypeVar bound to the union of the kinds.
    _gauge_cls: type[Gauge]  # type: ignore[assignment]  # see above
    _counter_cls: type[Counter]  # type: ignore[assignment]  # see above
    _histogram_cls: type[Histogram]  # type: ignore[assignment]  # see above

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._per_tier: dict[str, dict[tuple[int, str], Any]] = {}
        for name, (_, help_text) in _COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=help_text, labelnames=[*labelnames, "tier"])
            self._per_tier[name] = {
                (engine, tier): counter.labels(*values, tier)
                for engine, values in per_engine_labelvalues.items()
                for tier in TIERS
            }
        self._plain: dict[tuple[int, str], Any] = {}
        for name, (key, help_text) in _PLAIN_COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=help_text, labelnames=labelnames)
            for engine, values in per_engine_labelvalues.items():
                self._plain[(engine, key)] = counter.labels(*values)
        name, help_text = _DECISIONS
        decisions = self._counter_cls(
            name=name, documentation=help_text, labelnames=[*labelnames, "tier", "decision"]
        )
        self._decisions = {
            (engine, tier, decision): decisions.labels(*values, tier, decision)
            for engine, values in per_engine_labelvalues.items()
            for tier in TIERS
            for decision in DECISIONS
        }
        latency = self._histogram_cls(
            name="vllm:tiercache_load_seconds",
            documentation="Time to load a request's cached prefix, by its slowest tier",
            labelnames=[*labelnames, "tier"],
            buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
        )
        self._latency = {
            (engine, tier): latency.labels(*values, tier)
            for engine, values in per_engine_labelvalues.items()
            for tier in TIERS
        }
        self._gauges: dict[tuple[int, str], Any] = {}
        for gauge, (name, help_text) in GAUGES.items():
            metric = self._gauge_cls(
                name=name, documentation=help_text, labelnames=labelnames, multiprocess_mode="mostrecent"
            )
            for engine, values in per_engine_labelvalues.items():
                self._gauges[(engine, gauge)] = metric.labels(*values)
                self._gauges[(engine, gauge)].set(0)
        # engine -> source -> its latest gauge values
        self._gauge_sources: dict[int, dict[str, dict[str, int]]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, (prefix, _) in _COUNTERS.items():
            for tier in TIERS:
                amount = transfer_stats_data.get(prefix + tier, 0)
                if amount:
                    self._per_tier[name][(engine_idx, tier)].inc(amount)
        for key, _ in _PLAIN_COUNTERS.values():
            amount = transfer_stats_data.get(key, 0)
            if amount:
                self._plain[(engine_idx, key)].inc(amount)
        for tier in TIERS:
            for decision in DECISIONS:
                count = transfer_stats_data.get(decision_key(tier, decision), 0)
                if count:
                    self._decisions[(engine_idx, tier, decision)].inc(count)
        for tier, seconds in transfer_stats_data.get(LATENCIES, ()):
            self._latency[(engine_idx, tier)].observe(seconds)
        reported = transfer_stats_data.get(GAUGES_KEY)
        if reported:
            sources = self._gauge_sources.setdefault(engine_idx, {})
            sources.update(reported)
            for gauge in GAUGES:
                total = sum(values.get(gauge, 0) for values in sources.values())
                self._gauges[(engine_idx, gauge)].set(total)

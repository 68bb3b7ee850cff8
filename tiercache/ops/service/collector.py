"""The service's own Prometheus series, computed on each scrape from the Redis index,
the disk tier and the service's counters (its lookups and GC passes)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tiercache.ops.service.state import ServiceState
from tiercache.ops.service.stats import UNREGISTERED


class ServiceCollector:
    """Service-level series, computed on each scrape from Redis and the disk tier."""

    def __init__(self, state: ServiceState):
        self.state = state

    def collect(self) -> Iterator:
        state = self.state
        stats = state.stats()
        objects = GaugeMetricFamily(
            "tiercache_index_objects",
            "Objects held per namespace and tier (S3: from the Redis index; disk: this node)",
            labels=["namespace", "tier"],
        )
        nbytes = GaugeMetricFamily(
            "tiercache_index_bytes", "Bytes held per namespace and tier", labels=["namespace", "tier"]
        )
        deployments = GaugeMetricFamily(
            "tiercache_deployments", "Deployments registered per namespace", labels=["namespace"]
        )
        for ns, entry in stats["namespaces"].items():
            for tier, total in entry["tiers"].items():
                objects.add_metric([ns, tier], total["objects"])
                nbytes.add_metric([ns, tier], total["bytes"])
            if ns != UNREGISTERED:
                deployments.add_metric([ns], len(entry["deployments"]))
        yield objects
        yield nbytes
        yield deployments

        if state.config.s3 is not None and state.config.s3.capacity:
            capacity = GaugeMetricFamily(
                "tiercache_s3_capacity_bytes", "The S3 GC budget of a namespace", labels=["namespace"]
            )
            capacity.add_metric([state.config.namespace], state.config.s3.capacity)
            yield capacity

        up = GaugeMetricFamily(
            "tiercache_dependency_up", "1 while a dependency answers", labels=["dependency"]
        )
        if state.redis is not None:
            up.add_metric(["redis"], 1.0 if stats["redis"]["available"] else 0.0)
        yield up

        names = ("requests", "blocks_requested", "blocks_hit")
        families = {
            "requests": CounterMetricFamily(
                "tiercache_service_lookups", "Prefix lookups answered", labels=["namespace"]
            ),
            "blocks_requested": CounterMetricFamily(
                "tiercache_service_lookup_blocks", "Blocks asked for in lookups", labels=["namespace"]
            ),
            "blocks_hit": CounterMetricFamily(
                "tiercache_service_lookup_hit_blocks",
                "Blocks of the longest cached prefix returned by lookups",
                labels=["namespace"],
            ),
        }
        for ns, values in state.lookup_totals().items():
            for name, value in zip(names, values, strict=True):
                families[name].add_metric([ns], value)
        yield from families.values()

        gc = state.gc
        runs = CounterMetricFamily("tiercache_gc_runs", "S3 GC passes by result", labels=["result"])
        for result, count in gc.runs.items():
            runs.add_metric([result], count)
        yield runs
        yield CounterMetricFamily(
            "tiercache_gc_evicted_objects", "Objects the GC evicted", value=gc.evicted_objects
        )
        yield CounterMetricFamily(
            "tiercache_gc_evicted_bytes", "Bytes the GC evicted", value=gc.evicted_bytes
        )
        yield CounterMetricFamily(
            "tiercache_gc_orphans_deleted", "Unindexed S3 objects the sweep deleted", value=gc.orphans_deleted
        )
        yield CounterMetricFamily(
            "tiercache_gc_skipped_leased",
            "Eviction victims skipped under a read lease",
            value=gc.skipped_leased,
        )
        if gc.last_run is not None:
            yield GaugeMetricFamily(
                "tiercache_gc_last_run_timestamp_seconds", "When the last GC pass ended", value=gc.last_run
            )

"""Prometheus metrics, per tier and operation. One set per process; the service and
each vLLM worker expose their own."""

from __future__ import annotations

import time
from typing import Literal

from prometheus_client import Counter, Gauge, Histogram

TIER_BYTES = Counter("tiercache_tier_bytes", "Bytes moved by a tier operation", ["tier", "op"])
TIER_OPS = Counter("tiercache_tier_ops", "Tier operations by result", ["tier", "op", "result"])
TIER_LATENCY = Histogram(
    "tiercache_tier_latency_seconds",
    "Latency of one tier operation",
    ["tier", "op"],
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
TIER_USAGE = Gauge("tiercache_tier_usage_bytes", "Bytes held by a tier", ["tier"])
TIER_CAPACITY = Gauge("tiercache_tier_capacity_bytes", "Configured capacity of a tier", ["tier"])
TIER_EVICTIONS = Counter("tiercache_tier_evictions", "Objects evicted from a tier", ["tier"])
TIER_ERRORS = Counter("tiercache_tier_errors", "Tier errors by kind", ["tier", "kind"])
LEASE_CONFLICTS = Counter("tiercache_lease_conflicts", "Write leases refused because another writer held one")
MOVER_DROPPED = Counter("tiercache_mover_dropped", "Writes dropped under backpressure", ["tier"])
MOVER_QUEUE = Gauge("tiercache_mover_queue_depth", "Writes queued for a tier", ["tier"])
LOOKUP_BLOCKS = Counter("tiercache_lookup_blocks", "Blocks asked for in prefix lookups")
LOOKUP_HITS = Counter("tiercache_lookup_hits", "Blocks found in prefix lookups", ["tier"])
LOAD_DECISIONS = Counter(
    "tiercache_load_decisions",
    "Per request and tier holding part of its hit: loaded, skipped as slower than recomputing it, "
    "or not loaded for want of a free CPU slot to stage it through (no_room)",
    ["tier", "decision"],
)
# The connector's own failures, kept out of vLLM (connector/guard.py).
HOOK_FAILURES = Counter(
    "tiercache_hook_failures", "Connector hooks that raised; their step was served as a miss", ["hook"]
)
CONNECTOR_OFF = Gauge(
    "tiercache_connector_off", "1 while the connector is turned off after repeated failures", ["role"]
)
LOADS_TIMED_OUT = Counter(
    "tiercache_loads_timed_out", "Staged loads given up at movers.load_deadline_seconds and recomputed"
)
INDEX_ERRORS = Counter("tiercache_index_errors", "Shared index calls that failed", ["op"])
# Every HTTP request sent to S3 (retries included: each is billed), by operation, and
# the object bytes moved, by direction: what `tiercache bench` turns into requests
# per 1k tokens and dollars per million tokens (tiers/s3/cost.py).
S3_REQUESTS = Counter("tiercache_s3_requests", "HTTP requests sent to S3, by operation", ["op"])
S3_BYTES = Counter("tiercache_s3_bytes", "Object bytes sent to or read from S3", ["direction"])
GC_SWEEPS_REFUSED = Counter(
    "tiercache_gc_sweeps_refused",
    "Orphan sweeps refused because the index looked lost (far fewer entries than objects)",
)


class timed:
    """Count one operation, its bytes and latency; an exception counts as an error.

    `with timed("disk", "get", nbytes):` runs on every tier operation, so the labelled
    children are looked up once per (tier, op) and kept, and this is a plain class
    rather than a generator-based context manager."""

    __slots__ = ("_children", "_nbytes", "_start")
    _cache: dict[tuple[str, str], tuple] = {}

    def __init__(self, tier: str, op: str, nbytes: int = 0):
        children = self._cache.get((tier, op))
        if children is None:
            children = self._cache.setdefault(
                (tier, op),
                (
                    TIER_LATENCY.labels(tier, op),
                    TIER_OPS.labels(tier, op, "ok"),
                    TIER_OPS.labels(tier, op, "error"),
                    TIER_BYTES.labels(tier, op),
                ),
            )
        self._children = children
        self._nbytes = nbytes

    def __enter__(self) -> timed:
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        latency, ok, error, moved = self._children
        if exc_type is not None:
            error.inc()
            return False
        latency.observe(time.perf_counter() - self._start)
        ok.inc()
        if self._nbytes:
            moved.inc(self._nbytes)
        return False

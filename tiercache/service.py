"""The tiercache service (`tiercache serve`): health and readiness probes, Prometheus
metrics, per-namespace stats, a prefix lookup API for request routers, admin
endpoints (namespace flush, a GC pass) and the S3 garbage collector on a timer.

It reads the same config file as the connector. It never imports vLLM or torch, and
it never touches the CPU tiers of the vLLM workers: what it knows comes from the
Redis registry and index, the S3 bucket and, when `disk.path` is set, this node's
disk tier directory.

Nothing here reads S3 credentials: boto3 takes them from the standard chain, and no
response or log line carries them. Redis URLs are shown with their password hidden."""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Annotated, Any

from botocore.exceptions import BotoCoreError, ClientError
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from tiercache import __version__
from tiercache.config import TierCacheConfig, redact_url, unbounded_warnings
from tiercache.gc import (
    DEFAULT_ORPHAN_GRACE,
    GcBusy,
    flush_namespace,
    gc_redis_client,
    registered_deployments,
    run_gc,
)
from tiercache.index import Deployment, RedisIndex
from tiercache.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.tiers.disk import DiskLayout
from tiercache.tiers.s3 import S3Tier, make_client

log = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "TIERCACHE_ADMIN_TOKEN"
# One lookup names at most this many blocks: 65536 blocks of 16 tokens is a 1M-token prompt.
MAX_LOOKUP_HASHES = 65536
# A full lookup of MAX_LOOKUP_HASHES 64-byte hashes is ~8.5 MB of JSON.
MAX_BODY_BYTES = 16 * 2**20
# Lookup counters are kept per namespace up to this many names; the rest share one label.
MAX_TRACKED_NAMESPACES = 1000
OTHER_NAMESPACES = "(other)"
UNREGISTERED = "(unregistered)"
# A scrape re-reads Redis every time; the disk directory scan is reused this long.
DISK_SCAN_TTL = 15.0
# Readiness: the S3 probe never waits longer than this for an answer, nor retries.
PROBE_READ_TIMEOUT = 5.0
# After a Redis failure, the service's lookups wait at most this long before trying again.
SERVICE_MAX_BACKOFF = 2.0

NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
_HEX = re.compile(r"^[0-9a-f]*$")


# -- request and response models ----------------------------------------------------
def _block_hash(value: str) -> str:
    value = value.lower()
    if not 16 <= len(value) <= 128 or len(value) % 2 or not _HEX.match(value):
        raise ValueError("a block hash must be an even number (16 to 128) of hex digits")
    return value


BlockHashHex = Annotated[str, AfterValidator(_block_hash)]


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(
        min_length=1,
        max_length=128,
        pattern=NAMESPACE_PATTERN,
        description="The tiercache namespace the deployments were configured with "
        "(`namespace` in the connector config).",
        examples=["default"],
    )
    block_hashes: list[BlockHashHex] = Field(
        min_length=1,
        max_length=MAX_LOOKUP_HASHES,
        description="vLLM's chained block hashes of the prompt, in order, hex-encoded "
        f"(the same bytes as `request.block_hashes`). 1 to {MAX_LOOKUP_HASHES} of them.",
        examples=[["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]],
    )


class TierBlocks(BaseModel):
    s3: int = Field(description="Leading blocks every TP rank holds in the shared S3 tier.")
    disk: int | None = Field(
        None,
        description="Leading blocks every TP rank holds on this node's disk tier "
        "(null when the service has no `disk.path`).",
    )


class DeploymentHit(BaseModel):
    model_digest: str = Field(description="Digest of everything that makes the KV bytes compatible.")
    model: str
    tp_size: int
    prefix_blocks: int = Field(description="The longest prefix this deployment can load (any tier).")
    tiers: TierBlocks


class LookupResponse(BaseModel):
    namespace: str
    requested_blocks: int
    prefix_blocks: int = Field(description="The longest cached prefix over every deployment, in blocks.")
    deployments: list[DeploymentHit] = Field(
        description="Each deployment registered under the namespace, longest prefix first."
    )


class ProblemResponse(BaseModel):
    detail: Any


class ReadinessResponse(BaseModel):
    status: str = Field(description="`ready` or `unavailable`.")
    checks: dict[str, dict[str, Any]] = Field(
        description="Per dependency: `ok`, and when down, an `error` saying why."
    )


# -- the service's own state ----------------------------------------------------------
@dataclass
class LookupCounts:
    requests: int = 0
    blocks_requested: int = 0
    blocks_hit: int = 0

    def as_dict(self) -> dict[str, Any]:
        rate = self.blocks_hit / self.blocks_requested if self.blocks_requested else None
        return {
            "requests": self.requests,
            "blocks_requested": self.blocks_requested,
            "blocks_hit": self.blocks_hit,
            "hit_rate": rate,
        }


@dataclass
class GcTotals:
    runs: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    evicted_objects: int = 0
    evicted_bytes: int = 0
    orphans_deleted: int = 0
    skipped_leased: int = 0
    last_run: float | None = None
    last_duration: float | None = None
    last_report: dict[str, Any] | None = None


def _redis_for(config: TierCacheConfig) -> GuardedRedis | None:
    return GuardedRedis(config.redis_url, config.redis) if config.redis_url else None


def _stats(
    config: TierCacheConfig,
    redis: GuardedRedis | None,
    disk: dict[str, tuple[int, int]] | None,
) -> dict[str, Any]:
    """Objects and bytes per namespace, deployment and tier (see collect_stats)."""
    errors: list[str] = []
    deployments: list[Deployment] = []
    s3_counts: dict[str, int] = {}
    redis_state: dict[str, Any] = {"configured": redis is not None, "available": None}
    if redis is not None:
        redis_state["url"] = redact_url(redis.url)
        index = RedisIndex(redis)
        try:
            deployments = registered_deployments(redis)
            for dep in deployments:
                s3_counts[dep.model_digest] = sum(
                    index.count(dep.model_digest, rank) for rank in dep.rank_digests
                )
            redis_state["available"] = True
        except RedisUnavailable:
            redis_state["available"] = False
            errors.append("redis is unavailable: the S3 tier's index could not be read")

    namespaces: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []

    def namespace_entry(name: str) -> dict[str, Any]:
        return namespaces.setdefault(
            name,
            {
                "tiers": {},
                "deployments": [],
            },
        )

    def add(entry: dict[str, Any], tier: str, objects: int, nbytes: int) -> None:
        tiers = entry["tiers"]
        total = tiers.setdefault(tier, {"objects": 0, "bytes": 0})
        total["objects"] += objects
        total["bytes"] += nbytes

    disk_left = dict(disk or {})
    for dep in sorted(deployments, key=lambda d: (d.namespace, d.model, d.model_digest)):
        ns = namespace_entry(dep.namespace)
        objects = s3_counts.get(dep.model_digest)
        dep_entry: dict[str, Any] = {
            "model_digest": dep.model_digest,
            "model": dep.model,
            "tp_size": dep.tp_size,
            "object_bytes": dep.object_bytes,
            "tiers": {},
        }
        if objects is not None:
            nbytes = objects * dep.object_bytes
            dep_entry["tiers"]["s3"] = {"objects": objects, "bytes": nbytes}
            add(ns, "s3", objects, nbytes)
            rows.append(_row(dep.namespace, dep.model, dep.model_digest, "s3", objects, nbytes))
        if disk is not None:
            d_objects = d_bytes = 0
            for rank in dep.rank_digests:
                o, b = disk_left.pop(rank, (0, 0))
                d_objects, d_bytes = d_objects + o, d_bytes + b
            dep_entry["tiers"]["disk"] = {"objects": d_objects, "bytes": d_bytes}
            add(ns, "disk", d_objects, d_bytes)
            rows.append(_row(dep.namespace, dep.model, dep.model_digest, "disk", d_objects, d_bytes))
        ns["deployments"].append(dep_entry)
    # Disk objects of deployments the registry does not name (or all of them without Redis).
    for digest, (objects, nbytes) in sorted(disk_left.items()):
        ns = namespace_entry(UNREGISTERED)
        ns["deployments"].append(
            {
                "rank_digest": digest,
                "model": UNREGISTERED,
                "tiers": {"disk": {"objects": objects, "bytes": nbytes}},
            }
        )
        add(ns, "disk", objects, nbytes)
        rows.append(_row(UNREGISTERED, f"rank {digest}", None, "disk", objects, nbytes))

    s3_state: dict[str, Any] = {"configured": config.s3 is not None}
    if config.s3 is not None:
        s3_state.update(
            bucket=config.s3.bucket,
            prefix=config.s3.prefix,
            endpoint_url=redact_url(config.s3.endpoint_url) if config.s3.endpoint_url else None,
            capacity_bytes=config.s3.capacity,
            namespace=config.namespace,
            used_bytes=namespaces.get(config.namespace, {}).get("tiers", {}).get("s3", {}).get("bytes", 0),
        )
    return {
        "rows": rows,
        "namespaces": namespaces,
        "redis": redis_state,
        "s3": s3_state,
        "disk": {
            "configured": config.disk is not None,
            "path": str(config.disk.path) if config.disk else None,
        },
        "errors": errors,
    }


def _row(namespace: str, model: str, digest: str | None, tier: str, objects: int, nbytes: int) -> dict:
    return {
        "namespace": namespace,
        "model": model,
        "model_digest": digest,
        "tier": tier,
        "objects": objects,
        "bytes": nbytes,
    }


def collect_stats(config: TierCacheConfig) -> dict[str, Any]:
    """Objects and bytes per namespace, model and tier: the S3 tier from the Redis
    registry and index (ZCARD x object size), the disk tier by scanning `disk.path`.

    Shape: {"rows": [{"namespace", "model", "model_digest", "tier", "objects", "bytes"}...],
    "namespaces": {ns: {"tiers": {tier: {"objects", "bytes"}}, "deployments": [...]}},
    "redis": {...}, "s3": {...}, "disk": {...}, "errors": [...]}. A Redis outage is
    reported in "errors", not raised."""
    redis = _redis_for(config)
    try:
        disk = DiskLayout(config.disk.path).usage() if config.disk else None
        return _stats(config, redis, disk)
    finally:
        if redis is not None:
            redis.close()


class ServiceState:
    """Everything one service process shares between requests."""

    def __init__(self, config: TierCacheConfig, admin_token: str | None, gc_interval: float):
        self.config = config
        self.admin_token = admin_token or None
        self.gc_interval = gc_interval
        self.redis = None
        if config.redis_url:
            # Routers get a fast 503 while Redis is out, and answers again soon after it
            # returns: the breaker's backoff is capped lower than a scheduler's.
            settings = config.redis.model_copy(
                update={"max_backoff": min(config.redis.max_backoff, SERVICE_MAX_BACKOFF)}
            )
            self.redis = GuardedRedis(config.redis_url, settings)
        self.index = RedisIndex(self.redis) if self.redis else None
        # GC and flush get their own connection with longer timeouts than lookups.
        self.gc_redis = gc_redis_client(config) if config.redis_url else None
        self.s3: S3Tier | None = None
        self.s3_probe = None
        if config.s3 is not None:
            self.s3 = S3Tier(config.s3)
            probe = config.s3.model_copy(
                update={"read_timeout": min(config.s3.read_timeout, PROBE_READ_TIMEOUT), "max_attempts": 1}
            )
            self.s3_probe = make_client(probe)
        self.disk = DiskLayout(config.disk.path) if config.disk else None
        self._lock = threading.Lock()
        self.lookups: dict[str, LookupCounts] = {}
        self.gc = GcTotals()
        self._gc_lock = threading.Lock()
        self._disk_cache: tuple[float, dict[str, tuple[int, int]]] | None = None
        self._checks = ThreadPoolExecutor(4, thread_name_prefix="tiercache-probe")
        self._stop = threading.Event()
        self._gc_thread: threading.Thread | None = None

    # -- readiness ----------------------------------------------------------------
    def _check_redis(self) -> dict[str, Any]:
        try:
            self.redis.client.ping()
            return {"ok": True}
        except Exception as error:  # any failure to answer is "down", never a 500
            return {"ok": False, "error": f"no answer to PING ({type(error).__name__})"}

    def _check_s3(self) -> dict[str, Any]:
        try:
            self.s3_probe.head_bucket(Bucket=self.config.s3.bucket)
            return {"ok": True}
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", "error"))
            return {"ok": False, "error": f"head_bucket refused: {code}"}
        except (BotoCoreError, OSError) as error:
            return {"ok": False, "error": f"no answer to head_bucket ({type(error).__name__})"}

    def readiness(self) -> tuple[bool, dict[str, dict[str, Any]]]:
        probes = {}
        if self.redis is not None:
            budget = self.config.redis.connect_timeout + self.config.redis.socket_timeout
            probes["redis"] = (self._checks.submit(self._check_redis), budget)
        if self.s3_probe is not None:
            budget = self.config.s3.connect_timeout + min(self.config.s3.read_timeout, PROBE_READ_TIMEOUT)
            probes["s3"] = (self._checks.submit(self._check_s3), budget)
        checks: dict[str, dict[str, Any]] = {}
        for name, (future, budget) in probes.items():
            try:
                checks[name] = future.result(timeout=budget + 1.0)
            except FutureTimeout:
                checks[name] = {"ok": False, "error": f"no answer within {budget + 1.0:.1f}s"}
        return all(check["ok"] for check in checks.values()), checks

    # -- stats ----------------------------------------------------------------------
    def disk_scan(self, max_age: float = DISK_SCAN_TTL) -> dict[str, tuple[int, int]] | None:
        if self.disk is None:
            return None
        cached = self._disk_cache
        now = time.monotonic()
        if cached is not None and now - cached[0] < max_age:
            return cached[1]
        scan = self.disk.usage()
        self._disk_cache = (now, scan)
        return scan

    def stats(self, disk_max_age: float = DISK_SCAN_TTL) -> dict[str, Any]:
        data = _stats(self.config, self.redis, self.disk_scan(disk_max_age))
        with self._lock:
            counts = {ns: c.as_dict() for ns, c in self.lookups.items()}
        for ns, entry in data["namespaces"].items():
            entry["lookups"] = counts.pop(ns, LookupCounts().as_dict())
        for ns, count in counts.items():  # namespaces looked up but holding nothing
            data["namespaces"][ns] = {"tiers": {}, "deployments": [], "lookups": count}
        data["gc"] = self.gc_summary()
        return data

    def gc_summary(self) -> dict[str, Any]:
        gc = self.gc
        return {
            "interval_seconds": self.gc_interval if self.s3 is not None else None,
            "runs": dict(gc.runs),
            "evicted_objects": gc.evicted_objects,
            "evicted_bytes": gc.evicted_bytes,
            "orphans_deleted": gc.orphans_deleted,
            "skipped_leased": gc.skipped_leased,
            "last_run": gc.last_run,
            "last_duration_seconds": gc.last_duration,
        }

    # -- lookup -----------------------------------------------------------------------
    def _count_lookup(self, namespace: str, requested: int, hit: int) -> None:
        with self._lock:
            if namespace not in self.lookups and len(self.lookups) >= MAX_TRACKED_NAMESPACES:
                namespace = OTHER_NAMESPACES
            counts = self.lookups.setdefault(namespace, LookupCounts())
            counts.requests += 1
            counts.blocks_requested += requested
            counts.blocks_hit += hit

    def _disk_prefix(self, rank_digests: tuple[str, ...], hashes: list[str]) -> int:
        for i, block in enumerate(hashes):
            for rank in rank_digests:
                if not self.disk.holds(f"{rank}/{block}"):
                    return i
        return len(hashes)

    def lookup(self, request: LookupRequest) -> LookupResponse:
        hashes = request.block_hashes
        hits: list[DeploymentHit] = []
        if self.index is not None:
            raw = [bytes.fromhex(h) for h in hashes]
            deployments = [d for d in registered_deployments(self.redis) if d.namespace == request.namespace]
            for dep in sorted(deployments, key=lambda d: d.model_digest):
                # touch=False: a router asking is not a use, so GC order is left alone.
                s3_blocks = self.index.longest_prefix(dep.model_digest, dep.rank_digests, raw, touch=False)
                disk_blocks = (
                    self._disk_prefix(dep.rank_digests, hashes) if self.disk is not None else None
                )
                hits.append(
                    DeploymentHit(
                        model_digest=dep.model_digest,
                        model=dep.model,
                        tp_size=dep.tp_size,
                        prefix_blocks=max(s3_blocks, disk_blocks or 0),
                        tiers=TierBlocks(s3=s3_blocks, disk=disk_blocks),
                    )
                )
        hits.sort(key=lambda h: -h.prefix_blocks)
        best = hits[0].prefix_blocks if hits else 0
        self._count_lookup(request.namespace, len(hashes), best)
        return LookupResponse(
            namespace=request.namespace,
            requested_blocks=len(hashes),
            prefix_blocks=best,
            deployments=hits,
        )

    # -- GC ---------------------------------------------------------------------------
    def run_gc(self, sweep_orphans: bool = True, grace_seconds: float | None = None, wait: bool = False):
        if not self._gc_lock.acquire(blocking=wait):
            raise GcBusy()
        start = time.monotonic()
        try:
            report = run_gc(
                self.config,
                sweep_orphans=sweep_orphans,
                grace_seconds=DEFAULT_ORPHAN_GRACE if grace_seconds is None else grace_seconds,
                redis=self.gc_redis,
                s3=self.s3,
            )
        except Exception:
            self.gc.runs["error"] += 1
            raise
        finally:
            self.gc.last_run = time.time()
            self.gc.last_duration = time.monotonic() - start
            self._gc_lock.release()
        gc = self.gc
        gc.runs["error" if report.get("errors") else "ok"] += 1
        gc.evicted_objects += report["evicted_objects"]
        gc.evicted_bytes += report["evicted_bytes"]
        gc.orphans_deleted += report["orphans"]["deleted"]
        gc.skipped_leased += report["skipped_leased"]
        gc.last_report = report
        return report

    def _gc_loop(self) -> None:
        while not self._stop.wait(self.gc_interval):
            try:
                report = self.run_gc()
                if report["evicted_objects"] or report["orphans"]["deleted"] or report["errors"]:
                    log.info(
                        "gc: evicted %d objects (%d bytes), swept %d orphans, %d leased skipped%s",
                        report["evicted_objects"],
                        report["evicted_bytes"],
                        report["orphans"]["deleted"],
                        report["skipped_leased"],
                        f"; errors: {report['errors']}" if report["errors"] else "",
                    )
            except GcBusy:
                continue
            except Exception:  # the loop must outlive any one pass
                log.exception("gc pass failed")

    def start(self) -> None:
        for warning in unbounded_warnings(self.config):
            log.warning("%s", warning)
        if self.s3 is not None and self.gc_interval > 0 and self._gc_thread is None:
            self._gc_thread = threading.Thread(target=self._gc_loop, name="tiercache-gc", daemon=True)
            self._gc_thread.start()
            log.info("s3 gc every %.0fs for namespace %r", self.gc_interval, self.config.namespace)

    def close(self) -> None:
        self._stop.set()
        if self._gc_thread is not None:
            self._gc_thread.join(timeout=30)
            self._gc_thread = None
        self._checks.shutdown(wait=False, cancel_futures=True)
        if self.s3 is not None:
            self.s3.close()
        for redis in (self.redis, self.gc_redis):
            if redis is not None:
                redis.close()


# -- metrics ------------------------------------------------------------------------
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
        with state._lock:
            snapshot = {ns: (c.requests, c.blocks_requested, c.blocks_hit) for ns, c in state.lookups.items()}
        for ns, values in snapshot.items():
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


# -- the app ------------------------------------------------------------------------
class _AsciiJSON(JSONResponse):
    """JSON with every non-ASCII character escaped, so anything echoed from a request
    (even a lone surrogate) renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class BodyLimit:
    """Refuses a request body over `limit` bytes with 413.

    A declared Content-Length over the limit is refused before anything is read. A
    chunked body declares nothing, so the bytes are counted as they arrive: the body
    is read here, at most `limit` bytes of it, and handed on to the app unchanged. (The
    endpoints read their whole body anyway, so buffering it costs nothing more.)"""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._check_length(scope)
        if refusal is None:
            messages, refusal = await self._read_body(receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        pending = iter(messages)

        async def replay():
            message = next(pending, None)
            return message if message is not None else await receive()

        await self.app(scope, replay, send)

    def _check_length(self, scope) -> JSONResponse | None:
        length = dict(scope["headers"]).get(b"content-length")
        if length is None:
            return None
        if not length.isdigit():
            return _AsciiJSON({"detail": "Content-Length is not a number"}, status_code=400)
        if int(length) > self.limit:
            return self._too_large()
        return None

    async def _read_body(self, receive) -> tuple[list[dict], JSONResponse | None]:
        """The body's messages, or a 413 as soon as more than `limit` bytes came."""
        messages: list[dict] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away
                return messages, None
            received += len(message.get("body", b""))
            if received > self.limit:
                return messages, self._too_large()
            if not message.get("more_body", False):
                return messages, None

    def _too_large(self) -> JSONResponse:
        return _AsciiJSON({"detail": f"request body over {self.limit} bytes"}, status_code=413)


def _field_name(loc: tuple) -> str:
    parts = [str(part)[:64] for part in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:] or parts
    return ".".join(parts) or "(body)"


DESCRIPTION = """
The tiercache service: health and readiness probes, Prometheus metrics, cache stats,
a prefix lookup for request routers, and admin operations (namespace flush, S3 GC).

Admin endpoints need `Authorization: Bearer <TIERCACHE_ADMIN_TOKEN>`: without the
header they answer 401, with a wrong token 403, and while the service has no token
configured, always 403.
"""

TAGS = [
    {"name": "probes", "description": "Liveness, readiness and Prometheus metrics."},
    {"name": "cache", "description": "What the cache holds, and lookups for request routers."},
    {"name": "admin", "description": "Operations that delete data. Bearer token required."},
]


def create_app(
    config: TierCacheConfig,
    admin_token: str | None = None,
    *,
    gc_interval: float = 0.0,
) -> FastAPI:
    """The service as an ASGI app. `admin_token` guards the admin endpoints (None:
    they are refused); `gc_interval` > 0 runs the S3 GC on that period while the app
    is up (between lifespan startup and shutdown), when S3 is configured."""
    state = ServiceState(config, admin_token, gc_interval)
    metrics_registry = CollectorRegistry(auto_describe=False)
    metrics_registry.register(ServiceCollector(state))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        try:
            yield
        finally:
            state.close()

    app = FastAPI(
        title="tiercache",
        version=__version__,
        description=DESCRIPTION,
        openapi_tags=TAGS,
        lifespan=lifespan,
    )
    app.state.tiercache = state

    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        problems = [
            {
                "loc": [str(part)[:64] if isinstance(part, str) else part for part in item.get("loc", ())],
                "msg": str(item.get("msg", "invalid")).removeprefix("Value error, "),
                "type": str(item.get("type", "value_error")),
            }
            for item in error.errors()[:20]
        ]
        message = "; ".join(f"{_field_name(tuple(p['loc']))}: {p['msg']}" for p in problems[:5])
        return _AsciiJSON({"detail": problems, "message": f"invalid request: {message}"}, status_code=422)

    @app.exception_handler(RedisUnavailable)
    async def _redis_down(request: Request, error: RedisUnavailable):
        return _AsciiJSON(
            {"detail": "redis is unavailable: the shared index cannot be read now; retry later"},
            status_code=503,
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(BotoCoreError)
    @app.exception_handler(ClientError)
    async def _s3_down(request: Request, error: Exception):
        log.warning("s3 call failed: %s", type(error).__name__)
        return _AsciiJSON({"detail": "the S3 store did not answer; retry later"}, status_code=503)

    bearer = HTTPBearer(
        auto_error=False,
        description="The value of TIERCACHE_ADMIN_TOKEN the service was started with.",
    )

    def require_admin(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if state.admin_token is None:
            raise HTTPException(
                403, f"admin endpoints are disabled: {ADMIN_TOKEN_ENV} is unset for this service"
            )
        if credentials is None or not credentials.credentials:
            raise HTTPException(
                401,
                "admin endpoint: send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        given = credentials.credentials.encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, state.admin_token.encode()):
            raise HTTPException(403, "admin endpoint: the bearer token is not the admin token")

    admin_responses = {
        401: {"model": ProblemResponse, "description": "No bearer token."},
        403: {"model": ProblemResponse, "description": "Wrong token, or no admin token configured."},
        503: {"model": ProblemResponse, "description": "Redis or S3 did not answer."},
    }

    @app.get("/healthz", tags=["probes"], summary="Liveness")
    def healthz() -> dict[str, str]:
        """200 while the process runs, whatever its dependencies do: restart on failure
        of this probe only."""
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["probes"],
        summary="Readiness",
        response_model=ReadinessResponse,
        responses={503: {"model": ReadinessResponse, "description": "A dependency is down."}},
    )
    def readyz():
        """200 while Redis answers PING and, when S3 is configured, the bucket answers
        HEAD; 503 naming what is down otherwise. Each check is bounded by the
        configured connect/socket timeouts."""
        ready, checks = state.readiness()
        body = {"status": "ready" if ready else "unavailable", "checks": checks}
        return _AsciiJSON(body, status_code=200 if ready else 503)

    @app.get(
        "/metrics",
        tags=["probes"],
        summary="Prometheus metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format."}},
    )
    def metrics() -> Response:
        """Prometheus text: the process's `tiercache_` tier, lookup and GC series, plus
        index objects and bytes per namespace and tier, refreshed on each scrape."""
        body = generate_latest(REGISTRY) + generate_latest(metrics_registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats", tags=["cache"], summary="Objects, bytes and hit rates per namespace")
    def stats() -> dict[str, Any]:
        """Per namespace: objects and bytes per tier (S3 from the Redis index, ZCARD x
        object size; disk by scanning this node's `disk.path`), per deployment, and
        the hit rate of the lookups this service answered. `rows` flattens the same
        numbers. A Redis outage is reported under `errors`, not as a failure."""
        return state.stats(disk_max_age=1.0)

    @app.post(
        "/v1/lookup",
        tags=["cache"],
        summary="Longest cached prefix, for request routers",
        response_model=LookupResponse,
        responses={
            413: {"model": ProblemResponse, "description": "Request body too large."},
            503: {"model": ProblemResponse, "description": "Redis did not answer."},
        },
    )
    def lookup(request: LookupRequest) -> LookupResponse:
        """For each deployment registered under `namespace`: how many leading blocks of
        `block_hashes` it can load from the shared S3 tier (one Redis round trip per
        deployment, all TP ranks at once) and, when this service has the disk path,
        from this node's disk tier. Asking does not count as an access for the GC."""
        return state.lookup(request)

    @app.delete(
        "/v1/namespaces/{namespace}",
        tags=["admin"],
        summary="Flush a namespace",
        dependencies=[Depends(require_admin)],
        responses=admin_responses,
    )
    def flush(
        namespace: str = PathParam(
            min_length=1, max_length=128, pattern=NAMESPACE_PATTERN, description="The namespace to flush."
        ),
    ) -> dict[str, Any]:
        """Drop the index entries and registry entries of every deployment under the
        namespace, then delete their S3 objects (those under a live read lease are left
        to the orphan sweep) and their objects on this node's disk tier."""
        if state.redis is None:
            raise HTTPException(409, "redis_url is not configured: there is no registry of namespaces")
        report = flush_namespace(config, namespace, redis=state.gc_redis, s3=state.s3)
        state._disk_cache = None
        return report

    @app.post(
        "/v1/gc",
        tags=["admin"],
        summary="Run one S3 GC pass now",
        dependencies=[Depends(require_admin)],
        responses={**admin_responses, 409: {"model": ProblemResponse, "description": "Busy or no S3."}},
    )
    def gc(
        sweep_orphans: bool = Query(True, description="Also delete old S3 objects that no index names."),
        grace_seconds: float | None = Query(
            None,
            ge=0,
            le=7 * 86400,
            description="Orphans younger than this are kept (in-flight uploads). Default 600.",
        ),
    ) -> dict[str, Any]:
        """Keep the namespace's S3 tier under `s3.capacity` (oldest last access first;
        the index entry goes before the object; objects under a live read lease are
        skipped), then sweep orphans. Answers the pass's report."""
        if state.s3 is None:
            raise HTTPException(409, "s3 is not configured: there is nothing to collect")
        try:
            return state.run_gc(sweep_orphans=sweep_orphans, grace_seconds=grace_seconds)
        except GcBusy:
            raise HTTPException(409, "a GC pass is already running") from None

    return app


def serve(
    config: TierCacheConfig,
    host: str = "127.0.0.1",
    port: int = 8080,
    gc_interval: float = 60.0,
) -> None:
    """Run the service on uvicorn until SIGINT/SIGTERM. The admin token comes from
    TIERCACHE_ADMIN_TOKEN; log level from TIERCACHE_LOG_LEVEL (default INFO)."""
    import uvicorn

    level = os.environ.get("TIERCACHE_LOG_LEVEL", "INFO").upper()
    if level not in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"):
        level = "INFO"
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = os.environ.get(ADMIN_TOKEN_ENV) or None
    if token is None:
        log.warning("%s is unset: the admin endpoints answer 403", ADMIN_TOKEN_ENV)
    log.info(
        "tiercache service on %s:%d (namespace %r, redis %s, s3 %s)",
        host,
        port,
        config.namespace,
        redact_url(config.redis_url) if config.redis_url else "off",
        f"bucket {config.s3.bucket}" if config.s3 else "off",
    )
    app = create_app(config, admin_token=token, gc_interval=gc_interval)
    uvicorn.run(app, host=host, port=port, log_level=level.lower(), proxy_headers=False)

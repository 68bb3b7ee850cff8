"""What one service process shares between requests: its Redis and S3 connections,
the readiness probes, the lookups it answered, and the S3 GC (on a timer, or asked
for by the admin API)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from tiercache.config import TierCacheConfig, unbounded_warnings
from tiercache.errors import GcBusy
from tiercache.index.block_hashing import BlockHashing
from tiercache.index.keys import block_key
from tiercache.index.kv_groups import FULL, GroupRule, best_end, group_key
from tiercache.index.presence import InstancePrefix, instance_prefixes_and_ttls
from tiercache.index.redis_conn import GuardedRedis
from tiercache.index.redis_index import Deployment, RedisIndex
from tiercache.ops.peers import record_keys, serves_peers
from tiercache.ops.service.auth import ServiceTokens, TokenCheck
from tiercache.ops.service.models import (
    MAX_LOOKUP_HASHES,
    DeploymentHit,
    InstanceHit,
    LookupRequest,
    LookupResponse,
    TierBlocks,
)
from tiercache.ops.service.stats import tier_stats
from tiercache.tiers.disk.layout import DiskLayout
from tiercache.tiers.s3.gc import DEFAULT_ORPHAN_GRACE, run_gc
from tiercache.tiers.s3.passes import gc_redis_client, registered_deployments
from tiercache.tiers.s3.tier import S3Tier, make_client

log = logging.getLogger(__name__)

# Lookup counters are kept per namespace up to this many names; the rest share one label.
MAX_TRACKED_NAMESPACES = 1000
OTHER_NAMESPACES = "(other)"
# A scrape re-reads Redis every time; the disk directory scan is reused this long.
DISK_SCAN_TTL = 15.0
# Readiness: the S3 probe never waits longer than this for an answer, nor retries.
PROBE_READ_TIMEOUT = 5.0
# After a Redis failure, the service's lookups wait at most this long before trying again.
SERVICE_MAX_BACKOFF = 2.0


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


class ServiceState:
    """Everything one service process shares between requests."""

    def __init__(self, config: TierCacheConfig, tokens: ServiceTokens, gc_interval: float):
        self.config = config
        self.tokens = TokenCheck(tokens)
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
        assert self.redis is not None  # probed only when configured
        try:
            self.redis.client.ping()
            return {"ok": True}
        except Exception as error:  # any failure to answer is "down", never a 500
            return {"ok": False, "error": f"no answer to PING ({type(error).__name__})"}

    def _check_s3(self) -> dict[str, Any]:
        assert self.s3_probe is not None and self.config.s3 is not None  # probed only when configured
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
        if self.s3_probe is not None and self.config.s3 is not None:  # one is set with the other
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

    def forget_disk_scan(self) -> None:
        """The next stats read the disk again (after a flush deleted from it)."""
        self._disk_cache = None

    def stats(self, disk_max_age: float = DISK_SCAN_TTL) -> dict[str, Any]:
        data = tier_stats(self.config, self.redis, self.disk_scan(disk_max_age))
        with self._lock:
            counts = {ns: c.as_dict() for ns, c in self.lookups.items()}
        for ns, entry in data["namespaces"].items():
            entry["lookups"] = counts.pop(ns, LookupCounts().as_dict())
        for ns, count in counts.items():  # namespaces looked up but holding nothing
            data["namespaces"][ns] = {"tiers": {}, "deployments": [], "lookups": count}
        data["gc"] = self.gc_summary()
        return data

    def lookup_totals(self) -> dict[str, tuple[int, int, int]]:
        """(requests, blocks requested, blocks hit) per namespace, read at one instant."""
        with self._lock:
            return {ns: (c.requests, c.blocks_requested, c.blocks_hit) for ns, c in self.lookups.items()}

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
        assert self.disk is not None  # asked only with a disk tier
        for i, block in enumerate(hashes):
            for rank in rank_digests:
                if not self.disk.holds(f"{rank}/{block}"):
                    return i
        return len(hashes)

    def lookup(self, request: LookupRequest) -> LookupResponse:
        requested = len(request.block_hashes) if request.block_hashes is not None else 0
        hits: list[DeploymentHit] = []
        if self.index is not None:
            assert self.redis is not None  # the index is over it
            deployments = [d for d in registered_deployments(self.redis) if d.namespace == request.namespace]
            hashed: dict[tuple, list[bytes]] = {}  # token ids hashed once per way of hashing
            for dep in sorted(deployments, key=lambda d: d.model_digest):
                hit = self._lookup_deployment(dep, request, hashed)
                requested = max(requested, hit.requested_blocks)
                hits.append(hit)
        hits.sort(key=lambda h: -h.prefix_blocks)
        best = hits[0].prefix_blocks if hits else 0
        self._count_lookup(request.namespace, requested, best)
        return LookupResponse(
            namespace=request.namespace,
            requested_blocks=requested,
            prefix_blocks=best,
            deployments=hits,
        )

    def _lookup_deployment(self, dep: Deployment, request: LookupRequest, hashed: dict) -> DeploymentHit:
        assert self.index is not None and self.redis is not None  # lookup asks only with both
        error = None
        if request.block_hashes is not None:
            raw = [bytes.fromhex(h) for h in request.block_hashes]
        else:
            try:
                raw = self._hash_tokens(dep, request.token_ids, hashed)
            except ValueError as why:
                raw, error = [], str(why)
        # The tiers name blocks as the deployment's engines do (keyed by their weights
        # epoch after new weights in place); presence lists vLLM's own hashes.
        epoch = bytes.fromhex(dep.weights_epoch) if dep.weights_epoch else None
        keys = [block_key(h, epoch) for h in raw]
        if dep.groups and keys:
            s3, disk = self._group_prefixes(dep, keys)
        else:
            # touch=False: a router asking is not a use, so GC order is left alone.
            s3 = (
                self.index.longest_prefix(dep.model_digest, dep.rank_digests, keys, touch=False)
                if keys
                else 0
            )
            hexes = [h.hex() for h in keys]
            disk = self._disk_prefix(dep.rank_digests, hexes) if self.disk is not None else None
        prefixes, ttls = instance_prefixes_and_ttls(
            self.redis, dep.model_digest, raw, lambda name: record_keys(dep, name)
        )
        instances = self._instance_hits(prefixes, ttls, s3)
        serving = [p.cpu for p in prefixes if serves_peers(ttls[p.instance])]
        best_instance = instances[0].prefix_blocks if instances else 0
        return DeploymentHit(
            model_digest=dep.model_digest,
            model=dep.model,
            tp_size=dep.tp_size,
            block_size=dep.block_size or None,
            requested_blocks=len(raw) if error is None else 0,
            prefix_blocks=max(s3, disk or 0, best_instance),
            tiers=TierBlocks(s3=s3, disk=disk, peer=max(serving) if serving else None),
            instances=instances,
            error=error,
        )

    @staticmethod
    def _instance_hits(
        prefixes: list[InstancePrefix], ttls: dict[str, list[int]], s3: int
    ) -> list[InstanceHit]:
        """Each live instance's hit: its own tiers, what it can read from a peer (an
        instance reads another's CPU tier only while both have the peer tier on) and
        S3. Longest prefix first; on a tie, the instance holding more itself first (a
        local read beats one over the network), then by name."""
        serving = {p.instance: p.cpu for p in prefixes if serves_peers(ttls[p.instance])}
        ranked = []
        for p in prefixes:
            from_peer = 0
            if p.instance in serving:
                from_peer = max((cpu for name, cpu in serving.items() if name != p.instance), default=0)
            hit = InstanceHit(
                instance=p.instance,
                cpu=p.cpu,
                disk=p.disk,
                prefix_blocks=max(p.local, from_peer, s3),
                peer=p.instance in serving,
                peer_blocks=from_peer,
            )
            ranked.append(((-hit.prefix_blocks, -p.local, p.instance), hit))
        return [hit for _, hit in sorted(ranked, key=lambda item: item[0])]

    def _group_prefixes(self, dep: Deployment, raw: list[bytes]) -> tuple[int, int | None]:
        """A hybrid model's prefix in S3 and on disk: the longest one every KV cache
        group can serve (tiercache/index/kv_groups.py), each group's blocks under their own
        names. Presence (the instances' CPU and disk) lists one group only, the first
        full-attention one: an upper bound."""
        s3_index = self.index
        assert s3_index is not None  # lookup asks only with an index
        rules = [GroupRule.decode(text) for text in dep.groups]
        block_size = dep.block_size or 1
        # Every group's blocks in one round trip: a full-attention group's as a
        # prefix, the others' one by one (which of them count depends on where the
        # hit ends). touch=False: a router asking is not a use.
        keys = [[group_key(block, group) for block in raw] for group in range(len(rules))]
        probes = [(group_keys, rule.kind == FULL) for group_keys, rule in zip(keys, rules, strict=True)]
        answers = s3_index.presence(dep.model_digest, dep.rank_digests, probes, touch=False)

        def in_s3(group: int, index: int) -> bool:
            held = answers[group]
            return index < len(held) and held[index]

        def on_disk(group: int, index: int) -> bool:
            assert self.disk is not None  # asked only with a disk tier
            name = group_key(raw[index], group).hex()
            return all(self.disk.holds(f"{rank}/{name}") for rank in dep.rank_digests)

        s3 = best_end(rules, 0, len(raw), block_size, in_s3)
        disk = best_end(rules, 0, len(raw), block_size, on_disk) if self.disk is not None else None
        return s3, disk

    @staticmethod
    def _hash_tokens(dep: Deployment, token_ids: list[int], hashed: dict) -> list[bytes]:
        """vLLM's block hashes of `token_ids` as `dep`'s engines compute them."""
        if not dep.block_size or not dep.hash_algo:
            raise ValueError("registered without its block hashing (an older tiercache): pass block_hashes")
        if dep.hash_seed is None:
            raise ValueError(
                f"its engines hash blocks with {dep.hash_algo} and a random seed (PYTHONHASHSEED unset), "
                "which only they know: pass block_hashes, or set PYTHONHASHSEED"
            )
        way = (dep.hash_algo, dep.block_size, dep.hash_seed)
        if way not in hashed:
            hashing = BlockHashing(dep.hash_algo, dep.block_size, dep.hash_seed)
            hashed[way] = hashing.block_hashes(token_ids)[:MAX_LOOKUP_HASHES]
        return hashed[way]

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

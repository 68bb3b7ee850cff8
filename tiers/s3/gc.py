"""The S3 garbage collector and the namespace flush.

Scope. The service's config describes one namespace's S3 tier (`namespace`, and
`s3.bucket`, `s3.prefix`, `s3.capacity`), so:
- the capacity pass evicts only from deployments registered under `config.namespace`;
  other namespaces run their own service (or `tiercache gc`) with their own budget;
- the orphan sweep covers every object under the bucket and prefix, whatever its
  namespace, because whether an object is an orphan is decided by the index alone.

Capacity. A deployment uses (blocks indexed) x object_bytes per TP rank in S3 (a
run's table of contents is shared by its blocks, so this is close, not exact). GC
works per object: while the namespace is over `s3.capacity`, the run with the oldest
last access (a lookup that finds any of its blocks touches it; over every rank of
every deployment) goes first, unless it was hit since GC last came to it: then it gets
a second chance (the recent end, half its hits kept), so a run hit h times outlasts
about log2(h) + 1 trips through the queue, and runs uploaded and never read go before
the ones read often (by last access and hits). For each victim the run is unindexed whole (every
block still located in it) with `Leases.gc_unindex_run`, which refuses while a read
lease on the run is live (that victim is skipped), and only once the entries are
gone is the object deleted. A reader either holds a lease on an object that stays,
or gets a miss. An object is thus deleted only when none of its blocks is indexed
or leased.

Orphans. A run object is an orphan when the index holds no record of it: an upload
whose index write failed, a GC pass that died between its two steps, a flushed
namespace. Objects younger than a grace period are kept, since an upload's PUT lands
before its index entry is written. Per-block objects written before runs
are never read by this tiercache: they are swept once past the grace period, not
counted by the guard below, and what is left of the per-block index in Redis
(`tc:{*}:idx:*`) is deleted by the same pass.

Lost index. An index that lost its data (Redis without persistence, a failover to an
empty replica, a wrong URL) makes every object look orphaned. So the sweep first
counts, deleting nothing, and refuses (a warning naming the counts, and
`tiercache_gc_sweeps_refused_total`) when more than half of the objects past the
grace period have no entry, unless they are ORPHANS_ALWAYS_SWEPT or fewer. reindex.py
(`tiercache gc --reindex`) then rebuilds the index from the objects' own headers,
restoring the registry first from the copy each GC pass keeps in the bucket;
`force_sweep` deletes them anyway.

Known race, harmless: if a writer re-uploads a key between the GC's unindex and its
delete, the fresh object goes with the delete while its new entry stays. The first
reader then finds no object, and the engine drops the entry (a miss, never wrong
bytes).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from tiercache.config import TierCacheConfig
from tiercache.index.leases import Leases
from tiercache.index.redis_conn import GuardedRedis
from tiercache.index.redis_index import Deployment, RedisIndex, runs_key
from tiercache.metrics import GC_SWEEPS_REFUSED
from tiercache.tiers.disk.layout import DiskLayout
from tiercache.tiers.s3.legacy import sweep_legacy
from tiercache.tiers.s3.passes import (
    SWEEP_BATCH,
    PassClients,
    delete_objects,
    is_s3_error,
    registered_deployments,
    s3_pass,
    save_registry_snapshot,
)
from tiercache.tiers.s3.tier import S3Tier

log = logging.getLogger(__name__)

DEFAULT_ORPHAN_GRACE = 600.0
# Entries looked at per index and round of the capacity pass.
_EVICT_BATCH = 5000
_MAX_ROUNDS = 1000
# The sweep deletes at most this share of the objects past the grace period in one
# pass: more than that unindexed means the index was lost, not that they are orphans...
MAX_ORPHAN_SHARE = 0.5
# ...unless they are this few (the leftovers of a flush, a few failed index writes).
ORPHANS_ALWAYS_SWEPT = 16


def run_gc(
    config: TierCacheConfig,
    sweep_orphans: bool = True,
    now: float | None = None,
    *,
    grace_seconds: float = DEFAULT_ORPHAN_GRACE,
    redis: GuardedRedis | None = None,
    s3: S3Tier | None = None,
    force_sweep: bool = False,
) -> dict[str, Any]:
    """One GC pass: keep `config.namespace` under `s3.capacity` (when set), then sweep
    orphans older than `grace_seconds` (measured against `now`, epoch seconds, default
    the current time). The sweep refuses when the index looks lost (see the module's
    doc) unless `force_sweep`. Returns a report; Redis or S3 failures are listed in its
    "errors" and end the pass early, without raising."""
    started = time.monotonic()
    now = time.time() if now is None else now
    report: dict[str, Any] = {
        "namespace": config.namespace,
        "capacity_bytes": config.s3.capacity if config.s3 else None,
        "used_bytes_before": None,
        "used_bytes_after": None,
        "evicted_objects": 0,
        "evicted_bytes": 0,
        "skipped_leased": 0,
        "spared_hit": 0,
        "delete_failed": 0,
        "orphans": {
            "scanned": 0,
            "too_young": 0,
            "found": 0,
            "deleted": 0,
            "delete_failed": 0,
            "refused": None,
            "legacy_deleted": 0,
            "legacy_index_keys_deleted": 0,
        },
        "errors": [],
    }
    with s3_pass(config, redis, s3, report, "collect") as clients:
        if clients is not None:
            redis, s3 = clients
            deployments = registered_deployments(redis)
            save_registry_snapshot(s3, deployments)
            mine = [d for d in deployments if d.namespace == config.namespace]
            _keep_under_capacity(redis, s3, config, mine, report)
            if sweep_orphans:
                _sweep_orphans(redis, s3, deployments, now - grace_seconds, report, force_sweep)
    report["duration_seconds"] = round(time.monotonic() - started, 3)
    return report


def _used_bytes(index: RedisIndex, deployments: list[Deployment]) -> int:
    return sum(
        index.count(dep.model_digest, rank) * dep.object_bytes
        for dep in deployments
        for rank in dep.rank_digests
    )


def _keep_under_capacity(
    redis: GuardedRedis,
    s3: S3Tier,
    config: TierCacheConfig,
    deployments: list[Deployment],
    report: dict[str, Any],
) -> None:
    index = RedisIndex(redis)
    leases = Leases(redis, config.redis.write_lease_ttl, config.redis.read_lease_ttl)
    used = _used_bytes(index, deployments)
    report["used_bytes_before"] = report["used_bytes_after"] = used
    assert config.s3 is not None  # run_gc returns early without S3
    capacity = config.s3.capacity
    if capacity is None:
        return
    leased: set[tuple[str, str, bytes]] = set()
    leased_per_index: dict[tuple[str, str], int] = defaultdict(int)
    for _ in range(_MAX_ROUNDS):
        if used <= capacity:
            break
        # The oldest runs overall are among each index's oldest `need` runs (plus
        # those a lease holds back, which stay at the front). A run holds at least
        # one block, so `need` runs always free enough.
        candidates: list[tuple[float, str, str, bytes, int]] = []
        for dep in deployments:
            need = math.ceil((used - capacity) / dep.object_bytes)
            for rank in dep.rank_digests:
                held = leased_per_index[(dep.model_digest, rank)]
                n = min(need + held, _EVICT_BATCH + held)
                for run_id, score in index.oldest(dep.model_digest, rank, n):
                    if (dep.model_digest, rank, run_id) not in leased:
                        candidates.append((score, dep.model_digest, rank, run_id, dep.object_bytes))
        if not candidates:  # every run left is leased
            break
        candidates.sort()
        hits = _hits_of(index, candidates)
        spared: dict[tuple[str, str], list[tuple[bytes, int]]] = defaultdict(list)
        for _score, model, rank, run_id, size in candidates:
            if used <= capacity:
                break
            run_hits = hits.get((model, rank, run_id), 0)
            if run_hits:
                spared[(model, rank)].append((run_id, run_hits))
                report["spared_hit"] += 1
                continue
            removed = leases.gc_unindex_run(model, rank, run_id)
            if removed == -1:  # a live read lease: this one stays
                leased.add((model, rank, run_id))
                leased_per_index[(model, rank)] += 1
                report["skipped_leased"] += 1
                continue
            if removed == -2:  # someone else removed it; it no longer counts
                continue
            # The entries are gone, so no new reader can lease the run: now the object.
            used -= removed * size
            report["evicted_objects"] += 1
            report["evicted_bytes"] += removed * size
            if not s3.delete_run(rank, run_id.hex()):
                report["delete_failed"] += 1  # left for the orphan sweep
        now = time.time()
        for (model, rank), runs in spared.items():
            index.spare(model, rank, runs, now)
        used = _used_bytes(index, deployments)  # writers go on while we work
    report["used_bytes_after"] = used


def _hits_of(
    index: RedisIndex, candidates: list[tuple[float, str, str, bytes, int]]
) -> dict[tuple[str, str, bytes], int]:
    """The hits of each candidate run since GC last spared it: one call per index."""
    by_index: dict[tuple[str, str], list[bytes]] = defaultdict(list)
    for _score, model, rank, run_id, _size in candidates:
        by_index[(model, rank)].append(run_id)
    hits = {}
    for (model, rank), runs in by_index.items():
        for run_id, count in zip(runs, index.run_hits(model, rank, runs), strict=True):
            if count:
                hits[(model, rank, run_id)] = count
    return hits


def _find_model(redis: GuardedRedis, rank: str) -> str | None:
    """The deployment digest of an index named for `rank`, for a rank the registry
    does not list (its deployment never registered, or was flushed). None: no index."""
    pattern = runs_key("*", rank)

    def scan() -> str | None:
        for raw in redis.client.scan_iter(match=pattern, count=1000):
            name = raw.decode() if isinstance(raw, bytes) else raw
            return name[name.index("{") + 1 : name.index("}")]
        return None

    return redis.call("scan", scan)


# A run object as the sweep sees it: (rank digest, run hex).
RunName = tuple[str, str]


class _OrphanFinder:
    """Which of a list of run objects the index holds no record of. The deployment of
    a rank the registry does not list is looked up once, by the name of its index."""

    def __init__(self, redis: GuardedRedis, deployments: list[Deployment]):
        self.redis = redis
        self.model_of: dict[str, str | None] = {
            rank: dep.model_digest for dep in deployments for rank in dep.rank_digests
        }

    def unindexed(self, runs: list[RunName]) -> list[RunName]:
        by_rank: dict[str, list[str]] = defaultdict(list)
        for rank, run in runs:
            by_rank[rank].append(run)
        found: list[RunName] = []
        for rank, names in by_rank.items():
            if rank not in self.model_of:
                self.model_of[rank] = _find_model(self.redis, rank)
            model = self.model_of[rank]
            if model is None:
                found.extend((rank, run) for run in names)
                continue
            zkey = runs_key(model, rank)
            members = [bytes.fromhex(run) for run in names]
            scores = self.redis.call(
                "orphan_check", lambda k=zkey, m=members: self.redis.client.zmscore(k, m)
            )
            found.extend((rank, run) for run, score in zip(names, scores, strict=True) if score is None)
        return found


def _old_unindexed(
    s3: S3Tier, finder: _OrphanFinder, cutoff: float, counts: dict[str, Any]
) -> Iterator[list[RunName]]:
    """Batch by batch, the run objects older than `cutoff` that the index holds no
    record of; what is listed is counted in `counts` ("scanned", "too_young")."""
    batch: list[RunName] = []
    for rank, run, _size, modified in s3.list_runs():
        counts["scanned"] += 1
        if modified.timestamp() > cutoff:
            counts["too_young"] += 1
            continue
        batch.append((rank, run))
        if len(batch) >= SWEEP_BATCH:
            yield finder.unindexed(batch)
            batch = []
    if batch:
        yield finder.unindexed(batch)


def _sweep_orphans(
    redis: GuardedRedis,
    s3: S3Tier,
    deployments: list[Deployment],
    cutoff: float,
    report: dict[str, Any],
    force: bool = False,
) -> None:
    orphans = report["orphans"]
    sweep_legacy(redis, s3, cutoff, orphans, delete_objects)
    finder = _OrphanFinder(redis, deployments)
    # Count first, deleting nothing: whether the index can be trusted is known only
    # once the whole bucket has been compared with it.
    for found in _old_unindexed(s3, finder, cutoff, orphans):
        orphans["found"] += len(found)
    old = orphans["scanned"] - orphans["too_young"]
    if not orphans["found"]:
        return
    if not force and _index_looks_lost(orphans["found"], old):
        _refuse_sweep(orphans, old)
        return
    # Listed and checked again: an entry written since the count keeps its object.
    for found in _old_unindexed(s3, finder, cutoff, {"scanned": 0, "too_young": 0}):
        deleted, failed = delete_objects(s3, [s3.run_name(rank, run) for rank, run in found])
        orphans["deleted"] += deleted
        orphans["delete_failed"] += failed


def _index_looks_lost(unindexed: int, old: int) -> bool:
    return unindexed > ORPHANS_ALWAYS_SWEPT and unindexed > MAX_ORPHAN_SHARE * old


def _refuse_sweep(orphans: dict[str, Any], old: int) -> None:
    message = (
        f"orphan sweep refused: {orphans['found']} of the {old} S3 objects past the grace "
        f"period have no index entry (more than {MAX_ORPHAN_SHARE:.0%}), so the index looks "
        "lost (Redis without persistence, a failover to an empty replica, a wrong redis_url); "
        "nothing was deleted. Rebuild the index with `tiercache gc --reindex`, or delete them "
        "anyway with `tiercache gc --force-sweep`"
    )
    log.warning("%s", message)
    GC_SWEEPS_REFUSED.inc()
    orphans["refused"] = message


def _leased_runs(redis: GuardedRedis, model_digest: str) -> set[tuple[str, str]]:
    """(rank digest, run hex) of every read lease key of a deployment now present."""
    prefix = f"tc:{{{model_digest}}}:rl:"  # read_lease_prefix without the rank

    def scan() -> set[tuple[str, str]]:
        found = set()
        for raw in redis.client.scan_iter(match=prefix + "*", count=1000):
            name = raw.decode() if isinstance(raw, bytes) else raw
            rank, _, run = name[len(prefix) :].partition(":")
            found.add((rank, run))
        return found

    return redis.call("scan", scan)


def flush_namespace(
    config: TierCacheConfig,
    namespace: str,
    *,
    redis: GuardedRedis | None = None,
    s3: S3Tier | None = None,
) -> dict[str, Any]:
    """Forget every deployment registered under `namespace`: drop its index entries
    and registry entry first (so no reader finds them), then delete its S3 objects
    (except those under a live read lease, left to the orphan sweep) and, when
    `disk.path` is set, its objects on this node's disk tier.

    Other nodes' disk tiers are theirs to evict. A deployment still running keeps
    working: it re-indexes what it uploads next, and re-registers on restart.
    Raises ValueError without Redis, RedisUnavailable when Redis does not answer."""
    if config.redis_url is None and redis is None:
        raise ValueError("redis_url is not configured: there is no registry of namespaces")
    report: dict[str, Any] = {
        "namespace": namespace,
        "deployments": [],
        "index_entries_removed": 0,
        "s3_objects_deleted": 0,
        "s3_delete_failed": 0,
        "s3_skipped_leased": 0,
        "disk_objects_deleted": 0,
        "errors": [],
    }
    with PassClients(config, redis, s3) as res:
        assert res.redis is not None  # a client given, or redis_url (checked above)
        index = RedisIndex(res.redis)
        for dep in registered_deployments(res.redis):
            if dep.namespace != namespace:
                continue
            leased = _leased_runs(res.redis, dep.model_digest)
            report["index_entries_removed"] += index.drop_deployment(dep)
            report["deployments"].append({"model_digest": dep.model_digest, "model": dep.model})
            if res.s3 is not None:
                for rank in dep.rank_digests:
                    try:
                        names = []
                        for _rank, run, _size, _modified in res.s3.list_runs(rank):
                            if (rank, run) in leased:
                                report["s3_skipped_leased"] += 1
                            else:
                                names.append(res.s3.run_name(rank, run))
                    except Exception as error:
                        if not is_s3_error(error):
                            raise
                        report["errors"].append(f"s3 listing failed: {type(error).__name__}")
                        continue
                    deleted, failed = delete_objects(res.s3, names)
                    report["s3_objects_deleted"] += deleted
                    report["s3_delete_failed"] += failed
            if config.disk is not None:
                layout = DiskLayout(config.disk.path)
                for rank in dep.rank_digests:
                    report["disk_objects_deleted"] += layout.remove_digest(rank)
    return report

"""Objects and bytes per namespace, deployment and tier: the S3 tier from the Redis
registry and index, the disk tier from a scan of this node's `disk.path`."""

from __future__ import annotations

from typing import Any

from tiercache.config import TierCacheConfig, redact_url
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import Deployment, RedisIndex
from tiercache.tiers.disk.layout import DiskLayout
from tiercache.tiers.s3.passes import registered_deployments

# The namespace disk objects are counted under when no registered deployment names them.
UNREGISTERED = "(unregistered)"


def _redis_for(config: TierCacheConfig) -> GuardedRedis | None:
    return GuardedRedis(config.redis_url, config.redis) if config.redis_url else None


def tier_stats(
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
        return tier_stats(config, redis, disk)
    finally:
        if redis is not None:
            redis.close()

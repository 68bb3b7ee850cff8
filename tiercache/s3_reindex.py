"""`tiercache gc --reindex`: rebuild the S3 tier's index from the objects, after Redis
lost it (see s3_gc.py's "Lost index"). The registry comes back first, from the copy
each GC pass keeps in the bucket; then every object of a registered deployment whose
header names its own key, rank and size is indexed again."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tiercache.config import TierCacheConfig
from tiercache.index import REGISTRY, Deployment, index_key
from tiercache.redis_conn import GuardedRedis
from tiercache.s3_gc import (
    SWEEP_BATCH,
    PassClients,
    failures_reported,
    load_registry_snapshot,
    registered_deployments,
)
from tiercache.tiers.format import DATA_ALIGN, CorruptObject, ObjectHeader, decode_header, header_length
from tiercache.tiers.s3 import S3Tier


def _restore_registry(redis: GuardedRedis, s3: S3Tier) -> int:
    """Put back every deployment of the bucket's copy that the registry lacks."""
    snapshot = load_registry_snapshot(s3)
    present = {
        name.decode() if isinstance(name, bytes) else name
        for name in redis.call("registry", lambda: redis.client.hkeys(REGISTRY))
    }
    restored = 0
    for model_digest, value in snapshot.items():
        if model_digest in present or not isinstance(value, str):
            continue
        redis.call("register", lambda d=model_digest, v=value: redis.client.hsetnx(REGISTRY, d, v))
        restored += 1
    return restored


def read_object_header(s3: S3Tier, key: str) -> tuple[ObjectHeader, int]:
    """An object's safetensors header, and where its pages start, from ranged GETs
    (one when the header fits its usual 4 KiB). Raises CorruptObject."""
    name = s3.object_name(key)
    head = _ranged_get(s3, name, 0, DATA_ALIGN)
    end = 8 + header_length(head)
    if end > len(head):
        head += _ranged_get(s3, name, len(head), end)
    if end > len(head):
        raise CorruptObject(f"object shorter than its {end}-byte header")
    return decode_header(head[8:end]), end


def _ranged_get(s3: S3Tier, name: str, start: int, stop: int) -> bytes:
    response = s3.client.get_object(Bucket=s3.bucket, Key=name, Range=f"bytes={start}-{stop - 1}")
    return response["Body"].read()


def _check_object(s3: S3Tier, key: str, size: int) -> str:
    """"ok" when the object's header is whole and names this very key, rank and size;
    otherwise "corrupt", or "vanished" when it was deleted since it was listed."""
    from botocore.exceptions import ClientError

    try:
        header, data_offset = read_object_header(s3, key)
    except CorruptObject:
        return "corrupt"
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code")
        if code in ("NoSuchKey", "404"):
            return "vanished"
        if code == "InvalidRange":  # an empty object
            return "corrupt"
        raise
    rank = key.split("/")[0]
    matches = header.key == key and header.namespace_digest == rank and data_offset + header.nbytes == size
    return "ok" if matches else "corrupt"


def reindex(
    config: TierCacheConfig,
    *,
    redis: GuardedRedis | None = None,
    s3: S3Tier | None = None,
) -> dict[str, Any]:
    """Rebuild the S3 tier's index from the objects, after Redis lost it.

    The registry is restored first from the copy GC passes keep in the bucket. Then
    each object of a registered deployment's rank, of that deployment's object size,
    has its safetensors header read (ranged GETs, in parallel); an object whose header
    is whole and names its own key and rank gets its index entry back, scored with its
    last-modified time (an entry still present keeps its score). Corrupt objects and
    those of unregistered deployments are counted and left for the sweep; the pages'
    checksum is checked on the first read, as always. Failures are listed in "errors"."""
    report: dict[str, Any] = {
        "registry_restored": 0,
        "scanned": 0,
        "indexed": 0,
        "already_indexed": 0,
        "corrupt": 0,
        "vanished": 0,
        "unregistered": 0,
        "errors": [],
    }
    if config.s3 is None or config.redis_url is None:
        report["errors"].append("s3 is not configured: there is nothing to index")
        return report
    with PassClients(config, redis, s3) as res, failures_reported(report):
        assert res.redis is not None and res.s3 is not None  # both configured (checked above)
        report["registry_restored"] = _restore_registry(res.redis, res.s3)
        deployments = registered_deployments(res.redis)
        _reindex_objects(res.redis, res.s3, deployments, report)
    return report


def _reindex_objects(
    redis: GuardedRedis, s3: S3Tier, deployments: list[Deployment], report: dict[str, Any]
) -> None:
    deployment_of = {rank: dep for dep in deployments for rank in dep.rank_digests}
    batch: list[tuple[str, int, float, str]] = []
    for key, size, modified in s3.list_objects():
        report["scanned"] += 1
        dep = deployment_of.get(key.split("/")[0])
        if dep is None:
            report["unregistered"] += 1
            continue
        if size != dep.object_bytes:
            report["corrupt"] += 1
            continue
        batch.append((key, size, modified.timestamp(), dep.model_digest))
        if len(batch) >= SWEEP_BATCH:
            _reindex_batch(redis, s3, batch, report)
            batch = []
    if batch:
        _reindex_batch(redis, s3, batch, report)


def _reindex_batch(
    redis: GuardedRedis, s3: S3Tier, batch: list[tuple[str, int, float, str]], report: dict[str, Any]
) -> None:
    outcomes = s3.pool.map(lambda item: _check_object(s3, item[0], item[1]), batch)
    entries: dict[str, dict[bytes, float]] = defaultdict(dict)  # index key -> member -> score
    for (key, _size, modified, model), outcome in zip(batch, outcomes, strict=True):
        if outcome != "ok":
            report[outcome] += 1
            continue
        rank, block = key.split("/")
        entries[index_key(model, rank)][bytes.fromhex(block)] = modified
    for zkey, members in entries.items():
        added = int(redis.call("reindex", lambda k=zkey, m=members: redis.client.zadd(k, m, nx=True)))
        report["indexed"] += added
        report["already_indexed"] += len(members) - added

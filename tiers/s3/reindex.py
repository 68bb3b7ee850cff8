"""`tiercache gc --reindex`: rebuild the S3 tier's index from the objects, after Redis
lost it (see gc.py's "Lost index"). The registry comes back first, from the copy
each GC pass keeps in the bucket; then every run object of a registered deployment
whose table of contents names its own run, rank and size gets its entries back: one
per block, at its position, and the run's record (tiers/s3/runs.py)."""

from __future__ import annotations

from typing import Any

from tiercache.config import TierCacheConfig
from tiercache.index.redis_conn import GuardedRedis
from tiercache.index.redis_index import REGISTRY, Deployment, RunRecord, index_keys, location
from tiercache.tiers.format import CorruptObject
from tiercache.tiers.s3.passes import (
    SWEEP_BATCH,
    load_registry_snapshot,
    registered_deployments,
    s3_pass,
)
from tiercache.tiers.s3.runs import RunHeader
from tiercache.tiers.s3.tier import S3Tier


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


def _check_run(s3: S3Tier, rank: str, run: str, size: int) -> tuple[str, RunHeader | None]:
    """("ok", its table of contents) when a run's header is whole and names this very
    run, rank and size; otherwise ("corrupt", None), or ("vanished", None) when it
    was deleted since it was listed."""
    from botocore.exceptions import ClientError

    try:
        header = s3.read_run_header(rank, run)
    except CorruptObject:
        return "corrupt", None
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code")
        if code in ("NoSuchKey", "404"):
            return "vanished", None
        if code == "InvalidRange":  # an empty object
            return "corrupt", None
        raise
    whole = header.geometry.object_bytes(len(header.block_hashes)) == size
    if header.run_hex == run and header.namespace_digest == rank and whole:
        return "ok", header
    return "corrupt", None


def reindex(
    config: TierCacheConfig,
    *,
    redis: GuardedRedis | None = None,
    s3: S3Tier | None = None,
) -> dict[str, Any]:
    """Rebuild the S3 tier's index from the objects, after Redis lost it.

    The registry is restored first from the copy GC passes keep in the bucket. Then
    each run object of a registered deployment's rank has its table of contents read
    (ranged GETs, in parallel); a run whose header is whole and names its own run,
    rank and size gets its entries back: each block at its position (a block still
    indexed elsewhere keeps that entry), the run's record, and its last access, its
    last-modified time (a run still present keeps its own). "indexed" counts blocks.
    Corrupt runs and those of unregistered deployments are counted and left for the
    sweep; each block's checksum is checked on its first read, as always. Failures are
    listed in "errors"."""
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
    with s3_pass(config, redis, s3, report, "index") as clients:
        if clients is not None:
            redis, s3 = clients
            report["registry_restored"] = _restore_registry(redis, s3)
            deployments = registered_deployments(redis)
            _reindex_objects(redis, s3, deployments, report)
    return report


def _reindex_objects(
    redis: GuardedRedis, s3: S3Tier, deployments: list[Deployment], report: dict[str, Any]
) -> None:
    deployment_of = {rank: dep for dep in deployments for rank in dep.rank_digests}
    batch: list[tuple[str, str, int, float, str]] = []
    for rank, run, size, modified in s3.list_runs():
        report["scanned"] += 1
        dep = deployment_of.get(rank)
        if dep is None:
            report["unregistered"] += 1
            continue
        batch.append((rank, run, size, modified.timestamp(), dep.model_digest))
        if len(batch) >= SWEEP_BATCH:
            _reindex_batch(redis, s3, batch, report)
            batch = []
    if batch:
        _reindex_batch(redis, s3, batch, report)


def _reindex_batch(
    redis: GuardedRedis, s3: S3Tier, batch: list[tuple[str, str, int, float, str]], report: dict[str, Any]
) -> None:
    outcomes = s3.pool.map(lambda item: _check_run(s3, item[0], item[1], item[2]), batch)
    for (rank, run, _size, modified, model), (outcome, header) in zip(batch, outcomes, strict=True):
        if header is None:
            report[outcome] += 1
            continue
        run_id = bytes.fromhex(run)
        geometry = header.geometry
        record = RunRecord(
            geometry.data_start, geometry.frame_header, geometry.slot_bytes, header.block_hashes
        )
        blk, runs, records = index_keys(model, rank)

        def restore(
            blk: str = blk,
            runs: str = runs,
            records: str = records,
            record: RunRecord = record,
            run_id: bytes = run_id,
            modified: float = modified,
        ) -> list[int]:
            pipe = redis.client.pipeline(transaction=True)
            for i, block in enumerate(record.block_hashes):
                pipe.hsetnx(blk, block, location(run_id, i))
            pipe.zadd(runs, {run_id: modified}, nx=True)
            pipe.hset(records, run_id, record.encode())
            return pipe.execute()

        added = redis.call("reindex", restore)
        indexed = sum(int(bool(x)) for x in added[: len(record.block_hashes)])
        report["indexed"] += indexed
        report["already_indexed"] += len(record.block_hashes) - indexed

"""What tiercache kept in S3 and Redis before runs: one object per block,
`<prefix><rank digest>/<block hash>.safetensors`, and one index ZSET per rank,
`tc:{<model digest>}:idx:<rank digest>`. Nothing reads either any more (after an
upgrade the S3 tier starts cold); each GC pass reclaims them here."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from tiercache.index.redis_conn import GuardedRedis
from tiercache.tiers.s3.tier import S3Tier


def sweep_legacy(
    redis: GuardedRedis,
    s3: S3Tier,
    cutoff: float,
    orphans: dict[str, Any],
    delete_objects: Callable[[S3Tier, Iterable[str]], tuple[int, int]],
) -> None:
    """Per-block objects and index of a tiercache before runs: nothing reads them now.
    Objects go once past the grace period (counted apart, never refused: they say
    nothing about whether the index was lost); the old index keys go at once."""
    old = [
        s3.object_name(key) for key, _size, modified in s3.list_objects() if modified.timestamp() <= cutoff
    ]
    deleted, failed = delete_objects(s3, old)
    orphans["legacy_deleted"] = deleted
    orphans["delete_failed"] += failed

    def drop_old_index() -> int:
        keys = list(redis.client.scan_iter(match="tc:{*}:idx:*", count=1000))
        for key in keys:  # one key per call: they may lie in different cluster slots
            redis.client.delete(key)
        return len(keys)

    orphans["legacy_index_keys_deleted"] = redis.call("scan", drop_old_index)

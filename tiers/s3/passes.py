"""What every pass over S3 and its index shares (GC, the namespace flush, re-index):
the clients of one pass, failures ending it into its report, the deployment
registry and the copy of it each GC pass keeps in the bucket, and batched deletes."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

from tiercache.config import TierCacheConfig
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import REGISTRY, Deployment
from tiercache.tiers.s3.tier import S3Tier

log = logging.getLogger(__name__)

# Objects checked against the index per Redis call, and deleted per S3 call (S3's
# DeleteObjects takes at most 1000 keys).
SWEEP_BATCH = 1000
_DIGEST = re.compile(r"^[0-9a-f]{16}$")
# The copy of the registry each GC pass keeps in the bucket (under s3.prefix), for reindex.
REGISTRY_SNAPSHOT = "tiercache-registry.json"


def registered_deployments(redis: GuardedRedis) -> list[Deployment]:
    """Every deployment in the registry; an unreadable entry is skipped with a warning
    rather than failing the caller."""
    raw = redis.call("registry", lambda: redis.client.hgetall(REGISTRY))
    deployments = []
    for digest, value in raw.items():
        try:
            deployment = Deployment.from_json(value)
            # Digests name files and S3 keys: accept nothing but what keys.py makes.
            if not all(_DIGEST.match(d) for d in (deployment.model_digest, *deployment.rank_digests)):
                raise ValueError("digests are not 16 hex digits")
            if deployment.object_bytes <= 0:
                raise ValueError("object_bytes is not positive")
        except (ValueError, TypeError, KeyError, AttributeError):
            log.warning("registry entry %r is not a deployment; skipped", digest)
            continue
        deployments.append(deployment)
    return deployments


def gc_redis_client(config: TierCacheConfig) -> GuardedRedis:
    # GC and flush move more than a scheduler lookup: allow Redis longer to answer.
    settings = config.redis.model_copy(
        update={"socket_timeout": max(config.redis.socket_timeout, 10.0), "retry_backoff": 0.0}
    )
    assert config.redis_url is not None  # called only where Redis is configured
    return GuardedRedis(config.redis_url, settings)


class PassClients(contextlib.ExitStack):
    """The Redis and S3 clients of one pass: the caller's, or our own (closed after)."""

    def __init__(self, config: TierCacheConfig, redis: GuardedRedis | None, s3: S3Tier | None):
        super().__init__()
        self.redis = redis
        self.s3 = s3
        if self.redis is None and config.redis_url:
            self.redis = gc_redis_client(config)
            self.callback(self.redis.close)
        if self.s3 is None and config.s3 is not None:
            self.s3 = S3Tier(config.s3)
            self.callback(self.s3.close)


@contextlib.contextmanager
def s3_pass(
    config: TierCacheConfig,
    redis: GuardedRedis | None,
    s3: S3Tier | None,
    report: dict[str, Any],
    doing: str,
) -> Iterator[tuple[GuardedRedis, S3Tier] | None]:
    """The clients of a pass over S3 and its index (GC, re-index), or None, noted in
    the report's "errors", where either is not configured. Failures end the pass and
    are listed there too (failures_reported)."""
    if config.s3 is None or config.redis_url is None:
        report["errors"].append(f"s3 is not configured: there is nothing to {doing}")
        yield None
        return
    with PassClients(config, redis, s3) as res, failures_reported(report):
        assert res.redis is not None and res.s3 is not None  # both configured (checked above)
        yield res.redis, res.s3


@contextlib.contextmanager
def failures_reported(report: dict[str, Any]) -> Iterator[None]:
    """Redis or S3 failing ends the work early, listed in the report's "errors"."""
    try:
        yield
    except RedisUnavailable as error:
        report["errors"].append(f"redis unavailable: {type(error.__cause__ or error).__name__}")
    except Exception as error:  # an S3 listing failure, mostly: report, don't crash the loop
        if not is_s3_error(error):
            raise
        report["errors"].append(f"s3 unavailable: {type(error).__name__}")


def is_s3_error(error: Exception) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    return isinstance(error, (BotoCoreError, ClientError))


def delete_objects(s3: S3Tier, names: Iterable[str]) -> tuple[int, int]:
    """Delete objects (by their full names in the bucket) in batches of up to 1000
    per request: (deleted, failed)."""
    from botocore.exceptions import BotoCoreError, ClientError

    names = list(names)
    deleted = failed = 0
    for start in range(0, len(names), SWEEP_BATCH):
        chunk = names[start : start + SWEEP_BATCH]
        request = {"Objects": [{"Key": name} for name in chunk], "Quiet": True}
        try:
            response = s3.client.delete_objects(Bucket=s3.bucket, Delete=request)
        except (BotoCoreError, ClientError) as error:
            log.warning("s3 batch delete of %d objects failed: %s", len(chunk), type(error).__name__)
            failed += len(chunk)
            continue
        errors = len(response.get("Errors", ()))
        failed += errors
        deleted += len(chunk) - errors
    return deleted, failed


# -- the registry's copy in the bucket (reindex.py restores it) ----------------
def _snapshot_name(s3: S3Tier) -> str:
    return s3.config.prefix + REGISTRY_SNAPSHOT


def load_registry_snapshot(s3: S3Tier) -> dict[str, str]:
    """The registry as the last GC pass saw it: model digest -> deployment JSON."""
    from botocore.exceptions import ClientError

    try:
        body = s3.client.get_object(Bucket=s3.bucket, Key=_snapshot_name(s3))["Body"].read()
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return {}
        raise
    try:
        snapshot = json.loads(body)
    except ValueError:
        log.warning("the registry's copy %s is not JSON; ignored", _snapshot_name(s3))
        return {}
    return snapshot if isinstance(snapshot, dict) else {}


def save_registry_snapshot(s3: S3Tier, deployments: list[Deployment]) -> None:
    """Keep a copy of the registry in the bucket, rewritten only when it changed. An
    empty registry is what a lost Redis looks like, so it never replaces a copy."""
    from botocore.exceptions import BotoCoreError, ClientError

    if not deployments:
        return
    snapshot = {dep.model_digest: dep.to_json() for dep in deployments}
    try:
        if load_registry_snapshot(s3) != snapshot:
            body = json.dumps(snapshot, sort_keys=True).encode()
            s3.client.put_object(Bucket=s3.bucket, Key=_snapshot_name(s3), Body=body)
    except (BotoCoreError, ClientError) as error:  # the pass itself does not need it
        log.warning("could not save the registry's copy in S3: %s", type(error).__name__)

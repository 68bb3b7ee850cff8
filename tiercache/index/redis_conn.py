"""One Redis connection (standalone, TLS or Cluster) with a circuit breaker: after a
failure, calls are skipped for a backoff that grows to a cap, so an unreachable
Redis costs the scheduler one short timeout, then nothing, until it comes back."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from tiercache.config import RedisConfig, redact_url
from tiercache.errors import RedisUnavailable
from tiercache.metrics import INDEX_ERRORS

log = logging.getLogger(__name__)
T = TypeVar("T")


def connect(url: str, settings: RedisConfig):
    common = {
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.connect_timeout,
        # No retries inside the client: redis-py's default (10, with backoff up to a
        # second) turns one timed-out call into seconds of waiting. A failed call is a
        # miss, and the breaker below is the retry.
        "retry": Retry(NoBackoff(), 0),
    }
    if url.startswith("rediss") and settings.ssl_ca_certs:
        common["ssl_ca_certs"] = str(settings.ssl_ca_certs)
    if "+cluster://" in url:
        plain = url.replace("+cluster://", "://", 1)
        return RedisCluster.from_url(plain, **common)
    return redis.Redis.from_url(url, health_check_interval=0, **common)


class GuardedRedis:
    def __init__(self, url: str, settings: RedisConfig, client=None):
        self.url = url
        self.settings = settings
        self.cluster = isinstance(client, RedisCluster) if client is not None else "+cluster://" in url
        # A standalone client connects on its first command; a cluster client reads
        # the slot map when it is built, so it is built on first use: a cluster that
        # is down at startup is a miss, not a failure to start.
        self._client = client if client is not None or self.cluster else connect(url, settings)
        self._lock = threading.Lock()
        self._failures = 0
        self._closed_until = 0.0
        self._scripts: dict[str, object] = {}

    @property
    def client(self):
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    try:
                        self._client = connect(self.url, self.settings)
                    except (redis.RedisError, RedisClusterException, OSError) as error:
                        raise RedisUnavailable(
                            f"redis {redact_url(self.url)}: cannot connect ({type(error).__name__})"
                        ) from error
                client = self._client
        return client

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._closed_until

    def script(self, source: str):
        script = self._scripts.get(source)
        if script is None:
            client = self.call("connect", lambda: self.client)  # breaker-guarded
            script = self._scripts[source] = client.register_script(source)
        return script

    def call(self, op: str, fn: Callable[..., T], slow_after: float | None = None) -> T:
        """Run `fn` against Redis, or raise RedisUnavailable without waiting when the
        breaker is open. A call that answers, but after `slow_after` seconds, returns
        its answer and opens the breaker as a failure would: each socket read is
        bounded by the socket timeout, but a Redis that answers every read just in
        time would otherwise cost every call several of them."""
        if not self.available:
            raise RedisUnavailable(f"redis {redact_url(self.url)} is in backoff")
        started = time.monotonic()
        try:
            result = fn()
        except (redis.RedisError, RedisClusterException, RedisUnavailable, OSError) as error:
            # RedisClusterException (a slot no live node serves, no reachable node)
            # is not a RedisError.
            self._failed(op, type(error).__name__)
            raise RedisUnavailable(str(error)) from error
        took = time.monotonic() - started
        if slow_after is not None and took > slow_after:
            self._failed(op, f"answered in {took:.2f}s")
            return result
        if self._failures:
            with self._lock:
                if self._failures:
                    log.info("redis %s answers again", redact_url(self.url))
                self._failures = 0
                self._closed_until = 0.0
        return result

    def _failed(self, op: str, why: str) -> None:
        INDEX_ERRORS.labels(op).inc()
        with self._lock:
            self._failures += 1
            backoff = min(
                self.settings.retry_backoff * 2 ** (self._failures - 1),
                self.settings.max_backoff,
            )
            self._closed_until = time.monotonic() + backoff
        if self._failures == 1:
            log.warning(
                "redis %s unreachable (%s); shared lookups are misses for %.1fs",
                redact_url(self.url),
                why,
                backoff,
            )

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except (redis.RedisError, RedisClusterException, RedisUnavailable, OSError):
            return False

    def close(self) -> None:
        if self._client is None:
            return
        with contextlib.suppress(redis.RedisError, RedisClusterException, OSError):
            self._client.close()

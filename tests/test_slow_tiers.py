"""Slow, not failing, S3 and Redis (issue 16, item 10): real redis-server and moto's S3
server behind the slowing TCP proxy of tests/support/faults.py. A slow S3 must not
pin the CPU tier until stores are dropped; a slow Redis must cost the scheduler a
bounded wait, then nothing while the breaker is open."""

from __future__ import annotations

import time
import uuid
from urllib.parse import urlparse

import numpy as np
import pytest
from prometheus_client import REGISTRY

from tiercache.config import RedisConfig, build_config
from tiercache.engine import LocalTierCache, ObjectShape
from tiercache.index import RedisIndex
from tiercache.redis_conn import GuardedRedis, RedisUnavailable

from support.faults import TcpProxy

BLOCK = 64 * 1024
SLOTS = 8


def block(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def payload(i: int) -> bytes:
    return np.random.default_rng(i).bytes(BLOCK)


def dropped_s3_writes() -> float:
    return REGISTRY.get_sample_value("tiercache_mover_dropped_total", {"tier": "s3"}) or 0.0


@pytest.fixture
def slow_s3(s3_endpoint):
    proxy = TcpProxy(urlparse(s3_endpoint).port, delay=1.0).start()
    yield proxy
    proxy.stop()


def put_soon(cache: LocalTierCache, i: int, within: float) -> int | None:
    """Store block i, waiting up to `within` seconds for a CPU slot to come free:
    long enough for a disk write, far shorter than one slowed S3 PUT."""
    deadline = time.monotonic() + within
    while True:
        slot = cache.put(block(i), payload(i))
        if slot is not None or time.monotonic() > deadline:
            return slot
        time.sleep(0.005)


def test_a_slow_s3_leaves_the_cpu_tier_free_for_stores(tmp_path, redis_url, bucket, slow_s3):
    config = build_config(
        {
            "redis_url": redis_url,
            "cpu": {"capacity": SLOTS * BLOCK},
            "disk": {"path": str(tmp_path / "disk"), "capacity": "64MiB"},
            "s3": {
                "bucket": bucket,
                "endpoint_url": slow_s3.url,
                "region": "us-east-1",
                "read_timeout": 5,
                "max_attempts": 1,
            },
            "movers": {"workers": 2},
        },
        environ={},
    )
    shape = ObjectShape(uuid.uuid4().hex[:16], uuid.uuid4().hex[:16], BLOCK, layout="LBHNC", dtype="uint8")
    cache = LocalTierCache(config, shape, pin_memory=False)
    bound = cache.engine.upload_slot_limit
    try:
        assert bound < SLOTS
        dropped_before = dropped_s3_writes()
        started = time.monotonic()
        for i in range(4 * SLOTS):  # four times the tier, while every PUT takes seconds
            assert put_soon(cache, i, within=1.0) is not None, f"store {i} dropped: the CPU tier is pinned"
        assert time.monotonic() - started < 20
        # Every slot is free as soon as its disk write ends (milliseconds): a block
        # waiting for its S3 run waits as a copy. The copies still count against the
        # bound, so past it the S3 writes are dropped, below.
        deadline = time.monotonic() + 1.0
        while cache.slots.unpinned() < SLOTS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.slots.unpinned() == SLOTS
        assert dropped_s3_writes() - dropped_before >= 4 * SLOTS - 2 * bound  # counted, not silent
        for i in range(4 * SLOTS):
            assert shape.key(block(i)) in cache.engine.disk
        slow_s3.delay = 0.0  # S3 recovers: every store goes there again
        assert cache.engine.flush(30)
        assert cache.put(block(1000), payload(1000)) is not None
        assert cache.engine.flush(30)
        assert cache.engine.index.locate(shape.model_digest, shape.rank_digest, block(1000)) is not None
    finally:
        cache.close()


def test_a_slow_redis_costs_a_lookup_a_bounded_wait_then_nothing(redis_server):
    """A Redis that answers late, or not in time: the first lookup ends within a few
    socket timeouts (with the answer, when one came), counts as a failure, and later
    lookups fail at once while the breaker is open."""
    settings = RedisConfig(socket_timeout=0.25, connect_timeout=0.25, retry_backoff=5.0)
    hashes = [bytes([i]) * 32 for i in range(8)]
    for delay in (2.0, 0.05):  # every read times out; every read answers in time, slowly
        proxy = TcpProxy(redis_server.port, delay=delay).start()
        guarded = GuardedRedis(f"redis://127.0.0.1:{proxy.port}/0", settings)
        index = RedisIndex(guarded)
        try:
            started = time.monotonic()
            try:
                found = index.longest_prefix("m" * 16, ["r" * 16], hashes)
            except RedisUnavailable:
                found = None
            assert time.monotonic() - started < 4 * settings.socket_timeout, delay
            assert found == (None if delay > settings.socket_timeout else 0)
            started = time.monotonic()
            with pytest.raises(RedisUnavailable):
                index.longest_prefix("m" * 16, ["r" * 16], hashes)
            assert time.monotonic() - started < 0.05, delay  # the breaker is open
        finally:
            guarded.close()
            proxy.stop()

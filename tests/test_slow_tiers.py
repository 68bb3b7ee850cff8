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
from tiercache.connector.driver import ConnectorDriver
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import RedisIndex
from tiercache.object_shape import ObjectShape

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


def put_soon(cache: ConnectorDriver, i: int, within: float) -> int | None:
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
    cache = ConnectorDriver(config, BLOCK, model=uuid.uuid4().hex)
    shape = cache.shape
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
            cache.deliver_reports()  # the slots the movers freed, as the next step would
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


# -- issue 39, item 4: a slow tier is a miss, not a stall --------------------------------
def tiered_cache(tmp_path, redis_url, bucket, s3_url: str, **movers) -> tuple[ConnectorDriver, ObjectShape]:
    config = build_config(
        {
            "redis_url": redis_url,
            "cpu": {"capacity": SLOTS * BLOCK},
            "disk": {"path": str(tmp_path / "disk"), "capacity": "64MiB"},
            "s3": {"bucket": bucket, "endpoint_url": s3_url, "region": "us-east-1", "max_attempts": 1},
            "movers": movers,
        },
        environ={},
    )
    cache = ConnectorDriver(config, BLOCK, model=uuid.uuid4().hex)
    return cache, cache.shape


def test_slow_s3_reads_never_hold_a_disk_hit_behind_them(tmp_path, redis_url, bucket, slow_s3):
    """Each S3 hit staging holds a stager thread for the whole of its read. With S3
    and disk hits on the same threads, as many slow S3 hits as threads held every
    disk hit behind them (issue 39, item 4): the disk hit here was done only after an
    S3 read ended. Now it is done while every S3 read still waits."""
    slow_s3.delay = 0.0
    cache, shape = tiered_cache(tmp_path, redis_url, bucket, slow_s3.url, workers=2)
    try:
        for i in range(4):
            assert cache.put(block(i), payload(i)) is not None
        assert cache.engine.flush(30)
        for i in range(4):
            assert cache.engine.index.locate(shape.model_digest, shape.rank_digest, block(i)) is not None
        slow_s3.delay = 1.0  # each S3 read now takes seconds
        engine = cache.engine
        s3_loads = [engine.stage_many([(block(i), i, "s3")]) for i in range(3)]  # more than the threads
        disk_load = engine.stage_many([(block(3), 3, "disk")])
        assert disk_load.result(timeout=60) == [True]
        assert not any(load.done() for load in s3_loads), "the disk hit waited for an S3 read"
        assert [load.result(timeout=60) for load in s3_loads] == [[True]] * 3  # slow, not failed
    finally:
        slow_s3.delay = 0.0
        cache.close()


def test_an_s3_run_record_that_does_not_decode_is_a_miss(tmp_path, redis_url, bucket, s3_endpoint):
    """A run record in Redis that cannot be decoded raised struct.error out of the S3
    read, into the connector's hooks (issue 39, item 3)."""
    import redis as redis_client

    from tiercache.index.redis_index import RUN_ID_BYTES, index_keys

    cache, shape = tiered_cache(tmp_path, redis_url, bucket, s3_endpoint)
    try:
        assert cache.put(block(1), payload(1)) is not None
        assert cache.engine.flush(30)
        blocks_key, _, records_key = index_keys(shape.model_digest, shape.rank_digest)
        client = redis_client.Redis.from_url(redis_url)
        run = client.hget(blocks_key, block(1))[:RUN_ID_BYTES]
        client.hset(records_key, run, b"\x01")  # too short for its header
        out = memoryview(bytearray(BLOCK))
        assert cache.engine.read_s3([(block(1), out)]) == [False]
        assert cache.engine.stage_many([(block(1), 0, "s3")]).result(timeout=30) == [False]
    finally:
        cache.close()


def test_a_staged_load_past_its_deadline_is_a_recompute_and_its_late_read_lands_nowhere(
    tmp_path, redis_url, bucket, slow_s3
):
    """A hit staged from an S3 that answers late: once movers.load_deadline_seconds
    has passed, its request is reported finished receiving with its block failed
    (vLLM recomputes it) while the read still runs; the block's slot is released
    only once that read ended, and its bytes never reach the paged KV."""
    import torch

    from tiercache.connector.metadata import FILL_FAILED, RELEASED, BlockOp, LoadJob, TierCacheMetadata
    from tiercache.connector.worker import TierCacheWorker
    from tiercache.index.keys import KVSpec

    slow_s3.delay = 0.0
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv = {name: torch.randn(2, 10, 16, 2, 8) for name in layers}  # FlashAttention's layout
    slot_bytes = 2 * 2 * 16 * 2 * 8 * 4
    spec = KVSpec("m", "", "float32", "auto", 16, "cpu", 2, 2, 8, 1, 0, "t", slot_bytes)
    config = build_config(
        {
            "redis_url": redis_url,
            "cpu": {"capacity": 8 * slot_bytes},
            "s3": {
                "bucket": bucket,
                "endpoint_url": slow_s3.url,
                "region": "us-east-1",
                "max_attempts": 1,
                "pack_flush_seconds": 0.1,
            },
            "movers": {"load_deadline_seconds": 0.3},
        },
        environ={},
    )
    worker = TierCacheWorker(
        config, spec, uuid.uuid4().hex[:16], 10, tp_rank=0, writes_lower_tiers=True, disk_share=0
    )
    worker.register_kv_caches(kv, slot_bytes)
    assert worker.engine is not None
    try:
        hashed = uuid.uuid4().bytes * 2
        store = TierCacheMetadata(stores=[BlockOp(hashed, 3, 1, "cpu", "w")], stores_done=["w"])
        worker.start_load_kv(store)
        worker.wait_for_save(store)
        assert worker.engine.flush(30)
        worker.take_worker_meta()
        before = {name: t[:, 7].clone() for name, t in kv.items()}

        slow_s3.delay = 2.0
        load = TierCacheMetadata(loads=[LoadJob("r", [BlockOp(hashed, 7, 5, "s3")], is_async=True)])
        worker.start_load_kv(load)
        worker.wait_for_save(load)
        (staging,) = [future for pending in worker._loads._staging for _, _, future in pending.staged]
        deadline = time.monotonic() + 30
        while "r" not in worker.get_finished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not staging.done(), "reported only once the read ended"
        assert worker.take_failed_blocks() == {7}
        reports = [(kind, value) for _, kind, value in worker.take_worker_meta().reports]
        assert (FILL_FAILED, (hashed, 5)) in reports
        assert (RELEASED, 5) not in reports  # the late read still writes into it
        assert worker.take_stats().data.get("loads_timed_out") == 1

        slow_s3.stop()  # the read ends (failed) at once
        staging.exception(timeout=30)
        released = [value for _, kind, value in worker.take_worker_meta().reports if kind == RELEASED]
        assert released == [5]
        assert all(torch.equal(kv[name][:, 7], before[name]) for name in layers)
    finally:
        slow_s3.delay = 0.0
        worker.shutdown()

"""The Redis index and the leases, against a real redis-server: one round trip per
lookup, isolation, exactly one uploader of N, GC against read leases, and outages."""

from __future__ import annotations

import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import redis
from prometheus_client import REGISTRY

from tiercache.config import RedisConfig, build_config
from tiercache.engine import S3, ObjectShape, TierEngine
from tiercache.index.keys import KVSpec
from tiercache.index.leases import Claim, Leases, new_token, read_lease_key, write_lease_key
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import REGISTRY as REGISTRY_KEY
from tiercache.index.redis_index import Deployment, RedisIndex, RunRecord, blocks_key, index_keys, runs_key
from tiercache.tiers.cpu import CpuBuffer

from support.redis_config import PATIENT
from support.single_blocks import (
    acquire_read,
    add_block,
    claim_write,
    gc_unindex,
    publish,
    release_read,
    release_write,
)

BLOCK = 64 * 1024


def digest() -> str:
    return uuid.uuid4().hex[:16]


def hashes(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(32) for _ in range(n)]


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


class CommandLog:
    """Records the name of every command the client sends: each one is a round trip."""

    def __init__(self, client):
        self.names: list[str] = []
        original = client.execute_command

        def execute(*args, **kwargs):
            self.names.append(str(args[0]).upper())
            return original(*args, **kwargs)

        client.execute_command = execute

    def take(self) -> list[str]:
        names, self.names = self.names, []
        return names


@pytest.fixture
def guarded(redis_url):
    client = GuardedRedis(redis_url, PATIENT)
    yield client
    client.close()


def add_all(
    index: RedisIndex, model: str, rank: str, blocks: list[bytes], when: float | None = None
) -> bytes:
    """Index `blocks` as one run; its run id."""
    run_id = os.urandom(8)
    if blocks:
        index.add_run(model, rank, run_id, RunRecord(0, 0, 0, tuple(blocks)), when=when)
    return run_id


# -- lookups ------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("n", [32, 256, 2048])
def test_longest_prefix_is_one_round_trip(guarded, ranks, n):
    index = RedisIndex(guarded)
    model = digest()
    rank_digests = [digest() for _ in range(ranks)]
    blocks = hashes(n, seed=n)
    # Each rank holds a different prefix; the answer is the shortest. The last rank
    # also holds a block past a gap, which must not count.
    held = [n - 1 - 3 * r for r in range(ranks)]
    for rank, count in zip(rank_digests, held, strict=True):
        add_all(index, model, rank, blocks[:count])
    add_all(index, model, rank_digests[-1], blocks[held[-1] + 1 : held[-1] + 2])
    log = CommandLog(guarded.client)
    index.longest_prefix(model, rank_digests, blocks)  # loads the script if this server lacks it
    log.take()
    assert index.longest_prefix(model, rank_digests, blocks) == min(held)
    assert log.take() == ["EVALSHA"]
    # Full hits, total misses and a miss on the very first block are one call too.
    assert index.longest_prefix(model, rank_digests, blocks[: min(held)]) == min(held)
    assert index.longest_prefix(model, rank_digests, hashes(n, seed=n + 1)) == 0
    assert index.longest_prefix(model, rank_digests, [b"\0" * 32, *blocks]) == 0
    assert log.take() == ["EVALSHA"] * 3


def test_one_round_trip_seen_by_the_server(redis_server):
    guarded = GuardedRedis(redis_server.url, PATIENT)
    index = RedisIndex(guarded)
    model, ranks = digest(), [digest(), digest()]
    blocks = hashes(256)
    for rank in ranks:
        add_all(index, model, rank, blocks)
    index.longest_prefix(model, ranks, blocks)
    admin = redis.Redis(port=redis_server.port)
    admin.config_resetstat()
    assert index.longest_prefix(model, ranks, blocks) == 256
    stats = admin.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1
    assert "cmdstat_eval" not in stats and "cmdstat_script|load" not in stats
    # Server side, the script asked each rank's index once per chunk of members.
    assert stats["cmdstat_hmget"]["calls"] == 2
    guarded.close()


def test_lookup_survives_a_flushed_script_cache(guarded):
    index = RedisIndex(guarded)
    model, rank = digest(), digest()
    blocks = hashes(10)
    add_all(index, model, rank, blocks[:4])
    guarded.client.script_flush()
    assert index.longest_prefix(model, [rank], blocks) == 4


def test_lookup_across_chunk_boundaries(guarded):
    index = RedisIndex(guarded)
    model, rank = digest(), digest()
    blocks = hashes(2600, seed=7)
    add_all(index, model, rank, blocks)
    for present in (2600, 2001, 2000, 1999, 1001, 1000, 999, 1, 0):
        probe = blocks[:present] + [b"m" * 32] + blocks[present:]
        assert index.longest_prefix(model, [rank], probe) == present
    assert index.longest_prefix(model, [rank], []) == 0


def test_lookup_of_hashes_of_other_widths(guarded):
    index = RedisIndex(guarded)
    model, rank = digest(), digest()
    short = [bytes([i]) * 8 for i in range(1, 6)]  # e.g. a 64-bit hash function
    add_all(index, model, rank, short[:3])
    assert index.longest_prefix(model, [rank], short) == 3
    # A list that mixes widths (vLLM never sends one) is answered up to the first change.
    assert index.longest_prefix(model, [rank], short[:2] + [b"x" * 32] + short[2:]) == 2
    assert index.longest_prefix(model, [rank], [b"", *short]) == 0


def test_lookup_touches_only_what_it_found(guarded):
    index = RedisIndex(guarded)
    model, rank = digest(), digest()
    blocks = hashes(6)
    key = runs_key(model, rank)
    found = add_all(index, model, rank, blocks[:3], when=1.0)
    past_gap = add_all(index, model, rank, [blocks[4]], when=1.0)
    assert index.longest_prefix(model, [rank], blocks, touch=False) == 3
    assert guarded.client.zscore(key, found) == 1.0
    assert index.longest_prefix(model, [rank], blocks) == 3
    assert guarded.client.zscore(key, found) > 1e9  # now: a wall-clock time, per run
    assert guarded.client.zscore(key, past_gap) == 1.0  # past the gap: untouched
    assert guarded.client.zcard(key) == 2  # touch never adds a member
    assert [member for member, _ in index.oldest(model, rank, 1)] == [past_gap]


# -- isolation -------------------------------------------------------------------------------


def spec(**changes) -> KVSpec:
    base = KVSpec(
        model="meta-llama/Llama-3.1-8B",
        revision="main",
        dtype="bfloat16",
        kv_dtype="auto",
        block_size=32,
        layout="LBHNC",
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        tp_size=2,
        tp_rank=0,
        namespace="default",
        page_bytes=2 * 32 * 8 * 32 * 128 * 2,
    )
    return replace(base, **changes)


def test_namespace_digests():
    base = spec()
    assert spec().digest() == base.digest()  # two instances of one model agree
    rank1 = spec(tp_rank=1)
    assert rank1.model_digest() == base.model_digest() and rank1.digest() != base.digest()
    for change in (
        {"namespace": "prod"},
        {"model": "other"},
        {"revision": "v2"},
        {"dtype": "float16"},
        {"kv_dtype": "fp8"},
        {"block_size": 64},
        {"layout": "NLBHC"},
        {"tp_size": 4},
        {"head_size": 64},
    ):
        other = spec(**change)
        assert other.model_digest() != base.model_digest(), change
        assert other.digest() != base.digest(), change


def test_namespaces_and_deployments_are_isolated(guarded):
    index = RedisIndex(guarded)
    blocks = hashes(8)
    prod, dev = spec(namespace="prod"), spec(namespace="dev")
    add_all(index, prod.model_digest(), prod.digest(), blocks)
    assert index.longest_prefix(prod.model_digest(), [prod.digest()], blocks) == 8
    assert index.longest_prefix(dev.model_digest(), [dev.digest()], blocks) == 0
    # Same deployment, another rank: its own index.
    other_rank = spec(namespace="prod", tp_rank=1).digest()
    assert index.longest_prefix(prod.model_digest(), [other_rank], blocks) == 0
    assert index.longest_prefix(prod.model_digest(), [prod.digest(), other_rank], blocks) == 0
    # All keys of one deployment share a Redis Cluster hash slot.
    tags = {
        key.split("}")[0] for r in (prod.digest(), other_rank) for key in index_keys(prod.model_digest(), r)
    }
    assert len(tags) == 1


def test_registry_and_drop(guarded):
    index = RedisIndex(guarded)
    mine = Deployment(digest(), "prod", "m", 2, (digest(), digest()), 4096 + BLOCK)
    theirs = Deployment(digest(), "dev", "m", 1, (digest(),), 4096 + BLOCK)
    index.register(mine)
    index.register(theirs)
    found = {d.model_digest: d for d in index.deployments()}
    assert found[mine.model_digest] == mine and found[theirs.model_digest] == theirs
    blocks = hashes(5)
    for rank in mine.rank_digests:
        add_all(index, mine.model_digest, rank, blocks)
    add_all(index, theirs.model_digest, theirs.rank_digests[0], blocks)
    assert index.count(mine.model_digest, mine.rank_digests[1]) == 5
    assert sorted(index.members(mine.model_digest, mine.rank_digests[0])) == sorted(blocks)
    assert index.drop_deployment(mine) == 10
    assert index.count(mine.model_digest, mine.rank_digests[0]) == 0
    assert mine.model_digest not in {d.model_digest for d in index.deployments()}
    assert index.longest_prefix(theirs.model_digest, theirs.rank_digests, blocks) == 5
    index.unregister(theirs.model_digest)
    assert not guarded.client.hexists(REGISTRY_KEY, theirs.model_digest)


def test_index_add_remove_and_memory(guarded):
    index = RedisIndex(guarded)
    model, rank = digest(), digest()
    block = hashes(1)[0]
    add_block(index, model, rank, block)
    assert index.longest_prefix(model, [rank], [block]) == 1
    assert index.memory_usage(model, rank) > 0
    index.remove(model, rank, block)
    assert index.longest_prefix(model, [rank], [block]) == 0


# -- write leases -------------------------------------------------------------------------


def test_write_lease_tokens(guarded):
    leases = Leases(guarded)
    model, rank, block = digest(), digest(), hashes(1)[0]
    first, second = new_token(), new_token()
    conflicts = metric("tiercache_lease_conflicts_total")
    assert claim_write(leases, model, rank, block, first) is Claim.ACQUIRED
    assert claim_write(leases, model, rank, block, second) is Claim.HELD
    assert metric("tiercache_lease_conflicts_total") == conflicts + 1
    # Only the holder releases.
    assert not release_write(leases, model, rank, block, second)
    lease = write_lease_key(model, rank, block.hex())
    assert release_write(leases, model, rank, block, first)
    assert not release_write(leases, model, rank, block, first)
    # The next writer gets it, uploads and publishes: index entry in, lease out.
    assert claim_write(leases, model, rank, block, second) is Claim.ACQUIRED
    publish(leases, model, rank, block, second)
    assert not guarded.client.exists(lease)
    assert guarded.client.hexists(blocks_key(model, rank), block)
    assert claim_write(leases, model, rank, block, new_token()) is Claim.PRESENT


def test_publish_by_a_late_writer_keeps_the_holders_lease(guarded):
    leases = Leases(guarded)
    model, rank, block = digest(), digest(), hashes(1)[0]
    holder, late = new_token(), new_token()
    assert claim_write(leases, model, rank, block, holder) is Claim.ACQUIRED
    publish(leases, model, rank, block, late)
    assert guarded.client.get(write_lease_key(model, rank, block.hex())) == holder.encode()


def test_write_lease_expires(guarded):
    leases = Leases(guarded, write_ttl=0.1)
    model, rank, block = digest(), digest(), hashes(1)[0]
    assert claim_write(leases, model, rank, block, new_token()) is Claim.ACQUIRED  # then the holder dies
    deadline = time.monotonic() + 10
    while claim_write(leases, model, rank, block, "next") is Claim.HELD and time.monotonic() < deadline:
        time.sleep(0.05)
    assert guarded.client.get(write_lease_key(model, rank, block.hex())) == b"next"


# -- read leases and GC ----------------------------------------------------------------------


def test_gc_never_unindexes_under_a_read_lease(guarded):
    leases, index = Leases(guarded), RedisIndex(guarded)
    model, rank, block = digest(), digest(), hashes(1)[0]
    add_block(index, model, rank, block)
    one, two = new_token(), new_token()
    assert acquire_read(leases, model, rank, block, one)
    assert acquire_read(leases, model, rank, block, two)
    assert gc_unindex(leases, model, rank, block) == 0
    release_read(leases, model, rank, block, one)
    assert gc_unindex(leases, model, rank, block) == 0  # the second reader still reads
    assert index.longest_prefix(model, [rank], [block]) == 1
    release_read(leases, model, rank, block, two)
    assert gc_unindex(leases, model, rank, block) == 1
    assert index.longest_prefix(model, [rank], [block]) == 0
    # Once unindexed, no read lease is granted: a reader gets a miss, not a vanishing object.
    assert not acquire_read(leases, model, rank, block, new_token())
    assert gc_unindex(leases, model, rank, block) == -1
    assert not guarded.client.exists(read_lease_key(model, rank, block.hex()))


def test_read_lease_of_a_dead_reader_expires(guarded):
    leases, index = Leases(guarded, read_ttl=0.1), RedisIndex(guarded)
    model, rank, block = digest(), digest(), hashes(1)[0]
    add_block(index, model, rank, block)
    assert acquire_read(leases, model, rank, block, new_token())  # never released
    assert gc_unindex(leases, model, rank, block) == 0
    deadline = time.monotonic() + 10
    result = 0
    while result == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        result = gc_unindex(leases, model, rank, block)
    assert result == 1


# -- many writers of one key -------------------------------------------------------------


def _engines(n: int, redis_url: str, s3_endpoint: str, bucket: str, shape: ObjectShape, **redis_settings):
    config = build_config(
        {
            "redis_url": redis_url,
            "cpu": {"capacity": BLOCK},
            "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1"},
            "redis": redis_settings,
            "movers": {"workers": 2},
        },
        environ={},
    )
    return [TierEngine(config, shape, CpuBuffer(1, BLOCK, pin_memory=False)) for _ in range(n)]


def _count_puts(engines, delay: float = 0.0) -> list[int]:
    sent: list[int] = []

    def on_send(**_):
        sent.append(1)
        time.sleep(delay)  # a slow upload, so that every writer races the first one

    for engine in engines:
        engine.s3.client.meta.events.register("before-send.s3.PutObject", on_send)
    return sent


def test_eight_concurrent_writers_make_one_put(redis_url, s3_endpoint, bucket):
    shape = ObjectShape(digest(), digest(), BLOCK)
    engines = _engines(8, redis_url, s3_endpoint, bucket, shape)
    try:
        puts = _count_puts(engines, delay=0.3)
        block = hashes(1, seed=99)[0]
        data = np.random.default_rng(1).bytes(BLOCK)
        results: list = []
        barrier = threading.Barrier(8)

        def write(engine: TierEngine) -> bool:
            barrier.wait()
            return engine.write_down(block, None, results.append, data=data, tiers=(S3,))

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(write, engines))
        assert all(engine.flush(60) for engine in engines)
        assert len(puts) == 1
        assert len(results) == 8 and all(result.stored == {S3: True} for result in results)
        s3 = engines[0].s3
        runs = [run for _, run, _, _ in s3.list_runs(shape.rank_digest)]
        assert len(runs) == 1 and s3.read_run_header(shape.rank_digest, runs[0]).block_hashes == (block,)
        assert RedisIndex(engines[0].redis).count(shape.model_digest, shape.rank_digest) == 1
        out = bytearray(BLOCK)
        assert engines[3].read_into(block, memoryview(out), S3) and bytes(out) == data
        # A writer that comes later finds it present and uploads nothing.
        late: list = []
        engines[5].write_down(block, None, late.append, data=data, tiers=(S3,))
        engines[5].flush(30)
        assert late[0].stored == {S3: True} and len(puts) == 1
    finally:
        for engine in engines:
            engine.close()


def test_a_waiting_writer_takes_over_from_a_dead_one(redis_url, s3_endpoint, bucket):
    shape = ObjectShape(digest(), digest(), BLOCK)
    (engine,) = _engines(1, redis_url, s3_endpoint, bucket, shape, write_lease_ttl=30)
    try:
        puts = _count_puts([engine])
        block = hashes(1, seed=5)[0]
        # Another process claimed the key, then died before its PUT.
        dead = Leases(engine.redis, write_ttl=0.3)
        assert claim_write(dead, shape.model_digest, shape.rank_digest, block, new_token()) is Claim.ACQUIRED
        results: list = []
        engine.write_down(block, None, results.append, data=b"\x07" * BLOCK, tiers=(S3,))
        assert engine.flush(30)
        assert results[0].stored == {S3: True} and len(puts) == 1
        assert engine.index.locate(shape.model_digest, shape.rank_digest, block) is not None
        assert len(list(engine.s3.list_runs(shape.rank_digest))) == 1
    finally:
        engine.close()


# -- Redis going away and coming back --------------------------------------------------------


def test_redis_down_is_a_fast_miss_then_recovers(redis_server):
    settings = RedisConfig(retry_backoff=0.2, max_backoff=0.4)
    guarded = GuardedRedis(redis_server.url, settings)
    index, leases = RedisIndex(guarded), Leases(guarded)
    model, rank = digest(), digest()
    blocks = hashes(4)
    add_all(index, model, rank, blocks)
    assert index.longest_prefix(model, [rank], blocks) == 4
    assert guarded.available and guarded.ping()

    redis_server.stop()
    errors = metric("tiercache_index_errors_total", {"op": "lookup"})
    with pytest.raises(RedisUnavailable):
        index.longest_prefix(model, [rank], blocks)
    assert metric("tiercache_index_errors_total", {"op": "lookup"}) == errors + 1
    # The breaker is open: calls are refused without touching the network.
    assert not guarded.available
    with pytest.raises(RedisUnavailable, match="backoff"):
        index.longest_prefix(model, [rank], blocks)
    with pytest.raises(RedisUnavailable, match="backoff"):
        acquire_read(leases, model, rank, blocks[0], new_token())
    assert metric("tiercache_index_errors_total", {"op": "lookup"}) == errors + 1
    assert not guarded.ping()

    redis_server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 20
    found = None
    while found is None and time.monotonic() < deadline:
        try:
            add_block(index, model, rank, blocks[0])
            found = index.longest_prefix(model, [rank], blocks)
        except RedisUnavailable:
            time.sleep(0.05)
    assert found == 1
    assert guarded.available
    assert index.longest_prefix(model, [rank], blocks) == 1
    guarded.close()


def test_password_and_acl_user(redis_server):
    admin = redis.Redis(port=redis_server.port)
    admin.acl_setuser("tiercache", enabled=True, passwords=["+user-pw"], keys=["tc:*"], categories=["+@all"])
    admin.config_set("requirepass", "default-pw")
    base = f"127.0.0.1:{redis_server.port}/0"
    model, rank = digest(), digest()
    block = hashes(1)[0]
    for url in (f"redis://:default-pw@{base}", f"redis://tiercache:user-pw@{base}"):
        guarded = GuardedRedis(url, RedisConfig())
        index = RedisIndex(guarded)
        add_block(index, model, rank, block)
        assert index.longest_prefix(model, [rank], [block]) == 1
        guarded.close()
    wrong = GuardedRedis(f"redis://tiercache:wrong@{base}", RedisConfig())
    with pytest.raises(RedisUnavailable) as info:
        RedisIndex(wrong).longest_prefix(model, [rank], [block])
    assert "wrong" not in str(info.value)
    wrong.close()

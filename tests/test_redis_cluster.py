"""The index and leases through a real Redis Cluster: three masters on loopback ports
joined with `redis-cli --cluster create`, reached with a redis+cluster:// URL. One
deployment's keys share a hash tag, so a lookup over every rank is one script call
in one slot. A master killed means misses (RedisUnavailable), never an error."""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest
from redis.cluster import key_slot

from tiercache.config import RedisConfig, build_config
from tiercache.engine import S3, ObjectShape, TierEngine
from tiercache.index.leases import Claim, Leases, new_token
from tiercache.index.presence import (
    PresencePublisher,
    instance_prefixes,
    instance_prefixes_and_ttls,
    instances_key,
    live_instances,
    presence_key,
)
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import Deployment, RedisIndex, index_keys
from tiercache.tiers.cpu import CpuBuffer

from support.faults import RedisClusterServers, block_payload
from support.single_blocks import acquire_read, add_block, claim_write, gc_unindex, publish, release_read

pytestmark = pytest.mark.slow
SETTINGS = RedisConfig(retry_backoff=0.1, max_backoff=0.2, socket_timeout=1, connect_timeout=1)


@pytest.fixture
def cluster():
    servers = RedisClusterServers().start()
    yield servers
    servers.close()


def digest() -> str:
    return uuid.uuid4().hex[:16]


def hashes(n: int) -> list[bytes]:
    return [uuid.uuid4().bytes * 2 for _ in range(n)]


def test_index_and_leases_through_a_cluster(cluster):
    guarded = GuardedRedis(cluster.url, SETTINGS)
    assert guarded.cluster
    index, leases = RedisIndex(guarded), Leases(guarded, write_ttl=5, read_ttl=5)
    model, ranks = digest(), [digest(), digest()]
    index.register(Deployment(model, "ns", "m", 2, tuple(ranks), 4096))
    assert [d.model_digest for d in index.deployments()] == [model]
    blocks = hashes(40)
    for rank in ranks:
        for block in blocks[:30]:
            add_block(index, model, rank, block)
    index.remove(model, ranks[1], blocks[29])
    # One script over both ranks' keys (one slot thanks to the hash tag).
    assert len({key_slot(key.encode()) for r in ranks for key in index_keys(model, r)}) == 1
    assert index.longest_prefix(model, ranks, blocks) == 29
    # Leases: one writer claims, the object is published, a reader leases it, GC waits.
    block = hashes(1)[0]
    token = new_token()
    assert claim_write(leases, model, ranks[0], block, token) is Claim.ACQUIRED
    assert claim_write(leases, model, ranks[0], block, new_token()) is Claim.HELD
    publish(leases, model, ranks[0], block, token)
    assert claim_write(leases, model, ranks[0], block, new_token()) is Claim.PRESENT
    reader = new_token()
    assert acquire_read(leases, model, ranks[0], block, reader)
    assert gc_unindex(leases, model, ranks[0], block) == 0
    release_read(leases, model, ranks[0], block, reader)
    assert gc_unindex(leases, model, ranks[0], block) == 1
    assert not acquire_read(leases, model, ranks[0], block, new_token())
    guarded.close()


def test_tier_engine_stores_and_reads_through_a_cluster(cluster, s3_endpoint, bucket):
    config = build_config(
        {
            "namespace": "cluster",
            "redis_url": cluster.url,
            "redis": {"socket_timeout": 1, "connect_timeout": 1},
            "cpu": {"capacity": 64 * 4096},
            "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1"},
        },
        environ={},
    )
    shape = ObjectShape(digest(), digest(), 4096)
    engine = TierEngine(config, shape, CpuBuffer(1, 4096, pin_memory=False))
    try:
        blocks = hashes(8)
        done: list = []
        for block in blocks:
            engine.write_down(block, None, done.append, data=block_payload(block, 4096), tiers=(S3,))
        assert engine.flush(60)
        assert all(result.stored == {S3: True} for result in done)
        assert engine.index.longest_prefix(shape.model_digest, [shape.rank_digest], blocks) == 8
        out = memoryview(bytearray(4096))
        assert engine.read_into(blocks[3], out, S3) and bytes(out) == block_payload(blocks[3], 4096)
    finally:
        engine.close()


def test_one_master_killed_means_misses_not_errors(cluster):
    guarded = GuardedRedis(cluster.url, SETTINGS)
    index, leases = RedisIndex(guarded), Leases(guarded)
    models = [digest() for _ in range(12)]  # spread over the three masters' slots
    rank = digest()
    blocks = hashes(4)
    for model in models:
        for block in blocks:
            add_block(index, model, rank, block)
        assert index.longest_prefix(model, [rank], blocks) == 4
    victim = cluster.port_of_slot(key_slot(index_keys(models[0], rank)[0].encode()))
    cluster.kill(victim)
    outcomes = {"hit": 0, "miss": 0}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and outcomes["miss"] < 5:
        for model in models:
            try:
                found = index.longest_prefix(model, [rank], blocks)
                outcomes["hit" if found == 4 else "miss"] += 1
            except RedisUnavailable:
                outcomes["miss"] += 1  # what the scheduler counts as a miss
            with contextlib.suppress(RedisUnavailable):
                acquire_read(leases, model, rank, blocks[0], new_token())
        time.sleep(0.05)
    assert outcomes["miss"] > 0
    guarded.close()


def test_cluster_unreachable_at_startup_is_a_miss_not_a_crash():
    # Nothing listens: the client must still be built, and every call is a miss.
    guarded = GuardedRedis("redis+cluster://127.0.0.1:1", SETTINGS)
    with pytest.raises(RedisUnavailable):
        RedisIndex(guarded).longest_prefix(digest(), [digest()], hashes(2))
    guarded.close()


def test_presence_and_peer_record_ttls_in_one_script_through_a_cluster(cluster):
    """The service's lookup reads each instance's presence and its peer records' TTLs
    in one script call: through a cluster too, the keys sharing the deployment's slot."""
    guarded = GuardedRedis(cluster.url, SETTINGS)
    model, rank = digest(), digest()
    blocks = hashes(3)
    # Written as PresencePublisher lays it out (whose full rewrite renames in a
    # pipeline, a command redis-py refuses in a cluster pipeline).
    guarded.client.hset(presence_key(model, "node-a"), mapping={block: 1 for block in blocks[:2]})
    guarded.client.zadd(instances_key(model), {"node-a": time.time() + 30})
    record = f"tc:{{{model}}}:peer:{rank}:node-a"
    guarded.client.set(record, b"x", px=30_000)

    def keys_of(name):
        return [record, f"tc:{{{model}}}:peer:{rank}:{name}-gone"]

    prefixes, ttls = instance_prefixes_and_ttls(guarded, model, blocks, keys_of)

    assert [(p.instance, p.cpu, p.disk, p.local) for p in prefixes] == [("node-a", 2, 0, 2)]
    live, gone = ttls["node-a"]
    assert 0 < live <= 30_000 and gone == -2
    guarded.close()


def test_presence_is_published_through_a_cluster(cluster):
    """An instance's presence, written whole (its first batch, or after Redis lost it)
    and then batch by batch, reaches a Redis Cluster: the whole rewrite renamed its
    staging copy inside a pipeline, which redis-py's cluster pipeline refuses, so no
    instance was ever seen through a cluster."""
    guarded = GuardedRedis(cluster.url, SETTINGS)
    model = digest()
    blocks = hashes(3)
    publisher = PresencePublisher(guarded, model, "node-a", ttl=30, interval=5)
    try:
        publisher.update(blocks[0], "cpu", True)
        publisher.update(blocks[1], "cpu", True)
        assert publisher.flush()  # the whole copy
        assert live_instances(guarded, model) == ["node-a"]
        assert [p.cpu for p in instance_prefixes(guarded, model, blocks)] == [2]
        publisher.update(blocks[2], "cpu", True)
        assert publisher.flush()  # a batch of changes
        assert [p.cpu for p in instance_prefixes(guarded, model, blocks)] == [3]
    finally:
        publisher.close()
        guarded.close()

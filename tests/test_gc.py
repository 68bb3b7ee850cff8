"""The S3 garbage collector and the namespace flush, against a real redis-server and
a real S3 server (SeaweedFS), with objects written by the tier engine."""

from __future__ import annotations

import functools
import os
import time
import uuid

from tiercache.config import build_config
from tiercache.engine import ObjectShape, TierEngine
from tiercache.index.leases import Leases, new_token
from tiercache.index.redis_index import (
    Deployment,
    RedisIndex,
    RunRecord,
    blocks_key,
    parse_location,
    run_hits_key,
    runs_key,
)
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.format import CorruptObject
from tiercache.tiers.s3.gc import flush_namespace, run_gc
from tiercache.tiers.s3.runs import RunGeometry, RunHeader, frame_header_bytes, run_parts
from tiercache.tiers.s3.tier import S3Tier, make_client

from support.single_blocks import acquire_read, release_read

SLOT = 4096
OBJECT = ObjectShape("0" * 16, "1" * 16, SLOT).object_bytes


def make_config(redis_url, s3_endpoint, bucket, *, namespace="ns1", capacity=None, disk=None, prefix=""):
    data = {
        "namespace": namespace,
        "redis_url": redis_url,
        "cpu": {"capacity": 64 * SLOT},
        # Runs of one block: these tests are about objects, one per block here
        # (tests/test_runs.py has GC over runs of many).
        "s3": {
            "bucket": bucket,
            "endpoint_url": s3_endpoint,
            "region": "us-east-1",
            "prefix": prefix,
            "pack_blocks": 1,
        },
    }
    if capacity is not None:
        data["s3"]["capacity"] = capacity
    if disk is not None:
        data["disk"] = {"path": str(disk)}
    return build_config(data, environ={})


@functools.lru_cache
def _client(s3_config):
    return make_client(s3_config)  # boto3 clients are slow to make: one per endpoint


def s3_tier(config) -> S3Tier:
    return S3Tier(config.s3, client=_client(config.s3))


def digest() -> str:
    return uuid.uuid4().hex[:16]


def blocks(n: int) -> list[bytes]:
    return [uuid.uuid4().bytes + uuid.uuid4().bytes for _ in range(n)]


def store(config, hashes, *, namespace=None, tp=1, model="tiny-llama") -> Deployment:
    """Write `hashes` through the engine for every TP rank of a fresh deployment."""
    model_digest = digest()
    ranks = tuple(digest() for _ in range(tp))
    deployment = Deployment(
        model_digest,
        namespace or config.namespace,
        model,
        tp,
        ranks,
        ObjectShape(model_digest, ranks[0], SLOT).object_bytes,
    )
    for rank in ranks:
        shape = ObjectShape(model_digest, rank, SLOT)
        engine = TierEngine(config, shape, CpuBuffer(1, SLOT), s3=s3_tier(config))
        engine.register(deployment)
        for h in hashes:
            engine.write_down(h, None, lambda result: None, data=h * (SLOT // len(h)))
        assert engine.flush(30)
        engine.close()
    return deployment


def set_ages(redis, deployment, hashes, start=1000.0):
    """Give the runs holding `hashes` last-access scores in order, oldest first, on every rank."""
    for rank in deployment.rank_digests:
        locs = redis.client.hmget(blocks_key(deployment.model_digest, rank), hashes)
        runs = {parse_location(loc)[0]: start + i for i, loc in enumerate(locs)}
        redis.client.zadd(runs_key(deployment.model_digest, rank), runs, xx=True)


def s3_keys(config) -> set[str]:
    """The blocks the bucket's run objects hold, as "<rank>/<block hex>" (a run whose
    header cannot be read: "<rank>/corrupt-<run>")."""
    s3 = s3_tier(config)
    try:
        keys = set()
        for rank, run, _, _ in s3.list_runs():
            try:
                keys |= {f"{rank}/{h.hex()}" for h in s3.read_run_header(rank, run).block_hashes}
            except CorruptObject:
                keys.add(f"{rank}/corrupt-{run}")
        return keys
    finally:
        s3.close()


def put_run_object(config, shape, hashes) -> str:
    """Write a run object of these blocks without indexing it (an orphan); its run hex."""
    s3 = s3_tier(config)
    try:
        run = os.urandom(8).hex()
        frames = []
        for h in hashes:
            data = memoryview(h * (SLOT // len(h)))
            frames.append((shape.header(h, data), data))
        geometry = RunGeometry(0, frame_header_bytes([f[0] for f in frames]), SLOT)
        toc = RunHeader(run, shape.rank_digest, tuple(hashes), geometry)
        assert s3.put_run(shape.rank_digest, run, run_parts(toc, frames))
        return run
    finally:
        s3.close()


def indexed(redis, deployment, rank=None) -> set[bytes]:
    rank = rank or deployment.rank_digests[0]
    return set(redis.client.hkeys(blocks_key(deployment.model_digest, rank)))


def key_of(deployment, h, rank=None):
    return f"{rank or deployment.rank_digests[0]}/{h.hex()}"


def test_gc_keeps_namespace_under_capacity_oldest_first(redis, redis_url, real_s3_endpoint, real_bucket):
    config = make_config(redis_url, real_s3_endpoint, real_bucket, capacity=4 * OBJECT)
    hashes = blocks(10)
    dep = store(config, hashes)
    other = store(config, blocks(3), namespace="ns2")  # another namespace: not this budget
    set_ages(redis, dep, hashes)
    assert len(s3_keys(config)) == 13

    report = run_gc(config)

    assert report["errors"] == []
    assert report["used_bytes_before"] == 10 * OBJECT
    assert report["used_bytes_after"] <= 4 * OBJECT
    assert report["evicted_objects"] == 6
    assert report["evicted_bytes"] == 6 * OBJECT
    assert indexed(redis, dep) == set(hashes[6:])  # the newest four stay
    left = s3_keys(config)
    assert {key_of(dep, h) for h in hashes[6:]} <= left
    assert not {key_of(dep, h) for h in hashes[:6]} & left
    assert len(indexed(redis, other)) == 3
    # A second pass has nothing to do.
    again = run_gc(config)
    assert again["evicted_objects"] == 0 and again["orphans"]["deleted"] == 0


def test_gc_spares_runs_hit_lately_once(redis, redis_url, real_s3_endpoint, real_bucket):
    """GC by last access and hits: the oldest run, hit by a lookup since, outlasts a
    newer run never read, once per hit (halved)."""
    config = make_config(redis_url, real_s3_endpoint, real_bucket, capacity=2 * OBJECT)
    hashes = blocks(3)
    dep = store(config, hashes)
    set_ages(redis, dep, hashes)
    index, rank = RedisIndex(redis), dep.rank_digests[0]
    # A lookup that finds the oldest block counts a hit on its run (and touches it)...
    assert index.longest_prefix(dep.model_digest, dep.rank_digests, [hashes[0]]) == 1
    set_ages(redis, dep, hashes)  # ...which stays the oldest by last access here

    report = run_gc(config)

    assert report["spared_hit"] == 1
    assert indexed(redis, dep) == {hashes[0], hashes[2]}  # the newer, unread hashes[1] went
    hits_key = run_hits_key(dep.model_digest, rank)
    assert redis.client.hlen(hits_key) == 0  # one hit, halved: none left to spare it again

    # Spared, it went to the recent end: the next pass takes hashes[2] (older by last
    # access, and never read) before it.
    config = make_config(redis_url, real_s3_endpoint, real_bucket, capacity=1 * OBJECT)
    assert run_gc(config)["spared_hit"] == 0
    assert indexed(redis, dep) == {hashes[0]}

    # An unindexed run takes its count with it.
    assert index.longest_prefix(dep.model_digest, dep.rank_digests, [hashes[0]]) == 1
    assert redis.client.hlen(hits_key) == 1
    flush_namespace(config, config.namespace)
    assert redis.client.exists(hits_key) == 0


def test_gc_evicts_across_tp_ranks_and_deployments(redis, redis_url, real_s3_endpoint, real_bucket):
    config = make_config(redis_url, real_s3_endpoint, real_bucket, capacity=6 * OBJECT)
    old, new = blocks(3), blocks(3)
    dep_a = store(config, old, tp=2)
    dep_b = store(config, new, tp=2)
    set_ages(redis, dep_a, old, start=1000.0)
    set_ages(redis, dep_b, new, start=2000.0)

    report = run_gc(config)

    assert report["used_bytes_after"] == 6 * OBJECT
    # dep_a's blocks are older on both ranks, so they all go first.
    for rank in dep_a.rank_digests:
        assert indexed(redis, dep_a, rank) == set()
    for rank in dep_b.rank_digests:
        assert indexed(redis, dep_b, rank) == set(new)


def test_gc_never_deletes_under_a_live_read_lease(redis, redis_url, real_s3_endpoint, real_bucket):
    config = make_config(redis_url, real_s3_endpoint, real_bucket, capacity=2 * OBJECT)
    hashes = blocks(5)
    dep = store(config, hashes)
    set_ages(redis, dep, hashes)
    leases = Leases(redis, read_ttl=60)
    rank = dep.rank_digests[0]
    token = new_token()
    assert acquire_read(leases, dep.model_digest, rank, hashes[0], token)  # the oldest

    report = run_gc(config)

    assert report["skipped_leased"] == 1
    assert report["used_bytes_after"] <= 2 * OBJECT
    assert hashes[0] in indexed(redis, dep)
    assert key_of(dep, hashes[0]) in s3_keys(config)
    assert indexed(redis, dep) == {hashes[0], hashes[4]}

    # Once the lease is released it is the oldest, and goes on the next pass.
    release_read(leases, dep.model_digest, rank, hashes[0], token)
    config = make_config(redis_url, real_s3_endpoint, real_bucket, capacity=1 * OBJECT)
    run_gc(config)
    assert indexed(redis, dep) == {hashes[4]}
    assert key_of(dep, hashes[0]) not in s3_keys(config)


def test_gc_with_every_victim_leased_stops(redis, redis_url, real_s3_endpoint, real_bucket):
    config = make_config(redis_url, real_s3_endpoint, real_bucket, capacity=1 * OBJECT)
    hashes = blocks(3)
    dep = store(config, hashes)
    leases = Leases(redis, read_ttl=60)
    for h in hashes:
        assert acquire_read(leases, dep.model_digest, dep.rank_digests[0], h, new_token())

    report = run_gc(config)

    assert report["evicted_objects"] == 0
    assert report["skipped_leased"] == 3
    assert len(s3_keys(config)) == 3


class OrderCheckingS3(S3Tier):
    """Records, for each object deleted, whether its index entry was still there."""

    def __init__(self, config, redis, deployment):
        super().__init__(config)
        self.redis = redis
        self.deployment = deployment
        self.deleted: list[tuple[str, bool]] = []

    def delete_run(self, rank_digest: str, run_hex: str) -> bool:
        key = blocks_key(self.deployment.model_digest, rank_digest)
        locs = self.redis.client.hvals(key)
        still = any(parse_location(loc)[0].hex() == run_hex for loc in locs)
        self.deleted.append((run_hex, still))
        return super().delete_run(rank_digest, run_hex)


def test_gc_removes_the_index_entry_before_the_object(redis, redis_url, real_s3_endpoint, real_bucket):
    config = make_config(redis_url, real_s3_endpoint, real_bucket, capacity=1 * OBJECT)
    hashes = blocks(4)
    dep = store(config, hashes)
    spy = OrderCheckingS3(config.s3, redis, dep)
    try:
        report = run_gc(config, sweep_orphans=False, s3=spy)
    finally:
        spy.close()
    assert report["evicted_objects"] == 3
    assert len(spy.deleted) == 3
    assert not any(still_indexed for _, still_indexed in spy.deleted)


def test_orphan_sweep_keeps_young_and_indexed_objects(redis, redis_url, real_s3_endpoint, real_bucket):
    config = make_config(redis_url, real_s3_endpoint, real_bucket)  # no capacity: sweep only
    hashes = blocks(3)
    dep = store(config, hashes)
    # Orphans: an upload whose index write never happened, and one of an unknown deployment.
    orphan_blocks = blocks(2)
    shape = ObjectShape(dep.model_digest, dep.rank_digests[0], SLOT)
    stranger = ObjectShape(digest(), digest(), SLOT)
    for h in orphan_blocks:
        put_run_object(config, shape, [h])
    put_run_object(config, stranger, [hashes[0]])
    # An index of an unregistered deployment still protects its objects.
    unregistered = ObjectShape(digest(), digest(), SLOT)
    run = put_run_object(config, unregistered, [hashes[1]])
    record = RunRecord(0, 0, 0, (hashes[1],))
    RedisIndex(redis).add_run(unregistered.model_digest, unregistered.rank_digest, bytes.fromhex(run), record)
    assert len(s3_keys(config)) == 7

    fresh = run_gc(config)  # everything was written just now: inside the grace period
    assert fresh["orphans"]["deleted"] == 0
    assert fresh["orphans"]["too_young"] == 7
    assert len(s3_keys(config)) == 7

    later = run_gc(config, now=time.time() + 3600)
    assert later["errors"] == []
    assert later["orphans"]["scanned"] == 7
    assert later["orphans"]["deleted"] == 3
    left = s3_keys(config)
    assert left == {key_of(dep, h) for h in hashes} | {unregistered.key(hashes[1])}

    # --no-sweep leaves orphans alone.
    put_run_object(config, stranger, [hashes[2]])
    skipped = run_gc(config, sweep_orphans=False, now=time.time() + 3600)
    assert skipped["orphans"]["scanned"] == 0
    assert stranger.key(hashes[2]) in s3_keys(config)


def test_orphan_sweep_respects_the_prefix(redis, redis_url, real_s3_endpoint, real_bucket):
    config = make_config(redis_url, real_s3_endpoint, real_bucket, prefix="tenant-a/")
    outsider = make_config(redis_url, real_s3_endpoint, real_bucket, prefix="tenant-b/")
    shape = ObjectShape(digest(), digest(), SLOT)
    h = blocks(1)[0]
    put_run_object(outsider, shape, [h])
    report = run_gc(config, now=time.time() + 3600)
    assert report["orphans"]["scanned"] == 0
    assert s3_keys(outsider) == {shape.key(h)}


def test_gc_reports_redis_down_without_raising(redis_server, s3_endpoint, bucket):
    config = make_config(redis_server.url, s3_endpoint, bucket, capacity=OBJECT)
    redis_server.stop()
    report = run_gc(config)
    assert report["errors"] and "redis" in report["errors"][0]
    assert report["evicted_objects"] == 0


def test_gc_without_s3_does_nothing(redis_url):
    config = build_config({"redis_url": redis_url}, environ={})
    report = run_gc(config)
    assert report["errors"] == ["s3 is not configured: there is nothing to collect"]


def test_flush_namespace_drops_index_then_objects(redis, redis_url, real_s3_endpoint, real_bucket, tmp_path):
    config = make_config(redis_url, real_s3_endpoint, real_bucket, disk=tmp_path / "disk")
    mine, theirs = blocks(4), blocks(2)
    dep = store(config, mine, tp=2)
    other = store(config, theirs, namespace="ns2")
    leases = Leases(redis, read_ttl=60)
    token = new_token()
    rank0 = dep.rank_digests[0]
    assert acquire_read(leases, dep.model_digest, rank0, mine[0], token)
    assert len(s3_keys(config)) == 10
    disk_root = tmp_path / "disk"
    assert len(list(disk_root.glob("*/*/*.safetensors"))) == 10

    report = flush_namespace(config, "ns1")

    assert report["deployments"] == [{"model_digest": dep.model_digest, "model": "tiny-llama"}]
    assert report["index_entries_removed"] == 8
    assert report["s3_objects_deleted"] == 7
    assert report["s3_skipped_leased"] == 1  # left for the orphan sweep
    assert report["disk_objects_deleted"] == 8
    index = RedisIndex(redis)
    assert [d.model_digest for d in index.deployments()] == [other.model_digest]
    for rank in dep.rank_digests:
        assert indexed(redis, dep, rank) == set()
    assert s3_keys(config) == {key_of(other, h) for h in theirs} | {key_of(dep, mine[0])}
    assert len(list(disk_root.glob("*/*/*.safetensors"))) == 2

    # The leased object goes with the sweep once it is old enough.
    release_read(leases, dep.model_digest, rank0, mine[0], token)
    run_gc(config, now=time.time() + 3600)
    assert s3_keys(config) == {key_of(other, h) for h in theirs}


def test_flush_of_an_unknown_namespace_is_empty(redis, redis_url, real_s3_endpoint, real_bucket):
    config = make_config(redis_url, real_s3_endpoint, real_bucket)
    store(config, blocks(1))
    report = flush_namespace(config, "nobody")
    assert report["deployments"] == [] and report["s3_objects_deleted"] == 0
    assert len(s3_keys(config)) == 1


def refusals() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("tiercache_gc_sweeps_refused_total") or 0.0


def put_orphan(config, shape, h) -> None:
    put_run_object(config, shape, [h])


def test_sweep_refuses_when_redis_lost_its_data_and_reindex_brings_it_back(
    redis, redis_url, real_s3_endpoint, real_bucket, caplog
):
    """Review fix: after a FLUSHALL every object looked orphaned and the sweep emptied
    the bucket. It now refuses, and `reindex` rebuilds the index from the objects."""
    config = make_config(redis_url, real_s3_endpoint, real_bucket)
    hashes = blocks(30)
    dep = store(config, hashes, tp=2)
    assert run_gc(config)["errors"] == []  # a routine pass: it keeps a copy of the registry
    # A corrupt object of the deployment and one of a deployment nobody registered.
    s3 = s3_tier(config)
    try:
        name = s3.run_name(dep.rank_digests[0], os.urandom(8).hex())
        s3.client.put_object(Bucket=s3.bucket, Key=name, Body=b"\x00" * OBJECT)
    finally:
        s3.close()
    stranger = ObjectShape(digest(), digest(), SLOT)
    put_orphan(config, stranger, hashes[0])
    objects = s3_keys(config)
    assert len(objects) == 62

    redis.client.flushall()  # no persistence, a failover to an empty replica...
    before = refusals()
    with caplog.at_level("WARNING", logger="tiercache.tiers.s3.gc"):
        report = run_gc(config, now=time.time() + 3600)
    assert report["orphans"]["deleted"] == 0
    assert report["orphans"]["refused"]
    assert s3_keys(config) == objects
    assert refusals() == before + 1
    assert any("62" in r.getMessage() and "refus" in r.getMessage() for r in caplog.records)

    from tiercache.tiers.s3.reindex import reindex

    rebuilt = reindex(config)
    assert rebuilt["errors"] == []
    assert rebuilt["registry_restored"] == 1
    assert rebuilt["indexed"] == 60
    assert rebuilt["corrupt"] == 1
    assert rebuilt["unregistered"] == 1
    index = RedisIndex(redis)
    assert [d.model_digest for d in index.deployments()] == [dep.model_digest]
    assert index.longest_prefix(dep.model_digest, dep.rank_digests, hashes) == 30

    # With the index back, the sweep takes the genuine orphans (and only those).
    shape = ObjectShape(dep.model_digest, dep.rank_digests[0], SLOT)
    orphan = blocks(1)[0]
    put_orphan(config, shape, orphan)
    swept = run_gc(config, now=time.time() + 3600)
    assert not swept["orphans"]["refused"]
    assert swept["orphans"]["deleted"] == 3  # the corrupt one, the stranger's, the new orphan
    assert refusals() == before + 1
    assert s3_keys(config) == {key_of(dep, h, rank) for h in hashes for rank in dep.rank_digests}


def test_forced_sweep_deletes_what_the_guard_refused(redis, redis_url, real_s3_endpoint, real_bucket):
    config = make_config(redis_url, real_s3_endpoint, real_bucket)
    store(config, blocks(20))
    redis.client.flushall()
    assert run_gc(config, now=time.time() + 3600)["orphans"]["refused"]
    forced = run_gc(config, now=time.time() + 3600, force_sweep=True)
    assert forced["orphans"]["deleted"] == 20
    assert s3_keys(config) == set()

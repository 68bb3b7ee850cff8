"""S3 runs (issue 18): consecutive blocks of one request in one object, block-granular
loads with one ranged GET, per-block integrity, per-object GC and reindex, Redis bytes
per block, request counts. Real redis-server and a real S3 server (SeaweedFS) on
loopback."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from prometheus_client import REGISTRY
from pydantic import SecretStr

from tiercache.config import ConfigError, build_config
from tiercache.engine import S3, ObjectShape, TierEngine
from tiercache.index.leases import Leases, new_token
from tiercache.index.redis_index import Deployment, RedisIndex, RunRecord, blocks_key
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.s3.gc import run_gc
from tiercache.tiers.s3.reindex import reindex
from tiercache.tiers.s3.run_packer import RunPacker
from tiercache.tiers.s3.runs import SPREAD_HEX, parse_run_name

BLOCK = 16 * 1024
INTEGRITY_KEY = "k" * 40


def block(request: int, i: int) -> bytes:
    return request.to_bytes(4, "big") + i.to_bytes(4, "big") * 7


def data(request: int, i: int) -> bytes:
    return np.random.default_rng(1000 * request + i).bytes(BLOCK)


def requests(op: str) -> float:
    return REGISTRY.get_sample_value("tiercache_s3_requests_total", {"op": op}) or 0.0


def make_engine(tmp_path, redis_url, s3_endpoint, bucket, *, pack=16, slots=64, **s3) -> TierEngine:
    config = build_config(
        {
            "redis_url": redis_url,
            "cpu": {"capacity": slots * BLOCK},
            "movers": {"workers": 2, "queue_depth": 256},
            "integrity_key": INTEGRITY_KEY,
            "s3": {
                "bucket": bucket,
                "endpoint_url": s3_endpoint,
                "region": "us-east-1",
                "pack_blocks": pack,
                "pack_flush_seconds": 30,
                **s3,
            },
        },
        environ={},
    )
    shape = ObjectShape(uuid.uuid4().hex[:16], uuid.uuid4().hex[:16], BLOCK, layout="LBHNC", dtype="uint8")
    engine = TierEngine(config, shape, CpuBuffer(slots, BLOCK, pin_memory=False))
    engine.register(
        Deployment(shape.model_digest, config.namespace, "m", 1, (shape.rank_digest,), BLOCK + 4096)
    )
    return engine


@pytest.fixture
def engines(tmp_path, redis_url, real_s3_endpoint, real_bucket):
    """Tier engines on one bucket of the real S3 server (SeaweedFS): its ranged GETs
    and its listing are what the runs' reads, GC and reindex meet in production."""
    made: list[TierEngine] = []

    def make(**kwargs) -> TierEngine:
        engine = make_engine(tmp_path, redis_url, real_s3_endpoint, real_bucket, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def store(engine: TierEngine, request: int, count: int, first_slot: int = 0) -> list[bool]:
    """Write `count` blocks of one request through the movers, as a worker does."""
    stored: dict[int, bool] = {}
    for i in range(count):
        slot = first_slot + i
        engine.buffer.view(slot)[:] = data(request, i)

        def done(result, i=i) -> None:
            stored[i] = bool(result.stored.get(S3))

        engine.write_down(block(request, i), slot, done, tiers=(S3,), group=f"req-{request}")
    engine.end_group(f"req-{request}")
    assert engine.flush(30)
    return [stored[i] for i in range(count)]


def load(engine: TierEngine, request: int, first: int, count: int) -> list[bool]:
    outs = [memoryview(bytearray(BLOCK)) for _ in range(count)]
    ok = engine.read_s3([(block(request, first + i), outs[i]) for i in range(count)])
    for i, good in enumerate(ok):
        if good:
            assert bytes(outs[i]) == data(request, first + i), f"block {first + i} has the wrong bytes"
    return ok


def runs_in(engine: TierEngine) -> list[tuple[str, str, int]]:
    return [(rank, run, size) for rank, run, size, _ in engine.s3.list_runs(engine.shape.rank_digest)]


def test_packing_writes_one_object_per_run_of_blocks(engines):
    engine = engines(pack=8)
    puts = requests("put")
    assert store(engine, 1, 20) == [True] * 20
    assert requests("put") - puts == 3  # 8 + 8 + 4
    assert len(runs_in(engine)) == 3
    index = engine.index
    assert index.count(engine.shape.model_digest, engine.shape.rank_digest) == 20
    assert index.run_count(engine.shape.model_digest, engine.shape.rank_digest) == 3
    # Each run's blocks are consecutive blocks of the request, in order.
    positions = [
        index.locate(engine.shape.model_digest, engine.shape.rank_digest, block(1, i)) for i in range(20)
    ]
    assert [p for _, p in positions] == [*range(8), *range(8), *range(4)]


def test_a_block_waiting_for_its_run_gives_its_slot_back_and_uploads_its_own_bytes(engines):
    # A run gathers blocks for a whole prefill. Held in their CPU slots, a serving
    # load's cold requests pinned most of the CPU tier and it served almost no hits
    # (tests/test_e2e_serve_load.py); the blocks now wait as copies.
    engine = engines(pack=16)
    freed: list[int] = []
    ended: list[bool] = []
    puts = requests("put")
    for i in range(5):
        engine.buffer.view(i)[:] = data(4, i)
        engine.write_down(
            block(4, i),
            i,
            lambda result: ended.append(bool(result.stored.get(S3))),
            tiers=(S3,),
            group="req-4",
            on_slot_free=lambda result: freed.append(result.slot),
        )
    deadline = time.monotonic() + 10
    while len(freed) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(freed) == [0, 1, 2, 3, 4]
    assert requests("put") == puts and not ended  # the run is still gathering
    for i in range(5):
        engine.buffer.view(i)[:] = b"\xee" * BLOCK  # the slots are reused
    engine.end_group("req-4")
    assert engine.flush(30)
    assert ended == [True] * 5
    assert requests("put") - puts == 1
    assert load(engine, 4, 0, 5) == [True] * 5


def test_pack_size_one_writes_one_object_per_block(engines):
    engine = engines(pack=1)
    puts = requests("put")
    assert store(engine, 2, 5) == [True] * 5
    assert requests("put") - puts == 5
    assert load(engine, 2, 0, 5) == [True] * 5


def test_pack_bytes_bounds_a_run(engines):
    engine = engines(pack=16, pack_bytes=3 * BLOCK)
    assert store(engine, 3, 7) == [True] * 7
    assert len(runs_in(engine)) == 3  # 3 + 3 + 1


def test_run_names_spread_over_hashed_prefixes(engines):
    engine = engines(pack=1)
    store(engine, 4, 12)
    names = [item["Key"] for item in engine.s3.client.list_objects_v2(Bucket=engine.s3.bucket)["Contents"]]
    leading = {name.split("/")[0] for name in names}
    assert all(len(x) == SPREAD_HEX for x in leading)
    assert len(leading) > 4  # 12 runs over 256 prefixes
    assert all(parse_run_name("", name) is not None for name in names)


def test_a_prefix_ending_inside_a_run_loads_with_one_ranged_get(engines):
    engine = engines(pack=16)
    store(engine, 5, 16)
    gets = requests("get")
    assert load(engine, 5, 2, 9) == [True] * 9  # blocks 2..10 of a 16-block run
    assert requests("get") - gets == 1
    gets = requests("get")
    assert load(engine, 5, 0, 16) == [True] * 16
    assert requests("get") - gets == 1


def test_a_corrupt_block_fails_itself_and_later_ones_and_keeps_earlier_hits(engines):
    engine = engines(pack=8)
    store(engine, 6, 8)
    model, rank = engine.shape.model_digest, engine.shape.rank_digest
    run, _ = engine.index.locate(model, rank, block(6, 0))
    record = engine.index.run_record(model, rank, run)
    name = engine.s3.run_name(rank, run.hex())
    body = bytearray(engine.s3.client.get_object(Bucket=engine.s3.bucket, Key=name)["Body"].read())
    k = 3
    body[record.data_start + k * (record.frame_header + record.slot_bytes) + record.frame_header + 100] ^= (
        0xFF
    )
    engine.s3.client.put_object(Bucket=engine.s3.bucket, Key=name, Body=bytes(body))
    assert load(engine, 6, 0, 8) == [True, True, True, False, False, False, False, False]
    # Only block k is unindexed: the run and its other blocks stay.
    assert engine.index.locate(model, rank, block(6, k)) is None
    assert engine.index.locate(model, rank, block(6, k + 1)) is not None
    assert load(engine, 6, 4, 4) == [True] * 4
    assert load(engine, 6, 0, 3) == [True] * 3


def test_a_run_signed_with_another_key_is_a_miss(engines):
    writer = engines(pack=4)
    store(writer, 7, 4)
    reader_config = writer.config.model_copy(update={"integrity_key": SecretStr("x" * 40)})
    reader = TierEngine(reader_config, writer.shape, CpuBuffer(4, BLOCK, pin_memory=False))
    try:
        outs = [memoryview(bytearray(BLOCK)) for _ in range(4)]
        assert reader.read_s3([(block(7, i), outs[i]) for i in range(4)]) == [False] * 4
    finally:
        reader.close()


def test_gc_keeps_a_run_while_any_block_is_leased_and_deletes_it_after(engines, redis):
    engine = engines(pack=4)
    store(engine, 8, 8)  # two runs
    model, rank = engine.shape.model_digest, engine.shape.rank_digest
    leases = Leases(engine.redis)
    token = new_token()
    where, records = leases.acquire_read_blocks(model, rank, [block(8, 2)], token)  # inside the first run
    leased_run = where[0][0]
    config = engine.config.model_copy(update={"s3": engine.config.s3.model_copy(update={"capacity": 1})})
    report = run_gc(config, sweep_orphans=False, redis=engine.redis, s3=engine.s3)
    assert report["skipped_leased"] == 1 and report["evicted_objects"] == 1
    assert [run for _, run, _ in runs_in(engine)] == [leased_run.hex()]
    assert load(engine, 8, 0, 4) == [True] * 4  # the leased run is whole
    leases.release_runs(model, rank, list(records), token)
    report = run_gc(config, sweep_orphans=False, redis=engine.redis, s3=engine.s3)
    assert report["evicted_objects"] == 1
    assert runs_in(engine) == []
    assert engine.index.count(model, rank) == 0


def test_gc_removes_only_the_blocks_still_located_in_the_run(engines):
    engine = engines(pack=4)
    store(engine, 9, 4)
    model, rank = engine.shape.model_digest, engine.shape.rank_digest
    old_run, _ = engine.index.locate(model, rank, block(9, 0))
    # Block 1 was published again since, in another run: GC of the old run keeps it.
    engine.index.add_run(model, rank, b"\x01" * 8, RunRecord(0, 0, 0, (block(9, 1),)))
    assert Leases(engine.redis).gc_unindex_run(model, rank, old_run) == 3
    assert engine.index.locate(model, rank, block(9, 1)) == (b"\x01" * 8, 0)


def test_reindex_rebuilds_block_entries_from_run_headers(engines, redis):
    engine = engines(pack=4)
    store(engine, 10, 10)
    model, rank = engine.shape.model_digest, engine.shape.rank_digest
    before = {i: engine.index.locate(model, rank, block(10, i)) for i in range(10)}
    registry = engine.redis.client.hgetall("tc:registry")
    engine.redis.client.flushdb()
    engine.redis.client.hset("tc:registry", mapping=registry)
    assert load(engine, 10, 0, 10) == [False] * 10
    report = reindex(engine.config, redis=engine.redis, s3=engine.s3)
    assert report["indexed"] == 10 and report["scanned"] == 3 and not report["errors"]
    assert {i: engine.index.locate(model, rank, block(10, i)) for i in range(10)} == before
    assert load(engine, 10, 0, 10) == [True] * 10
    assert engine.index.longest_prefix(model, [rank], [block(10, i) for i in range(10)]) == 10


def test_orphan_runs_are_swept_and_old_per_block_objects_reclaimed(engines):
    engine = engines(pack=4)
    store(engine, 11, 4)
    model, rank = engine.shape.model_digest, engine.shape.rank_digest
    # An older tiercache's per-block object and index: never read, reclaimed by GC.
    header = engine.shape.header(block(11, 9), memoryview(data(11, 9)))
    old_object = engine.s3.object_name(header.key)
    engine.s3.client.put_object(Bucket=engine.s3.bucket, Key=old_object, Body=header.encode() + data(11, 9))
    assert [key for key, _, _ in engine.s3.list_objects()] == [header.key]
    engine.redis.client.zadd(f"tc:{{{model}}}:idx:{rank}", {block(11, 9): 1.0})
    report = run_gc(engine.config, redis=engine.redis, s3=engine.s3, now=time.time() + 3600)
    assert report["orphans"]["legacy_deleted"] == 1
    assert report["orphans"]["legacy_index_keys_deleted"] == 1
    assert report["orphans"]["found"] == 0 and len(runs_in(engine)) == 1
    assert list(engine.s3.list_objects()) == []
    # The run's index gone: its object is an orphan, swept.
    engine.index.drop_deployment(Deployment(model, engine.config.namespace, "m", 1, (rank,), BLOCK + 4096))
    report = run_gc(engine.config, redis=engine.redis, s3=engine.s3, now=time.time() + 3600)
    assert report["orphans"]["deleted"] == 1 and runs_in(engine) == []


def test_redis_bytes_per_block_with_runs_of_sixteen(redis):
    index = RedisIndex(redis)
    model, rank = "a" * 16, "b" * 16
    rng = np.random.default_rng(3)
    blocks = 16_000
    for _ in range(blocks // 16):
        hashes = tuple(rng.bytes(32) for _i in range(16))
        index.add_run(model, rank, rng.bytes(8), RunRecord(4096, 4096, 1 << 20, hashes))
    per_block = index.memory_usage(model, rank) / blocks
    print(f"Redis bytes per block, runs of 16: {per_block:.1f}")
    assert per_block <= 200
    assert redis.client.hlen(blocks_key(model, rank)) == blocks


def test_a_bad_pack_setting_names_its_field():
    for bad in ({"pack_blocks": 0}, {"pack_blocks": 5000}, {"pack_bytes": 0}, {"pack_flush_seconds": 0}):
        with pytest.raises(ConfigError) as error:
            build_config({"s3": {"bucket": "b", **bad}}, environ={})
        assert f"s3.{next(iter(bad))}" in str(error.value)


def test_the_packer_ships_consecutive_runs_ended_groups_and_late_ones():
    shipped: list[list[int]] = []
    now = [0.0]
    packer: RunPacker[int] = RunPacker(3, 0.5, shipped.append, clock=lambda: now[0])
    try:
        numbers = [packer.expect("a") for _ in range(5)]
        assert numbers == [0, 1, 2, 3, 4]
        for number in (1, 3, 4, 2):  # arriving out of order: nothing is consecutive from 0
            packer.add("a", number, 10 + number)
        assert shipped == []
        packer.add("a", 0, 10)
        assert shipped == [[10, 11, 12]]
        packer.end_group("a")
        assert shipped[-1] == [13, 14]
        # A group whose block 0 was abandoned and whose request ended ships the rest.
        first, second = packer.expect("b"), packer.expect("b")
        packer.end_group("b")
        packer.add("b", second, 21)
        assert shipped[-1] == [13, 14]
        packer.abandon("b", first)
        assert shipped[-1] == [21]
        # Blocks still in the movers' queue hold the flush clock: no split run.
        packer.add("d", packer.expect("d"), 40)
        late = packer.expect("d")
        now[0] = 0.9
        with packer._lock:
            packer._lock.notify()
        time.sleep(0.2)
        assert shipped[-1] == [21]
        packer.add("d", late, 41)
        packer.end_group("d")
        assert shipped[-1] == [40, 41]
        # A request that never ends ships on the timer once nothing is in flight.
        packer.add("c", packer.expect("c"), 30)
        now[0] = 2.0
        with packer._lock:
            packer._lock.notify()
        deadline = time.monotonic() + 5
        while shipped[-1] != [30] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shipped[-1] == [30]
        assert packer.waiting == 0
    finally:
        packer.close()


def test_a_long_stretch_of_large_blocks_goes_as_parallel_ranged_gets(engines, monkeypatch):
    import tiercache.tiers.s3.reader as s3_reader

    engine = engines(pack=16)
    store(engine, 12, 16)
    frame = engine.index.run_record(
        engine.shape.model_digest,
        engine.shape.rank_digest,
        engine.index.locate(engine.shape.model_digest, engine.shape.rank_digest, block(12, 0))[0],
    )
    monkeypatch.setattr(s3_reader, "PART_BYTES", 5 * (frame.frame_header + frame.slot_bytes))
    gets = requests("get")
    assert load(engine, 12, 0, 16) == [True] * 16
    assert requests("get") - gets == 4  # 5 + 5 + 5 + 1 frames

"""The tier engine, alone and under the connector's two halves (connector/driver.py)
over real Redis and S3 servers: write-through, write-back, promotion on hit,
backpressure, shutdown flush, full disk, Redis outage."""

from __future__ import annotations

import errno
import threading
import time
import uuid

import numpy as np
import pytest
from prometheus_client import REGISTRY

import tiercache.tiers.disk.tier as disk_module
from tiercache.config import build_config
from tiercache.connector.driver import ConnectorDriver
from tiercache.engine import ObjectShape, TierEngine
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import RedisIndex
from tiercache.tiers import CPU, DISK, S3
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.disk.layout import TMP_PREFIX

BLOCK = 64 * 1024


def block(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def data(i: int) -> bytes:
    return np.random.default_rng(i).bytes(BLOCK)


def metric(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def new_shape() -> ObjectShape:
    return ObjectShape(uuid.uuid4().hex[:16], uuid.uuid4().hex[:16], BLOCK, layout="LBHNC", dtype="uint8")


def new_model() -> str:
    """A model name of its own: drivers of one name share objects, as instances do."""
    return uuid.uuid4().hex


def make_config(tmp_path, *, redis_url=None, s3_endpoint=None, bucket=None, disk="disk", slots=4, **sections):
    data_ = {"cpu": {"capacity": slots * BLOCK}, "movers": {"workers": 2}}
    if disk:
        data_["disk"] = {"path": str(tmp_path / disk), "capacity": "64MiB"}
    if redis_url:
        data_["redis_url"] = redis_url
    if s3_endpoint:
        data_["s3"] = {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1"}
    for name, values in sections.items():
        data_[name] = {**data_.get(name, {}), **values}
    return build_config(data_, environ={})


@pytest.fixture
def stack(tmp_path, redis_url, s3_endpoint, bucket):
    """Make drivers of one model over the shared Redis and a fresh bucket; closes them."""
    made: list[ConnectorDriver] = []
    model = new_model()

    def make(disk="disk", slots=4, **sections) -> ConnectorDriver:
        config = make_config(
            tmp_path,
            redis_url=redis_url,
            s3_endpoint=s3_endpoint,
            bucket=bucket,
            disk=disk,
            slots=slots,
            **sections,
        )
        cache = ConnectorDriver(config, BLOCK, model=model)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


def s3_keys(cache: ConnectorDriver) -> set[str]:
    """The keys of the blocks the rank's S3 run objects hold."""
    s3, rank = cache.engine.s3, cache.shape.rank_digest
    return {
        f"{rank}/{h.hex()}"
        for _, run, _, _ in s3.list_runs(rank)
        for h in s3.read_run_header(rank, run).block_hashes
    }


def run_name_of(cache: ConnectorDriver, i: int) -> str:
    """The S3 name of the run object the index says holds block(i)."""
    run, _ = cache.engine.index.locate(cache.shape.model_digest, cache.shape.rank_digest, block(i))
    return cache.engine.s3.run_name(cache.shape.rank_digest, run.hex())


def indexed(cache: ConnectorDriver) -> int:
    return cache.engine.index.count(cache.shape.model_digest, cache.shape.rank_digest)


def put_flushed(cache: ConnectorDriver, i: int) -> int:
    slot = cache.put(block(i), data(i))
    assert slot is not None
    assert cache.flush(30)
    return slot


def got(cache: ConnectorDriver, i: int) -> str | None:
    hit = cache.get(block(i))
    if hit is None:
        return None
    tier, view = hit
    assert bytes(view) == data(i), f"block {i} from {tier} has the wrong bytes"
    return tier


def test_write_through_reaches_every_tier(stack):
    cache = stack()
    for i in range(3):
        put_flushed(cache, i)
    keys = {cache.shape.key(block(i)) for i in range(3)}
    assert set(cache.engine.disk.keys()) == keys
    assert s3_keys(cache) == keys
    assert indexed(cache) == 3
    assert (
        cache.engine.index.longest_prefix(
            cache.shape.model_digest, [cache.shape.rank_digest], [block(i) for i in range(3)]
        )
        == 3
    )
    assert all(got(cache, i) == CPU for i in range(3))


def test_hits_come_from_each_tier_and_are_promoted(stack):
    cache = stack(slots=2)
    for i in range(3):
        put_flushed(cache, i)  # 2 slots: block 0 leaves the CPU tier
    assert block(0) not in cache.slots
    assert got(cache, 0) == DISK
    assert block(0) in cache.slots  # promoted
    assert got(cache, 0) == CPU

    # Another node (its own empty disk) finds them in S3, and keeps a copy on disk.
    other = stack(disk="other-disk", slots=4)
    assert got(other, 1) == S3
    assert got(other, 1) == CPU
    assert other.engine.flush(30)
    assert other.shape.key(block(1)) in other.engine.disk
    # With no disk at all, S3 still serves.
    diskless = stack(disk=None, slots=4)
    assert got(diskless, 2) == S3
    assert got(cache, 99) is None and got(diskless, 99) is None


def test_write_back_writes_down_only_on_eviction(stack):
    cache = stack(slots=2, movers={"policy": "write_back"})
    put_flushed(cache, 0)
    put_flushed(cache, 1)
    assert len(cache.engine.disk) == 0 and s3_keys(cache) == set() and indexed(cache) == 0
    put_flushed(cache, 2)  # evicts block 0, which goes down now
    assert cache.engine.disk.keys() == [cache.shape.key(block(0))]
    assert s3_keys(cache) == {cache.shape.key(block(0))}
    assert indexed(cache) == 1
    assert got(cache, 0) == DISK  # right bytes: the copy was taken before the slot was reused
    assert cache.engine.flush(30)
    assert cache.shape.key(block(1)) in cache.engine.disk  # evicted by that promotion


def test_backpressure_drops_without_blocking(tmp_path, stack):
    cache = stack(slots=8, movers={"queue_depth": 1, "workers": 1})
    gate = threading.Event()
    upload = cache.engine.s3.put_run

    def slow_put(*args):
        gate.wait(60)
        return upload(*args)

    cache.engine.s3.put_run = slow_put
    dropped = metric("tiercache_mover_dropped_total", {"tier": "s3"})
    slots: list = []
    puts = threading.Thread(target=lambda: slots.extend(cache.put(block(i), data(i)) for i in range(5)))
    try:
        puts.start()
        puts.join(30)
        assert not puts.is_alive(), "put() blocked on a full queue"
    finally:
        gate.set()
    assert None not in slots  # every block is in the CPU tier...
    assert metric("tiercache_mover_dropped_total", {"tier": "s3"}) == dropped + 4  # ...4 not written down
    assert cache.engine.flush(30)
    assert s3_keys(cache) == {cache.shape.key(block(0))}
    assert cache.engine.disk.keys() == [cache.shape.key(block(0))]
    assert all(got(cache, i) == CPU for i in range(5))


def test_cpu_tier_full_of_transfers_drops_the_store(stack):
    cache = stack(slots=2, movers={"workers": 1})
    gate = threading.Event()
    upload = cache.engine.s3.put_run
    cache.engine.s3.put_run = lambda *args: gate.wait(60) and upload(*args)
    # Held on disk too: a block's slot is freed once the disk has it (its S3 run
    # waits with a copy), and a fast disk write freed slot 0 before the third put.
    disk_put = cache.engine.disk.put
    cache.engine.disk.put = lambda *args: gate.wait(60) and disk_put(*args)
    try:
        assert cache.put(block(0), data(0)) is not None
        assert cache.put(block(1), data(1)) is not None
        assert cache.scheduler.take_dropped_stores() == 0
        assert cache.put(block(2), data(2)) is None  # both slots wait on their upload
        assert cache.scheduler.take_dropped_stores() == 1  # counted for vLLM's stats
    finally:
        gate.set()
    assert cache.engine.flush(30)
    assert cache.put(block(2), data(2)) is not None


def test_close_flushes_queued_writes(stack):
    cache = stack(slots=16, movers={"workers": 2, "queue_depth": 64})
    upload = cache.engine.s3.put_run

    def slowish_put(*args):
        threading.Event().wait(0.05)
        return upload(*args)

    cache.engine.s3.put_run = slowish_put
    for i in range(8):
        assert cache.put(block(i), data(i)) is not None
    cache.close()
    assert s3_keys(cache) == {cache.shape.key(block(i)) for i in range(8)}
    assert len(cache.engine.disk) == 8


def test_close_gives_up_after_the_flush_bound(stack):
    cache = stack(slots=4, movers={"workers": 1, "shutdown_flush_seconds": 0.2})
    gate = threading.Event()
    upload = cache.engine.s3.put_run
    cache.engine.s3.put_run = lambda *args: gate.wait(60) and upload(*args)
    try:
        for i in range(3):
            assert cache.put(block(i), data(i)) is not None
        closer = threading.Thread(target=cache.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() waited past shutdown_flush_seconds"
        assert cache.engine.flush(0) is False  # writes were still queued when it gave up
        # A closed engine takes no more writes.
        results: list = []
        assert not cache.engine.write_down(block(9), None, results.append, data=data(9))
        assert results[0].stored == {}
    finally:
        gate.set()


def test_full_disk_drops_stores_while_cpu_hits_continue(stack, monkeypatch):
    cache = stack(slots=4)
    put_flushed(cache, 0)

    def no_space(fd, *parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "write_all", no_space)
    full = metric("tiercache_tier_errors_total", {"tier": "disk", "kind": "disk_full"})
    results: list = []
    engine = cache.engine
    assert engine.write_down(block(1), None, results.append, data=data(1))
    assert engine.flush(30)
    assert results[0].stored == {DISK: False, S3: True}  # S3 still takes it
    put_flushed(cache, 2)
    assert metric("tiercache_tier_errors_total", {"tier": "disk", "kind": "disk_full"}) == full + 2
    assert engine.disk.keys() == [cache.shape.key(block(0))]
    assert not list(engine.disk.root.rglob(f"{TMP_PREFIX}*"))  # no temp files left behind
    assert got(cache, 2) == CPU and got(cache, 0) == CPU
    monkeypatch.undo()
    put_flushed(cache, 3)
    assert cache.shape.key(block(3)) in engine.disk


def test_disk_root_replaced_by_a_file(tmp_path):
    config = make_config(tmp_path, slots=2)
    cache = ConnectorDriver(config, BLOCK, model=new_model())
    try:
        digest_dir = tmp_path / "disk" / cache.shape.rank_digest
        digest_dir.write_text("not a directory")  # every object path now fails to create
        errors = metric("tiercache_tier_errors_total", {"tier": "disk", "kind": "io"})
        put_flushed(cache, 0)
        assert len(cache.engine.disk) == 0
        assert metric("tiercache_tier_errors_total", {"tier": "disk", "kind": "io"}) == errors + 1
        assert got(cache, 0) == CPU
    finally:
        cache.close()


def test_embedded_cpu_and_disk_without_servers(tmp_path):
    cache = ConnectorDriver(make_config(tmp_path, slots=2), BLOCK, model=new_model())
    try:
        assert cache.engine.redis is None and cache.engine.s3 is None
        for i in range(4):
            put_flushed(cache, i)
        assert got(cache, 0) == DISK and got(cache, 3) == CPU
    finally:
        cache.close()


def test_a_corrupt_disk_object_is_a_miss_and_its_good_copies_serve_again(stack):
    cache = stack(slots=1)
    put_flushed(cache, 0)
    put_flushed(cache, 1)  # block 0 is on disk and in S3 only
    key = cache.shape.key(block(0))
    path = cache.engine.disk.path_of(key)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert got(cache, 0) is None  # a miss (vLLM recomputes it), never the corrupt bytes
    assert cache.flush(30)
    assert key not in cache.engine.disk and block(0) not in cache.policy.on_disk  # removed
    # The load failed a moment ago, so this node computes the block (and stores it
    # again) rather than try S3 at once; another node is served the good S3 copy.
    assert got(stack(disk="other-disk", slots=1), 0) == S3
    put_flushed(cache, 0)
    assert got(cache, 1) == DISK
    assert got(cache, 0) == DISK  # the recomputed copy


def test_corrupt_s3_object_is_unindexed(stack):
    cache = stack(disk=None, slots=1)
    put_flushed(cache, 0)
    put_flushed(cache, 1)
    s3 = cache.engine.s3
    name = run_name_of(cache, 0)
    size = s3.client.head_object(Bucket=s3.bucket, Key=name)["ContentLength"]
    s3.client.put_object(Bucket=s3.bucket, Key=name, Body=np.random.default_rng(0).bytes(size))
    assert indexed(cache) == 2
    assert got(cache, 0) is None
    assert indexed(cache) == 1  # the entry is gone: no one else asks for it
    # The run object itself stays for GC: in a run of many, its other blocks may be good.
    assert got(cache, 1) is not None


def test_redis_down_local_tiers_keep_working(tmp_path, redis_server, s3_endpoint, bucket):
    config = make_config(
        tmp_path,
        redis_url=redis_server.url,
        s3_endpoint=s3_endpoint,
        bucket=bucket,
        slots=2,
        redis={"retry_backoff": 0.1, "max_backoff": 0.2},
    )
    cache = ConnectorDriver(config, BLOCK, model=new_model())
    try:
        put_flushed(cache, 0)
        assert indexed(cache) == 1
        redis_server.stop()
        results: list = []
        assert cache.engine.write_down(block(1), None, results.append, data=data(1))
        assert cache.engine.flush(30)
        assert results[0].stored == {DISK: True, S3: False}  # no lease, no upload
        for i in range(1, 4):
            put_flushed(cache, i)
        assert not cache.engine.redis.available
        assert got(cache, 3) == CPU
        assert got(cache, 1) == DISK
        assert got(cache, 50) is None  # the shared tier is a miss, not an error
        assert cache.shape.key(block(3)) not in s3_keys(cache)

        redis_server.start()
        guarded = cache.engine.redis
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait out the backoff: the next call reconnects
            try:
                guarded.call("ping", guarded.client.ping)
                break
            except RedisUnavailable:
                time.sleep(0.05)
        put_flushed(cache, 5)
        assert cache.shape.key(block(5)) in s3_keys(cache)
        assert (
            RedisIndex(GuardedRedis(redis_server.url, config.redis)).count(
                cache.shape.model_digest, cache.shape.rank_digest
            )
            == 1
        )
    finally:
        cache.close()


def test_stage_many_in_parallel(stack):
    cache = stack(slots=4)
    for i in range(4):
        put_flushed(cache, i)
    other = stack(disk="empty", slots=8)
    engine = other.engine
    items = [(block(i), slot, S3) for slot, i in enumerate(range(4))]
    items.append((block(77), 4, S3))
    assert engine.stage_many(items).result(60) == [True, True, True, True, False]
    assert all(bytes(other.buffer.view(slot)) == data(i) for slot, i in enumerate(range(4)))


def test_engine_over_a_bare_buffer(tmp_path):
    config = make_config(tmp_path, slots=1)
    shape = new_shape()
    buffer = CpuBuffer(2, BLOCK, pin_memory=False)
    removed: list[str] = []
    engine = TierEngine(
        config, shape, buffer, disk_capacity=3 * (BLOCK + 4096), on_disk_remove=removed.append
    )
    try:
        results: list = []
        for i in range(4):
            buffer.view(0)[:] = data(i)
            assert engine.write_down(block(i), 0, results.append)
            assert engine.flush(30)
        assert [r.stored for r in results] == [{DISK: True}] * 4
        assert removed == [shape.key(block(0))]  # the disk budget held three
        assert not engine.stage(block(0), 1, DISK)
        assert engine.stage(block(3), 1, DISK) and bytes(buffer.view(1)) == data(3)
        assert not engine.stage(block(3), 1, S3)  # no S3 tier configured
    finally:
        engine.close()


class FaultyEndpoint:
    """An HTTP endpoint on loopback that answers every request with `answer` (raw
    response bytes) and then closes the connection: an S3 that refuses, throttles, or
    cuts a body short."""

    def __init__(self, answer: bytes):
        import socket

        self.answer = answer
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    request += chunk
                conn.sendall(self.answer)

    def close(self) -> None:
        self._listener.close()


def s3_error(status: str, code: str) -> bytes:
    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>no</Message></Error>'
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n{body}"
    ).encode()


def cut_short(whole: bytes) -> bytes:
    """The object's first 6 KiB (its header and some pages) under its full length."""
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(whole)}\r\nConnection: close\r\n\r\n".encode()
    return head + whole[: 6 * 1024]


@pytest.mark.parametrize("fault", ["503 SlowDown", "403 AccessDenied", "connection cut mid-body", "refused"])
def test_a_transient_s3_failure_is_a_miss_that_keeps_the_index_entry(fault, tmp_path, stack):
    writer = stack(disk=None, slots=1)
    put_flushed(writer, 0)
    assert indexed(writer) == 1
    s3 = writer.engine.s3
    name = run_name_of(writer, 0)
    whole = s3.client.get_object(Bucket=s3.bucket, Key=name)["Body"].read()
    answers = {
        "503 SlowDown": s3_error("503 Slow Down", "SlowDown"),
        "403 AccessDenied": s3_error("403 Forbidden", "AccessDenied"),
        "connection cut mid-body": cut_short(whole),
    }
    endpoint = FaultyEndpoint(answers.get(fault, b""))
    if fault == "refused":
        endpoint.close()  # nothing listens on the port any more
    faulty = {"endpoint_url": endpoint.url, "max_attempts": 1, "connect_timeout": 1, "read_timeout": 1}
    config = writer.config.model_copy(update={"s3": writer.config.s3.model_copy(update=faulty)})
    reader = TierEngine(config, writer.shape, CpuBuffer(1, BLOCK, pin_memory=False))
    try:
        out = memoryview(bytearray(BLOCK))
        assert not reader.read_into(block(0), out, S3)  # a miss...
        assert indexed(writer) == 1  # ...and nothing else: the object is still there
        assert writer.engine.read_into(block(0), out, S3) and bytes(out) == data(0)
    finally:
        reader.close()
        endpoint.close()


def test_a_missing_s3_object_is_unindexed(stack):
    cache = stack(disk=None, slots=1)
    put_flushed(cache, 0)
    s3 = cache.engine.s3
    s3.client.delete_object(Bucket=s3.bucket, Key=run_name_of(cache, 0))
    out = memoryview(bytearray(BLOCK))
    assert not cache.engine.read_into(block(0), out, S3)
    assert indexed(cache) == 0  # NoSuchKey: the entry named nothing

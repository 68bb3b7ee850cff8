"""Faults injected under a running vLLM engine (the CPU build, a tiny random Llama):
Redis killed and restarted, S3 down and slow (a TCP proxy in front of the S3 server),
every S3 object overwritten with noise, the disk tier made unwritable, an engine
killed with SIGKILL mid-write and restarted. Then, on the tier engine itself: two
processes storing one prefix at once, and GC racing a reader.

Two connector engines serve every vLLM scenario (engine starts cost most of the
time here); the test drives them between prompts through {"touch"}/{"wait_for"}
entries of tiercache.ops.vllm_runner. Outputs are compared with a run without the
connector as tests/test_e2e_vllm.py does."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import boto3
import pytest
import redis as redis_py

from tiercache.config import build_config
from tiercache.engine import S3, ObjectShape, TierEngine
from tiercache.index.redis_index import REGISTRY, Deployment, blocks_key, parse_location
from tiercache.ops.local_stack import RedisServer, create_bucket
from tiercache.ops.tiny_model import write_tiny_llama
from tiercache.ops.vllm_runner import assert_same_output, connector_config, loading_every_hit, run_engine
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.disk.layout import DiskLayout
from tiercache.tiers.format import CorruptObject, check_digest, checksum, decode_header, header_length
from tiercache.tiers.s3.gc import run_gc
from tiercache.tiers.s3.runs import check_run_bytes, run_object_name
from tiercache.tiers.s3.tier import Fetch

from support.faults import (
    EngineProcess,
    TcpProxy,
    block_payload,
    wait_for_file,
    write_blocks_in_process,
)

BLOCK = 32
FULL = 9 * BLOCK  # 299-token prompts: 9 loadable blocks
BOUNDED = 30.0  # "bounded wait": a prompt under a fault may not take longer than this
_rng = random.Random(4321)
PROMPTS = {name: [_rng.randrange(1, 2000) for _ in range(299)] for name in "ABCDEFGHX"}
PROMPTS.update({f"K{i}": [_rng.randrange(1, 2000) for _ in range(299)] for i in range(1, 5)})


def prompt(name: str) -> dict:
    return {"name": name, "ids": PROMPTS[name]}


def object_ok(data: bytes, key: str | None = None) -> bool:
    """A whole object whose header parses and whose pages match its checksum: a disk
    object of one block, or an S3 run whose every block does."""
    try:
        if b'"tiercache-run"' in data[: 8 + header_length(data[:8])]:
            check_run_bytes(data)
            return key is None
        length = header_length(data[:8])
        header = decode_header(data[8 : 8 + length])
        pages = data[-header.nbytes :] if header.nbytes else b""
        if len(data) < 8 + length + header.nbytes or (key is not None and header.key != key):
            return False
        check_digest(header, checksum(pages))
        return True
    except CorruptObject:
        return False


# -- the world: Redis, S3 behind a proxy, a model, the reference outputs --------------------


class World:
    def __init__(self, root: Path, s3_endpoint: str):
        self.root = root
        self.redis_server = RedisServer().start()
        self.redis = redis_py.Redis(port=self.redis_server.port)
        self.bucket = f"tc-rel-{uuid.uuid4().hex[:8]}"
        self.s3_url = s3_endpoint
        create_bucket(s3_endpoint, self.bucket)
        self.s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
        self.proxy = TcpProxy(urlparse(s3_endpoint).port).start()
        self.disk = root / "disk"
        self.model = str(write_tiny_llama(root / "llama", seed=0))
        self.signals = root / "signals"
        self.signals.mkdir()

    def config(self) -> dict:
        return {
            "namespace": "rel",
            "redis_url": self.redis_server.url,
            # Short breaker and leases, so that recovery fits in a test.
            "redis": {"retry_backoff": 0.2, "max_backoff": 1.0, "write_lease_ttl": 5, "read_lease_ttl": 10},
            "cpu": {"capacity": "64MiB"},
            "disk": {"path": str(self.disk), "capacity": "256MiB"},
            "s3": {
                "bucket": self.bucket,
                "endpoint_url": self.proxy.url,
                "region": "us-east-1",
                "prefix": "rel/",
                "connect_timeout": 1,
                "read_timeout": 2,
                "max_attempts": 2,
            },
        }

    def signal(self, name: str) -> Path:
        return self.signals / name

    def go(self, name: str) -> None:
        self.signal(name).touch()

    def deployment(self) -> Deployment:
        raw = self.redis.hgetall(REGISTRY)
        (deployment,) = [Deployment.from_json(v) for v in raw.values() if b'"rel"' in v]
        return deployment

    def index_members(self) -> set[bytes]:
        dep = self.deployment()
        return set(self.redis.hkeys(blocks_key(dep.model_digest, dep.rank_digests[0])))

    def indexed_objects(self) -> dict[str, int]:
        """S3 name of every run object the index locates a block in -> its blocks indexed."""
        dep = self.deployment()
        rank = dep.rank_digests[0]
        names: dict[str, int] = {}
        for loc in self.redis.hvals(blocks_key(dep.model_digest, rank)):
            name = run_object_name("rel/", rank, parse_location(loc)[0].hex())
            names[name] = names.get(name, 0) + 1
        return names

    def s3_objects(self) -> dict[str, bytes]:
        """Every KV object under the prefix: S3 name -> bytes (GC's copy of the
        registry, kept in the bucket too, is not one)."""
        out = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix="rel/"):
            for item in page.get("Contents", ()):
                if item["Key"].endswith(".safetensors"):
                    out[item["Key"]] = self.s3.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read()
        return out

    def wait_indexed(self, count: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if len(self.index_members()) >= count:
                    return
            except ValueError:  # not registered yet
                pass
            time.sleep(0.1)
        raise TimeoutError(f"fewer than {count} objects indexed after {timeout}s")

    def close(self) -> None:
        self.proxy.stop()
        self.redis_server.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory, s3_endpoint):
    w = World(tmp_path_factory.mktemp("reliability"), s3_endpoint)
    yield w
    w.close()


@pytest.fixture(scope="module")
def reference(world):
    spec = {"model": world.model, "kv_transfer_config": None, "prompts": [prompt(n) for n in PROMPTS]}
    out = run_engine(spec, world.root / "runs")
    return {r["name"]: r for r in out["results"]}


def engine_spec(world: World, items: list[dict]) -> dict:
    # Each scenario is about what a load from a tier does when it fails: load every hit.
    kv = connector_config(loading_every_hit(world.config()))
    return {"model": world.model, "kv_transfer_config": kv, "prompts": items}


# -- engine 1: store everything, then SIGKILL it while uploads are in flight -----------------


@pytest.fixture(scope="module")
def killed(world, reference):
    """Engine W stores B..G (then their disk copies are deleted, so that later they
    live in S3 alone), stores A, then runs K1..K4 with S3 slowed down and is killed
    with SIGKILL while uploads are in flight. Returns what was found afterwards."""
    s = world.signal
    items = [prompt(n) for n in "BCDEFG"]
    items += [{"touch": str(s("w1"))}, {"wait_for": str(s("w1-go"))}, prompt("A")]
    items += [{"touch": str(s("w2"))}, {"wait_for": str(s("w2-go"))}]
    for i in range(1, 5):
        items += [prompt(f"K{i}"), {"touch": str(s(f"k{i}"))}]
    items += [{"wait_for": str(s("never")), "timeout": 120}]
    engine = EngineProcess(engine_spec(world, items), world.root / "runs")
    found: dict = {}
    try:
        engine.wait_file(s("w1"), 600)
        world.wait_indexed(6 * 9)
        for path in world.disk.rglob("*.safetensors"):
            path.unlink()
        world.go("w1-go")
        engine.wait_file(s("w2"))
        world.wait_indexed(7 * 9)
        world.proxy.delay = 0.3  # every upload now takes about a second
        world.go("w2-go")
        engine.wait_file(s("k2"))
        deadline = time.monotonic() + 10
        leases: list = []
        while not leases and time.monotonic() < deadline:
            leases = list(world.redis.scan_iter(match="tc:*:wl:*"))
            time.sleep(0.02)
        found["write_leases_at_kill"] = len(leases)
        found["indexed_at_kill"] = len(world.index_members())
        engine.kill()
    finally:
        engine.kill()
        world.proxy.delay = 0.0
    files = list(world.disk.rglob("*"))
    found["tmp_files"] = [p for p in files if p.name.startswith(".tmp-")]
    # Temp files (a write the kill cut short) are never read as objects: the disk tier
    # clears a dead process's at its next start. Every object must be whole.
    objects = [p for p in files if p.name.endswith(".safetensors") and not p.name.startswith(".tmp-")]
    found["disk_objects"] = {p: object_ok(p.read_bytes()) for p in objects}
    s3_objects = world.s3_objects()
    found["s3_objects"] = {name: object_ok(data) for name, data in s3_objects.items()}
    found["index"] = set(world.indexed_objects())
    direct = {**world.config()["s3"], "endpoint_url": world.s3_url}
    config = build_config({**world.config(), "s3": direct}, environ={})
    found["gc"] = run_gc(config, grace_seconds=0)
    found["s3_after_gc"] = set(world.s3_objects())
    found["index_after_gc"] = set(world.indexed_objects())
    return found


@pytest.mark.vllm
@pytest.mark.slow
def test_sigkill_mid_write_leaves_no_partial_object(killed):
    assert killed["write_leases_at_kill"] > 0  # it really died with uploads in flight
    assert killed["disk_objects"] and all(killed["disk_objects"].values())
    assert killed["s3_objects"] and all(killed["s3_objects"].values())
    # Every index entry names a whole object; objects without one are orphans for GC.
    assert killed["index"] <= set(killed["s3_objects"])
    assert killed["gc"]["errors"] == []
    assert killed["s3_after_gc"] == killed["index_after_gc"]


# -- engine 2: restarted after the kill; faults injected between its prompts -----------------


@pytest.fixture(scope="module")
def faults(world, killed, reference):
    s = world.signal
    items = [prompt("A"), prompt("K1"), prompt("B"), {"touch": str(s("f1"))}, {"wait_for": str(s("g1"))}]
    items += [prompt("C"), {"touch": str(s("f2"))}, {"wait_for": str(s("g2"))}]
    items += [prompt("X"), {"touch": str(s("f3a"))}, {"wait_for": str(s("g3a"))}]
    items += [prompt("D"), {"touch": str(s("f3"))}, {"wait_for": str(s("g3"))}]
    items += [prompt("E"), {"touch": str(s("f4"))}, {"wait_for": str(s("g4"))}]
    items += [prompt("F"), {"touch": str(s("f5"))}, {"wait_for": str(s("g5"))}]
    items += [prompt("G"), prompt("G"), {"touch": str(s("f6"))}, {"wait_for": str(s("g6"))}]
    items += [prompt("H"), prompt("H"), prompt("A")]
    engine = EngineProcess(engine_spec(world, items), world.root / "runs")
    seen: dict = {}
    try:
        engine.wait_file(s("f1"), 600)
        world.redis.save()  # a Redis with persistence: its index survives the restart
        world.redis_server.stop()
        world.go("g1")
        engine.wait_file(s("f2"))
        world.redis_server.start()
        time.sleep(1.5)  # past the breaker's backoff (max_backoff 1 s)
        world.go("g2")
        engine.wait_file(s("f3a"))
        time.sleep(1.5)
        world.go("g3a")
        engine.wait_file(s("f3"))
        world.proxy.stop()  # S3 down: connections refused
        world.go("g3")
        engine.wait_file(s("f4"))
        world.proxy.delay = 3.0  # S3 slow: every chunk 3 s late, read_timeout is 2 s
        world.proxy.start()
        world.go("g4")
        engine.wait_file(s("f5"))
        world.proxy.delay = 0.0
        objects = world.s3_objects()
        seen["overwritten"] = sum(len(check_run_bytes(data).block_hashes) for data in objects.values())
        for name, data in objects.items():  # noise of the same size, header included
            world.s3.put_object(Bucket=world.bucket, Key=name, Body=os.urandom(len(data)))
        world.go("g5")
        engine.wait_file(s("f6"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            valid = [
                count
                for name, count in world.indexed_objects().items()
                for _ in range(count)
                if object_ok(world.s3.get_object(Bucket=world.bucket, Key=name)["Body"].read())
            ]
            if len(valid) >= 9:
                break
            time.sleep(0.2)
        seen["valid_indexed_after_corruption"] = len(valid)
        layout = DiskLayout(world.disk)
        rank_dirs = [layout.digest_dir(digest) for digest in layout.digests()]
        seen["disk_files_before_unwritable"] = len(list(world.disk.rglob("*.safetensors")))
        for rank_dir in rank_dirs:  # the tier's folder becomes a file: every write fails
            shutil.rmtree(rank_dir)
            rank_dir.write_text("not a directory")
        world.go("g6")
        result = engine.wait(600)
    finally:
        engine.kill()
        world.proxy.delay = 0.0
        if world.proxy._listener is None:
            world.proxy.start()
        if world.redis_server.process is None:
            world.redis_server.start()
    seen["disk_files_after"] = len(list(world.disk.rglob("*.safetensors")))
    seen["results"] = result["results"]
    seen["log"] = engine.log_file.read_text(errors="replace")
    return seen


def by_name(faults, name: str, nth: int = 0) -> dict:
    return [r for r in faults["results"] if r["name"] == name][nth]


@pytest.mark.vllm
@pytest.mark.slow
def test_restart_after_sigkill_serves_from_disk_and_s3(faults, reference):
    assert by_name(faults, "A")["num_cached_tokens"] == FULL  # disk, after the restart
    assert by_name(faults, "B")["num_cached_tokens"] == FULL  # S3 (its disk copy was removed)
    for name in ("A", "K1", "B"):
        assert_same_output(by_name(faults, name), reference[name])


@pytest.mark.vllm
@pytest.mark.slow
def test_redis_killed_then_restarted_under_a_running_engine(faults, reference):
    down = by_name(faults, "C")
    assert down["num_cached_tokens"] == 0  # C is in S3, but its index is unreachable: a miss
    assert down["seconds"] < BOUNDED
    assert_same_output(down, reference["C"])
    assert_same_output(by_name(faults, "X"), reference["X"])
    back = by_name(faults, "D")
    assert back["num_cached_tokens"] == FULL  # S3 hits resume after the restart
    assert_same_output(back, reference["D"])


@pytest.mark.vllm
@pytest.mark.slow
def test_s3_down_or_slow_is_a_bounded_wait_and_a_recompute(faults, reference):
    for name in ("E", "F"):  # E: connections refused; F: answers slower than read_timeout
        result = by_name(faults, name)
        assert result["seconds"] < BOUNDED, result
        assert_same_output(result, reference[name])
    # No traceback through tiercache's code (vLLM logs one of its own at warm-up).
    for block in faults["log"].split("Traceback")[1:]:
        head = block[:4000]
        assert "/tiercache/" not in head and "/main/connector/" not in head, head


@pytest.mark.vllm
@pytest.mark.slow
def test_s3_objects_overwritten_with_noise_are_recomputed_and_stored_again(faults, reference):
    assert faults["overwritten"] >= 9 * 7
    first, second = by_name(faults, "G", 0), by_name(faults, "G", 1)
    assert_same_output(first, reference["G"])
    # The first G's recomputed blocks were stored again (the corrupt objects were
    # dropped from the index): a whole hit, and a right one.
    assert second["num_cached_tokens"] == FULL
    assert_same_output(second, reference["G"])
    # ... and the recomputed blocks were uploaded again, whole.
    assert faults["valid_indexed_after_corruption"] >= 9


@pytest.mark.vllm
@pytest.mark.slow
def test_unwritable_disk_tier_drops_stores_and_serving_continues(faults, reference):
    cold, hit = by_name(faults, "H", 0), by_name(faults, "H", 1)
    assert_same_output(cold, reference["H"])
    assert hit["num_cached_tokens"] == FULL  # from the CPU tier
    assert_same_output(hit, reference["H"])
    again = by_name(faults, "A", 1)
    assert again["num_cached_tokens"] == FULL
    assert_same_output(again, reference["A"])
    assert faults["disk_files_after"] == 0
    assert "dropped store" in faults["log"]


# -- tier engine: two writers in two processes, GC racing a reader ----------------------------

SLOT = 4096


def tier_config(redis_url: str, s3_endpoint: str, bucket: str, **s3_extra) -> dict:
    return {
        "namespace": "race",
        "redis_url": redis_url,
        "redis": {"write_lease_ttl": 10, "read_lease_ttl": 10, "socket_timeout": 2},
        "cpu": {"capacity": 64 * SLOT},
        "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1", **s3_extra},
    }


@pytest.mark.slow
def test_two_processes_storing_one_prefix_make_one_upload_per_object(redis_url, s3_endpoint, bucket):
    shape = ObjectShape(uuid.uuid4().hex[:16], uuid.uuid4().hex[:16], SLOT)
    blocks = [uuid.uuid4().bytes * 2 for _ in range(32)]
    data = tier_config(redis_url, s3_endpoint, bucket)
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    fields = {"model_digest": shape.model_digest, "rank_digest": shape.rank_digest, "slot_bytes": SLOT}
    procs = [
        ctx.Process(target=write_blocks_in_process, args=(data, fields, blocks, start, results))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    time.sleep(2)  # both are importing; whichever is ready waits for the start
    start.set()
    outcomes = [results.get(timeout=180) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    puts = sum(count for count, _ in outcomes)
    assert all(all(stored) and len(stored) == len(blocks) for _, stored in outcomes)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    names = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", ())]
    assert puts == len(names)  # one PUT per run object, whoever made it
    uploaded: list[bytes] = []
    for name in names:
        body = client.get_object(Bucket=bucket, Key=name)["Body"].read()
        assert object_ok(body)
        uploaded += check_run_bytes(body).block_hashes
    assert sorted(uploaded) == sorted(blocks)  # every block uploaded exactly once
    r = redis_py.Redis.from_url(redis_url)
    assert r.hlen(blocks_key(shape.model_digest, shape.rank_digest)) == len(blocks)


@pytest.mark.slow
def test_gc_racing_a_reader_gives_bytes_or_a_miss(redis_url, s3_endpoint, bucket):
    shape = ObjectShape(uuid.uuid4().hex[:16], uuid.uuid4().hex[:16], SLOT)
    capacity = 8 * shape.object_bytes  # far below what the writer stores
    config = build_config(tier_config(redis_url, s3_endpoint, bucket, capacity=capacity), environ={})
    deployment = Deployment(shape.model_digest, "race", "m", 1, (shape.rank_digest,), shape.object_bytes)
    writer = TierEngine(config, shape, CpuBuffer(1, SLOT, pin_memory=False))
    reader = TierEngine(config, shape, CpuBuffer(1, SLOT, pin_memory=False))
    writer.register(deployment)
    written: list[bytes] = []
    stop = threading.Event()
    counts = {
        "hits": 0,
        "misses": 0,
        "wrong": 0,
        "gone_under_lease": 0,
        "gc_passes": 0,
        "evicted": 0,
        "gc_errors": 0,
    }
    real_fetch = reader.s3.fetch_run

    def fetch_run(*args, **kwargs):  # called only once a read lease is held
        found = real_fetch(*args, **kwargs)
        counts["gone_under_lease"] += sum(result is not Fetch.OK for result in found)
        return found

    reader.s3.fetch_run = fetch_run

    def write() -> None:
        for _ in range(200):  # fresh keys: no re-upload races the GC's delete
            if stop.is_set():
                return
            block = uuid.uuid4().bytes * 2
            done: list = []
            writer.write_down(block, None, done.append, data=block_payload(block, SLOT), tiers=(S3,))
            writer.flush(30)
            if done and done[0].stored.get(S3):
                written.append(block)

    def read() -> None:
        rng = random.Random(7)
        out = memoryview(bytearray(SLOT))
        while not stop.is_set():
            if not written:
                time.sleep(0.01)
                continue
            block = rng.choice(written[-24:])
            if reader.read_into(block, out, S3):
                counts["hits"] += 1
                if bytes(out) != block_payload(block, SLOT):
                    counts["wrong"] += 1
            else:
                counts["misses"] += 1

    def collect() -> None:
        while not stop.is_set():
            report = run_gc(config, sweep_orphans=False)
            counts["gc_errors"] += len(report["errors"])
            counts["gc_passes"] += 1
            counts["evicted"] += report["evicted_objects"]

    threads = [threading.Thread(target=f) for f in (read, read, collect)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        writer_thread = threading.Thread(target=write)
        writer_thread.start()
        writer_thread.join(max(1, deadline - time.monotonic()))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        writer.close()
        reader.close()
    assert counts["wrong"] == counts["gone_under_lease"] == counts["gc_errors"] == 0, counts
    assert counts["hits"] > 0 and counts["misses"] > 0 and counts["evicted"] > 0, counts
    final = run_gc(config, sweep_orphans=False)
    assert final["used_bytes_after"] <= capacity


def test_signals_wait_and_fail_early(tmp_path):
    # The hook the vLLM scenarios rely on: a bounded wait for a file.
    target = tmp_path / "x"
    threading.Timer(0.2, target.touch).start()
    wait_for_file(target, 5)
    with pytest.raises(TimeoutError):
        wait_for_file(tmp_path / "never", 0.2)


@pytest.mark.slow
def test_soak_for_a_minute_through_every_tier(tmp_path):
    """The short version of benchmarks/soak.py (run it with --minutes 15 for the real
    one): capacities far below the working set, Redis restarted under load."""
    import json
    import subprocess
    import sys

    out = tmp_path / "soak.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
    args = [sys.executable, str(script), "--minutes", "1", "--gc-every", "3", "--redis-restarts"]
    proc = subprocess.run([*args, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["wrong"] == 0 and summary["crashes"] == 0, summary["crash_log"]
    assert summary["requests"] > 0 and all(summary["hits"].values()), summary
    figures = {k: v for k, v in summary.items() if k.startswith("max_") or k.endswith("_within_capacity")}
    assert summary["disk_within_capacity"] and summary["s3_within_capacity"], (figures, summary["capacities"])
    assert summary["gc_errors"] == 0 and summary["redis_restarts"] >= 1


@pytest.mark.parametrize("removed_by", ["delete", "eviction"])
def test_a_second_writer_of_a_block_never_leaves_a_file_nothing_counts(tmp_path, monkeypatch, removed_by):
    """Two movers storing one block (the soak found 97 files in a 96-object tier): the
    second writer had checked the key before the first counted it and was still
    writing when the object was removed; its file, renamed between the removal's
    forgetting the key and its unlink, stayed on disk counted by nothing, or was
    unlinked after it was counted. Here the second writer is held in its rename (made
    under the root index's write lock, with its count) while the block is removed:
    the removal waits for the rename, then takes the file."""
    from tiercache.tiers.disk import tier as disk_module
    from tiercache.tiers.disk.tier import DiskTier

    shape = ObjectShape("5" * 16, "6" * 16, SLOT)
    tier = DiskTier(tmp_path, shape.object_bytes)  # room for one object
    block, other = b"k" * 32, b"j" * 32
    key = shape.key(block)

    def put(b: bytes) -> bool:
        data = memoryview(block_payload(b, SLOT))
        return tier.put(shape.key(b), data, shape.header(b, data))

    real_replace = os.replace
    go = threading.Event()
    second = threading.Thread(target=put, args=(block,), name="second-writer")

    def replace(src, dst):
        if threading.current_thread() is second:
            go.wait(10)  # checked the key before the first writer counted it; still writing
        real_replace(src, dst)

    monkeypatch.setattr(disk_module.os, "replace", replace)
    assert put(block)  # the first writer stores and counts the block
    os.unlink(tier.layout.path(key))  # ...which goes, unknown to the second
    assert not tier.get_into(key, memoryview(bytearray(SLOT)))
    second.start()
    time.sleep(0.2)  # the second writer is waiting in its rename
    removal = threading.Thread(
        target=tier.delete if removed_by == "delete" else put,
        args=(key if removed_by == "delete" else other,),
    )
    removal.start()
    time.sleep(0.2)
    assert removal.is_alive(), "the removal did not wait for the rename under way"
    go.set()
    second.join(10)
    removal.join(10)
    files = {p.name for p in tmp_path.rglob("*.safetensors") if not p.name.startswith(".tmp-")}
    stored = tier.keys()
    counted = {Path(tier.layout.path(k)).name for k in stored}
    assert files == counted
    assert Path(tier.layout.path(key)).name not in files  # the removal came last
    assert tier.usage_bytes() <= shape.object_bytes


def test_a_block_stored_while_its_file_is_being_removed_is_counted_only_if_its_file_stays(tmp_path):
    """A mover stores a block at the moment the disk tier removes it (a corrupt copy
    of it, or an eviction): the store's rename and the removal's unlink used to
    interleave, so the store answered True and counted a file the removal then
    unlinked, and the scheduler heard "on disk" for a block that was not there (a
    later load failed)."""
    from tiercache.tiers.disk.tier import DiskTier

    shape = ObjectShape("9" * 16, "a" * 16, SLOT)
    block = b"m" * 32
    key = shape.key(block)
    answers: list[bool] = []
    racing: list[threading.Thread] = []

    def put(b: bytes) -> bool:
        data = memoryview(block_payload(b, SLOT))
        return tier.put(shape.key(b), data, shape.header(b, data))

    def on_remove(removed: str) -> None:
        # The removal has stopped counting the block and not yet unlinked its file:
        # a store of it comes now, and gets as far as it can before the unlink.
        if removed == key and not racing:
            racing.append(threading.Thread(target=lambda: answers.append(put(block))))
            racing[0].start()
            racing[0].join(0.5)

    tier = DiskTier(tmp_path, 4 * shape.object_bytes, on_remove=on_remove)
    assert put(block)
    assert tier.delete(key)
    racing[0].join(10)
    assert answers == [True]
    files = {p.name for p in tmp_path.rglob("*.safetensors") if not p.name.startswith(".tmp-")}
    stored = tier.keys()
    counted = {Path(tier.layout.path(k)).name for k in stored}
    assert files == counted
    out = memoryview(bytearray(SLOT))
    assert tier.contains(key) and tier.get_into(key, out)  # the later store stands


def test_concurrent_disk_writers_never_overshoot_capacity(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from tiercache.tiers.disk.tier import DiskTier

    shape = ObjectShape("7" * 16, "8" * 16, SLOT)
    tier = DiskTier(tmp_path, 10 * shape.object_bytes)
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(tier.usage_bytes())

    def put(i: int) -> bool:
        block = i.to_bytes(4, "big") * 8
        data = memoryview(block_payload(block, SLOT))
        return tier.put(shape.key(block), data, shape.header(block, data))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(put, range(400)))
    finally:
        stop.set()
        watcher.join()
    assert max(seen) <= 10 * shape.object_bytes
    files = [p for p in tmp_path.rglob("*.safetensors") if not p.name.startswith(".tmp-")]
    assert len(files) == len(tier) <= 10
    assert tier.usage_bytes() == sum(p.stat().st_size for p in files)

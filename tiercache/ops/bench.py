"""`tiercache bench`: each tier's put/get throughput against a raw baseline measured
in the same run on the same bytes, the Redis prefix lookup, and memory.

Baselines:
  cpu   one numpy memcpy per block of the same bytes into pre-faulted memory (a
        single memcpy of all blocks at once is reported too, as raw_one_memcpy_*)
  disk  plain open()/write() and open()/readinto() of files of the same sizes in the
        same directories, reads into pre-faulted memory, one region per block (both
        sides warm in the page cache: nothing drops it)
  s3    plain boto3 put_object/get_object of the same payloads, same client settings,
        same concurrency (s3.max_concurrency threads)

The tier side runs the code the connector runs: for cpu, requests of 16 blocks
through the connector's two halves (connector/driver.py), the scheduler planning each
store and CPU-tier hit and the worker copying between the paged KV and CPU slots;
header + checksum + temp file + rename, and verified reads into CPU slots, for disk;
write lease + PUT + index publish, and read lease + verified GET into CPU slots, for
s3. For cpu and disk, tier and baseline alternate request by request (cpu) or block
by block (disk), which goes first alternating too, so both see the same machine; for
s3 they alternate wave by wave (one wave = s3.max_concurrency objects in flight). Speeds are medians over the
repeats, the warm-up repeat excluded; ratios are medians of the per-repeat ratios.

S3 requests (bench_packing.py): the same prompts stored and loaded with one object
per block and with runs, PUTs and GETs per 1k tokens, $ per million tokens at list
prices (tiers/s3/cost.py), and the S3-hit time of each.

This file runs past 500 lines on purpose: each tier's baseline and the tier's own
path stand next to each other, on the same bytes, so that a reader can check the
comparison is fair in one place.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.ops.bench_packing import MAX_PUT_RATIO, bench_requests, print_requests

REPEATS = 9  # measured, after one warm-up
# Blocks per request in the CPU tier's figures: a prompt of 256 tokens in 16-token
# blocks. The connector plans and reports per step, so a request's blocks share it.
CPU_REQUEST_BLOCKS = 16
LOOKUP_SIZES = (32, 256, 2048)
LOOKUP_SAMPLES = 200
INDEX_MEMBERS = 100_000
RSS_CPU_CAPACITY = 4 * 2**30
TARGETS = {"cpu": 0.70, "disk": 0.70, "s3": 0.90}
MAX_REDIS_BYTES_PER_BLOCK = 200
MAX_RSS_OVERHEAD = 0.10

log = logging.getLogger(__name__)


# -- servers ----------------------------------------------------------------------------


@contextlib.contextmanager
def _servers(stack: str, redis_url: str | None, s3_endpoint: str | None, bucket: str):
    if redis_url or s3_endpoint:
        if not (redis_url and s3_endpoint):
            raise ValueError("--redis and --s3-endpoint go together")
        from tiercache.ops.local_stack import create_bucket

        create_bucket(s3_endpoint, bucket)
        yield redis_url, s3_endpoint, "given endpoint"
        return
    if stack != "local":
        raise ValueError(f"--stack must be 'local' (or give --redis and --s3-endpoint), got {stack!r}")
    from moto import __version__ as moto_version

    from tiercache.ops.local_stack import local_stack

    with local_stack(bucket, s3_process=True) as (redis_server, s3):
        yield redis_server.url, s3.url, f"moto {moto_version} S3 server (Python), own process, loopback"


# -- helpers ----------------------------------------------------------------------------


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _timed(fn: Callable[..., Any]) -> float:  # called with no arguments (a lambda's defaults bind)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Pair:
    """Times of a tier operation and its baseline over the repeats."""

    def __init__(self) -> None:
        self.tier: list[float] = []
        self.raw: list[float] = []

    def record(self, repeat: int, tier_s: float, raw_s: float) -> None:
        if repeat > 0:  # repeat 0 is the warm-up
            self.tier.append(tier_s)
            self.raw.append(raw_s)

    def add(self, repeat: int, tier: Callable[[], Any], raw: Callable[[], Any]) -> None:
        """Time two batches, alternating which goes first."""
        first, second = (tier, raw) if repeat % 2 == 0 else (raw, tier)
        a, b = _timed(first), _timed(second)
        self.record(repeat, *((a, b) if repeat % 2 == 0 else (b, a)))

    def add_interleaved(
        self, repeat: int, n: int, tier: Callable[[int], Any], raw: Callable[..., Any]
    ) -> None:
        """Time block by block: tier and raw on block i back to back, in turns first."""
        tier_s = raw_s = 0.0
        clock = time.perf_counter
        for i in range(n):
            if i % 2 == 0:
                start = clock()
                tier(i)
                middle = clock()
                raw(i)
                tier_s, raw_s = tier_s + middle - start, raw_s + clock() - middle
            else:
                start = clock()
                raw(i)
                middle = clock()
                tier(i)
                raw_s, tier_s = raw_s + middle - start, tier_s + clock() - middle
        self.record(repeat, tier_s, raw_s)

    def add_waves(
        self,
        repeat: int,
        n: int,
        wave: int,
        tier: Callable[[range], Any],
        raw: Callable[[range], Any],
    ) -> None:
        """Like add_interleaved, by waves of `wave` items run concurrently."""
        tier_s = raw_s = 0.0
        for number, start in enumerate(range(0, n, wave)):
            items = range(start, min(start + wave, n))
            if number % 2 == 0:
                t, r = _timed(lambda items=items: tier(items)), _timed(lambda items=items: raw(items))
            else:
                r, t = _timed(lambda items=items: raw(items)), _timed(lambda items=items: tier(items))
            tier_s, raw_s = tier_s + t, raw_s + r
        self.record(repeat, tier_s, raw_s)

    def gbps(self, nbytes: int) -> tuple[float, float]:
        return _gbps(nbytes, statistics.median(self.tier)), _gbps(nbytes, statistics.median(self.raw))

    def ratio(self) -> float:
        """Median of the per-repeat ratios: tier and raw of one repeat ran side by side
        on the same machine state, so their ratio is steadier than either speed."""
        return statistics.median(raw / tier for tier, raw in zip(self.tier, self.raw, strict=True))


def _tier_figures(put: _Pair, get: _Pair, nbytes: int) -> dict[str, float]:
    put_gbps, raw_put = put.gbps(nbytes)
    get_gbps, raw_get = get.gbps(nbytes)
    return {
        "put_gbps": round(put_gbps, 4),
        "get_gbps": round(get_gbps, 4),
        "raw_put_gbps": round(raw_put, 4),
        "raw_get_gbps": round(raw_get, 4),
        "put_ratio": round(put.ratio(), 3),
        "get_ratio": round(get.ratio(), 3),
    }


def _hashes(n: int, salt: int) -> list[bytes]:
    rng = np.random.default_rng(10_000 + salt)
    return [rng.bytes(32) for _ in range(n)]


class _Progress:
    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description:<28}"), BarColumn(), TimeElapsedColumn(), transient=False
            )
            self.task = self.bar.add_task("starting", total=total)

    def __enter__(self) -> _Progress:
        if self.bar:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()

    def step(self, description: str) -> None:
        if self.bar:
            self.bar.update(self.task, advance=1, description=description)


# -- tiers ------------------------------------------------------------------------------


def _bench_cpu(payload: np.ndarray, progress: _Progress) -> dict[str, float]:
    from tiercache.config import build_config
    from tiercache.connector.driver import ConnectorDriver

    blocks, block_bytes = payload.shape
    config = build_config({"cpu": {"capacity": blocks * block_bytes}}, environ={})
    # The paged KV: the first `blocks` blocks hold the payload, as a forward leaves
    # what it computed; a get loads into the next `blocks`; one more takes each
    # request's last token.
    cache = ConnectorDriver(config, block_bytes, model="bench-cpu", num_blocks=2 * blocks + 1)
    for i in range(blocks):
        cache.kv_block(i)[:] = payload[i]
        cache.kv_block(blocks + i)[:] = payload[i]  # pre-faulted, as vLLM's paged KV is
    source = cache.buffer.tensor.numpy()
    # The blocks of each request, in turn (the last may be shorter).
    requests = [
        list(range(s, min(s + CPU_REQUEST_BLOCKS, blocks))) for s in range(0, blocks, CPU_REQUEST_BLOCKS)
    ]
    # Pre-faulted destinations of the baseline's own, so neither side finds the
    # other's lines in cache.
    raw_dst, raw_out = (np.ones_like(payload) for _ in range(2))
    put, get, one_put, one_get = _Pair(), _Pair(), _Pair(), _Pair()
    try:
        for repeat in range(REPEATS + 1):
            hashes = _hashes(blocks, repeat)  # new blocks: the last repeat's are evicted
            slot_of: list[int] = [0] * blocks

            def tier_put(r: int, hashes=hashes, slot_of=slot_of) -> None:
                ids = requests[r]
                cache.serve([hashes[i] for i in ids], gpu_blocks=ids, computes=True)
                for i in ids:
                    slot = cache.slots.slot_of(hashes[i])
                    assert slot is not None  # stored, in a CPU tier that holds every block
                    slot_of[i] = slot

            def tier_get(r: int, hashes=hashes) -> None:
                ids = requests[r]
                served = cache.serve([hashes[i] for i in ids], gpu_blocks=[blocks + i for i in ids])
                assert served.tiers == ["cpu"] * len(ids)  # put above, in a tier that holds every block

            def raw_put(r: int) -> None:
                for i in requests[r]:
                    np.copyto(raw_dst[i], payload[i])

            def raw_get(r: int, slot_of=slot_of) -> None:
                for i in requests[r]:
                    np.copyto(raw_out[i], source[slot_of[i]])

            put.add_interleaved(repeat, len(requests), tier_put, raw_put)
            get.add_interleaved(repeat, len(requests), tier_get, raw_get)
            one_put.add(repeat, lambda: None, lambda: np.copyto(raw_dst, payload))
            one_get.add(repeat, lambda: None, lambda: np.copyto(raw_out, source))
            progress.step("cpu")
        if not np.array_equal(cache.kv[blocks : 2 * blocks].numpy(), payload):
            raise RuntimeError("a CPU-tier get loaded other bytes than were put")
    finally:
        cache.close()
    figures = _tier_figures(put, get, payload.nbytes)
    figures["raw_one_memcpy_put_gbps"] = round(one_put.gbps(payload.nbytes)[1], 4)
    figures["raw_one_memcpy_get_gbps"] = round(one_get.gbps(payload.nbytes)[1], 4)
    return figures


def _bench_disk(payload: np.ndarray, root: Path, progress: _Progress) -> dict[str, float]:
    from tiercache.engine import ObjectShape
    from tiercache.tiers.cpu import CpuBuffer
    from tiercache.tiers.disk.tier import DiskTier

    blocks, block_bytes = payload.shape
    shape = ObjectShape("d" * 16, "d" * 16, block_bytes)
    tier = DiskTier(root, 2 * (REPEATS + 1) * blocks * shape.object_bytes)
    for prefix in range(256):  # the folders a long-running tier has: neither side pays mkdir
        (root / shape.rank_digest / f"{prefix:02x}").mkdir(parents=True, exist_ok=True)
    buffer = CpuBuffer(blocks, block_bytes, pin_memory=False)  # gets land in CPU slots
    slots = [buffer.view(i) for i in range(blocks)]
    rows = [memoryview(row) for row in payload]
    preamble_bytes = shape.object_bytes - block_bytes
    # The baseline's reads land in pre-faulted memory of their own, one region per
    # block, as the tier's land in CPU slots (not in one reused, cache-hot buffer).
    raw_in = CpuBuffer(blocks, shape.object_bytes, pin_memory=False)
    put, get = _Pair(), _Pair()
    for repeat in range(REPEATS + 1):
        hashes = _hashes(blocks, 100 + repeat)
        keys = [shape.key(h) for h in hashes]
        paths = [tier.path_of(k) for k in keys]
        raw_paths = [p.with_name("raw-" + p.name) for p in paths]

        def tier_put(i: int, hashes=hashes, keys=keys) -> None:
            if not tier.put(keys[i], rows[i], shape.header(hashes[i], rows[i])):
                raise RuntimeError(f"disk tier refused {keys[i]}")

        def raw_put(i: int, raw_paths=raw_paths) -> None:
            # A file of the same size as the tier's object: a preamble, then the pages.
            with open(raw_paths[i], "wb") as f:
                f.write(bytes(preamble_bytes))
                f.write(rows[i])

        def tier_get(i: int, keys=keys) -> None:
            if not tier.get_into(keys[i], slots[i]):
                raise RuntimeError(f"disk tier lost {keys[i]}")

        def raw_get(i: int, paths=paths) -> None:
            with open(paths[i], "rb", buffering=0) as f:  # the very file the tier wrote
                f.readinto(raw_in.view(i))

        put.add_interleaved(repeat, blocks, tier_put, raw_put)
        get.add_interleaved(repeat, blocks, tier_get, raw_get)
        for key, path in zip(keys, raw_paths, strict=True):
            tier.delete(key)
            path.unlink()
        progress.step("disk")
    return _tier_figures(put, get, payload.nbytes)


def _bench_s3(
    payload: np.ndarray, redis_url: str, s3_endpoint: str, bucket: str, progress: _Progress
) -> tuple[dict[str, float], int]:
    from tiercache.config import build_config
    from tiercache.engine import S3, ObjectShape, TierEngine
    from tiercache.tiers.cpu import CpuBuffer
    from tiercache.tiers.s3.tier import make_client

    blocks, block_bytes = payload.shape
    config = build_config(
        {
            "redis_url": redis_url,
            "cpu": {"capacity": blocks * block_bytes},
            "s3": {"bucket": bucket, "prefix": "bench/", "endpoint_url": s3_endpoint, "region": "us-east-1"},
        },
        environ={},
    )
    assert config.s3 is not None
    concurrency = config.s3.max_concurrency
    shape = ObjectShape("e" * 16, "e" * 16, block_bytes)
    buffer = CpuBuffer(blocks, block_bytes, pin_memory=False)
    engine = TierEngine(config, shape, buffer)
    assert engine.s3 is not None and engine.index is not None  # configured above
    raw_client = make_client(config.s3)  # plain boto3, the same transport settings
    pool = ThreadPoolExecutor(concurrency)
    rows = [memoryview(row) for row in payload]
    put, get = _Pair(), _Pair()
    try:
        for repeat in range(REPEATS + 1):
            hashes = _hashes(blocks, 200 + repeat)
            headers = [shape.header(h, row) for h, row in zip(hashes, rows, strict=True)]
            names = [f"bench/raw/{h.key}" for h in headers]  # raw objects of the same size
            raw_bodies = [h.encode() + row.tobytes() for h, row in zip(headers, rows, strict=True)]

            def tier_put(items: range, hashes=hashes, headers=headers) -> None:
                writer = engine.s3_writer
                assert writer is not None  # the bench config has S3 and Redis
                done = pool.map(lambda i: writer.upload(hashes[i], rows[i], headers[i]), items)
                if not all(done):
                    raise RuntimeError("s3 tier refused a put")

            def raw_put(items: range, names=names, raw_bodies=raw_bodies) -> None:
                put_one = raw_client.put_object
                list(pool.map(lambda i: put_one(Bucket=bucket, Key=names[i], Body=raw_bodies[i]), items))

            def tier_get(items: range, hashes=hashes) -> None:
                done = pool.map(lambda i: engine.read_into(hashes[i], buffer.view(i), S3), items)
                if not all(done):
                    raise RuntimeError("s3 tier lost an object")

            def raw_get(items: range, names=names) -> None:  # objects of the size the tier wrote
                get_one = raw_client.get_object
                list(pool.map(lambda i: get_one(Bucket=bucket, Key=names[i])["Body"].read(), items))

            put.add_waves(repeat, blocks, concurrency, tier_put, raw_put)
            get.add_waves(repeat, blocks, concurrency, tier_get, raw_get)
            runs = [
                engine.s3.run_name(rank, run) for rank, run, _, _ in engine.s3.list_runs(shape.rank_digest)
            ]
            tier_and_raw = names + runs
            for start in range(0, len(tier_and_raw), 500):
                objects = [{"Key": n} for n in tier_and_raw[start : start + 500]]
                raw_client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
            for key in _index_keys(shape):
                engine.index.redis.client.delete(key)
            progress.step("s3")
    finally:
        pool.shutdown()
        engine.close()
    return _tier_figures(put, get, payload.nbytes), concurrency


def _index_keys(shape) -> tuple[str, ...]:
    from tiercache.index.redis_index import index_keys

    return index_keys(shape.model_digest, shape.rank_digest)


# -- lookup and memory ------------------------------------------------------------------


def _bench_lookup(redis_url: str, progress: _Progress) -> dict[str, dict[str, float]]:
    from tiercache.config import RedisConfig
    from tiercache.index.redis_conn import GuardedRedis
    from tiercache.index.redis_index import RedisIndex, RunRecord, index_keys

    guarded = GuardedRedis(redis_url, RedisConfig())
    index = RedisIndex(guarded)
    model, rank = "f" * 16, "f" * 16
    keys = index_keys(model, rank)
    sent = [0]
    original = guarded.client.execute_command

    def counting(*args, **kwargs):
        sent[0] += 1
        return original(*args, **kwargs)

    results = {}
    try:
        for n in LOOKUP_SIZES:
            hashes = _hashes(n, 300 + n)
            guarded.client.delete(*keys)
            for first in range(0, n, 16):  # runs of 16, as tiercache writes them
                run = first.to_bytes(8, "big")
                index.add_run(model, rank, run, RunRecord(0, 0, 0, tuple(hashes[first : first + 16])))
            for _ in range(5):  # warm-up: script loaded, connection open
                assert index.longest_prefix(model, [rank], hashes) == n
            guarded.client.execute_command = counting
            sent[0] = 0
            times = []
            for _ in range(LOOKUP_SAMPLES):
                start = time.perf_counter()
                found = index.longest_prefix(model, [rank], hashes)
                times.append(time.perf_counter() - start)
                assert found == n
            del guarded.client.execute_command
            trips = sent[0] / LOOKUP_SAMPLES
            results[str(n)] = {
                "p50_ms": round(statistics.median(times) * 1000, 4),
                "p99_ms": round(float(np.percentile(times, 99)) * 1000, 4),
                "round_trips": int(trips) if trips == int(trips) else round(trips, 3),
            }
            progress.step("lookup")
    finally:
        guarded.client.delete(*keys)
        guarded.close()
    return results


def _redis_bytes_per_block(redis_url: str) -> float:
    """The index's Redis bytes per block, in runs of 16 (tiercache/index/redis_index.py's layout)."""
    from tiercache.config import RedisConfig
    from tiercache.index.redis_conn import GuardedRedis
    from tiercache.index.redis_index import RedisIndex, RunRecord, index_keys

    guarded = GuardedRedis(redis_url, RedisConfig(socket_timeout=10))
    index = RedisIndex(guarded)
    model, rank = "bench0000000000a", "bench0000000000b"
    try:
        guarded.client.delete(*index_keys(model, rank))
        rng = np.random.default_rng(7)
        for _ in range(INDEX_MEMBERS // 16):
            hashes = tuple(rng.bytes(32) for _ in range(16))
            index.add_run(model, rank, rng.bytes(8), RunRecord(4096, 4096, 1 << 20, hashes))
        assert index.count(model, rank) == INDEX_MEMBERS
        return index.memory_usage(model, rank) / INDEX_MEMBERS
    finally:
        guarded.client.delete(*index_keys(model, rank))
        guarded.close()


def _vm(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_probe(args: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: the connector's halves with every tier, write-through,
    at the given CPU capacity, then restarted over the same disk and every block read
    back from it (staged into CPU slots); how much memory the process holds beyond
    that capacity and the paged KV it loads into (vLLM's memory, not the cache's)."""
    import gc

    import torch  # noqa: F401  (loaded before the baseline: a vLLM worker has it anyway)

    from tiercache.config import build_config
    from tiercache.connector.driver import ConnectorDriver

    baseline = _vm("VmRSS")
    capacity, block_bytes, blocks = args["capacity"], args["block_bytes"], args["blocks"]
    config = build_config(
        {
            "redis_url": args["redis_url"],
            "cpu": {"capacity": capacity},
            "disk": {"path": args["disk"], "capacity": 4 * blocks * (block_bytes + 8192)},
            "s3": {"bucket": args["bucket"], "prefix": "rss/", "endpoint_url": args["s3_endpoint"]},
        },
        environ={},
    )
    payload = np.random.default_rng(3).integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    hashes = _hashes(blocks, 400)
    cache = ConnectorDriver(config, block_bytes, model="bench-rss", num_blocks=blocks + 1)
    cache.serve(hashes, list(payload))
    cache.flush(60)
    cache.close()
    del cache
    gc.collect()
    cache = ConnectorDriver(config, block_bytes, model="bench-rss", num_blocks=blocks + 1)
    served = cache.serve(hashes)  # a new instance: every block from disk
    if served.tiers != ["disk"] * blocks:
        raise RuntimeError(f"the memory probe read back {served.tiers} instead of disk hits")
    cache.flush(60)
    kv_bytes = cache.kv.numel()
    rss, peak = _vm("VmRSS") - kv_bytes, _vm("VmHWM") - kv_bytes
    num_slots = cache.slots.num_slots
    cache.close()
    return {
        "capacity": capacity,
        "rss": rss,
        "peak_rss": peak,
        "baseline_rss": baseline,
        "cpu_slots": num_slots,
    }


def _measure_rss(redis_url, s3_endpoint, bucket, block_bytes, blocks, workdir: Path) -> dict[str, Any]:
    args = {
        "capacity": RSS_CPU_CAPACITY,
        "block_bytes": block_bytes,
        "blocks": blocks,
        "redis_url": redis_url,
        "s3_endpoint": s3_endpoint,
        "bucket": bucket,
        "disk": str(workdir / "rss-disk"),
    }
    code = (
        "import json, sys; from tiercache.ops.bench import rss_probe; "
        "print(json.dumps(rss_probe(json.loads(sys.argv[1]))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        raise RuntimeError(f"memory probe failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- the run --------------------------------------------------------------------------------


def _machine(workdir: Path, s3_server: str, redis_url: str) -> dict[str, Any]:
    import redis
    import torch

    cpu_model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        names = (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
        cpu_model = next(names, "")
    mem_total = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        mem_total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal"))
    fs = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        fs = subprocess.run(
            ["df", "--output=fstype", str(workdir)], capture_output=True, text=True, timeout=10
        ).stdout.split()[-1]
    client = redis.Redis.from_url(redis_url)
    try:
        redis_version = client.info("server").get("redis_version", "")
    finally:
        client.close()
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_total_bytes": mem_total,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "disk_dir_fs": fs,
        "redis_server": redis_version,
        "s3_server": s3_server,
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def run_bench(
    stack: str,
    redis_url: str | None,
    s3_endpoint: str | None,
    bucket: str,
    block_bytes: int,
    blocks: int,
    progress: bool,
) -> dict[str, Any]:
    if block_bytes < 4096 or blocks < 1:
        raise ValueError("block_bytes must be at least 4096 and blocks at least 1")
    logging.getLogger("tiercache").setLevel(logging.ERROR)
    payload = np.random.default_rng(1).integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    workdir = Path(tempfile.mkdtemp(prefix="tiercache-bench-"))
    steps = 3 * (REPEATS + 1) + len(LOOKUP_SIZES) + 3
    try:
        with (
            _servers(stack, redis_url, s3_endpoint, bucket) as (redis_at, s3_at, s3_server),
            _Progress(progress, steps) as bar,
        ):
            machine = _machine(workdir, s3_server, redis_at)
            cpu = _bench_cpu(payload, bar)
            disk = _bench_disk(payload, workdir / "disk", bar)
            s3, concurrency = _bench_s3(payload, redis_at, s3_at, bucket, bar)
            lookup = _bench_lookup(redis_at, bar)
            requests = bench_requests(redis_at, s3_at, bucket, block_bytes)
            bar.step("s3 requests")
            per_block = _redis_bytes_per_block(redis_at)
            bar.step("redis memory")
            rss = _measure_rss(redis_at, s3_at, bucket, block_bytes, blocks, workdir)
            bar.step("process memory")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    capacity = rss["capacity"]
    return {
        "tiers": {"cpu": cpu, "disk": disk, "s3": s3},
        "lookup": lookup,
        "s3_requests": requests,
        "memory": {
            "redis_bytes_per_block": round(per_block, 1),
            "rss_over_cpu_capacity": round((rss["rss"] - capacity) / capacity, 4),
            "peak_rss_over_cpu_capacity": round((rss["peak_rss"] - capacity) / capacity, 4),
            "cpu_capacity_bytes": capacity,
            "rss_bytes": rss["rss"],
            "rss_before_cache_bytes": rss["baseline_rss"],
            "index_members": INDEX_MEMBERS,
        },
        "machine": machine,
        "settings": {
            "block_bytes": block_bytes,
            "blocks": blocks,
            "repeats": REPEATS,
            "warmup_repeats": 1,
            "s3_concurrency": concurrency,
            "lookup_ranks": 1,
            "lookup_samples": LOOKUP_SAMPLES,
            "page_cache": "warm for both disk figures (not dropped)",
        },
    }


def targets_missed(result: dict[str, Any]) -> list[str]:
    missed = []
    for tier, figures in result["tiers"].items():
        for op in ("put", "get"):
            if figures[f"{op}_ratio"] < TARGETS[tier]:
                missed.append(f"{tier} {op} {figures[f'{op}_ratio']:.0%} of raw (< {TARGETS[tier]:.0%})")
    for n, figures in result["lookup"].items():
        if figures["round_trips"] != 1:
            missed.append(f"lookup of {n} took {figures['round_trips']} round trips")
    requests = result.get("s3_requests")
    if requests and requests["put_ratio"] > MAX_PUT_RATIO:
        missed.append(
            f"packed runs sent {requests['put_ratio']:.3f} of per-block PUTs (> {MAX_PUT_RATIO:.3f})"
        )
    memory = result["memory"]
    if memory["redis_bytes_per_block"] > MAX_REDIS_BYTES_PER_BLOCK:
        missed.append(f"redis holds {memory['redis_bytes_per_block']} bytes per block")
    if memory["rss_over_cpu_capacity"] > MAX_RSS_OVERHEAD:
        missed.append(f"RSS is {memory['rss_over_cpu_capacity']:.1%} over the CPU capacity")
    return missed


def print_table(result: dict[str, Any], console) -> None:
    from rich.table import Table

    table = Table(title="tier throughput (GB/s, medians)")
    for column in ("tier", "put", "raw put", "put/raw", "get", "raw get", "get/raw", "target"):
        table.add_column(column, justify="right" if column != "tier" else "left")
    for tier, f in result["tiers"].items():
        target = TARGETS[tier]

        def ratio(value: float, target: float = target) -> str:
            colour = "green" if value >= target else "red"
            return f"[{colour}]{value:.0%}[/{colour}]"

        table.add_row(
            tier,
            f"{f['put_gbps']:.3f}",
            f"{f['raw_put_gbps']:.3f}",
            ratio(f["put_ratio"]),
            f"{f['get_gbps']:.3f}",
            f"{f['raw_get_gbps']:.3f}",
            ratio(f["get_ratio"]),
            f">= {target:.0%}",
        )
    console.print(table)
    lookups = Table(title="Redis prefix lookup (1 rank, all blocks present)")
    for column in ("blocks", "p50 ms", "p99 ms", "round trips"):
        lookups.add_column(column, justify="right")
    for n, f in result["lookup"].items():
        lookups.add_row(n, f"{f['p50_ms']:.3f}", f"{f['p99_ms']:.3f}", str(f["round_trips"]))
    console.print(lookups)
    if result.get("s3_requests"):
        print_requests(result["s3_requests"], console)
    memory = result["memory"]
    console.print(
        f"Redis bytes per indexed block: {memory['redis_bytes_per_block']:.1f} (target <= "
        f"{MAX_REDIS_BYTES_PER_BLOCK}); RSS beyond a {memory['cpu_capacity_bytes'] / 2**30:.0f} GiB "
        f"CPU tier: {memory['rss_over_cpu_capacity']:.1%} (target <= {MAX_RSS_OVERHEAD:.0%})"
    )
    machine = result["machine"]
    console.print(
        f"{machine['nproc']} CPUs ({machine['cpu_model']}), "
        f"{machine['mem_total_bytes'] / 2**30:.1f} GiB RAM, S3: {machine['s3_server']}"
    )
    missed = targets_missed(result)
    if missed:
        console.print("[red]missed: " + "; ".join(missed) + "[/red]")
    else:
        console.print("[green]every target met[/green]")

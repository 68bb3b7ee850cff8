"""End-to-end benchmarks of tiercache inside vLLM, against baselines measured in the
same run: time to first token (TTFT) cold, on vLLM's own prefix-cache hit, on vLLM's
ExampleConnector hit and on tiercache hits from CPU, disk and S3; the store-path
overhead; the Redis prefix lookup; S3 GET throughput.

    python benchmarks/e2e.py ttft   --lengths 1000,2000,4000 --repeats 3
    python benchmarks/e2e.py disk   --engines 3   (more fresh disk-hit engines, after ttft)
    python benchmarks/e2e.py lookup
    python benchmarks/e2e.py s3
    python benchmarks/e2e.py s3hit  --s3-server seaweedfs   (S3 hit / CPU hit, one S3 server)
    python benchmarks/e2e.py plot   (PNGs under docs/img/ from the saved JSON)

Every engine is a fresh vLLM process (tiercache.ops.vllm_runner). Each engine
first runs unrelated warm-up prompts (the CPU backend's first request pays seconds
of one-off set-up; a hit path is warmed with a hit too); only later requests are
measured. Every figure is a median over `--repeats` distinct prompts, and every hit
is checked: its num_cached_tokens, and its first-step top logprobs within 0.3 of the
cold run of the same prompt in the baseline engine.

TTFT is vLLM's own first_token_latency (arrival to first token, with log_stats on in
every engine); decode tokens/s is (generated - 1) / (last token - first token).

The helpers the benchmarks share (model, prompts, engine runner, summaries) are in
harness.py. This file is the e2e benchmark's commands, one section each (ttft,
disk, store, lookup, s3, plot); it is long because each command's set-up, run and
summary read best in one place; other scripts import from harness.py, not from here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import (
    BLOCK,
    IMG,
    MODEL,
    NAMESPACE,
    RESULTS,
    CpuMonitor,
    EngineRunner,
    Requests,
    decode_rate,
    engine_env,
    logprob_gap,
    machine,
    median,
    prompt,
    request,
    results_by,
    save,
    service_cpus,
    store_services,
    summarize_rows,
    ttft,
    write_model,
)

# -- TTFT -----------------------------------------------------------------------------


# Disk hits staged into CPU slots (as on GPUs), so that the same prompt asked again
# is a CPU-tier hit: the disk hit / CPU hit pairs below need one.
STAGED_DISK = {"load_in_forward": False}


def tiercache_kv(extra: dict[str, Any]) -> dict[str, Any]:
    from tiercache.ops.vllm_runner import connector_config

    return connector_config({"namespace": NAMESPACE, **extra})


def example_kv(path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def ttft_runner(args: argparse.Namespace, work: Path, longest: int, partial: Path) -> EngineRunner:
    """The engine runner of the TTFT engines: the benchmark model, room for the
    longest prompt and the decoded tokens, vLLM's per-request timestamps on."""
    base_spec = {
        "model": str(write_model(work / "model")),
        "max_model_len": longest + args.decode_tokens + 64,
        "gpu_memory_utilization": args.kv_fraction,
        "log_stats": True,
    }
    return EngineRunner(base_spec, work / "runs", engine_env(args), partial)


def run_ttft(args: argparse.Namespace) -> dict[str, Any]:
    from tiercache.ops.local_stack import local_stack

    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    longest = max(lengths + ([8000] if args.cold_8k else []))
    asks = Requests(lengths, args.repeats)
    decode = args.decode_tokens
    runner = ttft_runner(args, work, longest, work / "partial.json")
    engine, warm, colds, hits = runner.run, asks.warm, asks.colds, asks.hits

    # 1. No connector, no prefix cache: cold TTFT and decode rate (the baseline of all).
    extra_cold = [request("cold8k/8000/0", prompt(8, 8000))] if args.cold_8k else []
    engine("none", warm(False) + colds(decode, False) + extra_cold)
    # 2. vLLM's own prefix cache: the floor.
    engine("prefix_cache", warm(True) + colds(1, True), enable_prefix_caching=True)
    # 3. vLLM's ExampleConnector: hit in the same engine, then from a fresh engine.
    example_dir = work / "example"
    shutil.rmtree(example_dir, ignore_errors=True)
    engine(
        "example",
        warm(True, stored=True) + colds(1, True),
        kv_transfer_config=example_kv(example_dir),
    )
    engine("example_fresh", warm(False, stored=True) + hits(), kv_transfer_config=example_kv(example_dir))

    # 4. tiercache with every tier (CPU + disk + Redis/S3, write-through).
    disk_full, disk_empty = work / "disk-full", work / "disk-empty"
    for d in (disk_full, disk_empty):
        shutil.rmtree(d, ignore_errors=True)
    cpu = {"capacity": args.cpu_capacity}
    stack = local_stack(
        "tiercache-bench", s3_process=True, cpus=service_cpus(args), s3_server=s3_server(args)
    )
    with stack as (redis_server, s3):
        shared = {
            "redis_url": redis_server.url,
            "s3": {"bucket": "tiercache-bench", "endpoint_url": s3.url, "prefix": "e2e/"},
            "movers": {"shutdown_flush_seconds": 300, "cost_model": "off"},  # each tier's own hit
        }
        engine(
            "tiercache",
            warm(True, stored=True) + colds(decode, True),
            kv_transfer_config=tiercache_kv({"cpu": cpu, "disk": {"path": str(disk_full)}, **shared}),
        )
        # 5. A fresh engine, disk tier only: disk hits, then the same prompt again
        #    (now a CPU hit, with no write-through in flight). Staged, as on GPUs: a
        #    disk hit read in the forward (the CPU backend's default) is not promoted,
        #    so no CPU hit would follow; hit_pairs.py measures that read.
        engine(
            "tiercache_disk",
            warm(False, stored=True) + hits(twice=True),
            kv_transfer_config=tiercache_kv({"cpu": cpu, "disk": STAGED_DISK | {"path": str(disk_full)}}),
        )
        # 6. A fresh engine with an empty disk: S3 hits (via one Redis lookup).
        engine(
            "tiercache_s3",
            warm(False, stored=True) + hits(twice=True),
            kv_transfer_config=tiercache_kv({"cpu": cpu, "disk": {"path": str(disk_empty)}, **shared}),
        )
        # 7. The floors of those hits' extra time: the same number of objects read with
        #    nothing but plain reads and plain boto3, in as many threads as tiercache uses.
        blocks = max(lengths) // BLOCK
        raw = {
            "blocks": blocks,
            "disk_read_seconds": [raw_disk_read(disk_full, blocks) for _ in range(args.repeats)],
            "s3_get_seconds": [
                raw_s3_get(s3.url, "tiercache-bench", "e2e/", blocks) for _ in range(args.repeats)
            ],
        }

    runner.stop()
    return {**summarize_ttft(runner.engines, lengths, args), "raw_transfers": raw}


def s3_server(args: argparse.Namespace) -> str:
    """The S3 server the TTFT engines use: moto, or SeaweedFS (a real store that checks
    signatures and serves ranged GETs from its volumes); the sink only takes writes."""
    if args.s3_server not in ("moto", "seaweedfs"):
        raise SystemExit(f"--s3-server {args.s3_server}: ttft and s3hit read back, so moto or seaweedfs")
    return args.s3_server


def run_s3_hit(args: argparse.Namespace) -> dict[str, Any]:
    """The S3 hit's TTFT against the CPU hit, on one S3 server (`--s3-server`): steps 4
    and 6 of `ttft` alone. A storing engine (each prompt cold, then its CPU hit with the
    write-through in flight), then a fresh engine with an empty disk: each prompt's S3
    hit, then the same prompt again, a CPU hit after the S3 promote (after a settle for
    the warm-ups' uploads, which `ttft` does not wait for). The ratios are
    paired prompt by prompt inside that engine; every hit is checked against the
    storing engine's cold run of the same prompt."""
    from tiercache.ops.local_stack import local_stack

    server = s3_server(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    asks = Requests(lengths, args.repeats)
    runner = ttft_runner(args, work, max(lengths), work / f"partial-s3hit-{server}.json")
    disk_full, disk_empty = work / "disk-full", work / "disk-empty"
    for d in (disk_full, disk_empty):
        shutil.rmtree(d, ignore_errors=True)
    cpu = {"capacity": args.cpu_capacity}
    with local_stack("tiercache-bench", s3_process=True, cpus=service_cpus(args), s3_server=server) as (
        redis_server,
        s3,
    ):
        shared = {
            "redis_url": redis_server.url,
            "s3": {"bucket": "tiercache-bench", "endpoint_url": s3.url, "prefix": "e2e/"},
            "movers": {"shutdown_flush_seconds": 300, "cost_model": "off"},  # each tier's own hit
        }
        runner.run(
            "tiercache",
            asks.warm(True, stored=True) + asks.colds(1, True),
            kv_transfer_config=tiercache_kv({"cpu": cpu, "disk": {"path": str(disk_full)}, **shared}),
        )
        # The warm-ups store their own prompts, uploaded as each request ends: the
        # settle (longer than s3.pack_flush_seconds) keeps those uploads out of the
        # timed S3 hits (docs/benchmarks.md, "Inside vLLM: the S3 hit's TTFT with runs").
        settle = [{"sleep": 8}]
        runner.run(
            "tiercache_s3",
            asks.warm(False, stored=True) + settle + asks.hits(twice=True),
            kv_transfer_config=tiercache_kv({"cpu": cpu, "disk": {"path": str(disk_empty)}, **shared}),
        )
    runner.stop()
    engines = runner.engines
    cold, cpu_hit = results_by(engines, "tiercache", "cold"), results_by(engines, "tiercache", "hit")
    s3_hit, promoted = results_by(engines, "tiercache_s3", "hit"), results_by(engines, "tiercache_s3", "hit2")
    per_length: dict[int, dict[str, Any]] = {}
    for n in lengths:
        keys = [k for k in sorted(s3_hit) if k[0] == n and k in promoted and k in cold]
        ratios = [ttft(s3_hit[k]) / ttft(promoted[k]) for k in keys]
        per_length[n] = {
            "cold_ttft_median": median([ttft(cold[k]) for k in keys]),
            "cpu_hit_same_engine_ttft_median": median([ttft(cpu_hit[k]) for k in keys if k in cpu_hit]),
            "s3_hit_ttft_median": median([ttft(s3_hit[k]) for k in keys]),
            "cpu_hit_after_s3_promote_ttft_median": median([ttft(promoted[k]) for k in keys]),
            "s3_hit_vs_cpu_hit_paired": {"median": median(ratios), "all": ratios},
            "s3_hit_extra_seconds_median": median([ttft(s3_hit[k]) - ttft(promoted[k]) for k in keys]),
            "s3_hit_cached_tokens": [s3_hit[k]["num_cached_tokens"] for k in keys],
            "max_logprob_gap": max(
                logprob_gap(r[k]["top_logprobs"], cold[k]["top_logprobs"])
                for r in (s3_hit, promoted)
                for k in keys
            ),
        }
    return {
        "machine": machine(),
        "args": vars(args),
        "s3_server": server,
        "lengths": lengths,
        "per_length": per_length,
        "raw": engines,
    }


def print_s3_hit(data: dict[str, Any]) -> None:
    print(f"\nS3 server: {data['s3_server']}")
    columns = ["prompt", "cold", "CPU hit (storing engine)", "S3 hit", "CPU hit after promote"]
    print("| " + " | ".join([*columns, "S3 hit / CPU hit", "cached"]) + " |")
    print("|---|---|---|---|---|---|---|")
    for n, v in data["per_length"].items():
        ratio = v["s3_hit_vs_cpu_hit_paired"]
        print(
            f"| {n} tok | {v['cold_ttft_median'] * 1000:.0f} ms "
            f"| {v['cpu_hit_same_engine_ttft_median'] * 1000:.0f} ms "
            f"| {v['s3_hit_ttft_median'] * 1000:.0f} ms "
            f"| {v['cpu_hit_after_s3_promote_ttft_median'] * 1000:.0f} ms "
            f"| {ratio['median']:.2f} ({min(ratio['all']):.2f}-{max(ratio['all']):.2f}) "
            f"| {v['s3_hit_cached_tokens']} |"
        )


def raw_disk_read(root: Path, count: int) -> float:
    """Seconds to read `count` of the disk tier's objects under `root` into memory with
    plain reads, in as many threads as tiercache's disk readers (movers.workers)."""
    from tiercache.config import MoverConfig

    files = sorted(root.rglob("*.safetensors"))[:count]
    size = max(f.stat().st_size for f in files)
    buffers = threading.local()

    def allocate() -> None:
        # Each thread's buffer, touched once, before the timing starts.
        buffers.one = bytearray(b"\1" * size)

    def read(path: Path) -> int:
        with open(path, "rb", buffering=0) as f:
            return f.readinto(buffers.one)

    workers = MoverConfig().workers
    with ThreadPoolExecutor(workers, initializer=allocate) as pool:
        # Start every thread (the pool starts one per task until it has them all).
        list(pool.map(time.sleep, [0.05] * workers))
        start = time.perf_counter()
        list(pool.map(read, files))
        return time.perf_counter() - start


def raw_s3_get(url: str, bucket: str, prefix: str, count: int) -> float:
    """Seconds to GET `count` objects under `prefix` with a plain boto3 client, in as
    many threads as tiercache's S3 tier (s3.max_concurrency)."""
    import boto3
    from botocore.config import Config

    from tiercache.config import S3TierConfig

    threads = S3TierConfig(bucket=bucket).max_concurrency
    client = boto3.client("s3", endpoint_url=url, config=Config(max_pool_connections=threads))
    names = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]][:count]

    def get(name: str) -> int:
        return len(client.get_object(Bucket=bucket, Key=name)["Body"].read())

    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(get, names))
        return time.perf_counter() - start


def run_disk(args: argparse.Namespace) -> dict[str, Any]:
    """More samples of the noisiest ratio of the TTFT run: `--engines` fresh engines,
    configured as its disk-hit engine, read the disk it left behind; in each, every
    prompt's disk hit is paired with the CPU hit of the same prompt right after. With
    `--from-device`, the objects are dropped from the page cache before each engine, so
    its disk hits read the device rather than memory."""
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    disk_full = work / "disk-full"
    if not any(disk_full.rglob("*.safetensors")):
        raise SystemExit(f"{disk_full} holds no objects: run `e2e.py ttft` first, with the same --workdir")
    asks = Requests(lengths, args.repeats)
    runner = ttft_runner(args, work, max(lengths), work / "partial-disk.json")
    kv = tiercache_kv(
        {"cpu": {"capacity": args.cpu_capacity}, "disk": STAGED_DISK | {"path": str(disk_full)}}
    )
    pairs: dict[str, list[float]] = {}
    extra: dict[str, list[float]] = {}
    floor: list[float] = []
    for i in range(args.engines):
        name = f"tiercache_disk_{i}"
        if args.from_device:
            drop_from_page_cache(disk_full)
        runner.run(name, asks.warm(False, stored=True) + asks.hits(twice=True), kv_transfer_config=kv)
        first, second = results_by(runner.engines, name, "hit"), results_by(runner.engines, name, "hit2")
        for key in sorted(first):
            if key in second and first[key]["num_cached_tokens"] and second[key]["num_cached_tokens"]:
                pairs.setdefault(str(key[0]), []).append(ttft(first[key]) / ttft(second[key]))
                extra.setdefault(str(key[0]), []).append(ttft(first[key]) - ttft(second[key]))
        # The floor of the extra time: one hit's objects read with plain reads, from
        # where the engine found them.
        if args.from_device:
            drop_from_page_cache(disk_full)
        floor.append(raw_disk_read(disk_full, max(lengths) // BLOCK))
    runner.stop()
    for n, ratios in pairs.items():
        print(
            f"{n} tokens: disk hit / CPU hit, {len(ratios)} pairs: median {median(ratios):.2f}, "
            f"range {min(ratios):.2f}-{max(ratios):.2f}, in order {[round(r, 2) for r in ratios]}; "
            f"over the CPU hit: median {median(extra[n]) * 1000:.0f} ms, plain reads of as many "
            f"objects {median(floor) * 1000:.0f} ms"
        )
    return {
        "machine": machine(),
        "args": vars(args),
        "pairs": pairs,
        "extra_seconds": extra,
        "raw_disk_read_seconds": floor,
        "raw": runner.engines,
    }


def drop_from_page_cache(root: Path) -> None:
    """Evict the cached pages of every object under `root`, so the next reads go to
    the device."""
    for path in root.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # the kernel drops clean pages only
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


TTFT_ROWS = {
    "cold (no connector)": ("none", "cold"),
    "tiercache cold (storing)": ("tiercache", "cold"),
    "vLLM prefix cache hit": ("prefix_cache", "hit"),
    "ExampleConnector hit (same engine)": ("example", "hit"),
    "ExampleConnector hit (fresh engine)": ("example_fresh", "hit"),
    "tiercache CPU hit (same engine, write-through in flight)": ("tiercache", "hit"),
    "tiercache CPU hit (after disk promote, quiet)": ("tiercache_disk", "hit2"),
    "tiercache disk hit (fresh engine)": ("tiercache_disk", "hit"),
    "tiercache S3 hit (fresh engine, empty disk)": ("tiercache_s3", "hit"),
    "tiercache CPU hit (after S3 promote, quiet)": ("tiercache_s3", "hit2"),
}


def summarize_ttft(engines: dict[str, Any], lengths: list[int], args) -> dict[str, Any]:
    table, decode = summarize_rows(engines, TTFT_ROWS, lengths, ("none", "tiercache"))
    # Ratios taken inside one engine, prompt by prompt (robust to other load on the
    # machine): a lower-tier hit against the CPU hit of the same prompt right after.
    paired, over = {}, {}
    for eng in ("tiercache_disk", "tiercache_s3"):
        first, second = results_by(engines, eng, "hit"), results_by(engines, eng, "hit2")
        keys = {n: [k for k in sorted(first) if k[0] == n and k in second] for n in lengths}
        paired[eng] = {n: median([ttft(first[k]) / ttft(second[k]) for k in keys[n]]) for n in lengths}
        over[eng] = {n: median([ttft(first[k]) - ttft(second[k]) for k in keys[n]]) for n in lengths}
    extra = {"paired_lower_tier_vs_cpu_hit": paired, "paired_lower_tier_extra_seconds": over}
    cold8k = results_by(engines, "none", "cold8k")
    if cold8k:
        extra["cold_8k_seconds"] = ttft(next(iter(cold8k.values())))
    return {
        "machine": machine(),
        "args": vars(args),
        "model": {**MODEL, "params": int((Path(args.workdir) / "model" / "params.txt").read_text())},
        "lengths": lengths,
        "table": table,
        "decode": decode,
        "engines": {
            k: {
                "startup_seconds": v["startup_seconds"],
                "wall_seconds": v["wall_seconds"],
                "loadavg": v.get("loadavg"),
            }
            for k, v in engines.items()
        },
        "raw": engines,
        **extra,
    }


def print_ttft(data: dict[str, Any]) -> None:
    lengths = data["lengths"]
    cold = data["table"]["cold (no connector)"]
    print(
        "\n| run | "
        + " | ".join(f"{n} tok TTFT (x cold)" for n in lengths)
        + " | cached | max logprob gap | other load (cores) |"
    )
    print("|---|" + "---|" * (len(lengths) + 3))
    for row, per in data["table"].items():
        cells = []
        for n in lengths:
            if n not in per and str(n) not in per:
                cells.append("-")
                continue
            v = per.get(n) or per.get(str(n))
            c = cold.get(n) or cold.get(str(n))
            cells.append(f"{v['ttft_median'] * 1000:.0f} ms ({v['ttft_median'] / c['ttft_median']:.3f})")
        last = per.get(lengths[-1]) or per.get(str(lengths[-1])) or {}
        gap = max((v["max_logprob_gap"] for v in per.values()), default=float("nan"))
        foreign = [f for v in per.values() for f in v.get("foreign_cores") or [] if f is not None]
        load = f"{median(foreign):.2f}" if foreign else "-"
        print(f"| {row} | " + " | ".join(cells) + f" | {last.get('cached_tokens')} | {gap:.3f} | {load} |")
    print("decode tokens/s:", {k: round(v["tokens_per_s_median"], 2) for k, v in data["decode"].items()})
    print("lower-tier hit / CPU hit, same engine:", data.get("paired_lower_tier_vs_cpu_hit"))
    raw, over = data.get("raw_transfers"), data.get("paired_lower_tier_extra_seconds")
    if raw and over:
        for eng, floor in (("tiercache_disk", "disk_read_seconds"), ("tiercache_s3", "s3_get_seconds")):
            extra = over[eng].get(str(lengths[-1]), over[eng].get(lengths[-1]))
            bare = median(raw[floor])
            print(
                f"{eng}: {extra * 1000:.0f} ms over the CPU hit; {raw['blocks']} objects by "
                f"{floor.replace('_seconds', '')} alone: {bare * 1000:.0f} ms ({extra / bare:.2f}x)"
            )


def run_store(args: argparse.Namespace) -> dict[str, Any]:
    """Store-path overhead by tier set: the same cold prompts (each generating
    `--decode-tokens`) with no connector, vLLM's ExampleConnector, then with tiercache
    storing into the CPU tier only, CPU + disk, and CPU + disk + S3 (write-through).
    Each engine then runs the same prompts again, storing nothing, for a ratio of
    decode rates taken inside one engine."""
    from tiercache.ops.vllm_runner import run_engine

    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    model = str(write_model(work / "model"))
    monitor = CpuMonitor()
    # Prompts of their own (seed offset), so nothing is already on disk or in S3.
    items = [
        {"name": "warm", "ids": prompt(11, 64), "max_tokens": 1},
        {"name": "warm", "ids": prompt(12, 512), "max_tokens": 1},
    ]
    colds = {(n, r): prompt(500_000 + 1000 * n + r, n) for n in lengths for r in range(args.repeats)}
    for (n, r), ids in colds.items():
        items.append({"name": f"cold/{n}/{r}", "ids": ids, "max_tokens": args.decode_tokens})
    # The same prompts again once every write has ended: the same decode with nothing
    # being stored, in the same engine (a hit where there is a cache, else cold again).
    # Engines differ by up to 10% in decode rate, so this is the ratio to trust.
    items.append({"sleep": 10})
    for (n, r), ids in colds.items():
        items.append({"name": f"again/{n}/{r}", "ids": ids, "max_tokens": args.decode_tokens})
    spec = {
        "model": model,
        # The 512-token warm-up prompt must fit too.
        "max_model_len": max([*lengths, 512]) + args.decode_tokens + 64,
        "gpu_memory_utilization": args.kv_fraction,
        "log_stats": True,
        "prompts": items,
    }
    out: dict[str, Any] = {"machine": machine(), "args": vars(args), "engines": {}}
    with store_services(args) as (redis_server, s3_url):
        # "example": vLLM's ExampleConnector storing the same prompts, the cost of any
        # connector in vLLM's step; "none" is the baseline of every ratio.
        configs = {
            "none": None,
            "example": "example",
            "cpu": {},
            "cpu+disk": {"disk": {"path": str(work / "store-disk-a")}},
            "cpu+disk+s3": {
                "disk": {"path": str(work / "store-disk-b")},
                "redis_url": redis_server.url,
                "s3": {"bucket": "tiercache-store", "endpoint_url": s3_url, "prefix": "store/"},
                "movers": {"shutdown_flush_seconds": 300, "cost_model": "off"},  # each tier's own hit
            },
        }
        if args.only:
            configs = {name: configs[name] for name in args.only.split(",")}
        for name, extra in configs.items():
            for d in ("store-disk-a", "store-disk-b", "store-example"):
                shutil.rmtree(work / d, ignore_errors=True)
            engine_spec = dict(spec)
            if extra == "example":
                engine_spec["kv_transfer_config"] = example_kv(work / "store-example")
            elif extra is not None:
                engine_spec["kv_transfer_config"] = tiercache_kv(
                    {"cpu": {"capacity": args.cpu_capacity}, **extra}
                )
            print(f"[{time.strftime('%H:%M:%S')}] store engine {name}", flush=True)
            result = run_engine(engine_spec, work / "runs", env=engine_env(args), timeout=3600)
            rows = [r for r in result["results"] if r["name"] != "warm"]
            for r in rows:
                r["foreign_cores"] = monitor.foreign_cores(r["started_at"], r["started_at"] + r["seconds"])
            cold = {r["name"].split("/", 1)[1]: r for r in rows if r["name"].startswith("cold/")}
            again = {r["name"].split("/", 1)[1]: r for r in rows if r["name"].startswith("again/")}
            out["engines"][name] = {
                "ttft_median": median([r["metrics"]["first_token_latency"] for r in cold.values()]),
                "decode_tokens_per_s_median": median([decode_rate(r) for r in cold.values()]),
                "decode_again_tokens_per_s_median": median([decode_rate(r) for r in again.values()]),
                # Prompt by prompt: decoding while its blocks are written down, over
                # decoding the same prompt with nothing to write.
                "decode_storing_vs_not": median([decode_rate(cold[k]) / decode_rate(again[k]) for k in cold]),
                "foreign_cores_median": median([r["foreign_cores"] for r in cold.values()]),
                "results": rows,
            }
            e = out["engines"][name]
            print(
                f"   TTFT {e['ttft_median']:.3f}s decode {e['decode_tokens_per_s_median']:.2f} tok/s "
                f"(again, storing nothing: {e['decode_again_tokens_per_s_median']:.2f}; storing / not, "
                f"prompt by prompt: {e['decode_storing_vs_not']:.3f}) "
                f"other load {e['foreign_cores_median']:.2f} cores",
                flush=True,
            )
    monitor.stop()
    base = out["engines"].get("none")
    for e in out["engines"].values() if base else []:
        e["ttft_vs_none"] = e["ttft_median"] / base["ttft_median"]
        e["decode_vs_none"] = e["decode_tokens_per_s_median"] / base["decode_tokens_per_s_median"]
    return out


# -- Redis lookup -----------------------------------------------------------------------


def run_lookup(args: argparse.Namespace) -> dict[str, Any]:
    import redis as redis_lib

    from tiercache.config import RedisConfig
    from tiercache.index.redis_conn import GuardedRedis
    from tiercache.index.redis_index import RedisIndex, index_keys, location
    from tiercache.ops.local_stack import RedisServer

    server = RedisServer().start()
    try:
        guarded = GuardedRedis(server.url, RedisConfig(socket_timeout=5.0))
        index = RedisIndex(guarded)
        raw = redis_lib.Redis(port=server.port)
        model, rank = "a" * 16, "b" * 16
        key, runs, _ = index_keys(model, rank)  # the block HASH; lookups touch the runs ZSET
        rng = random.Random(0)
        samples = args.lookup_samples

        def fill(total: int) -> None:
            have = raw.hlen(key)
            pipe = raw.pipeline(transaction=False)
            for i in range(have, total):  # runs of 16 blocks, as tiercache writes them
                run = (i // 16).to_bytes(8, "big")
                pipe.hset(key, rng.randbytes(32), location(run, i % 16))
                if i % 16 == 0:
                    pipe.zadd(runs, {run: float(i)})
                if (i + 1) % 10_000 == 0:
                    pipe.execute()
            pipe.execute()

        def prompt_hashes(blocks: int) -> list[bytes]:
            hashes = [rng.randbytes(32) for _ in range(blocks)]
            add(hashes)
            return hashes

        def add(hashes: list[bytes]) -> None:
            for start in range(0, len(hashes), 16):
                run = rng.randbytes(8)
                raw.hset(key, mapping={h: location(run, i) for i, h in enumerate(hashes[start : start + 16])})
                raw.zadd(runs, {run: 0.0})

        def timed(fn, n: int) -> list[float]:
            fn()  # warm-up (script load)
            out = []
            for _ in range(n):
                began = time.perf_counter()
                fn()
                out.append(time.perf_counter() - began)
            return out

        def ping_us() -> float:
            return median(timed(raw.ping, samples)) * 1e6

        def commandstats() -> dict[str, int]:
            return {k: v["calls"] for k, v in raw.info("commandstats").items()}

        result: dict[str, Any] = {"by_prompt": {}, "by_index": {}}
        fill(100_000)
        result["ping_us"] = ping_us()
        for blocks in (32, 256, 2048):
            hashes = prompt_hashes(blocks)
            times = timed(lambda h=hashes: index.longest_prefix(model, [rank], h), samples)
            before = commandstats()
            for _ in range(100):
                found = index.longest_prefix(model, [rank], hashes)
            after = commandstats()
            assert found == blocks, (found, blocks)
            delta = {k.removeprefix("cmdstat_"): (after.get(k, 0) - before.get(k, 0)) / 100 for k in after}
            delta = {k: v for k, v in delta.items() if v and k not in ("info",)}
            result["by_prompt"][blocks] = {
                "median_us": median(times) * 1e6,
                "p90_us": sorted(times)[int(0.9 * len(times))] * 1e6,
                "x_ping": median(times) * 1e6 / result["ping_us"],
                "commands_per_lookup": delta,
                "index_size": raw.hlen(key),
            }
            print("lookup", blocks, "blocks:", result["by_prompt"][blocks], flush=True)
        hashes = prompt_hashes(256)
        for size in (1_000, 10_000, 100_000, 1_000_000):
            raw.delete(key, runs)
            add(hashes)
            fill(size)
            times = timed(lambda: index.longest_prefix(model, [rank], hashes), samples)
            result["by_index"][size] = {
                "median_us": median(times) * 1e6,
                "p90_us": sorted(times)[int(0.9 * len(times))] * 1e6,
                "x_ping": median(times) * 1e6 / result["ping_us"],
                "memory_bytes": raw.memory_usage(key, samples=0) + raw.memory_usage(runs, samples=0),
            }
            print("index size", size, result["by_index"][size], flush=True)
        result["ping_us_end"] = ping_us()
        result["machine"] = machine()
        return result
    finally:
        server.close()


# -- S3 GET throughput ----------------------------------------------------------------------


def run_s3(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from tiercache.config import S3TierConfig
    from tiercache.engine import ObjectShape
    from tiercache.index.redis_index import RUN_ID_BYTES
    from tiercache.ops.local_stack import moto_process
    from tiercache.tiers.cpu import CpuBuffer
    from tiercache.tiers.s3.runs import FrameWant, RunGeometry, RunHeader, frame_header_bytes, run_parts
    from tiercache.tiers.s3.tier import Fetch, S3Tier, make_client

    # moto in its own process, as a real endpoint would be: the clients measured here
    # do not share its interpreter lock.
    with moto_process("bench") as url:
        size = args.s3_object_mib * 2**20
        count = args.s3_objects
        shape = ObjectShape("c" * 16, "d" * 16, size)
        writer = S3Tier(S3TierConfig(bucket="bench", endpoint_url=url, max_concurrency=8))
        rng = np.random.default_rng(0)
        # Each object a run of one block, read the way the engine reads runs: one
        # ranged GET of the block's frame, verified.
        runs = []
        for i in range(count):
            block = i.to_bytes(32, "big")
            data = memoryview(rng.integers(0, 255, size, dtype=np.uint8).tobytes())
            header = shape.header(block, data)
            run_hex = os.urandom(RUN_ID_BYTES).hex()
            provisional = RunGeometry(0, frame_header_bytes([header]), size)
            toc = RunHeader(run_hex, shape.rank_digest, (block,), provisional)
            parts = run_parts(toc, [(header, data)])
            assert writer.put_run(shape.rank_digest, run_hex, parts)
            geometry = RunGeometry(len(parts[0]), provisional.frame_header, size)
            runs.append((header.key, run_hex, geometry))
        result: dict[str, Any] = {"object_bytes": size, "objects": count, "by_concurrency": {}}
        buffer = CpuBuffer(count, size, pin_memory=False)
        for conc in (1, 4, 16, 32):
            config = S3TierConfig(bucket="bench", endpoint_url=url, max_concurrency=conc)
            tier = S3Tier(config)
            client = make_client(config)  # the same client settings for the baseline

            def tier_get(i: int, tier=tier) -> int:
                key, run_hex, geometry = runs[i]
                want = FrameWant(0, key, buffer.view(i))
                assert tier.fetch_run(shape.rank_digest, run_hex, geometry, [want]) == [Fetch.OK]
                return size

            def raw_get(i: int, client=client) -> int:
                name = writer.run_name(shape.rank_digest, runs[i][1])
                body = client.get_object(Bucket="bench", Key=name)["Body"].read()
                return len(body)

            def rate(fn, conc=conc) -> float:
                with ThreadPoolExecutor(conc) as pool:
                    began = time.perf_counter()
                    total = sum(pool.map(fn, range(count)))
                return total / (time.perf_counter() - began) / 2**20

            rate(tier_get), rate(raw_get)  # warm-up: connections, page faults
            tiers, raws = [], []
            for rep in range(args.repeats):
                # Alternate which goes first.
                if rep % 2:
                    raws.append(rate(raw_get))
                    tiers.append(rate(tier_get))
                else:
                    tiers.append(rate(tier_get))
                    raws.append(rate(raw_get))
            result["by_concurrency"][conc] = {
                "tiercache_mib_s": median(tiers),
                "boto3_mib_s": median(raws),
                "ratio": median(tiers) / median(raws),
                "tiercache_all": tiers,
                "boto3_all": raws,
            }
            print(
                "s3 concurrency",
                conc,
                {k: v for k, v in result["by_concurrency"][conc].items() if not k.endswith("_all")},
                flush=True,
            )
            tier.close()
        writer.close()
        result["machine"] = machine()
        return result


# -- plots --------------------------------------------------------------------------------


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    ttft_file = RESULTS / "ttft.json"
    if ttft_file.exists():
        data = json.loads(ttft_file.read_text())
        lengths = [str(n) for n in data["lengths"]]
        peer_file = RESULTS / "lmcache.json"
        if peer_file.exists():  # LMCache's hits, measured by lmcache_peer.py right after
            peer = json.loads(peer_file.read_text())["table"]
            data["table"].update({f"{r} [own run]": v for r, v in peer.items() if r.startswith("LMCache")})
        rows = [r for r in data["table"] if "cold" not in r]
        cold = data["table"]["cold (no connector)"]
        colds = ", ".join(f"{n}: {cold[n]['ttft_median']:.1f} s" for n in lengths if n in cold)
        fig, ax = plt.subplots(figsize=(10, 5.5))
        width = 0.8 / len(lengths)
        for j, n in enumerate(lengths):
            vals = [data["table"][r].get(n, {}).get("ttft_median", float("nan")) * 1000 for r in rows]
            bars = ax.barh([i + j * width for i in range(len(rows))], vals, height=width, label=f"{n} tokens")
            ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        ax.set_yticks([i + width * (len(lengths) - 1) / 2 for i in range(len(rows))])
        ax.set_yticklabels(rows, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("time to first token, ms (median)")
        ax.set_title(f"TTFT on a hit, by source of the KV (cold, no cache: {colds})", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(IMG / "e2e-ttft.png", dpi=110)
        plt.close(fig)
        print("wrote", IMG / "e2e-ttft.png")
    lookup_file = RESULTS / "lookup.json"
    if lookup_file.exists():
        data = json.loads(lookup_file.read_text())
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        xs = sorted(int(k) for k in data["by_prompt"])
        a.plot(xs, [data["by_prompt"][str(x)]["median_us"] for x in xs], "o-", label="longest_prefix")
        a.axhline(data["ping_us"], color="gray", ls="--", label="PING (one round trip)")
        a.set_xscale("log")
        a.set_xlabel("prompt length, blocks (index of 1e5 keys)")
        a.set_ylabel("median latency, µs")
        a.legend(fontsize=8)
        xs = sorted(int(k) for k in data["by_index"])
        b.plot(
            xs, [data["by_index"][str(x)]["median_us"] for x in xs], "o-", label="longest_prefix, 256 blocks"
        )
        b.axhline(data["ping_us"], color="gray", ls="--", label="PING")
        b.set_xscale("log")
        b.set_xlabel("index size, keys")
        b.set_ylim(bottom=0)
        a.set_ylim(bottom=0)
        b.legend(fontsize=8)
        fig.suptitle("Redis prefix lookup (one EVALSHA)")
        fig.tight_layout()
        fig.savefig(IMG / "e2e-lookup.png", dpi=110)
        plt.close(fig)
        print("wrote", IMG / "e2e-lookup.png")
    s3_file = RESULTS / "s3.json"
    if s3_file.exists():
        data = json.loads(s3_file.read_text())
        xs = sorted(int(k) for k in data["by_concurrency"])
        fig, ax = plt.subplots(figsize=(6, 4))
        tiercache_rates = [data["by_concurrency"][str(x)]["tiercache_mib_s"] for x in xs]
        ax.plot(xs, tiercache_rates, "o-", label="S3Tier.fetch_run")
        ax.plot(
            xs,
            [data["by_concurrency"][str(x)]["boto3_mib_s"] for x in xs],
            "s--",
            label="raw boto3 get_object",
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent GETs")
        ax.set_ylabel("MiB/s (median)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"S3 GET throughput, {data['object_bytes'] // 2**20} MiB objects (moto, loopback)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(IMG / "e2e-s3.png", dpi=110)
        plt.close(fig)
        print("wrote", IMG / "e2e-s3.png")
    plot_more(plt)


STORE_LABELS = {"none": "no connector", "example": "ExampleConnector"}


def plot_more(plt) -> None:
    store_file = RESULTS / "store.json"
    if store_file.exists():
        data = json.loads(store_file.read_text())
        names = list(data["engines"])
        fig, ax = plt.subplots(figsize=(7, 4.6))
        xs = range(len(names))
        ttft_ratios = [data["engines"][n]["ttft_vs_none"] for n in names]
        dec = [data["engines"][n]["decode_vs_none"] for n in names]
        bars = [
            ax.bar([x - 0.27 for x in xs], ttft_ratios, width=0.27, label="cold TTFT / no connector"),
            ax.bar(list(xs), dec, width=0.27, label="decode tokens/s / no connector"),
        ]
        if all("decode_storing_vs_not" in data["engines"][n] for n in names):
            same = [data["engines"][n]["decode_storing_vs_not"] for n in names]
            label = "decode storing / same prompt storing nothing, same engine"
            bars.append(ax.bar([x + 0.27 for x in xs], same, width=0.27, label=label))
        for b in bars:
            ax.bar_label(b, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(list(xs), [STORE_LABELS.get(n, f"tiercache\n{n}") for n in names], fontsize=8)
        ax.set_ylim(0, 1.35)
        ax.set_ylabel("ratio to no connector (median)")
        ax.set_title("Store path: 2000-token cold prompts, 32 tokens generated")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
        fig.tight_layout()
        fig.savefig(IMG / "e2e-store.png", dpi=110)
        plt.close(fig)
        print("wrote", IMG / "e2e-store.png")
    workload_file = RESULTS / "workload.json"
    if workload_file.exists():
        data = json.loads(workload_file.read_text())
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = {
            "none": "no cache",
            "tiercache": "tiercache",
            "tiercache_second": "second engine (Redis + S3)",
        }
        for name, rows in data["per_request"].items():
            ax.plot(range(len(rows)), [r["ttft"] for r in rows], "o-", ms=3, label=labels.get(name, name))
        users = data["args"]["users"]
        for t in range(1, data["args"]["turns"]):
            ax.axvline(t * users - 0.5, color="gray", lw=0.5)
        ax.set_xlabel(f"request (turn by turn, {users} users each)")
        ax.set_ylabel("TTFT, s")
        ax.set_ylim(bottom=0)
        ax.set_title("Multi-round chat: time to first token per request")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(IMG / "e2e-workload.png", dpi=110)
        plt.close(fig)
        print("wrote", IMG / "e2e-workload.png")


# -- main ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["ttft", "s3hit", "disk", "store", "lookup", "s3", "plot", "table"])
    parser.add_argument("--lengths", default="2000", help="prompt lengths in tokens, comma separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens generated by the cold runs")
    parser.add_argument("--cold-8k", action="store_true", help="also one cold 8000-token run")
    parser.add_argument("--cpu-capacity", default="4GiB")
    parser.add_argument("--kv-fraction", type=float, default=0.25, help="vLLM gpu_memory_utilization")
    parser.add_argument("--workdir", default="/tmp/tiercache-bench-e2e")
    parser.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (CPU build)",
    )
    parser.add_argument("--lookup-samples", type=int, default=300)
    parser.add_argument("--s3-objects", type=int, default=64)
    parser.add_argument("--s3-object-mib", type=int, default=2)
    parser.add_argument("--engines", type=int, default=3, help="disk: fresh engines to run")
    parser.add_argument(
        "--from-device", action="store_true", help="disk: drop the objects from the page cache first"
    )
    parser.add_argument("--only", default=None, help="store: run only these engines (comma separated)")
    parser.add_argument(
        "--s3-server",
        choices=["moto", "seaweedfs", "sink"],
        default="moto",
        help="the S3 endpoint: for ttft and s3hit moto or seaweedfs (SeaweedFS, a real "
        "S3-compatible store); for store moto or sink (see store_services)",
    )
    parser.add_argument("--name", default=None, help="results file name (default: the subcommand)")
    args = parser.parse_args()
    name = args.name or args.what
    if args.what == "ttft":
        data = run_ttft(args)
        save(name, data)
        print_ttft(data)
    elif args.what == "s3hit":
        data = run_s3_hit(args)
        save(args.name or f"s3hit-{args.s3_server}", data)
        print_s3_hit(data)
    elif args.what == "disk":
        save(name, run_disk(args))
    elif args.what == "store":
        if args.s3_server == "seaweedfs":
            raise SystemExit("--s3-server seaweedfs: store writes through to moto or the sink")
        save(name, run_store(args))
    elif args.what == "table":
        print_ttft(json.loads((RESULTS / f"{args.name or 'ttft'}.json").read_text()))
    elif args.what == "lookup":
        save(name, run_lookup(args))
    elif args.what == "s3":
        save(name, run_s3(args))
    else:
        plot(args)


if __name__ == "__main__":
    main()

"""Soak run through every tier with capacities far below the working set.

The connector's two halves (scheduler and worker, driven as vLLM drives them by
connector/driver.py) over a tiny CPU tier, a tiny disk tier and S3 (moto) indexed in
Redis (redis-server), both on loopback. Requests are prompts (chains of blocks) drawn
from a skewed distribution: the connector loads the longest prefix its tiers hold
(each loaded block is checked byte for byte against what was stored: a wrong answer
is counted, never expected), and the rest is computed and stored. A GC pass
keeps S3 under its budget every few seconds; with --redis-restarts the Redis server
is killed and restarted (keeping its data) on that period.

Reports requests and blocks served, hits per tier (blocks loaded from it), blocks
computed, wrong answers, crashes (exceptions
in the load loop), RSS over time, the most files/bytes ever on disk and the most
objects in S3 right after each GC pass, against their capacities.

    python benchmarks/soak.py --minutes 12 --out benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

SLOT = 64 * 1024


def payload(block: bytes) -> bytes:
    seed = hashlib.sha256(block).digest()
    return (seed * (SLOT // len(seed)))[:SLOT]


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def disk_usage(root: Path) -> tuple[int, int]:
    from tiercache.tiers.disk.layout import DiskLayout

    usage = DiskLayout(root).usage().values()
    return sum(objects for objects, _ in usage), sum(size for _, size in usage)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--prompts", type=int, default=400, help="distinct prompts in the working set")
    parser.add_argument("--blocks-per-prompt", type=int, default=8)
    parser.add_argument("--cpu-slots", type=int, default=24)
    parser.add_argument("--disk-objects", type=int, default=96)
    parser.add_argument("--s3-objects", type=int, default=400)
    parser.add_argument("--gc-every", type=float, default=5.0, help="seconds between GC passes")
    parser.add_argument(
        "--redis-restarts", action="store_true", help="kill and restart Redis every sixth GC pass"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import redis as redis_py

    from tiercache.config import build_config
    from tiercache.connector.driver import ConnectorDriver
    from tiercache.object_shape import ObjectShape
    from tiercache.ops.local_stack import local_stack
    from tiercache.tiers.s3.gc import run_gc

    work = Path(tempfile.mkdtemp(prefix="tiercache-soak-"))
    obj = ObjectShape("5" * 16, "6" * 16, SLOT).object_bytes  # what a capacity in objects means
    rng = random.Random(0)
    prompts = []
    for p in range(args.prompts):
        chain, parent = [], b"soak"
        for i in range(args.blocks_per_prompt):
            # Prompts share prefixes in families of four, like chat turns.
            family = p // 4 if i < args.blocks_per_prompt // 2 else p
            parent = hashlib.sha256(parent + f"{family}:{i}".encode()).digest()
            chain.append(parent)
        prompts.append(chain)
    distinct = len({b for chain in prompts for b in chain})
    weights = [1.0 / (i + 1) ** 0.8 for i in range(args.prompts)]

    # moto in its own process: the RSS measured below is tiercache's, not the S3 store's.
    with local_stack(bucket="soak", s3_process=True) as (redis_server, s3):
        config = build_config(
            {
                "namespace": "soak",
                "redis_url": redis_server.url,
                "redis": {"retry_backoff": 0.2, "max_backoff": 1.0},
                "cpu": {"capacity": args.cpu_slots * SLOT},
                "disk": {"path": str(work / "disk"), "capacity": args.disk_objects * obj},
                "s3": {
                    "bucket": "soak",
                    "endpoint_url": s3.url,
                    "region": "us-east-1",
                    "capacity": args.s3_objects * obj,
                },
                "movers": {"queue_depth": 256},
            },
            environ={},
        )
        cache = ConnectorDriver(config, SLOT, model="soak")
        stats = {
            "requests": 0,
            "blocks": 0,
            "hits": {"cpu": 0, "disk": 0, "s3": 0},
            "computed": 0,
            "wrong": 0,
            "crashes": 0,
            "gc_passes": 0,
            "gc_errors": 0,
            "redis_restarts": 0,
            "max_disk_files": 0,
            "max_disk_bytes": 0,
            "max_s3_objects_after_gc": 0,
            "max_s3_used_bytes_after_gc": 0,
            "rss_mib": [],
        }
        lock = threading.Lock()  # held by the load loop per request, by GC for a pass
        stop = threading.Event()
        crash_log: list[str] = []

        def collector() -> None:
            while not stop.wait(args.gc_every):
                with lock:
                    cache.flush(60)
                    if args.redis_restarts and stats["gc_passes"] % 6 == 5:
                        redis_py.Redis(port=redis_server.port).save()  # keep the index
                        redis_server.stop()
                        redis_server.start()
                        stats["redis_restarts"] += 1
                    report = run_gc(config, grace_seconds=30)
                    stats["gc_passes"] += 1
                    stats["gc_errors"] += len(report["errors"])
                    count = sum(1 for _ in cache.engine.s3.list_runs())
                    stats["max_s3_objects_after_gc"] = max(stats["max_s3_objects_after_gc"], count)
                    if report["used_bytes_after"] is not None:
                        stats["max_s3_used_bytes_after_gc"] = max(
                            stats["max_s3_used_bytes_after_gc"], report["used_bytes_after"]
                        )

        def sampler() -> None:
            started = time.monotonic()
            while not stop.wait(1.0):
                with lock:  # a consistent snapshot: no request and no write in flight
                    cache.flush(60)
                    files, size = disk_usage(work / "disk")
                stats["max_disk_files"] = max(stats["max_disk_files"], files)
                stats["max_disk_bytes"] = max(stats["max_disk_bytes"], size)
                elapsed = time.monotonic() - started
                if not stats["rss_mib"] or elapsed - stats["rss_mib"][-1][0] >= 30:
                    stats["rss_mib"].append((round(elapsed), round(rss_mib(), 1)))

        threads = [threading.Thread(target=f, daemon=True) for f in (collector, sampler)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + args.minutes * 60
        while time.monotonic() < deadline:
            chain = rng.choices(prompts, weights)[0]
            try:
                with lock:
                    served = cache.serve(chain, [payload(block) for block in chain])
                    stats["blocks"] += len(chain)
                    for block, tier, kv in zip(chain, served.tiers, served.kv, strict=True):
                        if tier is None:
                            stats["computed"] += 1
                            continue
                        stats["hits"][tier] += 1
                        if bytes(kv) != payload(block):
                            stats["wrong"] += 1
                    stats["requests"] += 1
            except Exception:  # a crash of the cache: counted, shown, and the loop goes on
                stats["crashes"] += 1
                if len(crash_log) < 5:
                    crash_log.append(traceback.format_exc())
        stop.set()
        for thread in threads:
            thread.join(120)
        cache.close()
    stats["rss_mib"].append(("end", round(rss_mib(), 1)))
    summary = {
        "minutes": args.minutes,
        "working_set_blocks": distinct,
        "capacities": {
            "cpu_slots": args.cpu_slots,
            "disk_objects": args.disk_objects,
            "disk_bytes": args.disk_objects * obj,
            "s3_objects": args.s3_objects,
            "s3_bytes": args.s3_objects * obj,
        },
        **stats,
        "crash_log": crash_log,
    }
    from tiercache.tiers.disk.tier import LINGER_SHARE

    # The files of objects evicted a moment ago linger, up to a share of the capacity
    # over it, for loads planned before the eviction was reported.
    disk_bytes = args.disk_objects * obj
    summary["disk_within_capacity"] = summary["max_disk_bytes"] <= disk_bytes + disk_bytes // LINGER_SHARE
    summary["s3_within_capacity"] = summary["max_s3_objects_after_gc"] <= args.s3_objects
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return summary


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["wrong"] == 0 and result["crashes"] == 0 else 1)

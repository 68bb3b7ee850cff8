"""Replay a production KV-cache trace through the connector's real halves, per mover policy.

A trace in Mooncake's format (FAST25-release/traces/*.jsonl of kvcache-ai/Mooncake):
one JSON object per line, a request, whose `hash_ids` are its prompt's blocks (chained:
a block's id stands for its whole prefix). Each request is served in order through
`ConnectorDriver` (connector/driver.py): the connector loads the longest prefix its
tiers hold and stores what the request computes, and every decision (hits, stores,
evictions, what is written down where) is the connector's own. Capacities are
fractions of the replayed requests' distinct blocks: the CPU tier and the disk split
`total` between them (`--cpu-share` to the CPU tier); with `--s3`, an S3 tier (moto, in
its own process, indexed in a local redis-server) of `--s3-capacity` times `total`,
kept under it as the product keeps it: the GC's capacity pass (tiers/s3/gc.py, by last
access and hits) every `--gc-every` requests, as the service runs it on a timer.

Printed per policy and capacity: blocks hit per tier, blocks and bytes written to disk
and S3 and the PUTs S3 was sent, and the hits (CPU and disk) against an infinite cache
and against Belady's offline optimum over one cache of the same total capacity (the
block next asked for furthest in the future leaves first, or the newcomer is not kept;
a request hits the longest prefix it holds, as the connector loads). Every write-down
is finished before the next request (`flush`), so the run is the same each time.

    python benchmarks/trace_replay.py TRACE.jsonl --requests 1500 --out benchmarks/results/replay.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

BLOCK_BYTES = 4096  # small pages: the decisions, not the copies, are what is measured
NEVER = sys.maxsize


def read_trace(path: Path, requests: int | None) -> list[list[int]]:
    trace = []
    with open(path) as lines:
        for line in lines:
            if line.strip():
                trace.append([int(block) for block in json.loads(line)["hash_ids"]])
                if requests is not None and len(trace) >= requests:
                    break
    return trace


def block_hash(block: int) -> bytes:
    return block.to_bytes(32, "big")


def infinite_hits(trace: list[list[int]]) -> int:
    """Blocks hit by a cache that keeps everything (each request's longest seen prefix)."""
    seen: set[int] = set()
    hits = 0
    for request in trace:
        for block in request:
            if block not in seen:
                break
            hits += 1
        seen.update(request)
    return hits


def belady_hits(trace: list[list[int]], capacity: int) -> int:
    """Belady's offline optimum for one cache of `capacity` blocks, with bypass: on a
    miss the block is kept only if it is asked for again sooner than the cached block
    asked for furthest ahead (which then leaves). Hits count as the connector counts
    them: a request's longest prefix that is cached."""
    uses: dict[int, list[int]] = defaultdict(list)
    time_ = 0
    for request in trace:
        for block in request:
            uses[block].append(time_)
            time_ += 1
    seen: dict[int, int] = defaultdict(int)
    cached: dict[int, int] = {}  # block -> its next use
    furthest: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits = 0
    for request in trace:
        prefix = True
        for block in request:
            seen[block] += 1
            times = uses[block]
            next_use = times[seen[block]] if seen[block] < len(times) else NEVER
            if block in cached and prefix:
                hits += 1
            else:
                prefix = False
            if block in cached:
                cached[block] = next_use
                heapq.heappush(furthest, (-next_use, block))
                continue
            if next_use == NEVER or capacity <= 0:
                continue
            if len(cached) >= capacity:
                while -furthest[0][0] != cached.get(furthest[0][1], -1):
                    heapq.heappop(furthest)
                if -furthest[0][0] <= next_use:
                    continue  # everything cached is needed sooner: bypass
                _, victim = heapq.heappop(furthest)
                del cached[victim]
            cached[block] = next_use
            heapq.heappush(furthest, (-next_use, block))
    return hits


def _sample(name: str, labels: dict[str, str]) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def _counters() -> dict[str, float]:
    return {
        "disk_bytes": _sample("tiercache_tier_bytes_total", {"tier": "disk", "op": "put"}),
        "disk_writes": _sample("tiercache_tier_ops_total", {"tier": "disk", "op": "put", "result": "ok"}),
        "s3_bytes": _sample("tiercache_tier_bytes_total", {"tier": "s3", "op": "put"}),
        "s3_puts": _sample("tiercache_s3_requests_total", {"op": "put"}),
        "dropped": sum(_sample("tiercache_mover_dropped_total", {"tier": tier}) for tier in ("disk", "s3")),
    }


def movers_of(spec: str) -> dict:
    """`selective+selective_disk_min_requests=1`: a mover policy and settings of the
    movers section to run it with."""
    policy, *settings = spec.split("+")
    movers: dict = {"policy": policy}
    for setting in settings:
        key, _, value = setting.partition("=")
        movers[key] = value
    return movers


def replay(
    trace, policy: str, cpu_blocks: int, disk_blocks: int, work: Path, stack=None, s3_blocks=0, gc_every=20
) -> dict:
    """One run of `trace` under `policy` (a spec, see movers_of): hits per tier and
    what went down. With `stack` (redis-server, S3), an S3 tier of `s3_blocks` (0:
    unbounded), collected every `gc_every` requests."""
    from tiercache.config import build_config
    from tiercache.connector.driver import ConnectorDriver
    from tiercache.object_shape import ObjectShape
    from tiercache.tiers.s3.gc import run_gc
    from tiercache.tiers.s3.passes import gc_redis_client
    from tiercache.tiers.s3.tier import S3Tier

    object_bytes = ObjectShape("0" * 16, "0" * 16, BLOCK_BYTES).object_bytes
    run = f"run-{cpu_blocks}-{disk_blocks}-{time.monotonic_ns()}"
    data: dict = {
        "namespace": run,
        "cpu": {"capacity": cpu_blocks * BLOCK_BYTES},
        "disk": {"path": str(work / run), "capacity": disk_blocks * object_bytes},
        "movers": {"cost_model": "off", "queue_depth": 1_000_000, "workers": 2, **movers_of(policy)},
    }
    if stack is not None:
        redis_server, s3 = stack
        data["redis_url"] = redis_server.url
        data["s3"] = {"bucket": "replay", "endpoint_url": s3.url, "region": "us-east-1", "prefix": run}
        if s3_blocks:
            data["s3"]["capacity"] = s3_blocks * object_bytes
    config = build_config(data, environ={})
    collect = stack is not None and s3_blocks > 0
    gc_clients = (gc_redis_client(config), S3Tier(config.s3)) if collect else None
    evicted = spared = 0
    longest = max(len(request) for request in trace)
    driver = ConnectorDriver(config, BLOCK_BYTES, model=run, num_blocks=longest + 2)
    page = bytes(BLOCK_BYTES)
    hits = {"cpu": 0, "disk": 0, "s3": 0}
    before = _counters()
    start = time.monotonic()
    try:
        for number, request in enumerate(trace, 1):
            hashes = [block_hash(block) for block in request]
            served = driver.serve(hashes, [page] * len(hashes))
            for tier in served.tiers:
                if tier is not None:
                    hits[tier] += 1
            driver.flush()
            if gc_clients is not None and number % gc_every == 0:
                report = run_gc(config, sweep_orphans=False, redis=gc_clients[0], s3=gc_clients[1])
                if report["errors"]:
                    raise RuntimeError(f"the GC pass failed: {report['errors']}")
                evicted += report["evicted_objects"]
                spared += report["spared_hit"]
    finally:
        driver.close()
        if gc_clients is not None:
            gc_clients[0].close()
            gc_clients[1].close()
    after = _counters()
    moved = {name: int(after[name] - before[name]) for name in after}
    gc = {"gc_evicted_runs": evicted, "gc_spared_runs": spared} if collect else {}
    return {"hits": hits, **moved, **gc, "seconds": round(time.monotonic() - start, 1)}


def table(report: dict) -> str:
    """The runs of one report as a markdown table, each policy against write-through
    at the same capacity."""
    lines = [
        "| capacity | policy | hits CPU / disk / S3 | CPU + disk hits (x write-through) | of Belady | "
        "of infinite | all hits (x write-through) | disk writes (MiB) | S3 PUTs (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {run["capacity"]: run for run in report["runs"] if run["policy"] == "write_through"}
    mib = 1 << 20
    for run in report["runs"]:
        hits = run["hits"]
        ref = base.get(run["capacity"])
        compared = ref is not None and ref is not run
        times = f" (x{run['local_hits'] / max(1, ref['local_hits']):.2f})" if compared else ""
        total = sum(hits.values())
        all_times = f" (x{total / max(1, sum(ref['hits'].values())):.2f})" if compared else ""
        lines.append(
            f"| {run['capacity']:.0%} | {run['policy']} | {hits['cpu']} / {hits['disk']} / {hits['s3']} | "
            f"{run['local_hits']}{times} | {run['of_belady']} | {run['of_infinite']} | {total}{all_times} | "
            f"{run['disk_writes']} ({run['disk_bytes'] / mib:.0f}) | "
            f"{run['s3_puts']} ({run['s3_bytes'] / mib:.0f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a trace in Mooncake's format (jsonl)")
    parser.add_argument(
        "--requests", type=int, default=None, help="replay the first N requests (default all)"
    )
    parser.add_argument(
        "--capacities", default="0.05,0.12,0.25", help="CPU + disk capacity, fractions of the distinct blocks"
    )
    parser.add_argument("--cpu-share", type=float, default=0.5, help="the CPU tier's part of the capacity")
    parser.add_argument(
        "--policies",
        default="write_through,selective",
        help="comma separated: a mover policy, with settings after +: selective+selective_s3_min_requests=1",
    )
    parser.add_argument("--s3", action="store_true", help="an S3 tier too (moto and redis-server, local)")
    parser.add_argument(
        "--s3-capacity",
        type=float,
        default=2.0,
        help="the S3 tier's capacity, times the CPU + disk capacity (0: unbounded, no GC)",
    )
    parser.add_argument("--gc-every", type=int, default=20, help="an S3 GC pass every N requests")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="print a saved report (--out) as a table")
    args = parser.parse_args(argv)
    if args.table is not None:
        report = json.loads(args.table.read_text())
        print(table(report))
        return report

    trace = read_trace(args.trace, args.requests)
    distinct = len({block for request in trace for block in request})
    asked = sum(len(request) for request in trace)
    infinite = infinite_hits(trace)
    report: dict = {
        "trace": args.trace.name,
        "requests": len(trace),
        "blocks_asked": asked,
        "distinct_blocks": distinct,
        "infinite_hits": infinite,
        "cpu_share": args.cpu_share,
        "s3_capacity": args.s3_capacity if args.s3 else None,
        "gc_every": args.gc_every if args.s3 else None,
        "block_bytes": BLOCK_BYTES,
        "runs": [],
    }
    print(
        f"{args.trace.name}: {len(trace)} requests, {asked} blocks asked, {distinct} distinct, "
        f"infinite cache hits {infinite}"
    )
    work = Path(tempfile.mkdtemp(prefix="tiercache-replay-"))
    stack_context = None
    stack = None
    if args.s3:
        from tiercache.ops.local_stack import local_stack

        stack_context = local_stack(bucket="replay", s3_process=True)
        stack = stack_context.__enter__()
    try:
        for fraction in [float(f) for f in args.capacities.split(",")]:
            total = max(2, int(fraction * distinct))
            cpu_blocks = max(1, int(total * args.cpu_share))
            disk_blocks = total - cpu_blocks
            s3_blocks = int(total * args.s3_capacity) if args.s3 else 0
            belady = belady_hits(trace, total)
            results = {}
            for policy in args.policies.split(","):
                result = replay(trace, policy, cpu_blocks, disk_blocks, work, stack, s3_blocks, args.gc_every)
                local = result["hits"]["cpu"] + result["hits"]["disk"]
                result.update(
                    policy=policy,
                    capacity=fraction,
                    cpu_blocks=cpu_blocks,
                    disk_blocks=disk_blocks,
                    s3_blocks=s3_blocks,
                    belady_hits=belady,
                    local_hits=local,
                    of_belady=round(local / belady, 3) if belady else None,
                    of_infinite=round(local / infinite, 3) if infinite else None,
                )
                results[policy] = result
                report["runs"].append(result)
                print(json.dumps(result), flush=True)
            base = results.get("write_through")
            if base is not None:
                for policy, result in results.items():
                    if policy == "write_through":
                        continue
                    hits_ratio = result["local_hits"] / max(1, base["local_hits"])
                    all_ratio = sum(result["hits"].values()) / max(1, sum(base["hits"].values()))
                    disk_ratio = base["disk_bytes"] / max(1, result["disk_bytes"])
                    s3_ratio = base["s3_bytes"] / max(1, result["s3_bytes"]) if args.s3 else None
                    print(
                        f"  {fraction:.0%} {policy} vs write_through: CPU + disk hits x{hits_ratio:.2f}, "
                        f"all hits x{all_ratio:.2f}, disk bytes 1/{disk_ratio:.1f}"
                        + (f", S3 bytes 1/{s3_ratio:.1f}" if s3_ratio else ""),
                        flush=True,
                    )
    finally:
        if stack_context is not None:
            stack_context.__exit__(None, None, None)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return report


if __name__ == "__main__":
    main()

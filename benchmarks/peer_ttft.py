"""Time to first token of a peer-tier hit against a local CPU-tier hit and a disk hit,
on the same prompts, in one run (issue 47, item 6):

    python benchmarks/peer_ttft.py --lengths 1000,2000 --repeats 2 [--json]

Three vLLM engines (CPU build), the benchmark model of benchmarks/harness.py, one
redis-server:

1. the holder computes each prompt cold (its CPU tier and its disk tier store it),
   then stays up while the reader reads;
2. the reader, which never saw the prompts, asks each one: a peer hit, read from the
   holder's CPU tier over NIXL (UCX on loopback); then, its own prefix cache cleared,
   again: a local CPU hit of the blocks the peer read staged into its CPU tier;
3. the holder restarted on the same disk, the peer tier off: each prompt is a disk hit.

TTFT is vLLM's own first-token latency per request. Ratios are medians of per-prompt
ratios against the local CPU hit of the same prompt. Each engine first reads one
unrelated prompt the same way, so connection set-up is not counted in the first
measured one."""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BLOCK, median, prompt, save, ttft, write_model  # noqa: E402

from tiercache.ops.local_stack import RedisServer  # noqa: E402
from tiercache.ops.vllm_runner import connector_config, loading_every_hit, run_engine  # noqa: E402


def kv(redis_url: str, name: str, disk: Path, peer: bool) -> dict[str, Any]:
    extra = {
        "cpu": {"capacity": "1GiB"},
        "disk": {"path": str(disk), "capacity": "8GiB"},
        "redis_url": redis_url,
        "instance_id": name,
        "presence": {"interval": 0.2, "ttl": 5},
        "peer": {"enabled": peer},
    }
    return connector_config(loading_every_hit(extra))


def request(name: str, ids: list[int]) -> dict[str, Any]:
    return {"name": name, "ids": ids, "max_tokens": 1}


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = {(n, r): prompt(4700 + 1000 * n + r, n) for n in lengths for r in range(args.repeats)}
    warm = prompt(1, 4 * BLOCK + 5)  # each engine's first request, unrelated
    first_read = prompt(2, 4 * BLOCK + 5)  # the holder computes it, the reader reads it first
    work = Path(tempfile.mkdtemp(prefix="tc-peer-ttft-"))
    disk = work / "disk"
    base = {
        "model": str(write_model(work / "model")),
        "max_model_len": max(lengths) + 64,
        "gpu_memory_utilization": args.kv_fraction,
        "log_stats": True,
        "counters": "vllm:tiercache_loaded_blocks",
    }
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}
    stored, read = work / "stored", work / "read"
    redis = RedisServer().start()
    try:
        holder_items = [request("warm", warm), request("first_read", first_read)]
        holder_items += [request(f"cold/{n}/{r}", ids) for (n, r), ids in prompts.items()]
        holder_items += [{"sleep": 1}, {"touch": str(stored)}, {"wait_for": str(read), "timeout": 1800}]
        reader_items: list[dict[str, Any]] = [request("warm", warm[::-1])]
        reader_items += [{"wait_for": str(stored), "timeout": 1800}, request("first_read", first_read)]
        for (n, r), ids in prompts.items():
            reader_items += [
                request(f"peer/{n}/{r}", ids),
                {"clear_vllm_prefix_cache": True},
                request(f"cpu/{n}/{r}", ids),
                {"clear_vllm_prefix_cache": True},
            ]
        reader_items.append({"touch": str(read)})
        holder = {**base, "kv_transfer_config": kv(redis.url, "holder", disk, True), "prompts": holder_items}
        reader = {
            **base,
            "kv_transfer_config": kv(redis.url, "reader", work / "reader-disk", True),
            "prompts": reader_items,
            "in_process": True,  # clear_vllm_prefix_cache reaches the engine core
        }

        def engine(spec: dict[str, Any]) -> dict[str, Any]:
            try:
                return run_engine(spec, work / "runs", env, 3600)
            finally:  # one engine that failed must not leave the other waiting on it
                stored.touch()
                read.touch()

        with ThreadPoolExecutor(2) as pool:
            held, loaded = pool.map(engine, (holder, reader))
        restarted_items = [request("warm", warm[::-1][1:]), request("first_read", first_read)]
        restarted_items += [request(f"disk/{n}/{r}", ids) for (n, r), ids in prompts.items()]
        restarted_kv = kv(redis.url, "restarted", disk, False)
        restarted = run_engine(
            {**base, "kv_transfer_config": restarted_kv, "prompts": restarted_items}, work / "runs", env, 3600
        )
    finally:
        redis.close()
    by_name = {r["name"]: r for out in (held, loaded, restarted) for r in out["results"]}
    table: dict[int, dict[str, Any]] = {}
    for n in lengths:
        keys = [r for (m, r) in prompts if m == n]
        row: dict[str, Any] = {}
        for kind in ("cold", "peer", "cpu", "disk"):
            row[f"{kind}_ttft_median"] = median([ttft(by_name[f"{kind}/{n}/{r}"]) for r in keys])
        for kind in ("peer", "disk", "cold"):
            row[f"{kind}_vs_cpu"] = median(
                [ttft(by_name[f"{kind}/{n}/{r}"]) / ttft(by_name[f"cpu/{n}/{r}"]) for r in keys]
            )
        row["peer_cached_tokens"] = [by_name[f"peer/{n}/{r}"]["num_cached_tokens"] for r in keys]
        table[n] = row
    return {
        "lengths": lengths,
        "repeats": args.repeats,
        "table": table,
        "loaded_blocks_reader": loaded["results"][-1].get("counters", {}),
        "loaded_blocks_restarted": restarted["results"][-1].get("counters", {}),
    }


def report(data: dict[str, Any]) -> None:
    print("tokens   cold s   peer s   cpu s   disk s   peer/cpu  disk/cpu  cold/cpu")
    for n, row in data["table"].items():
        print(
            f"{n:>6}  {row['cold_ttft_median']:7.3f}  {row['peer_ttft_median']:7.3f}  "
            f"{row['cpu_ttft_median']:6.3f}  {row['disk_ttft_median']:7.3f}  "
            f"{row['peer_vs_cpu']:8.2f}  {row['disk_vs_cpu']:8.2f}  {row['cold_vs_cpu']:8.2f}"
        )
    print("reader's loaded blocks by tier:", data["loaded_blocks_reader"])
    print("restarted holder's loaded blocks by tier:", data["loaded_blocks_restarted"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--kv-fraction", type=float, default=0.15, help="gpu_memory_utilization (on CPU: of host memory)"
    )
    parser.add_argument("--reserved-cpus", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="also save benchmarks/results/peer_ttft.json")
    args = parser.parse_args()
    data = run(args)
    if args.json:
        save("peer_ttft", data)
    report(data)


if __name__ == "__main__":
    main()

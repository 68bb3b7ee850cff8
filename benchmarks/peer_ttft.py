"""Time to first token of a peer-tier hit against a local CPU-tier hit, a disk hit and
an S3 hit, on the same prompts, in one run:

    python benchmarks/peer_ttft.py --lengths 1000,2000 --repeats 2 [--json]

Four vLLM engines (CPU build), the benchmark model of benchmarks/harness.py, one
redis-server, SeaweedFS's S3 gateway on loopback:

1. the holder computes each prompt cold (its CPU, disk and S3 tiers store it), then
   stays up while the reader reads;
2. the reader, which never saw the prompts, asks each one: a peer hit, read from the
   holder's CPU tier over NIXL (UCX on loopback); then, its own prefix cache cleared,
   again: a local CPU hit of the blocks the peer read staged into its CPU tier;
3. the holder restarted on the same disk, the peer tier off: each prompt is a disk
   hit, then (prefix cache cleared) a CPU hit in that engine;
4. an engine with an empty disk, the peer tier off: each prompt is an S3 hit, then a
   CPU hit in that engine.

TTFT is vLLM's own first-token latency per request. Each lower tier's ratio is the
median of per-prompt ratios against the CPU hit of the same prompt in the same
engine, so engines started at different moments compare through one yardstick:
peer/S3 is (peer/CPU) / (S3/CPU). Each engine first reads one unrelated prompt the
same way, so connection set-up is not counted in the first measured one."""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BLOCK, MODEL, median, median_interval, prompt, save, ttft, write_model  # noqa: E402

from tiercache.ops.local_stack import RedisServer, seaweedfs_process  # noqa: E402
from tiercache.ops.vllm_runner import connector_config, loading_every_hit, run_engine  # noqa: E402

BUCKET = "tc-peer-ttft"


# KV bytes of one block of the benchmark model: K and V, float32, every layer.
BLOCK_BYTES = 2 * 4 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"] * MODEL["head_dim"] * BLOCK


def cpu_capacity(prompts: dict[tuple[int, int], list[int]]) -> int:
    """A CPU tier that holds every prompt's blocks with room to spare: the holder must
    still hold the first prompt when the reader asks for it, else that read is an S3
    hit measured as a peer one."""
    blocks = sum(len(ids) // BLOCK + 1 for ids in prompts.values()) + 32  # + the warm-ups
    return max(2**30, int(1.25 * blocks * BLOCK_BYTES))


def kv(redis_url: str, name: str, disk: Path, peer: bool, s3_url: str, cpu_bytes: int) -> dict[str, Any]:
    extra = {
        "cpu": {"capacity": cpu_bytes},
        "disk": {"path": str(disk), "capacity": "8GiB"},
        "s3": {"bucket": BUCKET, "endpoint_url": s3_url, "region": "us-east-1", "capacity": "8GiB"},
        "redis_url": redis_url,
        "instance_id": name,
        "presence": {"interval": 0.2, "ttl": 5},
        "peer": {"enabled": peer},
        # The S3 engine needs every upload the holder made.
        "movers": {"shutdown_flush_seconds": 300},
    }
    return connector_config(loading_every_hit(extra))


def hit_then_cpu_hit(kind: str, prompts: dict[tuple[int, int], list[int]]) -> list[dict[str, Any]]:
    """Each prompt as a `kind` hit, then, vLLM's prefix cache cleared, as a CPU hit of
    the blocks that hit staged into this engine's CPU tier."""
    items: list[dict[str, Any]] = []
    for (n, r), ids in prompts.items():
        items += [
            request(f"{kind}/{n}/{r}", ids),
            {"clear_vllm_prefix_cache": True},
            request(f"{kind}-cpu/{n}/{r}", ids),
            {"clear_vllm_prefix_cache": True},
        ]
    return items


def request(name: str, ids: list[int]) -> dict[str, Any]:
    return {"name": name, "ids": ids, "max_tokens": 1}


def engines(base, env, work, disk, redis_url, s3_url, prompts, warm, first_read, stored, read):
    """The four engines of the docstring, in order; each one's output."""
    cpu_bytes = cpu_capacity(prompts)
    holder_items = [request("warm", warm), request("first_read", first_read)]
    holder_items += [request(f"cold/{n}/{r}", ids) for (n, r), ids in prompts.items()]
    holder_items += [{"sleep": 1}, {"touch": str(stored)}, {"wait_for": str(read), "timeout": 1800}]
    reader_items: list[dict[str, Any]] = [request("warm", warm[::-1])]
    reader_items += [{"wait_for": str(stored), "timeout": 1800}, request("first_read", first_read)]
    reader_items += hit_then_cpu_hit("peer", prompts)
    reader_items.append({"touch": str(read)})
    in_process = {"in_process": True}  # clear_vllm_prefix_cache reaches the engine core
    holder = {
        **base,
        "kv_transfer_config": kv(redis_url, "holder", disk, True, s3_url, cpu_bytes),
        "prompts": holder_items,
    }
    reader = {
        **base,
        **in_process,
        "kv_transfer_config": kv(redis_url, "reader", work / "reader-disk", True, s3_url, cpu_bytes),
        "prompts": reader_items,
    }

    def engine(spec: dict[str, Any]) -> dict[str, Any]:
        try:
            return run_engine(spec, work / "runs", env, 3600)
        finally:  # one engine that failed must not leave the other waiting on it
            stored.touch()
            read.touch()

    with ThreadPoolExecutor(2) as pool:
        held, loaded = pool.map(engine, (holder, reader))
    outputs = [held, loaded]
    for name, folder in (("disk", disk), ("s3", work / "empty-disk")):
        items = [request("warm", warm[::-1][1:]), request("first_read", first_read)]
        items += hit_then_cpu_hit(name, prompts)
        config = kv(redis_url, name, folder, False, s3_url, cpu_bytes)
        spec = {**base, **in_process, "kv_transfer_config": config}
        outputs.append(run_engine({**spec, "prompts": items}, work / "runs", env, 3600))
    return outputs


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
        with seaweedfs_process(BUCKET) as s3_url:
            held, loaded, restarted, from_s3 = engines(
                base, env, work, disk, redis.url, s3_url, prompts, warm, first_read, stored, read
            )
    finally:
        redis.close()
    by_name = {r["name"]: r for out in (held, loaded, restarted, from_s3) for r in out["results"]}
    table: dict[int, dict[str, Any]] = {}
    for n in lengths:
        keys = [r for (m, r) in prompts if m == n]
        row: dict[str, Any] = {}
        for kind in ("cold", "peer", "peer-cpu", "disk", "s3"):
            row[f"{kind}_ttft_median"] = median([ttft(by_name[f"{kind}/{n}/{r}"]) for r in keys])
        for kind in ("peer", "disk", "s3"):
            ratios = [ttft(by_name[f"{kind}/{n}/{r}"]) / ttft(by_name[f"{kind}-cpu/{n}/{r}"]) for r in keys]
            row[f"{kind}_vs_cpu"] = median(ratios)
            row[f"{kind}_vs_cpu_interval"] = median_interval(ratios)
        row["cold_vs_cpu"] = median(
            [ttft(by_name[f"cold/{n}/{r}"]) / ttft(by_name[f"peer-cpu/{n}/{r}"]) for r in keys]
        )
        row["peer_vs_s3"] = row["peer_vs_cpu"] / row["s3_vs_cpu"]
        row["peer_cached_tokens"] = [by_name[f"peer/{n}/{r}"]["num_cached_tokens"] for r in keys]
        table[n] = row
    return {
        "lengths": lengths,
        "repeats": args.repeats,
        "table": table,
        "loaded_blocks_reader": loaded["results"][-1].get("counters", {}),
        "loaded_blocks_restarted": restarted["results"][-1].get("counters", {}),
        "loaded_blocks_s3_engine": from_s3["results"][-1].get("counters", {}),
    }


def report(data: dict[str, Any]) -> None:
    print("tokens   cold s   peer s   cpu s   disk s     s3 s  peer/cpu  disk/cpu  s3/cpu  peer/s3  cold/cpu")
    for n, row in data["table"].items():
        print(
            f"{n:>6}  {row['cold_ttft_median']:7.3f}  {row['peer_ttft_median']:7.3f}  "
            f"{row['peer-cpu_ttft_median']:6.3f}  {row['disk_ttft_median']:7.3f}  "
            f"{row['s3_ttft_median']:7.3f}  "
            f"{row['peer_vs_cpu']:8.2f}  {row['disk_vs_cpu']:8.2f}  {row['s3_vs_cpu']:6.2f}  "
            f"{row['peer_vs_s3']:7.2f}  {row['cold_vs_cpu']:8.2f}"
        )
    print("95% interval of each median ratio to the CPU hit (bootstrap over prompts):")
    for n, row in data["table"].items():
        print(
            f"{n:>6}  "
            + "  ".join(
                f"{kind}/cpu {low:.2f}-{high:.2f}"
                for kind in ("peer", "disk", "s3")
                for low, high in [row[f"{kind}_vs_cpu_interval"]]
            )
        )
    print("reader's loaded blocks by tier:", data["loaded_blocks_reader"])
    print("restarted holder's loaded blocks by tier:", data["loaded_blocks_restarted"])
    print("S3 engine's loaded blocks by tier:", data["loaded_blocks_s3_engine"])


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

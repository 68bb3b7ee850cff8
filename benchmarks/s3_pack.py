"""TTFT of an S3 hit inside vLLM with one S3 object per block against runs (issue 18),
both measured in this one run, on the same prompts, on the same machine.

    python benchmarks/s3_pack.py --lengths 2000 --repeats 3 [--pack-blocks 16]

Per setting (`s3.pack_blocks` 1, then the packed one), with a Redis and an S3 server
of its own: a storing engine computes each prompt (CPU + disk + S3, write-through);
then a fresh engine with an empty disk loads each prompt from S3 (`hit`) and again
right after from its CPU tier (`hit2`). Reported: the S3 hit's TTFT, its ratio to the
CPU hit of the same prompt in the same engine (robust to other load on the machine),
the S3 objects written (one PUT each) per block stored, and packed against per-block.
Every hit's num_cached_tokens is kept, so a miss shows. The cost model is off, so each
hit loads from S3 whatever it costs."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from harness import (
    NAMESPACE,
    EngineRunner,
    Requests,
    engine_env,
    machine,
    median,
    results_by,
    save,
    service_cpus,
    ttft,
    write_model,
)

# Longer than s3.pack_flush_seconds (5): a partial run ships by then at the latest.
SETTLE_SECONDS = 8.0


def _kv(extra: dict[str, Any]) -> dict[str, Any]:
    from tiercache.testing.vllm_runner import connector_config

    return connector_config({"namespace": NAMESPACE, **extra})


def _objects_and_blocks(redis_url: str, s3_url: str, bucket: str) -> tuple[int, int]:
    """Run objects in the bucket, and blocks the index holds, summed over ranks."""
    import boto3
    import redis

    client = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")
    objects = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="e2e/"):
        objects += sum(1 for o in page.get("Contents", ()) if o["Key"].endswith(".run.safetensors"))
    r = redis.Redis.from_url(redis_url)
    blocks = sum(int(r.hlen(k)) for k in r.scan_iter(match="tc:*:blk:*"))
    r.close()
    return objects, blocks


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tiercache.testing.servers import local_stack

    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    asks = Requests(lengths, args.repeats)
    spec = {
        "model": str(write_model(work / "model")),
        "max_model_len": max(lengths) + 64,
        "gpu_memory_utilization": args.kv_fraction,
        "log_stats": True,
    }
    runner = EngineRunner(spec, work / "runs", engine_env(args), work / "partial.json")
    cpu = {"capacity": args.cpu_capacity}
    settings: dict[str, Any] = {}
    for pack in (1, args.pack_blocks):
        bucket = f"tiercache-pack{pack}"
        full, empty = work / f"disk-full-{pack}", work / f"disk-empty-{pack}"
        for d in (full, empty):
            shutil.rmtree(d, ignore_errors=True)
        with local_stack(bucket, s3_process=True, cpus=service_cpus(args)) as (redis_server, s3):
            shared = {
                "redis_url": redis_server.url,
                "s3": {"bucket": bucket, "endpoint_url": s3.url, "prefix": "e2e/", "pack_blocks": pack},
                "movers": {"shutdown_flush_seconds": 300, "cost_model": "off"},
            }
            store, fresh = f"store_pack{pack}", f"s3_pack{pack}"
            runner.run(
                store,
                asks.warm(False, stored=True) + asks.colds(1, False),
                kv_transfer_config=_kv({"cpu": cpu, "disk": {"path": str(full)}, **shared}),
            )
            objects, blocks = _objects_and_blocks(redis_server.url, s3.url, bucket)
            runner.run(
                fresh,
                # The warm-ups' own write-through goes to the same S3 server: let it
                # end before the S3 hits are timed.
                asks.warm(False, stored=True) + [{"sleep": SETTLE_SECONDS}] + asks.hits(twice=True),
                kv_transfer_config=_kv({"cpu": cpu, "disk": {"path": str(empty)}, **shared}),
            )
        first = results_by(runner.engines, fresh, "hit")
        second = results_by(runner.engines, fresh, "hit2")
        keys = sorted(k for k in first if k in second)
        settings[str(pack)] = {
            "pack_blocks": pack,
            "s3_objects": objects,
            "blocks_indexed": blocks,
            "objects_per_block": round(objects / blocks, 4) if blocks else None,
            "s3_hit_ttft_median": median([ttft(first[k]) for k in keys]),
            "cpu_hit_ttft_median": median([ttft(second[k]) for k in keys]),
            "s3_hit_vs_cpu_hit_paired": median([ttft(first[k]) / ttft(second[k]) for k in keys]),
            "cached_tokens": {f"{n}/{r}": first[(n, r)].get("num_cached_tokens") for n, r in keys},
            # Each length apart: the medians above mix short and long prompts.
            "per_length": {
                n: {
                    "s3_hit_ms": [round(1000 * ttft(first[k])) for k in keys if k[0] == n],
                    "cpu_hit_ms": [round(1000 * ttft(second[k])) for k in keys if k[0] == n],
                }
                for n in lengths
            },
        }
        print(settings[str(pack)], flush=True)
    runner.stop()
    base, packed = settings["1"], settings[str(args.pack_blocks)]
    return {
        "machine": machine(),
        "args": vars(args),
        "settings": settings,
        "put_ratio": round(packed["objects_per_block"] / base["objects_per_block"], 4),
        "s3_hit_ttft_ratio": round(packed["s3_hit_ttft_median"] / base["s3_hit_ttft_median"], 3),
        "s3_hit_paired_ratio": round(
            packed["s3_hit_vs_cpu_hit_paired"] / base["s3_hit_vs_cpu_hit_paired"], 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="2000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pack-blocks", type=int, default=16)
    parser.add_argument("--cpu-capacity", default="4GiB")
    parser.add_argument("--kv-fraction", type=float, default=0.25)
    parser.add_argument("--workdir", default="/tmp/tiercache-bench-s3pack")
    parser.add_argument("--reserved-cpus", type=int, default=1, help="as in e2e.py")
    args = parser.parse_args()
    data = run(args)
    save("s3_pack", data)
    print({k: data[k] for k in ("put_ratio", "s3_hit_ttft_ratio", "s3_hit_paired_ratio")})


if __name__ == "__main__":
    main()

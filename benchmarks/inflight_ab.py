"""The in-flight CPU-tier hit with the write-down gate and without it: one prompt after
another, each computed cold and then asked again at once, while its own write-through
to disk and S3 still runs, in two fresh tiercache engines that differ only in
`movers.yield_to_loads`. Each in-flight hit is paired with a prefix-cache hit of the
same prompt in the same engine, asked once the write-through is over.

    python benchmarks/inflight_ab.py --length 2000 --prompts 6 --name inflight-ab-1
    python benchmarks/inflight_ab.py --setting workers --order 4,1,4,1 --length 1000

Engines run in the order given by --order (off,on by default; a second run with on,off
tells the order's share). `--setting` varies another movers setting instead, each
engine with its own disk folder and S3 prefix. S3 is the sink (benchmarks/s3_sink.py)
unless --s3-server moto. Every hit is checked as in hit_pairs.py: whole prefix cached,
first token and top logprobs as in the prompt's cold run, every block loaded from the
CPU tier."""

from __future__ import annotations

import argparse
import shutil
from typing import Any

from harness import (
    engine_arguments,
    engine_runner,
    machine,
    median,
    prompt,
    request,
    save,
    store_services,
    ttft,
)
from hit_pairs import LOADED_BLOCKS, RESET, by_name, hit_problems, tiercache_kv


def items_for(asks: list[list[int]], length: int, quiet: float) -> list[dict[str, Any]]:
    warm = prompt(7000 + length, length)
    items = [request("warm", prompt(1, 64)), request("warm", warm), RESET, request("warm", warm)]
    for i, ids in enumerate(asks):
        items += [request(f"cold/{i}", ids), RESET, request(f"inflight/{i}", ids), {"sleep": quiet}]
        items += [request(f"pc/{i}", ids), RESET, request(f"cpu/{i}", ids)]
    return items


def check(results: dict[str, dict[str, Any]], count: int, length: int) -> list[str]:
    problems = []
    for i in range(count):
        cold = results[f"cold/{i}"]
        for label, tier in (("inflight", "cpu"), ("pc", None), ("cpu", "cpu")):
            problems += hit_problems(results[f"{label}/{i}"], cold, length, tier)
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--order", default="off,on", help="the setting's value per engine, in run order")
    parser.add_argument("--setting", default="yield_to_loads", help="the movers setting that differs")
    parser.add_argument("--quiet-seconds", type=float, default=8.0)
    engine_arguments(parser, "/tmp/tiercache-bench-inflight")
    parser.add_argument(
        "--load-in-forward",
        default="on",
        choices=["on", "off"],
        help="disk.load_in_forward of every engine: on, objects are written with a checksum per layer",
    )
    parser.add_argument("--name", default="inflight-ab")
    args = parser.parse_args()

    work, runner = engine_runner(args, args.length)
    asks = [prompt(50_000 + i, args.length) for i in range(args.prompts)]
    summary: dict[str, Any] = {}
    problems: list[str] = []
    with store_services(args) as (redis_server, s3_url):
        for number, value in enumerate(args.order.split(",")):
            gate = value if args.setting == "yield_to_loads" else f"{args.setting}={value}-{number}"
            disk = work / f"disk-{gate}"
            shutil.rmtree(disk, ignore_errors=True)
            config = {
                "cpu": {"capacity": args.cpu_capacity},
                "disk": {"path": str(disk), "load_in_forward": args.load_in_forward == "on"},
                "redis_url": redis_server.url,
                "s3": {"bucket": "tiercache-store", "endpoint_url": s3_url, "prefix": f"inflight-{gate}/"},
                "movers": {"shutdown_flush_seconds": 300, "cost_model": "off", "yield_to_loads": True},
            }
            # As written: the connector's config types it ("on" a bool, "4" a number).
            config["movers"][args.setting] = value
            name = f"gate_{gate}"
            runner.run(
                name,
                items_for(asks, args.length, args.quiet_seconds),
                kv_transfer_config=tiercache_kv(config),
                counters=LOADED_BLOCKS,
            )
            results = by_name(runner.engines[name])
            problems += [f"{name} {p}" for p in check(results, args.prompts, args.length)]
            inflight = [1000 * ttft(results[f"inflight/{i}"]) for i in range(args.prompts)]
            pc = [1000 * ttft(results[f"pc/{i}"]) for i in range(args.prompts)]
            cpu = [1000 * ttft(results[f"cpu/{i}"]) for i in range(args.prompts)]
            summary[name] = {
                "inflight_ms": inflight,
                "pc_ms": pc,
                "cpu_ms": cpu,
                "inflight_over_pc_paired": median([a / b for a, b in zip(inflight, pc, strict=True)]),
                "cpu_over_pc_paired": median([a / b for a, b in zip(cpu, pc, strict=True)]),
            }
    runner.stop()
    data = {"engines": runner.engines, "summary": summary, "machine": machine(), "args": vars(args)}
    save(args.name, data)
    print("| engine | in-flight hits (ms) | prefix-cache hits (ms) | in-flight / pc | quiet CPU hit / pc |")
    print("|---|---|---|---:|---:|")
    for name, row in summary.items():
        print(
            f"| {name} | {', '.join(f'{x:.0f}' for x in row['inflight_ms'])} "
            f"| {', '.join(f'{x:.0f}' for x in row['pc_ms'])} "
            f"| {row['inflight_over_pc_paired']:.3f}x | {row['cpu_over_pc_paired']:.3f}x |"
        )
    if problems:
        raise SystemExit("hits that were not right:\n  " + "\n  ".join(problems))


if __name__ == "__main__":
    main()

"""The first request after an idle pause, in an engine without a connector and in a
tiercache engine: each prompt computed cold, hit from vLLM's prefix cache at once,
then again after `--pause` seconds of nothing, then once more at once. Tells whether
a prefix-cache hit after a pause pays for the pause, and whether tiercache adds to it.

    python benchmarks/idle_ab.py --length 1000 --prompts 6 --pause 8"""

from __future__ import annotations

import argparse
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
from hit_pairs import by_name, tiercache_kv


def items_for(asks: list[list[int]], length: int, pause: float) -> list[dict[str, Any]]:
    warm = prompt(7000 + length, length)
    items = [request("warm", prompt(1, 64)), request("warm", warm), request("warm", warm)]
    for i, ids in enumerate(asks):
        items += [request(f"cold/{i}", ids), request(f"at_once/{i}", ids), {"sleep": pause}]
        items += [request(f"after_pause/{i}", ids), request(f"again/{i}", ids)]
    return items


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--pause", type=float, default=8.0)
    engine_arguments(parser, "/tmp/tiercache-bench-idle")
    parser.add_argument("--name", default="idle-ab")
    args = parser.parse_args()
    work, runner = engine_runner(args, args.length)
    asks = [prompt(60_000 + i, args.length) for i in range(args.prompts)]
    items = items_for(asks, args.length, args.pause)
    with store_services(args) as (redis_server, s3_url):
        runner.run("no_connector", items)
        config = {
            "cpu": {"capacity": args.cpu_capacity},
            "disk": {"path": str(work / "disk")},
            "redis_url": redis_server.url,
            "s3": {"bucket": "tiercache-store", "endpoint_url": s3_url, "prefix": "idle/"},
        }
        runner.run("tiercache", items, kv_transfer_config=tiercache_kv(config))
    runner.stop()
    summary = {}
    for engine, data in runner.engines.items():
        by = by_name(data)
        summary[engine] = {
            label: [1000 * ttft(by[f"{label}/{i}"]) for i in range(args.prompts)]
            for label in ("at_once", "after_pause", "again")
        }
    save(args.name, {"engines": runner.engines, "summary": summary, "machine": machine(), "args": vars(args)})
    print(
        "| engine | hit at once (ms) | after the pause | again at once | after the pause / at once, median |"
    )
    print("|---|---|---|---|---:|")
    for engine, row in summary.items():
        ratio = median([b / a for a, b in zip(row["at_once"], row["after_pause"], strict=True)])
        cells = [", ".join(f"{x:.0f}" for x in row[k]) for k in ("at_once", "after_pause", "again")]
        print(f"| {engine} | " + " | ".join(cells) + f" | {ratio:.3f}x |")


if __name__ == "__main__":
    main()

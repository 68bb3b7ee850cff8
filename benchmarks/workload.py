"""A synthetic multi-round chat against vLLM (CPU build here), with and without
tiercache, and a second engine that shares the first one's Redis and S3 (empty disk).

Every user's conversation starts with one shared system prompt; each turn appends the
previous reply and a new user message to that user's history, so each prompt extends
the user's previous prompt. Users take turns round-robin, so between two turns of one
user the others push its blocks out of a CPU tier smaller than the working set: the
disk tier serves them back, and the second engine gets everything from S3.

Replies are synthetic tokens (fixed per user and turn), not the model's output, so
that every engine sees exactly the same prompts; each request still generates
`--gen` tokens. Requests are sent one at a time (one stream).

    python benchmarks/workload.py                       # defaults: 4 users x 4 turns
    python benchmarks/workload.py --users 6 --turns 5

Reports per engine: hit rate (tokens served from a cache / prompt tokens, from
vLLM's num_cached_tokens), mean and p90 TTFT, requests/s and tokens/s, and the first
step's top logprobs of every request against the run without any cache (within 0.3).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from harness import (
    NAMESPACE,
    RESULTS,
    engine_env,
    logprob_gap,
    machine,
    prompt,
    service_cpus,
    write_model,
)

# Half the e2e model's depth (same KV heads and head size): 32 KiB of KV per token,
# 1 MiB per 32-token block, and twice the prefill speed, so the run stays short.
WORKLOAD_MODEL = dict(num_hidden_layers=4)


def conversations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The request list, in the order sent: turn by turn, user by user."""
    system = prompt(77, args.system)
    history = {u: list(system) for u in range(args.users)}
    requests = []
    for turn in range(args.turns):
        for user in range(args.users):
            if turn:
                history[user] += prompt(10_000 + 100 * user + turn, args.reply)  # the "reply"
            history[user] += prompt(20_000 + 100 * user + turn, args.message)
            requests.append({"name": f"u{user}/t{turn}", "ids": list(history[user]), "max_tokens": args.gen})
    return requests


def summarize(results: list[dict[str, Any]], wall: float, reference: dict[str, dict] | None) -> dict:
    ttft = [r["metrics"]["first_token_latency"] for r in results]
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["num_cached_tokens"] for r in results)
    generated = sum(len(r["token_ids"]) for r in results)
    busy = sum(r["seconds"] for r in results)
    out = {
        "requests": len(results),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens,
        "ttft_mean": statistics.mean(ttft),
        "ttft_p90": statistics.quantiles(ttft, n=10)[-1] if len(ttft) > 1 else ttft[0],
        "ttft_median": statistics.median(ttft),
        "busy_seconds": busy,
        "requests_per_s": len(results) / busy,
        "tokens_per_s": (prompt_tokens + generated) / busy,
        "engine_wall_seconds": wall,
    }
    if reference is not None:
        gaps = [logprob_gap(r["top_logprobs"], reference[r["name"]]["top_logprobs"]) for r in results]
        out["max_logprob_gap"] = max(gaps)
        out["requests_over_tolerance"] = sum(g > 0.3 for g in gaps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    parser.add_argument("--message", type=int, default=192, help="tokens per user message")
    parser.add_argument("--reply", type=int, default=64, help="tokens per (synthetic) reply")
    parser.add_argument("--gen", type=int, default=8, help="tokens generated per request")
    parser.add_argument(
        "--cpu-capacity", default="80MiB", help="smaller than the working set (152 blocks of 1 MiB)"
    )
    parser.add_argument("--workdir", default="/tmp/tiercache-bench-workload")
    parser.add_argument(
        "--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU (CPU build)"
    )
    args = parser.parse_args()

    from tiercache.testing.servers import local_stack
    from tiercache.testing.vllm_runner import connector_config, run_engine

    work = Path(args.workdir).resolve()
    model = str(write_model(work / "model", **WORKLOAD_MODEL))
    requests = conversations(args)
    longest = max(len(r["ids"]) for r in requests)
    warm = [
        {"name": "warm", "ids": prompt(1, 64), "max_tokens": 1},
        {"name": "warm", "ids": prompt(2, 512), "max_tokens": 1},
        {"name": "warm", "ids": prompt(2, 512), "max_tokens": 1},
    ]
    base = {
        "model": model,
        "max_model_len": longest + args.gen + 64,
        "gpu_memory_utilization": 0.2,
        "log_stats": True,
    }
    runs: dict[str, Any] = {}

    def engine(name: str, extra: dict[str, Any] | None) -> list[dict[str, Any]]:
        print(f"[{time.strftime('%H:%M:%S')}] engine {name}", flush=True)
        spec = {**base, "prompts": warm + requests}
        if extra is not None:
            spec["kv_transfer_config"] = connector_config({"namespace": NAMESPACE + "-workload", **extra})
        began = time.perf_counter()
        out = run_engine(spec, work / "runs", env=engine_env(args), timeout=3600)
        results = [r for r in out["results"] if r["name"] != "warm"]
        runs[name] = {"results": results, "wall": time.perf_counter() - began}
        return results

    none = engine("none", None)
    reference = {r["name"]: r for r in none}
    disk_a, disk_b = work / "disk-a", work / "disk-b"
    for d in (disk_a, disk_b):
        shutil.rmtree(d, ignore_errors=True)
    with local_stack("tiercache-workload", s3_process=True, cpus=service_cpus(args)) as (redis_server, s3):
        shared = {
            "redis_url": redis_server.url,
            "s3": {"bucket": "tiercache-workload", "endpoint_url": s3.url, "prefix": "chat/"},
            "movers": {"shutdown_flush_seconds": 300, "cost_model": "off"},  # each tier's own hit
        }
        cpu = {"capacity": args.cpu_capacity}
        engine("tiercache", {"cpu": cpu, "disk": {"path": str(disk_a)}, **shared})
        engine("tiercache_second", {"cpu": cpu, "disk": {"path": str(disk_b)}, **shared})

    summary = {name: summarize(r["results"], r["wall"], reference) for name, r in runs.items()}
    working_set_blocks = len(
        {tuple(r["ids"][: (i + 1) * 32]) for r in requests for i in range(len(r["ids"]) // 32)}
    )
    data = {
        "machine": machine(),
        "args": vars(args),
        "model": WORKLOAD_MODEL,
        "working_set_blocks": working_set_blocks,
        "summary": summary,
        "per_request": {
            name: [
                {
                    "name": r["name"],
                    "prompt_tokens": r["prompt_tokens"],
                    "cached": r["num_cached_tokens"],
                    "ttft": r["metrics"]["first_token_latency"],
                }
                for r in v["results"]
            ]
            for name, v in runs.items()
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "workload.json").write_text(json.dumps(data, indent=1))
    print(json.dumps(summary, indent=1))
    print("working set:", working_set_blocks, "blocks; CPU tier:", args.cpu_capacity)


if __name__ == "__main__":
    main()

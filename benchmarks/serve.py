"""vLLM's OpenAI server under load, driven by vLLM's own benchmark client
(`vllm.benchmarks.serve`), on two traces whose working set is several times the
server's KV cache:

    .venv/bin/python benchmarks/serve.py                  # all four configs, both traces
    .venv/bin/python benchmarks/serve.py --smoke          # a small trace, to try the set-up
    .venv/bin/python benchmarks/serve.py --table          # the saved run's table again
    .venv/bin/python benchmarks/serve.py --tiercache-set movers.workers=2   # override a setting

Configs, one server each, one after another: `prefix_cache` (vLLM's prefix cache
alone, the baseline of every ratio), `tiercache_cpu_disk`, `tiercache_cpu_disk_s3`
(moto and redis-server on loopback) and `lmcache` (LMCache's multi-process mode from
`--lmcache-venv`, see lmcache_peer.py; its L1 the size of tiercache's CPU tier, and a
file-system L2 that LMCache cannot bound). Every server keeps vLLM's prefix cache on,
gets VLLM_CPU_NUM_OF_RESERVED_CPU=1, block size 32 and the same KV cache; requests are
greedy and generate exactly `--output-len` tokens.

Traces (distinct tokens, so neither hits the other's blocks): `prefix_repetition`,
vLLM's built-in dataset; `multi_turn`, `--users` conversations of `--turns` turns, each
prompt the previous one plus a fixed synthetic reply and a new message, sent turn by
turn (a user's next turn only after its previous one came back; checked per run).

Each server first serves unrelated warm-ups; tiercache's write-downs finish between
traces. Hits by tier come from the servers' /metrics, read before and after each
trace. Results: benchmarks/results/serve.json (`--name`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The tests' helpers (tests/support/) import as `support.*`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import (  # noqa: E402
    RESULTS,
    CpuMonitor,
    foreign_vllm,
    machine,
    save,
    service_cpus,
    versions,
)

from tiercache.ops.tiny_model import write_tiny_llama  # noqa: E402

from support.serving import (  # noqa: E402
    EOS,
    VllmServer,
    metric,
    text_of,
    write_word_tokenizer,
)

CONFIGS = ("prefix_cache", "tiercache_cpu_disk", "tiercache_cpu_disk_s3", "lmcache")
TRACES = ("prefix_repetition", "multi_turn")
LABELS = {
    "prefix_cache": "(a) prefix cache only",
    "tiercache_cpu_disk": "(b) tiercache CPU + disk",
    "tiercache_cpu_disk_s3": "(c) tiercache CPU + disk + S3",
    "lmcache": "(d) LMCache MP (L1 + fs L2)",
}
BLOCK = 32
VOCAB = 2048
# 2 layers, hidden 1024, 8 KV heads of 128, float32: 16 KiB of KV per token, 512 KiB
# per block. A block's prefill (about 1.3 GFLOP) costs tens of ms on one core of this
# VM, copying its KV well under one: a cache has something to save. Two layers, not
# more, so that the whole run fits in about half an hour on 2 cores.
MODEL = dict(num_layers=2, hidden_size=1024, num_heads=8, num_kv_heads=8, intermediate_size=2048)
KV_BLOCK_BYTES = MODEL["num_layers"] * 2 * MODEL["num_kv_heads"] * 128 * BLOCK * 4
ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "PYTHONHASHSEED": "0",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # LMCache's and vLLM's usage telemetry off (there is no network here anyway).
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
}
# Counters read from each server's /metrics before and after a trace: name -> labels.
COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "device_hit_tokens": ("vllm:prefix_cache_hits_total", {}),
    "external_hit_tokens": ("vllm:external_prefix_cache_hits_total", {}),
    "preemptions": ("vllm:num_preemptions_total", {}),
    "generation_tokens": ("vllm:generation_tokens_total", {}),
    **{
        f"cached_tokens_{source}": ("vllm:prompt_tokens_cached_by_source_total", {"source": source})
        for source in ("device", "host", "disk", "p2p", "external_unspecified")
    },
    **{
        f"tiercache_loaded_blocks_{tier}": ("vllm:tiercache_loaded_blocks_total", {"tier": tier})
        for tier in ("cpu", "disk", "s3")
    },
    **{
        f"tiercache_failed_blocks_{tier}": ("vllm:tiercache_failed_blocks_total", {"tier": tier})
        for tier in ("cpu", "disk", "s3")
    },
    "tiercache_stored_blocks": ("vllm:tiercache_stored_blocks_total", {}),
    "tiercache_stores_dropped": ("vllm:tiercache_stores_dropped_total", {}),
    # The cost model's and the CPU tier's cuts: a hit loaded, skipped as slower than
    # recomputing it, or cut for want of CPU slots to stage it into.
    **{
        f"decision_{decision}_{tier}": (
            "vllm:tiercache_load_decisions_total",
            {"decision": decision, "tier": tier},
        )
        for decision in ("load", "skip", "no_room")
        for tier in ("disk", "s3")
    },
    "hook_failures": ("vllm:tiercache_hook_failures_total", {}),
}
IN_FLIGHT = ("vllm:tiercache_loads_in_flight", "vllm:tiercache_stores_in_flight")


# -- traces --------------------------------------------------------------------------
def multi_turn_trace(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The multi-turn trace in the order sent (turn by turn, user by user), as lines of
    the client's `timed_trace` dataset: each hash id stands for one 32-token block of
    random tokens, so a turn that lists its user's previous ids and then new ones
    extends the previous prompt exactly. Timestamps only keep the order (the client
    runs with --no-self-timed: as fast as the clients allow)."""
    for n in (args.context_len, args.message_len, args.reply_len):
        if n % BLOCK:
            raise SystemExit(f"multi-turn lengths must be multiples of {BLOCK} tokens, got {n}")
    next_id = iter(range(1, 1 << 30))

    def blocks(tokens: int) -> list[int]:
        return [next(next_id) for _ in range(tokens // BLOCK)]

    history = {u: blocks(args.context_len) for u in range(args.users)}
    lines = []
    for turn in range(args.turns):
        for user in range(args.users):
            if turn:
                history[user] += blocks(args.reply_len)  # the previous answer
            history[user] += blocks(args.message_len)  # the user's next message
            lines.append(
                {
                    "timestamp": len(lines),
                    "input_length": len(history[user]) * BLOCK,
                    "output_length": args.output_len,
                    "hash_ids": list(history[user]),
                }
            )
    return lines


def working_set_blocks(trace: str, args: argparse.Namespace) -> int:
    """Distinct full blocks the trace's prompts touch (what a cache would need to hold)."""
    if trace == "multi_turn":
        longest = args.context_len + args.turns * args.message_len + (args.turns - 1) * args.reply_len
        return args.users * (longest // BLOCK)
    per_prefix = args.requests // args.prefixes
    return args.prefixes * (args.prefix_len // BLOCK) + args.prefixes * per_prefix * (
        args.suffix_len // BLOCK
    )


def client_args(trace: str, server: VllmServer, args: argparse.Namespace, work: Path) -> list[str]:
    """The benchmark client's command line for one trace against one server."""
    common = [
        "--backend", "vllm",
        "--base-url", server.base,
        "--model", str(server.model),
        "--tokenizer", str(server.model),
        "--max-concurrency", str(args.clients),
        "--request-rate", "inf",
        "--temperature", "0",
        "--ignore-eos",
        "--seed", str(args.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--save-detailed",  # keeps ttfts, latencies, start times and texts in the result
        "--disable-tqdm",
    ]  # fmt: skip
    if trace == "prefix_repetition":
        return common + [
            "--dataset-name", "prefix_repetition",
            "--num-prompts", str(args.requests),
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
        ]  # fmt: skip
    path = work / "multi_turn.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in multi_turn_trace(args)))
    return common + [
        "--dataset-name", "timed_trace",
        "--dataset-path", str(path),
        "--num-prompts", str(args.users * args.turns),
        "--timed-trace-chunk-hash-size", str(BLOCK),
        "--no-self-timed",  # file order, as fast as the clients allow
    ]  # fmt: skip


def run_client(argv: list[str]) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return bench_main(parser.parse_args(argv))


def turns_sent_early(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Multi-turn requests sent before their user's previous turn had come back."""
    starts, latencies = result["start_times"], result["latencies"]
    early = 0
    for i in range(args.users, len(starts)):
        previous = i - args.users
        if starts[i] < starts[previous] + latencies[previous]:
            early += 1
    return early


# -- servers --------------------------------------------------------------------------
def wait_for_quiet_machine(limit: float) -> float:
    """Wait (up to `limit` s) until no other vLLM runs: a timed config must not share
    the 2 cores with someone else's engine. Returns the seconds waited."""
    began = time.monotonic()
    while others := foreign_vllm():
        if time.monotonic() - began > limit:
            print(f"still not quiet after {limit:.0f}s, going on: {others}", flush=True)
            break
        print(f"[{time.strftime('%H:%M:%S')}] waiting for foreign vLLM: {others[:3]}", flush=True)
        time.sleep(30)
    return time.monotonic() - began


def server_args(args: argparse.Namespace, kv: dict[str, Any] | None) -> list[str]:
    out = [
        "--dtype", "float32",
        "--block-size", str(BLOCK),
        "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", str(args.kv_blocks * KV_BLOCK_BYTES),
        "--enforce-eager",
        "--seed", "0",
    ]  # fmt: skip
    if kv is not None:
        out += ["--kv-transfer-config", json.dumps(kv)]
    return out


def tiercache_kv(args: argparse.Namespace, disk: Path, shared: dict[str, Any] | None) -> dict[str, Any]:
    from tiercache.ops.vllm_runner import connector_config

    shutil.rmtree(disk, ignore_errors=True)
    return connector_config(
        {
            "namespace": "bench-serve",
            "cpu": {"capacity": args.cpu_blocks * KV_BLOCK_BYTES},
            "disk": {"path": str(disk), "capacity": args.disk_blocks * KV_BLOCK_BYTES},
            **(shared or {}),
        }
    )


def tiercache_env(settings: list[str]) -> dict[str, str]:
    """--tiercache-set disk.load_in_forward=false as the environment override every
    tiercache process reads on top of its config (TIERCACHE_DISK__LOAD_IN_FORWARD)."""
    from tiercache.config_env import ENV_PREFIX

    env = {}
    for setting in settings:
        path, _, value = setting.partition("=")
        env[ENV_PREFIX + path.replace(".", "__").upper()] = value
    return env


@contextlib.contextmanager
def config_services(name: str, args: argparse.Namespace, work: Path):
    """What a config's server needs beside it; yields (kv_transfer_config, python, lmcache server)."""
    if name == "prefix_cache":
        yield None, None, None
    elif name == "tiercache_cpu_disk":
        yield tiercache_kv(args, work / "disk-b", None), None, None
    elif name == "tiercache_cpu_disk_s3":
        from tiercache.ops.local_stack import local_stack

        # On the core vLLM keeps for its scheduler, off the one the model computes on.
        with local_stack("tc-serve", s3_process=True, cpus=service_cpus(args)) as (redis_server, s3):
            shared = {
                "redis_url": redis_server.url,
                "s3": {
                    "bucket": "tc-serve",
                    "endpoint_url": s3.url,
                    "region": "us-east-1",
                    "prefix": "serve/",
                },
            }
            yield tiercache_kv(args, work / "disk-c", shared), None, None
    elif name == "lmcache":
        from lmcache_peer import LMCacheServer, lmcache_kv

        venv = Path(args.lmcache_venv)
        disk = work / "lmcache-l2"
        shutil.rmtree(disk, ignore_errors=True)
        l1_gb = args.cpu_blocks * KV_BLOCK_BYTES / 2**30  # as large as tiercache's CPU tier
        server = LMCacheServer(work / "lmcache", 256, l1_gb, binary=str(venv / "bin" / "lmcache"))
        # A file-system L2 below the L1 (the disk tier's counterpart; the fs adapter
        # declares no capacity, so nothing bounds it).
        server.command += ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(disk)})]
        server.start()
        try:
            yield lmcache_kv(server.port), str(venv / "bin" / "python"), server
        finally:
            server.stop()
    else:
        raise ValueError(name)


def warm_up(server: VllmServer) -> None:
    """Unrelated requests, each prompt twice (the hit path is warmed too), two at a time."""
    rng = random.Random(12345)
    prompts = [[rng.randrange(EOS + 1, VOCAB) for _ in range(n)] for n in (96, 400, 700)]

    async def go() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            for ids in prompts:
                body = {"model": str(server.model), "prompt": text_of(ids), "max_tokens": 4, "temperature": 0}
                for _ in range(2):
                    responses = await asyncio.gather(
                        *(client.post(f"{server.base}/v1/completions", json=body) for _ in range(2))
                    )
                    for r in responses:
                        r.raise_for_status()

    asyncio.run(go())


def settle(server: VllmServer, timeout: float = 120) -> float:
    """Wait for tiercache's loads and write-downs to finish, so a trace does not pay for
    the last one's. vLLM carries connector reports only in engine steps: tiny requests
    (no full block) keep steps coming."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        text = server.metrics()
        if not any(metric(text, name) for name in IN_FLIGHT):
            break
        httpx.post(
            f"{server.base}/v1/completions",
            json={"model": str(server.model), "prompt": text_of([5, 6, 7]), "max_tokens": 1},
            timeout=60,
        ).raise_for_status()
        time.sleep(0.5)
    return time.monotonic() - began


def counters(text: str) -> dict[str, float]:
    return {key: metric(text, name, **labels) for key, (name, labels) in COUNTERS.items()}


def lmcache_counters(server: Any) -> dict[str, float]:
    """LMCache's own counters (its `_total` samples; names vary by release), from the
    /metrics page of the server's HTTP port."""
    try:
        text = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("lmcache_") and "_total" in name:
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def run_config(
    name: str, args: argparse.Namespace, work: Path, model: Path, monitor: CpuMonitor
) -> dict[str, Any]:
    waited = wait_for_quiet_machine(args.quiet_wait)
    print(f"[{time.strftime('%H:%M:%S')}] config {name}", flush=True)
    out: dict[str, Any] = {"waited_for_quiet_s": waited, "traces": {}}
    with config_services(name, args, work) as (kv, python, lmcache):
        began = time.monotonic()
        env = {**ENV, **tiercache_env(args.tiercache_set)} if name.startswith("tiercache") else ENV
        server = VllmServer(model, server_args(args, kv), work / f"{name}.log", env, python=python)
        try:
            server.wait_ready()
            out["startup_s"] = time.monotonic() - began
            warm_up(server)
            if kv is not None:
                settle(server)
            for trace in args.traces:
                before, lm_before = server.metrics(), lmcache_counters(lmcache) if lmcache else {}
                t0 = time.time()
                result = run_client(client_args(trace, server, args, work))
                t1 = time.time()
                settled = settle(server) if kv is not None else 0.0
                after, lm_after = server.metrics(), lmcache_counters(lmcache) if lmcache else {}
                c0, c1 = counters(before), counters(after)
                summary = summarize(result, {k: c1[k] - c0[k] for k in c1})
                summary["foreign_cores"] = monitor.foreign_cores(t0, t1)
                summary["settle_s"] = settled
                if trace == "multi_turn":
                    summary["turns_sent_early"] = turns_sent_early(result, args)
                if lmcache:
                    summary["lmcache_server_counters"] = {
                        k: v - lm_before.get(k, 0.0)
                        for k, v in lm_after.items()
                        if v != lm_before.get(k, 0.0)
                    }
                out["traces"][trace] = {
                    "summary": summary,
                    "ttfts": result["ttfts"],
                    "latencies": result["latencies"],
                    "start_times": result["start_times"],
                    "input_lens": result["input_lens"],
                    "generated_texts": result["generated_texts"],
                    "errors": [e for e in result["errors"] if e],
                }
                (work / f"{name}-{trace}.metrics").write_text(after)
                print(f"[{time.strftime('%H:%M:%S')}] {name} {trace}: {json.dumps(summary)}", flush=True)
            if lmcache:
                out["lmcache_server_cpu_s"] = lmcache.cpu_seconds()
        finally:
            out["exit_code"] = server.stop()
            out["log"] = str(server.log_path)
    return out


def summarize(result: dict[str, Any], delta: dict[str, float]) -> dict[str, Any]:
    ttfts = [t for t, e in zip(result["ttfts"], result["errors"], strict=True) if not e]
    prompt_tokens = delta["prompt_tokens"] or float("nan")
    hits = {
        "vllm_prefix_cache": delta["cached_tokens_device"],
        "cpu": delta["cached_tokens_host"],
        "disk": delta["cached_tokens_disk"],
        "external": delta["cached_tokens_external_unspecified"] + delta["cached_tokens_p2p"],
    }
    return {
        "requests": result["completed"],
        "failed": result["failed"],
        "duration_s": result["duration"],
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1],
        "ttft_median_s": statistics.median(ttfts),
        "request_throughput": result["request_throughput"],
        "output_throughput": result["output_throughput"],
        "total_token_throughput": result["total_token_throughput"],
        "input_tokens": result["total_input_tokens"],
        "output_tokens": result["total_output_tokens"],
        "hit_tokens_by_source": hits,
        "hit_rate": sum(hits.values()) / prompt_tokens,
        "counters": delta,
    }


# -- the run ---------------------------------------------------------------------------
# A ratio's name in a summary's ratios, and the figure of the summary it divides.
RATIO_FIGURES = {
    "ttft_mean": "ttft_mean_s",
    "ttft_p90": "ttft_p90_s",
    "request_throughput": "request_throughput",
    "output_throughput": "output_throughput",
}


def ratios(summary: dict[str, Any], baseline: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    """Each named figure of a run's summary over the same figure of a baseline's."""
    return {name: summary[RATIO_FIGURES[name]] / baseline[RATIO_FIGURES[name]] for name in names}


def add_ratios(data: dict[str, Any]) -> None:
    """Each config's figures against (a) prefix cache only, and tiercache's against LMCache."""
    configs = data["configs"]
    base = configs.get("prefix_cache", {}).get("traces", {})
    peer = configs.get("lmcache", {}).get("traces", {})
    for name, cfg in configs.items():
        for trace, t in cfg.get("traces", {}).items():
            s = t["summary"]
            if trace in base:
                b = base[trace]["summary"]
                s["vs_prefix_cache"] = ratios(
                    s, b, ("ttft_mean", "ttft_p90", "request_throughput", "output_throughput")
                )
                texts = base[trace]["generated_texts"]
                s["same_output_as_prefix_cache"] = sum(
                    a == x for a, x in zip(t["generated_texts"], texts, strict=True)
                )
            if trace in peer and name.startswith("tiercache"):
                p = peer[trace]["summary"]
                s["vs_lmcache"] = ratios(s, p, ("ttft_mean", "request_throughput", "output_throughput"))


def git_state() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty_files": git("status", "--porcelain", "-uno").splitlines(),
    }


def prepare_run(args: argparse.Namespace) -> tuple[Path, Path, dict[str, Any]]:
    """The work folder, the benchmark model written in it, and what every result
    file starts with (machine, commit, arguments, model)."""
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(work / "model", vocab_size=VOCAB, max_positions=args.max_model_len, **MODEL)
    write_word_tokenizer(model, VOCAB)
    head = {
        "machine": machine(),
        "git": git_state(),
        "args": vars(args),
        "model": {**MODEL, "vocab_size": VOCAB, "dtype": "float32", "kv_block_bytes": KV_BLOCK_BYTES},
    }
    return work, model, head


def run_each(
    data: dict[str, Any],
    section: str,
    names: list[str],
    run_one: Callable[..., dict[str, Any]],
    add_ratios: Callable[[dict[str, Any]], None],
    args: argparse.Namespace,
    work: Path,
    model: Path,
) -> dict[str, Any]:
    """`run_one(name, args, work, model, monitor)` for each name, into data[section];
    one that fails is recorded and the others still run, and the results are saved
    after each (partial results survive a later failure)."""
    print(json.dumps(data["sizes_blocks"]), flush=True)
    monitor = CpuMonitor()
    began = time.monotonic()
    try:
        for name in names:
            try:
                data[section][name] = run_one(name, args, work, model, monitor)
            except Exception as e:  # noqa: BLE001 - one failing must not lose the others
                data[section][name] = {"error": f"{type(e).__name__}: {e}"[-4000:]}
                print(f"{section[:-1]} {name} failed: {e}", flush=True)
            add_ratios(data)
            save(args.name, data)
    finally:
        monitor.stop()
    data["wall_s"] = time.monotonic() - began
    add_ratios(data)
    return data


def run(args: argparse.Namespace) -> dict[str, Any]:
    work, model, head = prepare_run(args)
    sizes = {trace: working_set_blocks(trace, args) for trace in args.traces}
    data: dict[str, Any] = {
        **head,
        "sizes_blocks": {
            "kv_cache": args.kv_blocks,
            "cpu_tier": args.cpu_blocks,
            "disk_tier": args.disk_blocks,
            "working_set": sizes,
            "working_set_over_kv_cache": {k: v / args.kv_blocks for k, v in sizes.items()},
        },
        "configs": {},
    }
    data["versions"] = {"project": versions(sys.executable)}
    if "lmcache" in args.configs:
        data["versions"]["lmcache_venv"] = versions(str(Path(args.lmcache_venv) / "bin" / "python"))
    return run_each(data, "configs", args.configs, run_config, add_ratios, args, work, model)


# -- reporting ---------------------------------------------------------------------------
def table(data: dict[str, Any]) -> str:
    lines = [
        "| trace | config | mean TTFT (ms) | p90 TTFT (ms) | req/s | output tok/s | hit tokens by source: "
        "vLLM / host / disk / external | tiercache blocks loaded: CPU / disk / S3 | hit rate "
        "| x(a) mean TTFT | x(a) p90 | x(a) req/s | x(a) tok/s | x LMCache req/s |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for trace, name, s in summaries(data, "configs", CONFIGS, LABELS, lines):
        h = s["hit_tokens_by_source"]
        r = s.get("vs_prefix_cache", {})
        lm = s.get("vs_lmcache", {})
        c = s["counters"]
        tiers = ("cpu", "disk", "s3")
        loaded = " / ".join(f"{c[f'tiercache_loaded_blocks_{t}']:.0f}" for t in tiers)
        loaded = loaded if name.startswith("tiercache") else "-"
        lines.append(
            f"| {trace} | {LABELS[name]} | {s['ttft_mean_s'] * 1000:.0f} | {s['ttft_p90_s'] * 1000:.0f} "
            f"| {s['request_throughput']:.3f} | {s['output_throughput']:.1f} "
            f"| {h['vllm_prefix_cache']:.0f} / {h['cpu']:.0f} / {h['disk']:.0f} / {h['external']:.0f} "
            f"| {loaded} "
            f"| {s['hit_rate']:.2f} | {ratio(r, 'ttft_mean')} | {ratio(r, 'ttft_p90')} "
            f"| {ratio(r, 'request_throughput')} | {ratio(r, 'output_throughput')} "
            f"| {ratio(lm, 'request_throughput')} |"
        )
    return "\n".join(lines)


def summaries(
    data: dict[str, Any], section: str, names: list[str], labels: dict[str, str], lines: list[str]
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(trace, name, the trace's summary) of each run of `data[section]`, in a table's
    order (trace, then `names`); a run that failed gets its row in `lines` instead."""
    for trace in TRACES:
        for name in names:
            cfg = data[section].get(name)
            if cfg is None:
                continue
            if "error" in cfg:
                lines.append(f"| {trace} | {labels[name]} | failed: {cfg['error'][:120]} |")
                continue
            t = cfg["traces"].get(trace)
            if t is not None:
                yield trace, name, t["summary"]


def ratio(ratios: dict[str, float], key: str) -> str:
    """One ratio of a table's row, "-" where the run has none."""
    return f"{ratios[key]:.2f}" if key in ratios else "-"


def add_trace_arguments(
    parser: argparse.ArgumentParser,
    *,
    traces: list[str],
    output_len: int,
    prefixes: int,
    requests: int,
    users: int,
) -> None:
    """The traces run and their shape (vLLM's benchmark client), with a script's defaults."""
    parser.add_argument("--traces", default=",".join(traces), help="comma separated, of " + ", ".join(TRACES))
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (--max-concurrency)")
    parser.add_argument("--output-len", type=int, default=output_len, help="tokens generated per request")
    parser.add_argument("--prefixes", type=int, default=prefixes)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--requests", type=int, default=requests, help="prefix_repetition requests")
    parser.add_argument("--users", type=int, default=users)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--context-len", type=int, default=1024, help="each user's first context")
    parser.add_argument("--message-len", type=int, default=64)
    parser.add_argument(
        "--reply-len", type=int, default=32, help="the synthetic reply before each later turn"
    )


def add_run_arguments(parser: argparse.ArgumentParser, *, name: str, workdir: str, quiet_wait: float) -> None:
    """Where a run works and saves, and how it starts: every serving script's."""
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiercache-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a tiercache setting for every tiercache config, dotted: disk.load_in_forward=false",
    )
    parser.add_argument("--reserved-cpus", type=int, default=1, help="where moto and redis-server run")
    parser.add_argument(
        "--quiet-wait", type=float, default=quiet_wait, help="longest wait for foreign vLLM to end"
    )
    parser.add_argument("--workdir", default=workdir)
    parser.add_argument("--name", default=name, help="results file under benchmarks/results/")
    parser.add_argument("--smoke", action="store_true", help="a small trace: try the set-up, not a result")
    parser.add_argument("--table", action="store_true", help="print a saved run's table (--name), and exit")


def run_and_report(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    *,
    default_name: str,
    smoke_users: int,
) -> None:
    """--table: print a saved run's table; else run (a small trace with --smoke, saved
    apart unless --name says where), save and print the table."""
    if args.table:
        print(table(json.loads((RESULTS / f"{args.name}.json").read_text())))
        return
    if args.smoke:
        args.prefixes, args.requests, args.users, args.turns = 4, 8, smoke_users, 2
        args.name = args.name if args.name != default_name else f"{default_name}-smoke"
    data = run(args)
    save(args.name, data)
    print(table(data))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma separated, of " + ", ".join(CONFIGS)
    )
    add_trace_arguments(parser, traces=TRACES, output_len=32, prefixes=16, requests=48, users=16)
    parser.add_argument("--kv-blocks", type=int, default=160, help="vLLM's KV cache, in 32-token blocks")
    parser.add_argument("--cpu-blocks", type=int, default=320, help="tiercache CPU tier and LMCache L1")
    parser.add_argument("--disk-blocks", type=int, default=1024, help="tiercache disk tier")
    add_run_arguments(parser, name="serve", workdir="/tmp/tiercache-bench-serve", quiet_wait=1800)
    parser.add_argument("--lmcache-venv", default="/work/lmcache-venv")
    args = parser.parse_args()
    args.configs = args.configs.split(",")
    args.traces = args.traces.split(",")
    run_and_report(args, run, table, default_name="serve", smoke_users=4)


if __name__ == "__main__":
    main()

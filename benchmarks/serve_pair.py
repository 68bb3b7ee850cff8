"""Two vLLM OpenAI servers behind a round-robin router that ignores the cache, driven
by vLLM's own benchmark client (`vllm.benchmarks.serve`) against the router: what
sharing KV blocks between instances buys when a prefix's next request lands on the
other engine.

    .venv/bin/python benchmarks/serve_pair.py              # the three settings, prefix_repetition
    .venv/bin/python benchmarks/serve_pair.py --smoke      # a small trace, to try the set-up
    .venv/bin/python benchmarks/serve_pair.py --table      # the saved run's table again

Settings, one after another, each with two fresh engines (instance ids `a` and `b`):
`alone` (tiercache's CPU tier only, no Redis: each engine shares nothing, the baseline
of every ratio), `s3` (CPU tier + S3 on moto in its own process, with Redis) and
`peer` (CPU tier + the peer tier with Redis presence, no S3: an engine loads the
other's CPU-tier blocks over NIXL). Model, KV cache size, traces and client flags are
serve.py's; the working set is several times either engine's KV cache. On
`multi_turn` the number of users is odd, so each user's next turn goes to the engine
that did not serve the previous one.

The router is a small async HTTP proxy in this process (starlette on uvicorn, httpx
to the engines): request i goes to engine i mod 2, streamed responses pass through
as they come. Hits by tier are the sum of both servers' /metrics, read before and
after the trace. Results: benchmarks/results/serve_pair.json (`--name`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import CpuMonitor, service_cpus, versions  # noqa: E402
from serve import (  # noqa: E402
    BLOCK,
    COUNTERS,
    ENV,
    KV_BLOCK_BYTES,
    add_run_arguments,
    add_trace_arguments,
    client_args,
    prepare_run,
    ratio,
    ratios,
    run_and_report,
    run_client,
    run_each,
    server_args,
    settle,
    summaries,
    summarize,
    tiercache_env,
    turns_sent_early,
    wait_for_quiet_machine,
    warm_up,
    working_set_blocks,
)

from support.serving import VllmServer, metric  # noqa: E402

SETTINGS = ("alone", "s3", "peer")
TRACES = ("prefix_repetition", "multi_turn")
LABELS = {
    "alone": "(a) each engine alone (CPU tier)",
    "s3": "(b) CPU tier + S3 sharing",
    "peer": "(c) CPU tier + peer sharing",
}
TIERS = ("cpu", "disk", "s3", "peer")
PAIR_COUNTERS = {
    **COUNTERS,
    **{
        f"tiercache_loaded_blocks_{tier}": ("vllm:tiercache_loaded_blocks_total", {"tier": tier})
        for tier in TIERS
    },
    **{
        f"tiercache_loaded_bytes_{tier}": ("vllm:tiercache_loaded_bytes_total", {"tier": tier})
        for tier in TIERS
    },
    **{
        f"tiercache_failed_blocks_{tier}": ("vllm:tiercache_failed_blocks_total", {"tier": tier})
        for tier in TIERS
    },
}
LINKS_GBPS = (100, 400)


# -- the router -------------------------------------------------------------------------
class RoundRobinRouter:
    """An OpenAI-compatible front for several servers: each request to the next one in
    turn, whatever it holds in cache. Runs uvicorn in a thread of this process."""

    def __init__(self, backends: list[str]):
        from starlette.applications import Starlette
        from starlette.routing import Route

        from tiercache.ops.local_stack import free_port

        self.backends = backends
        self.turn = itertools.cycle(range(len(backends)))
        self.sent = [0] * len(backends)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        methods = ["GET", "POST"]
        self.app = Starlette(routes=[Route("/{path:path}", self.forward, methods=methods)])
        self.client: httpx.AsyncClient | None = None
        self.server: Any = None
        self.thread: threading.Thread | None = None

    async def forward(self, request: Any) -> Any:
        from starlette.background import BackgroundTask
        from starlette.responses import StreamingResponse

        if self.client is None:  # made on uvicorn's loop, where it is used
            self.client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=256))
        index = next(self.turn)
        self.sent[index] += 1
        url = self.backends[index] + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        upstream = await self.client.send(
            self.client.build_request(request.method, url, headers=headers, content=await request.body()),
            stream=True,
        )
        passed = {
            k: v
            for k, v in upstream.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding")
        }
        return StreamingResponse(
            upstream.aiter_raw(),
            status_code=upstream.status_code,
            headers=passed,
            background=BackgroundTask(upstream.aclose),
        )

    def start(self) -> RoundRobinRouter:
        import uvicorn

        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("router did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(10)


# -- settings ----------------------------------------------------------------------------
def pair_kv(args: argparse.Namespace, name: str, instance: str, shared: dict[str, Any]) -> dict[str, Any]:
    """One engine's connector config: the CPU tier, and what the setting shares."""
    from tiercache.ops.vllm_runner import connector_config

    extra: dict[str, Any] = {
        "namespace": f"bench-serve-pair-{name}",
        "instance_id": instance,
        "cpu": {"capacity": args.cpu_blocks * KV_BLOCK_BYTES},
        **shared,
    }
    return connector_config(extra)


@contextlib.contextmanager
def setting_services(name: str, args: argparse.Namespace):
    """What a setting's engines share beside them; yields the shared connector settings."""
    from tiercache.ops.local_stack import RedisServer, local_stack

    if name == "alone":
        yield {}
    elif name == "s3":
        with local_stack("tc-serve-pair", s3_process=True, cpus=service_cpus(args)) as (redis_server, s3):
            yield {
                "redis_url": redis_server.url,
                "s3": {
                    "bucket": "tc-serve-pair",
                    "endpoint_url": s3.url,
                    "region": "us-east-1",
                    "prefix": "pair/",
                },
            }
    elif name == "peer":
        redis_server = RedisServer(cpus=service_cpus(args) or None).start()
        try:
            yield {
                "redis_url": redis_server.url,
                "presence": {"interval": 0.2, "ttl": 5},
                "peer": {"enabled": True},
            }
        finally:
            redis_server.close()
    else:
        raise ValueError(name)


def counters(text: str) -> dict[str, float]:
    return {key: metric(text, n, **labels) for key, (n, labels) in PAIR_COUNTERS.items()}


def summed_counters(servers: list[VllmServer]) -> tuple[dict[str, float], list[dict[str, float]]]:
    each = [counters(s.metrics()) for s in servers]
    return {k: sum(c[k] for c in each) for k in each[0]}, each


def run_setting(
    name: str, args: argparse.Namespace, work: Path, model: Path, monitor: CpuMonitor
) -> dict[str, Any]:
    waited = wait_for_quiet_machine(args.quiet_wait)
    print(f"[{time.strftime('%H:%M:%S')}] setting {name}", flush=True)
    out: dict[str, Any] = {"waited_for_quiet_s": waited, "traces": {}}
    env = {**ENV, **tiercache_env(args.tiercache_set)}
    with setting_services(name, args) as shared:
        began = time.monotonic()
        servers = [
            VllmServer(
                model, server_args(args, pair_kv(args, name, i, shared)), work / f"{name}-{i}.log", env
            )
            for i in ("a", "b")
        ]
        router = None
        try:
            for s in servers:
                s.wait_ready()
            out["startup_s"] = time.monotonic() - began
            for s in servers:
                warm_up(s)
                settle(s)
            if name == "peer":
                time.sleep(1)  # a presence interval or more: each engine sees the other
            router = RoundRobinRouter([s.base for s in servers]).start()
            front = argparse.Namespace(base=router.base, model=model)
            for trace in args.traces:
                before, _ = summed_counters(servers)
                sent_before = list(router.sent)
                t0 = time.time()
                result = run_client(client_args(trace, front, args, work))  # type: ignore[arg-type]
                t1 = time.time()
                settled = max(settle(s) for s in servers)
                after, each = summed_counters(servers)
                summary = summarize(result, {k: after[k] - before[k] for k in after})
                summary["requests_per_engine"] = [
                    a - b for a, b in zip(router.sent, sent_before, strict=True)
                ]
                summary["foreign_cores"] = monitor.foreign_cores(t0, t1)
                summary["settle_s"] = settled
                if trace == "multi_turn":
                    summary["turns_sent_early"] = turns_sent_early(result, args)
                out["traces"][trace] = {
                    "summary": summary,
                    "ttfts": result["ttfts"],
                    "input_lens": result["input_lens"],
                    "errors": [e for e in result["errors"] if e],
                }
                print(f"[{time.strftime('%H:%M:%S')}] {name} {trace}: {json.dumps(summary)}", flush=True)
        finally:
            if router is not None:
                router.stop()
            out["exit_codes"] = [s.stop() for s in servers]
            out["logs"] = [str(s.log_path) for s in servers]
    return out


# -- the run ------------------------------------------------------------------------------
def add_ratios(data: dict[str, Any]) -> None:
    """Each setting's figures against (a), and the peer tier's bytes as link time."""
    base = data["settings"].get("alone", {}).get("traces", {})
    for cfg in data["settings"].values():
        for trace, t in cfg.get("traces", {}).items():
            s = t["summary"]
            if trace in base:
                b = base[trace]["summary"]
                s["vs_alone"] = ratios(s, b, ("ttft_mean", "ttft_p90", "request_throughput"))
            c = s["counters"]
            blocks = c["tiercache_loaded_blocks_peer"]
            if blocks:
                # Arithmetic, not measured: the bytes the run moved from the peer, at a
                # link's line rate, without protocol or setup costs.
                per_block = c["tiercache_loaded_bytes_peer"] / blocks
                prefix_blocks = data["args"]["prefix_len"] // BLOCK
                s["peer_link_arithmetic"] = {
                    "peer_blocks": blocks,
                    "bytes_per_block": per_block,
                    "prefix_blocks": prefix_blocks,
                    **{
                        f"ms_per_prefix_hit_at_{g}gbps": per_block * prefix_blocks * 8 / (g * 1e9) * 1000
                        for g in LINKS_GBPS
                    },
                    **{
                        f"ms_all_peer_bytes_at_{g}gbps": blocks * per_block * 8 / (g * 1e9) * 1000
                        for g in LINKS_GBPS
                    },
                }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work, model, head = prepare_run(args)
    sizes = {trace: working_set_blocks(trace, args) for trace in args.traces}
    data: dict[str, Any] = {
        **head,
        "sizes_blocks": {
            "kv_cache_per_engine": args.kv_blocks,
            "cpu_tier_per_engine": args.cpu_blocks,
            "working_set": sizes,
            "working_set_over_kv_cache": {k: v / args.kv_blocks for k, v in sizes.items()},
        },
        "versions": {"project": versions(sys.executable)},
        "settings": {},
    }
    return run_each(data, "settings", args.settings, run_setting, add_ratios, args, work, model)


# -- reporting -------------------------------------------------------------------------------
def table(data: dict[str, Any]) -> str:
    lines = [
        "| trace | setting | mean TTFT (ms) | p90 TTFT (ms) | req/s | hit tokens: vLLM / host / external "
        "| tiercache blocks loaded: CPU / S3 / peer | x(a) mean TTFT | x(a) p90 | x(a) req/s |",
        "|---|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    notes = []
    for trace, name, s in summaries(data, "settings", SETTINGS, LABELS, lines):
        c, h, r = s["counters"], s["hit_tokens_by_source"], s.get("vs_alone", {})
        loaded = " / ".join(f"{c[f'tiercache_loaded_blocks_{tier}']:.0f}" for tier in ("cpu", "s3", "peer"))
        lines.append(
            f"| {trace} | {LABELS[name]} | {s['ttft_mean_s'] * 1000:.0f} | {s['ttft_p90_s'] * 1000:.0f} "
            f"| {s['request_throughput']:.3f} "
            f"| {h['vllm_prefix_cache']:.0f} / {h['cpu']:.0f} / {h['external']:.0f} | {loaded} "
            f"| {ratio(r, 'ttft_mean')} | {ratio(r, 'ttft_p90')} | {ratio(r, 'request_throughput')} |"
        )
        if p := s.get("peer_link_arithmetic"):
            notes.append(
                f"{trace}, {LABELS[name]}: {p['peer_blocks']:.0f} blocks from the peer, "
                f"{p['bytes_per_block'] / 2**10:.0f} KiB each. Arithmetic, not measured: a "
                f"{p['prefix_blocks']}-block prefix hit would take "
                + ", ".join(f"{p[f'ms_per_prefix_hit_at_{g}gbps']:.2f} ms at {g} Gbps" for g in LINKS_GBPS)
                + "; all the run's peer bytes "
                + ", ".join(f"{p[f'ms_all_peer_bytes_at_{g}gbps']:.1f} ms at {g} Gbps" for g in LINKS_GBPS)
                + " (line rate, no protocol cost)."
            )
    return "\n".join(lines + [""] + notes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help="comma separated, of " + ", ".join(SETTINGS)
    )
    # Users odd, so that round robin sends each user's next turn to the other engine.
    add_trace_arguments(
        parser, traces=["prefix_repetition"], output_len=16, prefixes=12, requests=36, users=11
    )
    parser.add_argument(
        "--kv-blocks", type=int, default=96, help="each engine's KV cache, in 32-token blocks"
    )
    parser.add_argument("--cpu-blocks", type=int, default=320, help="each engine's tiercache CPU tier")
    add_run_arguments(parser, name="serve_pair", workdir="/tmp/tiercache-bench-serve-pair", quiet_wait=600)
    args = parser.parse_args()
    args.settings = args.settings.split(",")
    args.traces = args.traces.split(",")
    run_and_report(args, run, table, default_name="serve_pair", smoke_users=3)


if __name__ == "__main__":
    main()

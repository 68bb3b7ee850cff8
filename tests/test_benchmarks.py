"""What the benchmarks decide before they time anything (benchmarks/harness.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
LOCKED = "/work/cpu flock /tmp/tiercache-vllm.lock .venv/bin/python -m pytest tests/test_e2e_vllm.py"


def test_foreign_vllm_sees_other_engines_not_commands_queued_on_the_engine_lock():
    """serve.py waits for other people's vLLM before each config. A command that only
    waits for the engine lock (its command line names /tmp/tiercache-vllm.lock and a
    vLLM test file) uses no core and must not hold it up, nor may the lock's wrapper
    the run itself was started under; an engine is still seen."""
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "VLLM::EngineCore"])
    # A shell running a command and then another stays the process the name is on.
    queued = subprocess.Popen(["sh", "-c", "sleep 60; true", LOCKED])
    check = (
        f"import json, os, sys; sys.path.insert(0, {json.dumps(str(BENCHMARKS))}); "
        "from harness import foreign_vllm; print(json.dumps([os.getppid(), foreign_vllm()]))"
    )
    try:
        time.sleep(0.5)
        wrapper = ["sh", "-c", f"{sys.executable} -c '{check}'; true", LOCKED]
        run = subprocess.run(wrapper, capture_output=True, text=True, timeout=60, check=True)
        wrapper_pid, found = json.loads(run.stdout)
    finally:
        for proc in (engine, queued):
            proc.kill()
            proc.wait()
    pids = {int(line.split()[0]) for line in found}
    assert engine.pid in pids, found
    assert queued.pid not in pids, found
    assert wrapper_pid not in pids, found


def _trace_replay():
    sys.path.insert(0, str(BENCHMARKS))
    import trace_replay

    return trace_replay


def test_belady_and_the_infinite_cache_count_prefix_hits():
    replay = _trace_replay()
    trace = [[1, 2], [1, 3], [1, 2], [4], [1, 2, 3]]
    assert replay.infinite_hits(trace) == 1 + 2 + 3  # [1]; [1, 2]; [1, 2, 3], each seen before
    # One block of room: 1 is asked for most, and Belady keeps it throughout.
    assert replay.belady_hits(trace, 1) == 3
    assert replay.belady_hits(trace, 10) == replay.infinite_hits(trace)


def test_trace_replay_runs_both_policies_through_the_connector(tmp_path):
    """A small trace in Mooncake's format: a system prompt every request shares, a
    few conversations that come back, and blocks read once. Each policy's hits stay
    within Belady's, and the selective policy writes fewer blocks to disk."""
    lines = []
    fresh = iter(range(1000, 10**6))
    conversations = [[next(fresh) for _ in range(3)] for _ in range(4)]
    for turn in range(3):
        for blocks in conversations:
            blocks.append(next(fresh))
            lines.append({"timestamp": turn, "input_length": 0, "output_length": 0, "hash_ids": [0, *blocks]})
            lines.append({"timestamp": turn, "hash_ids": [0, *(next(fresh) for _ in range(6))]})
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = _trace_replay().main([str(trace), "--capacities", "0.25", "--out", str(tmp_path / "out.json")])
    runs = {run["policy"]: run for run in report["runs"]}
    assert set(runs) == {"write_through", "selective"}
    for run in runs.values():
        assert run["local_hits"] <= run["belady_hits"] <= report["infinite_hits"]
        assert run["dropped"] == 0
    assert runs["selective"]["disk_writes"] < runs["write_through"]["disk_writes"]
    assert json.loads((tmp_path / "out.json").read_text())["requests"] == len(lines)


def test_trace_replay_keeps_its_s3_tier_under_capacity_with_the_gc(tmp_path):
    """With --s3 the replay's S3 tier has a capacity its GC passes keep: write-through,
    which uploads every block, has runs evicted, and every hit is counted per tier."""
    fresh = iter(range(1000, 10**6))
    lines = [{"hash_ids": [0, *(next(fresh) for _ in range(4))]} for _ in range(12)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = [str(trace), "--capacities", "0.25", "--s3", "--s3-capacity", "0.5", "--gc-every", "2"]
    report = _trace_replay().main(args)
    runs = {run["policy"]: run for run in report["runs"]}
    assert report["distinct_blocks"] == 49
    assert runs["write_through"]["s3_blocks"] == 6  # half of CPU + disk's 12 (25% of 49)
    assert runs["write_through"]["gc_evicted_runs"] > 0
    for run in runs.values():
        assert sum(run["hits"].values()) <= report["infinite_hits"]


def test_a_median_interval_holds_the_median_and_narrows_with_agreeing_values():
    sys.path.insert(0, str(BENCHMARKS))
    from harness import median_interval

    spread = [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4]
    low, high = median_interval(spread)
    assert low < 1.7 < high and low >= 1.0 and high <= 2.4
    tight_low, tight_high = median_interval([1.69, 1.7, 1.71] * 3)
    assert high - low > tight_high - tight_low
    assert median_interval(spread) == (low, high)  # seeded: one set, one interval
    assert all(value != value for value in median_interval([1.0, 2.0]))  # too few: nan

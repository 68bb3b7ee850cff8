"""benchmarks/step_trace.py: the tracer installs in a child process against this vLLM
(every method it wraps exists), and the report's phases add up from the marks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "benchmarks" / "step_trace.py"


def step_trace():
    """The tool as a module (it runs as a script, from the benchmarks folder)."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        import step_trace

        return step_trace
    finally:
        sys.path.remove(str(TOOL.parent))


def test_run_installs_the_tracer_in_every_python_process_it_starts(tmp_path):
    # build_config reads TIERCACHE_* overrides and refuses unknown keys: the tracer's own
    # setting must not look like one (it did, and every traced tiercache engine failed).
    child = (
        "import tiercache.connector.worker as w; from tiercache.config import build_config; "
        "build_config({}); print(w.TierCacheWorker.step_arrives.__wrapped__.__name__); "
        "import gc; print(any(c.__name__ == 'collection' for c in gc.callbacks))"
    )
    out = subprocess.run(
        [sys.executable, str(TOOL), "run", str(tmp_path / "trace"), "--", sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["step_arrives", "True"]  # wrapped, and collections marked


def mark(
    t: float, name: str, ran: float = 0.0, waited: float = 0.0, pid: int = 1, **extra
) -> tuple[int, dict]:
    return pid, {"t": t, "n": name, "th": "MainThread", "cpu": ran, "ran": ran, "waited": waited, **extra}


def test_report_splits_the_first_step_into_phases(tmp_path):
    marks = [
        mark(9.990, "gc.start", pid=1, gen=2),  # 5 of its 15 ms fall inside the step
        mark(10.000, "EngineCore.preprocess_add_request>", pid=1),
        mark(10.005, "gc.stop", pid=1, gen=2),
        mark(10.001, "Scheduler.schedule>", pid=1),
        mark(10.003, "Scheduler.schedule<", pid=1),
        mark(10.004, "GPUModelRunner.execute_model>", ran=1.000, waited=0.500, pid=2),
        # inputs: 10 ms, of which 2 ran and 3 waited for a core: 5 blocked
        mark(10.014, "GPUModelRunner._model_forward>", ran=1.002, waited=0.503, pid=2),
        mark(10.114, "GPUModelRunner._model_forward<", ran=1.100, waited=0.504, pid=2),
        mark(10.050, "gc.start", pid=2, gen=0),  # wholly inside: 7 ms
        mark(10.057, "gc.stop", pid=2, gen=0),
        mark(10.127, "Scheduler.update_from_output>", pid=1),
        mark(10.200, "gc.start", pid=2, gen=1),  # after the step: not counted
        mark(10.290, "gc.stop", pid=2, gen=1),
    ]
    folder = tmp_path / "trace"
    folder.mkdir()
    for pid in (1, 2):
        lines = [json.dumps(m) for p, m in marks if p == pid]
        (folder / f"{pid}.jsonl").write_text("\n".join(lines) + "\n")
    medians = step_trace().report(str(folder), skip=0, cycle=["hit"], each=False)["hit"]
    expected = {
        "scheduled": 3.0,
        "handed": 1.0,
        "inputs": 10.0,
        "inputs_ran": 2.0,
        "inputs_waited": 3.0,
        "inputs_blocked": 5.0,
        "forward": 100.0,
        "forward_ran": 98.0,
        "forward_blocked": 1.0,
        "token_out": 13.0,
        "total": 127.0,
        "gc": 12.0,
        "gc_count": 2,
    }
    for phase, ms in expected.items():
        assert abs(medians[phase] - ms) < 1e-6, phase


def test_per_engine_the_report_skips_and_names_each_engines_requests_apart():
    from_engine = []
    for core, start in ((1, 10.0), (3, 20.0)):
        for request in range(3):  # a warm-up, then a cold run and its hit
            t = start + request
            from_engine.append({"n": "EngineCore.preprocess_add_request>", "t": t, "pid": str(core)})
    named_requests = step_trace().named_requests
    named = named_requests(from_engine, skip=1, cycle=["cold", "hit"], per_engine=True)
    assert [(name, mark["t"]) for name, mark in named] == [
        ("cold@0", 11.0),
        ("hit@0", 12.0),
        ("cold@1", 21.0),
        ("hit@1", 22.0),
    ]
    # The whole run as one: the second engine's warm-up takes a name, and the cycle slips.
    named = named_requests(from_engine, skip=1, cycle=["cold", "hit"], per_engine=False)
    assert [name for name, _ in named][2:4] == ["cold", "hit"] and named[2][1]["t"] == 20.0

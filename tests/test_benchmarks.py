"""What the benchmarks decide before they time anything (benchmarks/harness.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_foreign_vllm_sees_other_engines_not_the_lock_it_runs_under():
    """serve.py waits for other people's vLLM before each config. A run started the way
    this machine asks, under `flock /tmp/tiercache-vllm.lock`, must not wait for its own
    wrapper (whose command line names vLLM), nor for a `flock` queued on that lock; a
    foreign engine is still seen."""
    engine = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "vllm.entrypoints.stand_in"]
    )
    queued = subprocess.Popen(["flock", "/tmp/benchmarks-test-vllm.lock", "sleep", "60"])
    check = (
        f"import json, os, sys; sys.path.insert(0, {json.dumps(str(BENCHMARKS))}); "
        "from harness import foreign_vllm; print(json.dumps([os.getppid(), foreign_vllm()]))"
    )
    # The shell stays the check's parent (a command after it keeps it from exec'ing),
    # with the lock's name on its command line, as flock's would be.
    wrapper = ["sh", "-c", f"{sys.executable} -c '{check}'; true", "tiercache-vllm.lock"]
    try:
        time.sleep(0.5)
        run = subprocess.run(wrapper, capture_output=True, text=True, timeout=60, check=True)
        wrapper_pid, found = json.loads(run.stdout)
        pids = {int(line.split()[0]) for line in found}
    finally:
        for proc in (engine, queued):
            proc.kill()
            proc.wait()
    assert engine.pid in pids, found
    assert wrapper_pid not in pids, found
    assert queued.pid not in pids, found

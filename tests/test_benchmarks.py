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

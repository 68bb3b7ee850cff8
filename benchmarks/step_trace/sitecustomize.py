"""Loaded by every Python process started under `benchmarks/step_trace.py run` (this
folder is put first on PYTHONPATH): installs the step tracer where it is asked for."""

import os

if os.environ.get("STEP_TRACE_DIR"):
    from tiercache_step_trace import install

    install(os.environ["STEP_TRACE_DIR"])

"""Timestamps around the methods a hit's step goes through, in every vLLM process:
the engine core's request intake and scheduler, the model runner's phases, the
connector's hooks, the write-down gate and the movers' writes. Each process appends
one JSON line per mark to <dir>/<pid>.jsonl: the monotonic time (one clock for every
process of the host), the thread, and that thread's CPU time and scheduler counters
(/proc/thread-self/schedstat: time run, time waiting for a core), so that a phase
that took long can be told apart as work, waiting for a core, or blocked (on the
interpreter lock, most often)."""

from __future__ import annotations

import functools
import gc
import json
import os
import threading
import time
from typing import Any

# Processes that do no step work: left alone (they would only pay for importing vLLM).
_SKIPPED = (b"s3_sink", b"tiercache.uploader", b"moto.server", b"redis-server")


def _schedstat() -> tuple[float, float]:
    with open("/proc/thread-self/schedstat") as f:
        ran, waited, _ = f.read().split()
    return int(ran) / 1e9, int(waited) / 1e9


class _Log:
    def __init__(self, folder: str):
        self.folder = folder
        self.pid = -1
        self.file: Any = None

    def write(self, record: dict[str, Any]) -> None:
        if self.pid != os.getpid():  # a forked child writes a file of its own
            self.pid = os.getpid()
            self.file = open(os.path.join(self.folder, f"{self.pid}.jsonl"), "a", buffering=1)  # noqa: SIM115
        self.file.write(json.dumps(record) + "\n")


def install(folder: str) -> None:
    with open("/proc/self/cmdline", "rb") as f:
        command = f.read()
    if any(name in command for name in _SKIPPED):
        return
    os.makedirs(folder, exist_ok=True)
    log = _Log(folder)

    def mark(name: str, **extra: Any) -> None:
        ran, waited = _schedstat()
        log.write(
            {
                "t": time.monotonic(),
                "n": name,
                "th": threading.current_thread().name,
                "cpu": time.thread_time(),
                "ran": ran,
                "waited": waited,
                **extra,
            }
        )

    def wrap(cls: type, method: str, request_of=None) -> None:
        original = getattr(cls, method)

        @functools.wraps(original)
        def traced(*args, **kwargs):
            extra = {"req": request_of(*args)} if request_of else {}
            mark(f"{cls.__name__}.{method}>", **extra)
            try:
                return original(*args, **kwargs)
            finally:
                mark(f"{cls.__name__}.{method}<")

        setattr(cls, method, traced)

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tiercache.connector.scheduler import TierCacheScheduler
    from tiercache.connector.worker import TierCacheWorker
    from tiercache.engine import TierEngine
    from tiercache.foreground import ForegroundGate
    from tiercache.tiers.disk import DiskTier

    wrap(EngineCore, "preprocess_add_request", lambda self, request: request.request_id)
    wrap(EngineCore, "add_request")
    for method in ("schedule", "update_from_output"):
        wrap(Scheduler, method)
    for method in ("execute_model", "sample_tokens", "_update_states", "_prepare_inputs", "_model_forward"):
        wrap(GPUModelRunner, method)
    wrap(TierCacheScheduler, "get_num_new_matched_tokens", lambda self, request, computed: request.request_id)
    wrap(TierCacheScheduler, "build_connector_meta")
    for method in ("step_arrives", "forward_begins", "start_load_kv", "wait_for_save", "get_finished"):
        wrap(TierCacheWorker, method)
    for method in ("hold", "release", "release_after"):
        wrap(ForegroundGate, method)
    for method in ("_write_task", "_upload_run_task"):
        wrap(TierEngine, method)
    wrap(DiskTier, "put")

    # vLLM freezes the heap it starts with, but a step that allocates much (a cold
    # prompt's write-down tasks) can still set off a collection inside a later step.
    def collection(phase: str, info: dict[str, Any]) -> None:
        mark(f"gc.{phase}", gen=info["generation"], collected=info.get("collected"))

    gc.callbacks.append(collection)

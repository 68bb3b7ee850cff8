"""Where the write-down threads run.

vLLM's CPU backend binds each worker process's compute thread to the cores it runs
the model on, and every thread the worker starts inherits that binding. Left there,
the threads that write stored blocks down to disk and S3 (checksums, copies into the
page cache, request signing) take their time from the forward: a follow-up request
that hits the CPU tier right after the request that stored its prefix waited for the
write-down of that prefix (docs/benchmarks.md, "A follow-up turn right after its
store"). `background_thread` moves a pool's threads onto the cores the model does not
use (those vLLM reserves for its scheduler and front end) and lowers their priority,
so they yield to serving but still run on an idle machine.

Reads a waiting request needs (staging a disk or S3 hit) are not background work and
stay where they are. On a GPU host the workers are not bound: there is no spare core
to move to, and only the priority changes."""

from __future__ import annotations

import contextlib
import os
import threading

# How much nicer than the thread that starts them the write-down threads run.
BACKGROUND_NICE_INCREMENT = 10


def spare_cpus() -> set[int]:
    """Online CPUs the calling thread is not bound to: empty when it is not bound
    (the usual case outside vLLM's CPU backend)."""
    try:
        bound = os.sched_getaffinity(0)
    except (OSError, AttributeError):
        return set()
    return set(range(os.cpu_count() or 1)) - bound


def background_thread() -> None:
    """ThreadPoolExecutor initializer for write-down work: off the compute cores
    where there are spare ones, and at a lower priority. Threads it starts inherit
    both."""
    spare = spare_cpus()
    if spare:
        # A cgroup cpuset that excludes them refuses: then the thread stays put.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, spare)
    # Linux applies a thread id given to setpriority to that thread alone.
    with contextlib.suppress(OSError, AttributeError):
        current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(
            os.PRIO_PROCESS, threading.get_native_id(), min(19, current + BACKGROUND_NICE_INCREMENT)
        )

"""Where tiercache's own threads run.

vLLM's CPU backend binds each worker process to its compute cores (the OMP cores), and
every thread the worker starts inherits that binding. Left alone, the threads that write
blocks down to disk and S3 (checksums, file writes, boto3's request signing) would take
their CPU time from the forward pass: on a 2-core machine that cost about 12% of decode
throughput. These initializers move a pool's threads onto the cores the model does not
use, where there are any (the cores vLLM reserves for its scheduler and front end),
and lower the priority of background work so that it yields to serving.

Reads a waiting request needs (disk objects staged for a hit) are not background
work: they may run on any core the process may use, at normal priority. They take and
drop the interpreter lock many times per object, which only pays off because the
worker sleeps on them instead of spinning while nothing else runs (see the connector
worker's idle steps).

On a GPU host the workers are not bound, so there is no spare core to move to and only
the priority changes."""

from __future__ import annotations

import contextlib
import os
import threading

# How much nicer than the thread that starts them background threads run: they yield
# to the model's threads but still run on an idle machine.
BACKGROUND_NICE_INCREMENT = 10


def spare_cpus() -> set[int]:
    """CPUs this process may use that the calling thread is not bound to: empty when
    the thread is not bound (the common case outside vLLM's CPU backend)."""
    bound = os.sched_getaffinity(0)
    online = set(range(os.cpu_count() or 1))
    return online - bound


def move_to_spare_cpus() -> bool:
    """Bind the calling thread to the spare CPUs. False when there are none, or the
    system refuses them (a cgroup cpuset that excludes them): then it stays put."""
    spare = spare_cpus()
    if not spare:
        return False
    try:
        os.sched_setaffinity(0, spare)
    except OSError:
        return False
    return True


def background_thread() -> None:
    """ThreadPoolExecutor initializer for background work: off the compute cores and
    at a lower priority. Threads this thread starts inherit both."""
    move_to_spare_cpus()
    # Linux applies a thread id given to setpriority to that thread alone.
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), background_nice())


def background_nice() -> int:
    """The priority background work runs at, below the calling thread's."""
    try:
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (OSError, AttributeError):
        nice = 0
    return min(19, nice + BACKGROUND_NICE_INCREMENT)


def any_cpu_thread() -> None:
    """ThreadPoolExecutor initializer for reads a request waits on: free to run on
    the model's cores and the spare ones alike, at normal priority."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, os.sched_getaffinity(0) | spare_cpus())


def helper_thread() -> None:
    """ThreadPoolExecutor initializer for copies the current step waits on (a few
    long ones, each run outside the interpreter lock): off the compute cores where
    possible, at normal priority."""
    move_to_spare_cpus()

"""Processes that die the hard way: a whole process group SIGKILLed, in a pid
namespace of its own (a restarted container's), must leave no shared memory behind,
and an upload process that stops answering must not get its slot back while it may
still read it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from tiercache.tiers.cpu import CpuBuffer

SHM = "/dev/shm"
OWNER = """
import time
from tiercache.tiers.cpu import CpuBuffer
buffer = CpuBuffer(4, 4096, pin_memory=False, shared=True)
print("ready", flush=True)
time.sleep(600)
"""


def _in_own_pid_namespace() -> list[str]:
    """A command prefix that runs a process in a new pid namespace, as a restarted
    container's worker is; none where unshare is missing or refused."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True).returncode == 0:
        return [unshare, "--pid", "--fork"]
    return []


def test_a_killed_groups_shared_cpu_tier_leaves_nothing_in_dev_shm():
    """The shared CPU tier was a named segment in /dev/shm: a group SIGKILLed whole (its
    resource tracker with it) left it there, and a worker restarted in another pid
    namespace could never tell whether its owner was gone. It is a memory file now,
    freed with the last process that maps it."""
    before = set(os.listdir(SHM))
    owner = subprocess.Popen(
        [*_in_own_pid_namespace(), sys.executable, "-c", OWNER],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert owner.stdout.readline().strip() == "ready"
        made = set(os.listdir(SHM)) - before
    finally:
        os.killpg(owner.pid, signal.SIGKILL)  # the worker, its resource tracker, everything
        owner.wait()
    assert not made  # nothing named, so nothing to outlive the group
    assert set(os.listdir(SHM)) <= before


def test_an_upload_that_times_out_returns_only_once_the_process_is_dead(
    tmp_path, redis_url, s3_endpoint, bucket
):
    """Review fix: on a timeout the slot went back to the caller (and so to the next
    block) while the stalled process could still read it and upload its new bytes."""
    from test_engine import BLOCK, block, make_config, new_shape

    from tiercache.tiers.s3.uploader import UploadProcess, UploadSetup

    config = make_config(tmp_path, redis_url=redis_url, s3_endpoint=s3_endpoint, bucket=bucket, slots=2)
    buffer = CpuBuffer(2, BLOCK, pin_memory=False, shared=True)
    shape = new_shape()
    setup = UploadSetup(
        config, shape.model_digest, shape.rank_digest, buffer.shared_fd, BLOCK, 2, frozenset(), 0
    )
    uploads = UploadProcess(setup)
    try:
        process = uploads._process
        uploads.answer_timeout = 1.0
        os.kill(process.pid, signal.SIGSTOP)  # alive, holding its work, answering nothing
        assert not uploads.upload(block(1), 0, None, shape.header(block(1), buffer.view(0)))
        assert process.poll() is not None  # gone before the slot could be reused
    finally:
        uploads.close()
        buffer.close()

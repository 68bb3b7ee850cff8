"""Processes that die the hard way: a whole process group SIGKILLed leaves its CPU
tier's shared-memory segment behind, and an upload process that stops answering must
not get its slot back while it may still read it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tiercache.tiers.cpu import CpuBuffer

SHM = "/dev/shm"
OWNER = """
import time
from tiercache.tiers.cpu import CpuBuffer
buffer = CpuBuffer(4, 4096, pin_memory=False, shared=True)
print(buffer.shared_name, flush=True)
time.sleep(600)
"""


def test_a_killed_groups_segment_is_swept_at_the_next_start_and_a_live_ones_kept():
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        dead_name = owner.stdout.readline().strip()
    finally:
        os.killpg(owner.pid, signal.SIGKILL)  # the worker, its resource tracker, everything
        owner.wait()
    dead = os.path.join(SHM, dead_name)
    assert os.path.exists(dead)  # nobody was left to unlink it
    assert dead_name.startswith("tiercache-") and f"-{owner.pid}-" in dead_name

    live = CpuBuffer(4, 4096, pin_memory=False, shared=True)  # this process: a live owner
    try:
        assert not os.path.exists(dead)
        assert f"-{os.getpid()}-" in live.shared_name
        again = CpuBuffer(4, 4096, pin_memory=False, shared=True)
        again.close()
        assert os.path.exists(os.path.join(SHM, live.shared_name))
    finally:
        live.close()


def test_an_upload_that_times_out_returns_only_once_the_process_is_dead(
    tmp_path, redis_url, s3_endpoint, bucket
):
    """Review fix: on a timeout the slot went back to the caller (and so to the next
    block) while the stalled process could still read it and upload its new bytes."""
    from test_engine import BLOCK, block, make_config, new_shape

    from tiercache.uploader import UploadProcess, UploadSetup

    config = make_config(tmp_path, redis_url=redis_url, s3_endpoint=s3_endpoint, bucket=bucket, slots=2)
    buffer = CpuBuffer(2, BLOCK, pin_memory=False, shared=True)
    shape = new_shape()
    setup = UploadSetup(
        config, shape.model_digest, shape.rank_digest, buffer.shared_name, BLOCK, 2, frozenset(), 0
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

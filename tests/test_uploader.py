"""S3 write-through from the upload process: the blocks it reads from the shared CPU
tier land in S3 and the index; when it dies, stores are dropped (never an error) and
it comes back; it never outlives the worker that started it."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import replace

import pytest
from test_engine import BLOCK, block, data, make_config, new_shape

from tiercache.engine import DISK, S3, TierEngine
from tiercache.tiers.cpu import CpuBuffer


@pytest.fixture
def engine(tmp_path, redis_url, s3_endpoint, bucket):
    # Every slot may be held by an upload here: these tests fill all four at once.
    config = make_config(
        tmp_path,
        redis_url=redis_url,
        s3_endpoint=s3_endpoint,
        bucket=bucket,
        slots=4,
        # test_engine's configs upload in-process; these tests are of the upload process.
        movers={"upload_slot_share": 1.0, "upload_process": True},
    )
    buffer = CpuBuffer(4, BLOCK, pin_memory=False, shared=True)
    assert buffer.shared_fd is not None, "no memory file could be made for the CPU tier"
    made = TierEngine(config, new_shape(), buffer)
    yield made
    made.close()
    buffer.close()
    assert buffer.shared_fd is None


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def write(engine: TierEngine, i: int, slot: int | None) -> list:
    """Write block i down from `slot` (filled with its data first) or from a copy."""
    results: list = []
    if slot is not None:
        engine.buffer.view(slot)[:] = data(i)
        assert engine.write_down(block(i), slot, results.append)
    else:
        assert engine.write_down(block(i), None, results.append, data=data(i))
    return results


def test_uploads_run_in_their_own_process_and_land_indexed(engine):
    assert engine.uploads is not None and engine.uploads.pid != os.getpid()
    pending = [write(engine, i, slot=i) for i in range(4)]
    pending.append(write(engine, 9, slot=None))  # a write-back's copy travels by socket
    assert engine.flush(60)
    results = [r for done in pending for r in done]
    assert [r.stored for r in results] == [{DISK: True, S3: True}] * 5
    assert engine.index.count(engine.shape.model_digest, engine.shape.rank_digest) == 5
    out = memoryview(bytearray(BLOCK))
    for i in (0, 3, 9):
        assert engine.read_into(block(i), out, S3) and bytes(out) == data(i)


def gather_run(engine: TierEngine, count: int) -> list:
    """Write `count` blocks of one request down from slots 0.. and wait until every
    slot is free again while their S3 run still gathers (the request has not ended)."""
    freed: list[int] = []
    results: list = []
    for i in range(count):
        engine.buffer.view(i)[:] = data(i)
        assert engine.write_down(
            block(i), i, results.append, group="req", on_slot_free=lambda r: freed.append(r.slot)
        )
    wait_for(lambda: sorted(freed) == list(range(count)))
    assert not results  # nothing uploaded yet
    return results


def test_blocks_waiting_for_their_run_free_their_slots_and_upload_their_own_bytes(engine):
    results = gather_run(engine, 3)
    for i in range(3):
        engine.buffer.view(i)[:] = b"\xee" * BLOCK  # the CPU tier reuses the slots
    engine.end_group("req")
    assert engine.flush(60)
    assert [r.stored for r in results] == [{DISK: True, S3: True}] * 3
    out = memoryview(bytearray(BLOCK))
    for i in range(3):
        assert engine.read_into(block(i), out, S3) and bytes(out) == data(i)


def test_a_dead_upload_process_drops_stores_then_comes_back(engine):
    first = engine.uploads.pid
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: engine.uploads._conn is None)
    engine.uploads._next_start = time.monotonic() + 60  # not yet due to restart
    dropped = write(engine, 1, slot=0)
    assert engine.flush(30)
    assert dropped[0].stored == {DISK: True, S3: False}

    engine.uploads._next_start = 0
    stored = write(engine, 2, slot=0)
    assert engine.flush(60)
    assert stored[0].stored == {DISK: True, S3: True}
    assert engine.uploads.pid not in (None, first)


def test_uploads_in_flight_when_the_process_dies_report_not_stored(engine):
    os.kill(engine.uploads.pid, signal.SIGSTOP)
    pending = [write(engine, 1, slot=0), write(engine, 2, slot=1)]
    # Both go in one run (one upload), once the packer's flush timer ships it.
    wait_for(lambda: len(engine.uploads._pending) == 1 and engine._packer.waiting == 0)
    os.kill(engine.uploads.pid, signal.SIGKILL)
    assert engine.flush(30)
    results = [r for done in pending for r in done]
    assert sorted(str(r.stored) for r in results) == [str({DISK: True, S3: False})] * 2
    assert engine.index.count(engine.shape.model_digest, engine.shape.rank_digest) == 0


def test_the_upload_process_exits_when_its_worker_goes(engine):
    process = engine.uploads._process
    # What the worker's death looks like from there: its end of the socket goes away.
    end = socket.socket(fileno=os.dup(engine.uploads._conn.fileno()))
    end.shutdown(socket.SHUT_RDWR)
    end.close()
    assert process.wait(15) == 0


def test_an_upload_under_way_waits_while_the_worker_holds_its_gate(engine, tmp_path):
    """The upload process follows the worker's foreground gate: a PUT it was handed
    while a forward loads hits waits (between reads of its body) for the release."""
    from tiercache.foreground import ForegroundGate
    from tiercache.tiers.s3.uploader import UploadProcess

    assert engine.foreground.flag is not None
    assert engine.uploads.setup.gate_fd == engine.foreground.flag.fd  # the engine wires its own
    gate = ForegroundGate(max_hold=60.0, shared=True)
    setup = replace(engine.uploads.setup, gate_fd=gate.flag.fd)
    uploads = UploadProcess(setup)
    try:
        engine.buffer.view(0)[:] = data(7)
        header = engine.shape.header(block(7), engine.buffer.view(0))
        assert gate.hold()
        answers: list[bool] = []
        sender = threading.Thread(target=lambda: answers.append(uploads.upload(block(7), 0, None, header)))
        sender.start()
        sender.join(1.0)
        assert sender.is_alive() and not answers  # its body is not read while held
        assert engine.index.count(engine.shape.model_digest, engine.shape.rank_digest) == 0
        gate.release()
        sender.join(30)
        assert answers == [True]
        out = memoryview(bytearray(BLOCK))
        assert engine.read_into(block(7), out, S3) and bytes(out) == data(7)
    finally:
        uploads.close()
        gate.close()


def test_an_upload_stepping_aside_keeps_no_other_upload_waiting_for_its_answer(engine):
    """Review fix: the copies' frames were sent under the lock the answers are read
    under, so while one upload stepped aside for a forward, the answer of another (and
    the slot it frees) waited for it too."""
    from tiercache.tiers.s3.uploader import UploadProcess

    uploads = UploadProcess(engine.uploads.setup)
    released = threading.Event()
    uploads.pace = lambda: released.wait(60)  # a hold that lasts until the test ends it
    try:
        os.kill(uploads.pid, signal.SIGSTOP)  # A's answer can only come once B waits
        engine.buffer.view(0)[:] = data(1)
        first: list[bool] = []
        a = threading.Thread(
            target=lambda: first.append(
                uploads.upload(block(1), 0, None, engine.shape.header(block(1), engine.buffer.view(0)))
            )
        )
        a.start()
        wait_for(lambda: len(uploads._pending) == 1)
        copy = data(2)
        header = engine.shape.header(block(2), memoryview(copy))
        b = threading.Thread(target=lambda: uploads.upload(block(2), None, copy, header))
        b.start()
        wait_for(lambda: len(uploads._pending) == 2)  # B is in its pace, before its frame
        os.kill(uploads.pid, signal.SIGCONT)
        a.join(20)
        assert first == [True], "A's answer waited for B's send"
        assert b.is_alive()
    finally:
        released.set()
        os.kill(uploads.pid, signal.SIGCONT)
        uploads.close()


PLACEMENT_SCRIPT = """
import os, sys, time
os.sched_setaffinity(0, {0})  # as vLLM's CPU backend binds a worker to the model's core
from tiercache.config import TierCacheConfig
from tiercache.engine import ObjectShape, TierEngine
from tiercache.tiers.cpu import CpuBuffer
buffer = CpuBuffer(2, 4096, pin_memory=False, shared=True)
config = TierCacheConfig.model_validate(
    {"redis_url": sys.argv[1], "s3": {"bucket": sys.argv[3], "endpoint_url": sys.argv[2]}}
)
engine = TierEngine(config, ObjectShape("a" * 16, "b" * 16, 4096), buffer)
stored = []
engine.write_down(b"\1" * 32, 0, stored.append)
engine.flush(60)  # one upload done: the process is past its start-up
print(engine.uploads.pid, stored[0].stored["s3"], flush=True)
sys.stdin.readline()
engine.close()
buffer.close()
"""


REBIND_LATE = """
import os, time
time.sleep(0.5)  # after the worker placed the upload process
os.sched_setaffinity(0, {0})
"""


def test_the_upload_process_stays_off_the_model_core_under_vllm_openmp_binding(
    redis_url, s3_endpoint, bucket, tmp_path
):
    """vLLM's CPU backend preloads libgomp and sets GOMP_CPU_AFFINITY to the model's
    cores; a child inheriting both bound itself back onto the model's core, before or
    after the worker placed it (a race). A sitecustomize that rebinds the process late
    stands for the losing side of that race, so the test fails without the fix."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip(
            f"needs a second CPU for the upload process to move to; this machine allows "
            f"{sorted(os.sched_getaffinity(0))}"
        )
    libgomp = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    assert libgomp, "torch's CPU build ships libgomp in torch/lib; vLLM preloads it from there"
    (tmp_path / "sitecustomize.py").write_text(REBIND_LATE)
    env = {
        **os.environ,
        "LD_PRELOAD": str(libgomp[0]),
        "GOMP_CPU_AFFINITY": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    worker = subprocess.Popen(
        [sys.executable, "-c", PLACEMENT_SCRIPT, redis_url, s3_endpoint, bucket],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, stored = worker.stdout.readline().split()
        uploader = int(pid)
        assert stored == "True"
        with open(f"/proc/{uploader}/environ", "rb") as f:
            names = {entry.split(b"=", 1)[0].decode() for entry in f.read().split(b"\0") if entry}
        assert "GOMP_CPU_AFFINITY" not in names and "LD_PRELOAD" in names
        expected = set(range(os.cpu_count())) - {0}
        threads = os.listdir(f"/proc/{uploader}/task")
        assert len(threads) > 1  # its upload threads inherit where the process runs
        assert [os.sched_getaffinity(int(t)) for t in threads] == [expected] * len(threads)
        assert os.getpriority(os.PRIO_PROCESS, uploader) > os.getpriority(os.PRIO_PROCESS, worker.pid)
    finally:
        worker.communicate("\n", timeout=30)

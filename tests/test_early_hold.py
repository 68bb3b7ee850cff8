"""The hold of the movers begins in the scheduler's process, as it plans a step that
serves a hit (connector/early_hold.py, tiercache/foreground.py): the page a worker
publishes and its engine core joins, the movers and the upload process waiting on the
announcement, the worker's hold taking it over, and the scheduler announcing exactly
the steps the worker holds for."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from tests.test_connector_units import (
    BLOCK,
    blocks_of,
    make_scheduler,
    new_request,
    plan_cpu_hit,
    request,
    scheduler_output,
)
from tests.test_foreground import FakeClock, cpu_backend_worker
from tiercache.connector.early_hold import EarlyHold, gate_page_path, publish_gate_page
from tiercache.connector.metadata import BlockOp, LoadJob, TierCacheMetadata
from tiercache.foreground import ForegroundGate, GateFlag
from tiercache.tiers import CPU


@pytest.fixture
def engine_id():
    return f"test-{uuid.uuid4().hex}"


@pytest.fixture
def page_path(engine_id):
    """Where a worker of this process's engine core would publish rank 0's page."""
    path = gate_page_path(engine_id, os.getpid(), 0)
    yield path
    if os.path.exists(path):
        os.unlink(path)


def mover(gate: ForegroundGate) -> tuple[threading.Thread, threading.Event]:
    passed = threading.Event()
    thread = threading.Thread(target=lambda: (gate.wait(), passed.set()))
    thread.start()
    return thread, passed


def test_the_engine_core_joins_the_page_its_worker_published_and_removes_its_name(engine_id):
    """The worker is the engine core's child: it names the page after its parent's
    process id, which is the scheduler's own."""
    child = textwrap.dedent(
        f"""
        import sys, time
        from tiercache.connector.early_hold import publish_gate_page
        page = publish_gate_page({engine_id!r}, 0)
        print(page.path, flush=True)
        sys.stdin.readline()  # the engine core joined and announced a step
        print("held" if page.held else "free", flush=True)
        page.close()
        """
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert worker.stdin is not None and worker.stdout is not None
    try:
        path = worker.stdout.readline().strip()
        assert path == gate_page_path(engine_id, os.getpid(), 0) and os.path.exists(path)
        early = EarlyHold(engine_id, ranks=1)
        assert len(early.pages) == 1 and not os.path.exists(path)  # nothing left in /dev/shm
        early.announce()
        worker.stdin.write("\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "held" and early.announced == 1
        assert worker.wait(timeout=30) == 0
        early.close()
    finally:
        worker.kill()


def test_an_engine_core_with_no_published_page_announces_nothing_and_goes_on(engine_id):
    early = EarlyHold(engine_id, ranks=2)
    early.announce()
    assert early.pages == [] and early.announced == 0


def test_a_mover_waits_from_the_announcement_through_the_workers_hold(page_path):
    gate = ForegroundGate(max_hold=30.0, flag=GateFlag.published(page_path))
    scheduler = GateFlag.joined(page_path)
    try:
        assert scheduler.announce(seconds=30.0)
        thread, passed = mover(gate)
        assert not passed.wait(0.2)  # the step is planned, the worker has not got it
        assert gate.hold()  # the step arrives: the worker's hold takes over
        assert gate.early_holds == 1 and scheduler.early_until == 0.0
        assert not passed.wait(0.2)
        gate.release()
        assert passed.wait(5.0)
        thread.join()
    finally:
        gate.close()
        scheduler.close()


def test_a_step_that_holds_nothing_ends_the_announcement_at_once(page_path):
    gate = ForegroundGate(max_hold=30.0, flag=GateFlag.published(page_path))
    scheduler = GateFlag.joined(page_path)
    try:
        scheduler.announce(seconds=30.0)
        thread, passed = mover(gate)
        assert not passed.wait(0.1)
        gate.release()
        assert passed.wait(1.0) and gate.holds == 0
        thread.join()
    finally:
        gate.close()
        scheduler.close()


def test_an_announcement_no_step_takes_over_lapses_by_itself(page_path):
    gate = ForegroundGate(max_hold=30.0, flag=GateFlag.published(page_path))
    scheduler = GateFlag.joined(page_path)
    try:
        scheduler.announce(seconds=0.2)
        began = time.monotonic()
        gate.wait()
        assert 0.15 < time.monotonic() - began < 2.0
        # A step arriving after the lapse holds from its own start, not the announcement's.
        assert gate.hold() and gate.early_holds == 0
    finally:
        gate.close()
        scheduler.close()


def test_the_hold_counts_from_the_announcement(page_path):
    clock = FakeClock()
    gate = ForegroundGate(max_hold=0.5, clock=clock, flag=GateFlag.published(page_path))
    scheduler = GateFlag.joined(page_path)
    try:
        scheduler.announce(seconds=5.0)
        time.sleep(0.1)
        assert gate.hold()
        # The page says when the hold stops holding anyone: max_hold after it began,
        # which was the announcement, 0.1 s before the step arrived.
        assert gate.flag is not None and gate.flag.ends_at <= clock.now + 0.5 - 0.1
    finally:
        gate.close()
        scheduler.close()


def test_no_announcement_while_the_worker_refuses_holds(page_path):
    clock = FakeClock()
    gate = ForegroundGate(
        max_hold=0.5, max_share=0.5, window=2.0, clock=clock, flag=GateFlag.published(page_path)
    )
    scheduler = GateFlag.joined(page_path)
    try:
        for _ in range(3):  # holds back to back spend the share (test_foreground)
            assert gate.hold()
            clock.now += 0.5
            gate.release()
        assert not gate.hold()
        assert not scheduler.announce() and scheduler.early_until == 0.0
        gate.wait()  # nothing holds the movers
    finally:
        gate.close()
        scheduler.close()


def test_the_upload_process_follows_the_announcement(page_path):
    gate = ForegroundGate(max_hold=30.0, flag=GateFlag.published(page_path))
    scheduler = GateFlag.joined(page_path)
    follower = GateFlag(os.dup(gate.flag.fd))  # as the upload process maps it
    try:
        assert not follower.held
        scheduler.announce(seconds=30.0)
        assert follower.held
        gate.release()
        assert not follower.held
    finally:
        follower.close()
        gate.close()
        scheduler.close()


def test_a_published_page_nobody_joined_is_removed_when_the_worker_closes(page_path):
    gate = ForegroundGate(flag=GateFlag.published(page_path))
    assert os.path.exists(page_path)
    gate.close()
    assert not os.path.exists(page_path)


def test_the_cpu_backend_worker_publishes_its_gate_and_takes_the_announcement_over(tmp_path, engine_id):
    worker = cpu_backend_worker(tmp_path, engine_id=engine_id)
    # The test process stands in for the worker: its parent for the engine core.
    scheduler = GateFlag.joined(gate_page_path(engine_id, os.getppid(), 0))
    gate = worker.engine.foreground
    try:
        scheduler.announce()
        hit = TierCacheMetadata(loads=[LoadJob("r", [BlockOp(b"h" * 32, 5, 0, CPU)], False)])
        worker.step_arrives(hit)
        assert gate.held and gate.early_holds == 1
        worker.step_arrives(TierCacheMetadata())
        assert worker.take_stats().data["write_holds_early"] == 1
    finally:
        worker.shutdown()
        scheduler.close()


@pytest.mark.parametrize(
    "movers",
    [{"yield_to_loads": False}, {"hold_from_scheduler": False}],
    ids=["no holds", "holds from the worker only"],
)
def test_a_worker_without_the_early_hold_publishes_nothing(tmp_path, engine_id, movers):
    worker = cpu_backend_worker(tmp_path, engine_id=engine_id, **movers)
    try:
        assert not os.path.exists(gate_page_path(engine_id, os.getppid(), 0))
        assert worker.engine.foreground.flag is None
    finally:
        worker.shutdown()


def test_publishing_into_a_missing_folder_leaves_the_hold_to_the_worker(monkeypatch, tmp_path):
    monkeypatch.setattr("tiercache.connector.early_hold.SHM_DIR", str(tmp_path / "absent"))
    assert publish_gate_page("e", 0) is None


def test_the_scheduler_announces_the_steps_the_worker_holds_for_and_no_other(engine_id, page_path):
    worker_side = GateFlag.published(page_path)
    sched = make_scheduler(kv_in_host_memory=True)
    sched.early_hold = EarlyHold(engine_id, ranks=1)
    try:
        assert len(sched.early_hold.pages) == 1
        # A cold prompt, whose step only stores, then a CPU hit planned over it.
        plan_cpu_hit(sched)
        assert worker_side.early_until == 0.0
        sched.build_connector_meta(scheduler_output())
        assert worker_side.held and sched.early_hold.announced == 1
        worker_side.take_early()
        # A request over vLLM's own prefix cache.
        hit = request("r3", 2)
        assert sched.get_num_new_matched_tokens(hit, 2 * BLOCK) == (0, False)
        sched.update_state_after_alloc(hit, blocks_of([5, 6, 9]), 0)
        step = scheduler_output(
            [new_request(hit, [5, 6, 9], num_computed_tokens=2 * BLOCK)], scheduled={"r3": 1}
        )
        sched.build_connector_meta(step)
        assert worker_side.held and sched.early_hold.announced == 2
        worker_side.take_early()
        # A decode step.
        sched.build_connector_meta(scheduler_output())
        assert worker_side.early_until == 0.0 and sched.early_hold.announced == 2
    finally:
        sched.close()
        worker_side.close()

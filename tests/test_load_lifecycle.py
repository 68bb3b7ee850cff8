"""A load ends exactly once, and what vLLM hears of it fits the model: per block with
one KV cache group, per request with several (vLLM's engine core dies on a block-level
failure of a multi-group model). Each case here is a path a load used to end along
beside the others, driven on a real worker half with real disk tiers."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from tiercache.config import build_config
from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.metadata import RELEASED, BlockOp, LoadJob, TierCacheMetadata
from tiercache.connector.worker import TierCacheWorker
from tiercache.index.keys import KVSpec

NUM_BLOCKS = 12
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
TWO_GROUPS = [LAYERS[:2], LAYERS[2:]]


def make_worker(tmp_path, groups: list[list[str]] | None, **movers) -> TierCacheWorker:
    torch.manual_seed(0)
    if groups is None:
        kv = {name: torch.randn(NUM_BLOCKS, 2, 32, 8) for name in LAYERS}
    else:
        # vLLM's hybrid layout: the i-th layer of each group views the same pages.
        memory = [torch.randn(NUM_BLOCKS, 2, 32, 8) for _ in groups[0]]
        kv = {name: memory[i] for group in groups for i, name in enumerate(group)}
    slot_bytes = PagedKVCopier(kv, NUM_BLOCKS).slot_bytes
    spec = KVSpec("m", "", "float32", "auto", 32, "cpu", len(kv), 2, 8, 1, 0, "t", slot_bytes)
    settings = {
        "cpu": {"capacity": 8 * slot_bytes},
        "disk": {"path": str(tmp_path / "disk"), "load_in_forward": False},
        "movers": movers,
    }
    worker = TierCacheWorker(
        build_config(settings),
        spec,
        "digest",
        NUM_BLOCKS,
        tp_rank=0,
        writes_lower_tiers=True,
        disk_share=1 << 26,
        group_layers=groups,
    )
    worker.register_kv_caches(kv, slot_bytes)
    return worker


def step(worker: TierCacheWorker, meta: TierCacheMetadata) -> set[str]:
    """One step's hooks in vLLM's order; the requests reported finished receiving."""
    worker.track(meta)
    worker.step_arrives(meta)
    worker.forward_begins(meta)
    worker.start_load_kv(meta)
    for name in LAYERS:
        worker.wait_for_layer(name)
        worker.save_layer(name, meta)
    worker.wait_for_save(meta)
    return worker.get_finished(set())


def missing(block: int) -> bytes:
    """The hash of a block no tier holds: its staging fails."""
    return bytes([200 + block]) * 32


def released(worker: TierCacheWorker) -> Counter:
    meta = worker.take_worker_meta()
    return Counter(value for _, kind, value in (meta.reports if meta else []) if kind == RELEASED)


@pytest.mark.parametrize("groups", [None, TWO_GROUPS], ids=["one group", "two groups"])
def test_a_load_sharing_a_fill_that_fails_fails_as_the_model_requires(tmp_path, groups):
    """A second request planned to share the first one's staging of a slot
    (after_fill, tier cpu): that staging fails (the object is gone)."""
    worker = make_worker(tmp_path, groups)
    try:
        first = LoadJob("first", [BlockOp(missing(1), 5, 2, "disk")], True)
        second = LoadJob("second", [BlockOp(missing(1), 7, 2, "cpu", after_fill=True)], True)
        step(worker, TierCacheMetadata(loads=[first, second]))
        deadline = time.monotonic() + 30
        done: set[str] = set()
        failed_requests: set[str] = set()
        failed_blocks: set[int] = set()
        while done != {"first", "second"}:
            assert time.monotonic() < deadline
            done |= worker.get_finished(set())
            failed_requests |= worker.take_failed_requests()
            failed_blocks |= worker.take_failed_blocks()
            time.sleep(0.01)
        if groups is None:
            assert failed_blocks == {5, 7} and failed_requests == set()
        else:
            assert failed_blocks == set() and failed_requests == {"first", "second"}
        assert released(worker)[2] == 2  # each load gives the slot it pinned back once
    finally:
        worker.shutdown()


def store_on_disk(worker: TierCacheWorker, block_hash: bytes, gpu_block: int, slot: int) -> None:
    step(worker, TierCacheMetadata(stores=[BlockOp(block_hash, gpu_block, slot, "cpu", req_id="s")]))
    assert worker.engine is not None and worker.engine.flush(30)


@pytest.mark.parametrize("groups", [None, TWO_GROUPS], ids=["one group", "two groups"])
def test_a_hook_failure_after_an_async_hit_was_reported_reports_nothing_of_it(tmp_path, groups):
    """vLLM was told the hit is in, at the end of the step that saw it staged: a
    hook of the next step failing is not the hit's business."""
    worker = make_worker(tmp_path, groups, workers=1)
    gate = threading.Event()
    try:
        assert worker.engine is not None
        step(worker, TierCacheMetadata())  # the forward shows its layer order
        block = bytes([9]) * 32
        store_on_disk(worker, block, gpu_block=3, slot=1)
        worker.engine._stagers.submit(gate.wait)  # the only stager is busy: the load stages
        assert (
            step(worker, TierCacheMetadata(loads=[LoadJob("hit", [BlockOp(block, 6, 4, "disk")], True)]))
            == set()
        )
        gate.set()
        worker.engine._stagers.submit(lambda: None).result()  # the staging before it is over
        assert worker.get_finished(set()) == {"hit"}  # the end of a step
        # Already in the paged KV: vLLM may schedule it, or abort it and give its
        # blocks to another request, from now on.
        assert worker._registered_kv is not None
        assert all(torch.equal(kv[6], kv[3]) for kv in worker._registered_kv.values())
        assert worker.take_failed_blocks() == set() and worker.take_failed_requests() == set()
        nxt = TierCacheMetadata()
        worker.track(nxt)
        worker.step_arrives(nxt)
        worker.fail_step(nxt)  # a hook of the next step raised
        assert worker.take_failed_blocks() == set()
        assert worker.take_failed_requests() == set()
        assert worker.get_finished(set()) == set()
    finally:
        gate.set()
        worker.shutdown()


def test_kv_that_comes_back_different_after_sleep_ends_the_loads_waiting_across_it(tmp_path):
    """A disk hit still staging when the paged KV goes away, and a wake-up that finds
    other tensors: the load must end (failed), not wait for ever."""
    worker = make_worker(tmp_path, None, workers=1)
    gate = threading.Event()
    try:
        assert worker.engine is not None
        block = bytes([9]) * 32
        store_on_disk(worker, block, gpu_block=3, slot=1)
        worker.engine._stagers.submit(gate.wait)  # the only stager is busy: the load stages
        step(worker, TierCacheMetadata(loads=[LoadJob("across", [BlockOp(block, 6, 4, "disk")], True)]))
        worker.unregister_kv_caches()
        assert worker._registered_kv is not None
        for tensor in worker._registered_kv.values():
            tensor.set_(torch.zeros(NUM_BLOCKS, 2, 32, 4))
        worker.restore_kv_caches()
        assert worker.disabled_reason is not None
        gate.set()
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while "across" not in done:
            assert time.monotonic() < deadline, "the load waiting across the sleep never ended"
            time.sleep(0.01)
            done |= worker.get_finished(set())
        assert worker.take_failed_blocks() == {6}
    finally:
        gate.set()
        worker.shutdown()


def test_one_load_given_up_at_its_deadline_fails_no_other_load(tmp_path):
    """The first load's staging never started (the stagers are busy) when its
    deadline passed, and a second load shares its fill: the second fails alone; a
    third, unrelated load is not given up, and no hook fails."""
    worker = make_worker(tmp_path, None, load_deadline_seconds=0.3, workers=1)
    gate = threading.Event()
    try:
        assert worker.engine is not None
        block, other = bytes([9]) * 32, bytes([10]) * 32
        store_on_disk(worker, block, gpu_block=3, slot=1)
        store_on_disk(worker, other, gpu_block=2, slot=0)
        worker.engine._stagers.submit(gate.wait)  # the only stager is busy
        first = LoadJob("first", [BlockOp(block, 6, 4, "disk")], True)
        step(worker, TierCacheMetadata(loads=[first]))
        time.sleep(0.2)
        second = LoadJob("second", [BlockOp(block, 7, 4, "cpu", after_fill=True)], True)
        third = LoadJob("third", [BlockOp(other, 8, 5, "disk")], True)
        step(worker, TierCacheMetadata(loads=[second, third]))
        time.sleep(0.15)
        done = step(worker, TierCacheMetadata(idle=True))  # the first is past its deadline
        # The fill the second waited for will never come: it fails with the first.
        assert done == {"first", "second"}
        assert worker.take_failed_blocks() == {6, 7}
        gate.set()
        deadline = time.monotonic() + 30
        while "third" not in done:
            assert time.monotonic() < deadline
            time.sleep(0.01)
            done |= step(worker, TierCacheMetadata(idle=True))
        assert worker.take_failed_blocks() == set()  # the third loaded
        assert worker._registered_kv is not None
        assert all(torch.equal(kv[8], kv[2]) for kv in worker._registered_kv.values())
    finally:
        gate.set()
        worker.shutdown()


def test_a_load_that_raises_while_copying_in_fails_alone(tmp_path, monkeypatch):
    """The copy of one staged load raises: that load fails (its blocks recomputed),
    the other staged in the same poll loads, and the error is handed to the connector
    to count as a hook failure, not raised through get_finished (whose recovery gives
    up every load in flight)."""
    worker = make_worker(tmp_path, None, workers=1)
    gate = threading.Event()
    try:
        assert worker.engine is not None and worker.copier is not None
        one, two = bytes([9]) * 32, bytes([10]) * 32
        store_on_disk(worker, one, gpu_block=3, slot=1)
        store_on_disk(worker, two, gpu_block=2, slot=0)
        worker.engine._stagers.submit(gate.wait)
        jobs = [
            LoadJob("a", [BlockOp(one, 6, 4, "disk")], True),
            LoadJob("b", [BlockOp(two, 8, 5, "disk")], True),
        ]
        assert step(worker, TierCacheMetadata(loads=jobs)) == set()
        gate.set()
        worker.engine._stagers.submit(lambda: None).result()
        worker.engine._stagers.submit(lambda: None).result()
        real = worker.copier.queue_from_slots
        calls = []

        def first_raises(*args):
            calls.append(args)
            if len(calls) == 1:
                raise RuntimeError("injected")
            return real(*args)

        monkeypatch.setattr(worker.copier, "queue_from_slots", first_raises)
        assert worker.get_finished(set()) == {"a", "b"}
        assert worker.take_failed_blocks() == {6}
        assert [str(error) for error in worker.take_contained_errors()] == ["injected"]
        assert worker._registered_kv is not None
        assert all(torch.equal(kv[8], kv[2]) for kv in worker._registered_kv.values())
        assert released(worker)[4] == 1  # the failed load's slot is back too
    finally:
        gate.set()
        worker.shutdown()

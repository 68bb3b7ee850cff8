"""Sleep mode (vLLM 0.33): the worker follows the paged KV through
`unregister_kv_caches` / `restore_kv_caches`, in the order vLLM's GPU worker calls them
(`Worker.sleep`: unregister, then unmap; `Worker.wake_up`: map, then restore when the
KV cache is among the tags; `Worker.discard`: unregister, then drop). Here on CPU
tensors, with the remap played by pointing vLLM's tensor objects at new memory: what
a copier that kept its views or its kernel's address table would miss. The same order
driven by vLLM 0.33's own `Worker` code is in test_vllm_versions.py."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from tiercache.config import build_config
from tiercache.connector import worker as worker_module
from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.metadata import FILL_FAILED, FILLED, RELEASED, BlockOp, LoadJob, TierCacheMetadata
from tiercache.connector.worker import TierCacheWorker
from tiercache.index.keys import KVSpec

from support.worker_steps import vllm_step

NUM_BLOCKS = 12
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


@pytest.fixture(params=["direct copies (CPU backend)", "one-launch kernel (CUDA path's twin)"])
def copy_path(request, monkeypatch):
    """Both ways blocks cross: the CPU backend's strided copies, and the CUDA path's
    one-launch kernel with its table of KV addresses, on CPU tensors through Triton's
    interpreter."""
    if request.param.startswith("one-launch"):
        request.getfixturevalue("interpreted")
        monkeypatch.setattr(worker_module, "PagedKVCopier", functools.partial(PagedKVCopier, fused=True))
    return request.param


def paged_kv() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: torch.randn(NUM_BLOCKS, 2, 32, 8) for name in LAYERS}


def make_worker(kv: dict[str, torch.Tensor], disk_path=None) -> TierCacheWorker:
    slot_bytes = PagedKVCopier(kv, NUM_BLOCKS).slot_bytes
    spec = KVSpec("m", "", "float32", "auto", 32, "cpu", len(kv), 2, 8, 1, 0, "t", slot_bytes)
    settings: dict = {"cpu": {"capacity": 6 * slot_bytes}}
    if disk_path is not None:
        settings["disk"] = {"path": str(disk_path)}
    worker = TierCacheWorker(
        build_config(settings),
        spec,
        "digest",
        NUM_BLOCKS,
        tp_rank=0,
        writes_lower_tiers=True,
        disk_share=1 << 26 if disk_path is not None else 0,
    )
    worker.register_kv_caches(kv, slot_bytes)
    return worker


def step(worker: TierCacheWorker, meta: TierCacheMetadata) -> None:
    """One step as vLLM runs it, every attention layer's hooks included."""
    vllm_step(worker, meta, LAYERS)


def store(gpu_block: int, slot: int) -> TierCacheMetadata:
    return TierCacheMetadata(stores=[BlockOp(bytes([slot]) * 32, gpu_block, slot, "cpu", req_id="s")])


def load(slot: int, gpu_block: int) -> TierCacheMetadata:
    op = BlockOp(bytes([slot]) * 32, gpu_block, slot, "cpu")
    return TierCacheMetadata(loads=[LoadJob("r", [op], False)])


def remap(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Point each of vLLM's tensor objects at new memory holding other bytes; returns
    views of the old memory, which still hold what the KV held before."""
    old = {name: tensor.view_as(tensor) for name, tensor in kv.items()}
    for tensor in kv.values():
        tensor.set_(torch.randn_like(tensor))
    return old


def snapshot(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in kv.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[name], b[name]) for name in LAYERS)


def test_after_a_wake_up_loads_and_stores_use_the_memory_the_kv_tensors_hold_now(copy_path):
    kv = paged_kv()
    worker = make_worker(kv)
    try:
        step(worker, store(gpu_block=3, slot=1))  # a block cached before sleep
        cached = {name: kv[name][3].clone() for name in LAYERS}
        step(worker, TierCacheMetadata())  # a step that shows every layer's hook
        assert worker._loads.layer_order == LAYERS  # loads go layer by layer from here

        worker.unregister_kv_caches()  # Worker.sleep, before the unmap
        old = remap(kv)  # the unmap and, at wake-up, the map: new memory
        old_before = snapshot(old)
        worker.restore_kv_caches()  # Worker.wake_up, once the KV is mapped

        step(worker, load(slot=1, gpu_block=7))
        assert all(torch.equal(kv[name][7], cached[name]) for name in LAYERS)
        assert same(old, old_before)  # nothing was copied into the old memory

        computed = {name: kv[name][5].clone() for name in LAYERS}  # a block computed after waking
        step(worker, store(gpu_block=5, slot=2))
        step(worker, load(slot=2, gpu_block=9))
        assert all(torch.equal(kv[name][9], computed[name]) for name in LAYERS)
        assert not all(torch.equal(old[name][5], computed[name]) for name in LAYERS)
        assert same(old, old_before)
        assert worker.take_failed_blocks() == set()
    finally:
        worker.shutdown()


def test_while_the_kv_is_unmapped_loads_fail_and_stores_are_dropped(copy_path):
    """vLLM schedules nothing while asleep; a step that came all the same (or a wake-up
    of the weights alone, which restores no KV) must not touch the paged KV."""
    kv = paged_kv()
    worker = make_worker(kv)
    try:
        step(worker, store(gpu_block=3, slot=1))
        worker.take_worker_meta()
        worker.unregister_kv_caches()
        worker.unregister_kv_caches()  # Worker.discard after Worker.sleep: idempotent
        before = snapshot(kv)

        step(worker, load(slot=1, gpu_block=7))
        step(worker, store(gpu_block=4, slot=2))
        assert same(kv, before)
        assert worker.take_failed_blocks() == {7}  # vLLM recomputes it
        events = worker.take_worker_meta().counts()
        assert events[(RELEASED, 1)] == 1 and events[(RELEASED, 2)] == 1  # slots back
        assert events[(FILL_FAILED, (bytes([2]) * 32, 2))] == 1  # the store is dropped
        assert not any(kind == FILLED for kind, _ in events)

        worker.restore_kv_caches()
        worker.restore_kv_caches()  # idempotent
        step(worker, load(slot=1, gpu_block=7))
        assert torch.equal(kv[LAYERS[0]][7], kv[LAYERS[0]][3])
        assert worker.take_failed_blocks() == set()
    finally:
        worker.shutdown()


def test_restore_without_unregister_keeps_the_copier():
    """vLLM's wake-up after a sleep of level 0, or of the weights alone, restores
    nothing that was unregistered."""
    kv = paged_kv()
    worker = make_worker(kv)
    try:
        copier = worker.copier
        worker.restore_kv_caches()
        assert worker.copier is copier
    finally:
        worker.shutdown()


def test_kv_tensors_that_come_back_other_than_registered_turn_the_cache_off():
    kv = paged_kv()
    worker = make_worker(kv)
    try:
        worker.unregister_kv_caches()
        for name in LAYERS:
            kv[name].set_(torch.zeros(NUM_BLOCKS, 2, 32, 4))  # half the bytes per block
        worker.restore_kv_caches()
        assert worker.copier is None
        assert worker.disabled_reason is not None and "wake-up" in worker.disabled_reason
        step(worker, load(slot=1, gpu_block=7))
        assert worker.take_failed_blocks() == {7}
    finally:
        worker.shutdown()


def staged_disk_load(worker: TierCacheWorker, req_id: str, slot: int, gpu_block: int) -> None:
    """A disk hit staging into its slot, as `start_load_kv` leaves it (short of the
    poll at its end, which could race the staging thread), staged once this returns."""
    job = LoadJob(req_id, [BlockOp(bytes([1]) * 32, gpu_block, slot, "disk")], True)
    worker._loads.start_async(job)
    load = worker._loads.load_of(job)
    deadline = time.monotonic() + 30
    while not all(future.done() for _, _, future in load.staged):
        assert time.monotonic() < deadline, "the disk read never finished"
        time.sleep(0.01)


def test_a_disk_hit_staged_across_the_sleep_is_copied_in_only_after_the_wake_up(tmp_path):
    kv = paged_kv()
    worker = make_worker(kv, disk_path=tmp_path)
    try:
        step(worker, store(gpu_block=3, slot=1))  # written through to disk
        assert worker.engine.flush(30)
        cached = {name: kv[name][3].clone() for name in LAYERS}

        # Reported to vLLM before the sleep: in the paged KV before it was reported.
        staged_disk_load(worker, "before", slot=2, gpu_block=6)
        assert worker.get_finished(set()) == {"before"}
        assert all(torch.equal(kv[name][6], cached[name]) for name in LAYERS)
        worker.unregister_kv_caches()
        assert all(torch.equal(kv[name][6], cached[name]) for name in LAYERS)
        assert worker.take_worker_meta().counts()[(RELEASED, 2)] == 1  # its slot is free

        # Staged while asleep: it stays in its slot, reported to nobody, until restore.
        staged_disk_load(worker, "asleep", slot=3, gpu_block=7)
        assert worker.get_finished(set()) == set()
        old = remap(kv)
        old_before = snapshot(old)
        worker.restore_kv_caches()
        assert worker.get_finished(set()) == {"asleep"}
        step(worker, TierCacheMetadata())  # the forward that reads it
        assert all(torch.equal(kv[name][7], cached[name]) for name in LAYERS)
        assert same(old, old_before)
        assert worker.take_failed_blocks() == set()
    finally:
        worker.shutdown()

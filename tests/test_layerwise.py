"""CPU-tier hits loaded layer by layer during the forward (connector/layerwise.py)."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tiercache.config import build_config
from tiercache.connector import worker as worker_module
from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.layerwise import LayerwiseLoad
from tiercache.connector.metadata import FILLED, RELEASED, BlockOp, LoadJob, TierCacheMetadata
from tiercache.connector.worker import TierCacheWorker
from tiercache.index.keys import KVSpec
from tiercache.tiers.cpu import CpuBuffer

NUM_BLOCKS = 16
# Names whose sorted order (the slot layout) differs from the forward's order.
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(12)]


def paged_kv() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: torch.randn(NUM_BLOCKS, 2, 32, 16) for name in LAYERS}


def test_layerwise_load_puts_each_layer_in_place_before_wait_returns():
    kv = paged_kv()
    copier = PagedKVCopier(kv, NUM_BLOCKS)
    buffer = CpuBuffer(8, copier.slot_bytes, pin_memory=False)
    src, slots, dst = [2, 3, 4, 9], [0, 1, 2, 5], [10, 11, 12, 13]
    copier.to_slots(src, slots, buffer)
    want = {name: t[src].clone() for name, t in kv.items()}
    for t in kv.values():
        t[dst] = 0
    with ThreadPoolExecutor(1) as helper:
        load = LayerwiseLoad(copier, buffer, slots, dst, LAYERS, helper)
        for name in LAYERS:  # the forward, layer by layer
            load.wait(name)
            assert torch.equal(kv[name][dst], want[name]), name
        load.wait("not.a.kv.layer")  # a layer the load does not touch returns at once
        load.finish()
    assert not kv[LAYERS[0]][0:2].eq(want[LAYERS[0]][0:2]).all()  # other blocks untouched


def test_layerwise_load_when_the_forward_outruns_a_stalled_helper():
    """The forward's thread copies what it needs itself: no deadlock, no stale layer."""
    kv = paged_kv()
    copier = PagedKVCopier(kv, NUM_BLOCKS)
    buffer = CpuBuffer(4, copier.slot_bytes, pin_memory=False)
    copier.to_slots([1], [0], buffer)
    want = {name: t[1].clone() for name, t in kv.items()}
    gate = threading.Event()
    with ThreadPoolExecutor(1) as helper:
        helper.submit(gate.wait)  # the helper is busy until the forward is done
        load = LayerwiseLoad(copier, buffer, [0], [7], LAYERS, helper)
        for name in reversed(LAYERS):
            load.wait(name)
            assert torch.equal(kv[name][7], want[name]), name
        gate.set()
        load.finish()


def test_a_failed_layer_copy_is_raised_in_the_forward():
    kv = paged_kv()
    copier = PagedKVCopier(kv, NUM_BLOCKS)
    buffer = CpuBuffer(4, copier.slot_bytes, pin_memory=False)
    with ThreadPoolExecutor(1) as helper:
        load = LayerwiseLoad(copier, buffer, [99], [7], LAYERS, helper)  # no such slot
        with pytest.raises((IndexError, RuntimeError)):
            load.finish()


@pytest.fixture(params=["threads (CPU backend)", "per-layer kernels (CUDA path's twin)"])
def copy_path(request, monkeypatch):
    """Each worker test runs both ways a hit is loaded layer by layer: the CPU backend's
    copy threads, and the CUDA path's per-layer kernel launches (layerwise_gpu.py),
    here on CPU tensors through Triton's interpreter."""
    if request.param.startswith("per-layer"):
        request.getfixturevalue("interpreted")
        kernels = functools.partial(PagedKVCopier, staged=True, fused=True)
        monkeypatch.setattr(worker_module, "PagedKVCopier", kernels)
    return request.param


def make_worker(kv) -> TierCacheWorker:
    slot_bytes = PagedKVCopier(kv, NUM_BLOCKS).slot_bytes
    config = build_config({"cpu": {"capacity": 8 * slot_bytes}})
    spec = KVSpec("m", "", "float32", "auto", 32, "cpu", len(kv), 2, 16, 1, 0, "t", slot_bytes)
    worker = TierCacheWorker(
        config, spec, "digest", NUM_BLOCKS, tp_rank=0, writes_lower_tiers=True, disk_share=0
    )
    worker.register_kv_caches(kv, slot_bytes)
    return worker


def cpu_hit(slots, gpu_blocks) -> TierCacheMetadata:
    pairs = enumerate(zip(slots, gpu_blocks, strict=True))
    ops = [BlockOp(bytes([i]) * 32, gpu, slot, "cpu") for i, (slot, gpu) in pairs]
    return TierCacheMetadata(write_backs=[], loads=[LoadJob("r", ops, False)], stores=[])


def empty_step() -> TierCacheMetadata:
    return TierCacheMetadata(write_backs=[], loads=[], stores=[])


def forward(worker, meta, layers, check=None, attention=None) -> None:
    """What vLLM does in one step: start loads; per attention layer, wait for its load,
    compute (which writes the layer's new KV), hand it to the connector; then save."""
    worker.start_load_kv(meta)
    for name in layers:
        worker.wait_for_layer(name)
        if check:
            check(name)
        if attention:
            attention(name)
        worker.save_layer(name, meta)
    worker.wait_for_save(meta)


def test_worker_goes_layerwise_only_after_a_step_showed_every_layer_waited_for(copy_path):
    kv = paged_kv()
    worker = make_worker(kv)
    worker.copier.to_slots([0, 1], [3, 4], worker.buffer)
    want = {name: t[[0, 1]].clone() for name, t in kv.items()}
    try:
        # A forward that skips a layer's hook: loads must stay whole before the forward.
        forward(worker, empty_step(), LAYERS[:-1])
        assert worker._loads.layer_order is None
        meta = cpu_hit([3, 4], [8, 9])
        worker.start_load_kv(meta)
        assert worker._loads.layerwise == []
        assert all(torch.equal(kv[n][[8, 9]], want[n]) for n in LAYERS)  # in place already
        worker.wait_for_save(meta)

        forward(worker, empty_step(), LAYERS)  # every layer's hook ran: learnt
        assert worker._loads.layer_order == LAYERS

        def in_place(name):
            assert torch.equal(kv[name][[12, 13]], want[name]), name

        forward(worker, cpu_hit([3, 4], [12, 13]), LAYERS, check=in_place)
        events = worker.take_worker_meta().counts()
        assert events[(RELEASED, 3)] == 2 and events[(RELEASED, 4)] == 2  # once per load
        assert worker.take_worker_meta() is None
    finally:
        worker.shutdown()


def hit_in_place(kv, blocks, want, timeout: float = 5.0) -> bool:
    """Whether every layer of `blocks` holds `want` within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(torch.equal(kv[n][blocks], want[n]) for n in LAYERS):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize(
    "early", [True, False], ids=["vllm writes no block first", "vllm zeroes or copies blocks"]
)
def test_a_cpu_hit_starts_copying_when_the_step_arrives_where_nothing_overwrites_it(copy_path, early):
    """On the CPU backend the copy runs while vLLM prepares the step's inputs (between
    handle_preemptions and start_load_kv), unless vLLM writes paged blocks meanwhile;
    either way it is loaded once and its slots released once."""
    kv = paged_kv()
    worker = make_worker(kv)
    worker.copier.to_slots([0, 1], [3, 4], worker.buffer)
    want = {name: t[[0, 1]].clone() for name, t in kv.items()}
    try:
        forward(worker, empty_step(), LAYERS)  # the layer order, learnt
        meta = cpu_hit([3, 4], [12, 13])
        meta.loads_early = early
        worker.step_arrives(meta)
        if early and copy_path.startswith("threads"):
            assert hit_in_place(kv, [12, 13], want)  # before start_load_kv
        else:
            # Or CUDA's twin: copies on the copy stream, never ahead of the step's own.
            assert not hit_in_place(kv, [12, 13], want, timeout=0.3)
        worker.forward_begins(meta)
        forward(worker, meta, LAYERS)
        assert all(torch.equal(kv[n][[12, 13]], want[n]) for n in LAYERS)
        events = worker.take_worker_meta().counts()
        assert events[(RELEASED, 3)] == 1 and events[(RELEASED, 4)] == 1
    finally:
        worker.shutdown()


def test_a_lost_block_in_a_layerwise_hit_is_reported_and_the_rest_loaded():
    kv = paged_kv()
    worker = make_worker(kv)
    worker.copier.to_slots([0], [2], worker.buffer)
    try:
        forward(worker, empty_step(), LAYERS)
        ops = [BlockOp(b"a" * 32, 5, 2, "cpu"), BlockOp(b"b" * 32, 6, -1, "")]
        meta = TierCacheMetadata(write_backs=[], loads=[LoadJob("r", ops, False)], stores=[])
        forward(worker, meta, LAYERS)
        assert worker.take_failed_blocks() == {6}
        assert all(torch.equal(kv[n][5], kv[n][0]) for n in LAYERS)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("layerwise", [False, True], ids=["before the forward", "layer by layer"])
def test_one_requests_lost_block_fails_only_that_requests_blocks(layerwise):
    kv = paged_kv()
    worker = make_worker(kv)
    worker.copier.to_slots([0, 1, 2], [2, 3, 4], worker.buffer)
    try:
        if layerwise:
            forward(worker, empty_step(), LAYERS)
        first = [
            BlockOp(b"a" * 32, 5, 2, "cpu"),
            BlockOp(b"b" * 32, 6, -1, ""),  # lost since the lookup
            BlockOp(b"c" * 32, 7, 3, "cpu"),
        ]
        second = [BlockOp(b"d" * 32, 8, 3, "cpu"), BlockOp(b"e" * 32, 9, 4, "cpu")]
        loads = [LoadJob("r1", first, False), LoadJob("r2", second, False)]
        forward(worker, TierCacheMetadata(write_backs=[], loads=loads, stores=[]), LAYERS)
        assert worker.take_failed_blocks() == {6, 7}  # r1 from its lost block on; r2 whole
        for name in LAYERS:
            assert torch.equal(kv[name][5], kv[name][0])
            assert torch.equal(kv[name][8], kv[name][1]) and torch.equal(kv[name][9], kv[name][2])
        events = worker.take_worker_meta().counts()
        assert all(events[(RELEASED, slot)] for slot in (2, 3, 4))
    finally:
        worker.shutdown()


def staged_hit(worker, kv, slots, gpu_blocks, source_blocks, delay: float = 0.0):
    """A disk hit whose staging puts `source_blocks`' bytes in `slots` after `delay`
    seconds, as the tier engine's readers would."""
    ops = [
        BlockOp(bytes([i + 100]) * 32, gpu, slot, "disk")
        for i, (slot, gpu) in enumerate(zip(slots, gpu_blocks, strict=True))
    ]

    def stage_many(items):
        def run():
            time.sleep(delay)
            worker.copier.to_slots(source_blocks, slots, worker.buffer)
            return [True] * len(items)

        return ThreadPoolExecutor(1).submit(run)

    worker.engine.stage_many = stage_many
    return TierCacheMetadata(write_backs=[], loads=[LoadJob("r", ops, True)], stores=[], idle=True)


def test_an_idle_step_waits_for_a_staged_load_instead_of_returning_empty(monkeypatch):
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_SECONDS", 30.0)  # bounds only
    kv = paged_kv()
    worker = make_worker(kv)
    try:
        worker.start_load_kv(staged_hit(worker, kv, [1], [7], [0], delay=0.05))
        assert worker.get_finished() == {"r"}  # slept on the read: reported this step

        busy = staged_hit(worker, kv, [2], [8], [0], delay=0.2)
        busy.idle = False  # other requests compute this step: do not hold them up
        worker.start_load_kv(busy)
        assert worker.get_finished() == set()
        worker.start_load_kv(empty_step())
        while not worker.get_finished():
            time.sleep(0.01)
        assert all(torch.equal(kv[n][8], kv[n][0]) for n in LAYERS)
    finally:
        worker.shutdown()


def test_a_staged_hit_is_in_the_paged_kv_when_vllm_is_told(monkeypatch, copy_path):
    """Once told, vLLM may schedule the request, or abort it and give its blocks to
    another: a copy that landed later could not be reported failed, or would write
    over the other request's KV (docs/reliability.md)."""
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_SECONDS", 30.0)  # bounds only
    kv = paged_kv()
    worker = make_worker(kv)
    want = {name: t[[0, 1]].clone() for name, t in kv.items()}
    try:
        forward(worker, empty_step(), LAYERS)  # learn the layer order
        meta = staged_hit(worker, kv, [3, 4], [10, 11], [0, 1], delay=0.05)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.get_finished() == {"r"}
        assert worker._loads.layerwise == []  # nothing left for a later forward
        if copy_path.startswith("threads"):  # the CPU backend: copied before it returned
            for name in LAYERS:
                assert torch.equal(kv[name][[10, 11]], want[name]), name
        forward(worker, empty_step(), LAYERS)
        for name in LAYERS:
            assert torch.equal(kv[name][[10, 11]], want[name]), name
        events = worker.take_worker_meta().counts()
        assert events[(RELEASED, 3)] == 1 and events[(RELEASED, 4)] == 1
    finally:
        worker.shutdown()


def test_a_prompt_is_stored_with_what_each_layer_wrote_in_this_step(copy_path):
    """Stores leave each layer's blocks as the forward wrote them in the same step: on
    the CUDA path they are copied out layer by layer as the forward goes (a layer whose
    hook never came is copied at the end); on the CPU backend, whole, after it."""
    kv = paged_kv()
    worker = make_worker(kv)
    try:
        forward(worker, empty_step(), LAYERS)
        stores = [BlockOp(b"s" * 32, 5, 6, "cpu"), BlockOp(b"t" * 32, 9, 2, "cpu")]
        meta = TierCacheMetadata(write_backs=[], loads=[], stores=stores)
        written = {}
        worker.start_load_kv(meta)
        for name in LAYERS:
            worker.wait_for_layer(name)
            kv[name][[5, 9]] = torch.randn(2, *kv[name].shape[1:])  # the attention's new KV
            written[name] = kv[name][[5, 9]].clone()
            if name != LAYERS[-1]:  # the last layer's hook never comes
                worker.save_layer(name, meta)
        streamed = worker._saving is not None
        worker.wait_for_save(meta)
        assert streamed == copy_path.startswith("per-layer")
        assert worker._saving is None
        for name in kv:  # whatever the paged KV holds later, the slots keep this step's
            kv[name].zero_()
        worker.copier.from_slots([6, 2], [5, 9], worker.buffer)
        for name in LAYERS:
            assert torch.equal(kv[name][[5, 9]], written[name]), name
        events = worker.take_worker_meta().counts()
        assert events[(FILLED, (b"s" * 32, 6))] == 1 and events[(FILLED, (b"t" * 32, 2))] == 1
    finally:
        worker.shutdown()


def make_write_back_worker(kv, disk_root) -> TierCacheWorker:
    """A worker that writes down to a real disk tier (write-back policy)."""
    slot_bytes = PagedKVCopier(kv, NUM_BLOCKS).slot_bytes
    config = build_config(
        {
            "cpu": {"capacity": 8 * slot_bytes},
            "disk": {"path": str(disk_root), "capacity": 64 * slot_bytes},
            "movers": {"policy": "write_back"},
        }
    )
    spec = KVSpec("m", "", "float32", "auto", 32, "cpu", len(kv), 2, 16, 1, 0, "t", slot_bytes)
    worker = TierCacheWorker(
        config, spec, "digest", NUM_BLOCKS, tp_rank=0, writes_lower_tiers=True, disk_share=0
    )
    worker.register_kv_caches(kv, slot_bytes)
    return worker


@pytest.mark.parametrize(
    "order",
    ["stores, start_load_kv, wait_for_save", "stores, wait_for_save, start_load_kv"],
    ids=["start after the forward (vLLM, no sync loads)", "start after the save"],
)
def test_a_write_back_victim_is_written_down_as_it_was_before_its_slot_is_reused(copy_path, order, tmp_path):
    """vLLM starts a step's loads after its forward when none of them feeds it: by then
    the step's stores may have been copied into the victim's slot (on CUDA, layer by
    layer as the forward goes). The victim must still go down exactly as it was."""
    kv = paged_kv()
    worker = make_write_back_worker(kv, tmp_path / "disk")
    old_hash, slot = b"o" * 32, 6
    try:
        forward(worker, empty_step(), LAYERS)  # learn the layer order
        worker.copier.to_slots([1], [slot], worker.buffer)  # the victim, stored earlier
        old = bytes(worker.buffer.view(slot))
        # This step evicts it: a new block is stored into its slot.
        meta = TierCacheMetadata(
            write_backs=[(old_hash, slot)], loads=[], stores=[BlockOp(b"n" * 32, 9, slot, "cpu")]
        )
        for name in LAYERS:
            worker.wait_for_layer(name)
            kv[name][9] = torch.randn(*kv[name].shape[1:])  # the attention's new KV
            worker.save_layer(name, meta)
        if order.endswith("wait_for_save"):
            worker.start_load_kv(meta)
            worker.wait_for_save(meta)
        else:
            worker.wait_for_save(meta)
            worker.start_load_kv(meta)
        assert bytes(worker.buffer.view(slot)) != old  # the new block is in the slot now
        assert worker.engine.flush(10)
        written = bytearray(len(old))
        assert worker.engine.disk.get_into(worker.engine.shape.key(old_hash), memoryview(written))
        assert bytes(written) == old
    finally:
        worker.shutdown()

"""Background writes step aside while a forward loads hits on the CPU backend
(tiercache/foreground.py): the gate itself, a real tier engine's write-down held back
by it, and the connector's worker holding it exactly for forwards that copy hits."""

from __future__ import annotations

import threading
import time

import torch

from tiercache.config import build_config
from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.metadata import BlockOp, LoadJob, TierCacheMetadata
from tiercache.connector.stats import TierCacheStats
from tiercache.connector.worker import TierCacheWorker
from tiercache.engine import DISK, ObjectShape, TierEngine
from tiercache.foreground import OUTPUT_GRACE, ForegroundGate
from tiercache.index.keys import KVSpec
from tiercache.tiers import CPU
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.disk.tier import PIECE_BYTES


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_held_gate_keeps_a_waiting_mover_until_it_is_released():
    gate = ForegroundGate(max_hold=5.0)
    assert gate.hold()
    passed = threading.Event()
    mover = threading.Thread(target=lambda: (gate.wait(), passed.set()))
    mover.start()
    assert not passed.wait(0.2)
    gate.release()
    assert passed.wait(2.0)
    mover.join()


def test_a_mover_never_waits_longer_than_max_hold():
    gate = ForegroundGate(max_hold=0.1)
    gate.hold()  # never released: a step that did not end as expected
    began = time.monotonic()
    gate.wait()
    assert time.monotonic() - began < 1.0


def test_holds_stop_once_they_took_their_share_of_the_window():
    clock = FakeClock()
    gate = ForegroundGate(max_hold=0.5, max_share=0.5, window=2.0, clock=clock)
    # Holds back to back, 0.5 s each: held all the time, the share (1 s of a 2 s
    # window, the window's older part fading) is spent by the third.
    for _ in range(3):
        assert gate.hold()
        clock.now += 0.5
        gate.release()
    assert not gate.hold() and not gate.held and gate.skipped == 1
    clock.now += 2.0  # the window has moved on
    assert gate.hold() and gate.held


def test_a_hold_counts_at_most_max_hold_against_the_share():
    clock = FakeClock()
    gate = ForegroundGate(max_hold=0.5, max_share=0.5, window=2.0, clock=clock)
    gate.hold()
    clock.now += 30.0  # a step that never released for a long time
    gate.release()
    assert gate.hold()  # 0.5 s counted, decayed: room for more


def test_a_lingering_hold_ends_by_itself_and_counts_only_until_then():
    clock = FakeClock()
    gate = ForegroundGate(max_hold=0.5, max_share=0.5, window=2.0, clock=clock)
    assert gate.hold()
    clock.now += 0.1
    gate.release_after(0.02)
    assert gate.held and gate._ends_at() == clock.now + 0.02
    clock.now += 0.03
    assert not gate.held
    gate.wait()  # past its end: nobody waits
    clock.now += 10.0  # long after: only the 0.12 s held count, and they have faded
    assert gate.hold() and gate._held_seconds == 0.0


def test_a_step_with_hits_during_the_linger_keeps_the_hold_until_released():
    clock = FakeClock()
    gate = ForegroundGate(max_hold=0.5, clock=clock)
    assert gate.hold()
    gate.release_after(0.02)
    clock.now += 0.01
    assert gate.hold()  # the next step loads hits too
    clock.now += 0.05
    assert gate.held and gate._ends_at() == 100.5  # bound by max_hold again, no longer the grace
    gate.release_after(1.0)  # a grace never stretches a hold past its max_hold
    assert gate._ends_at() == 100.5
    gate.release()
    assert not gate.held and gate._ends_at() is None


def test_the_engine_writes_nothing_down_while_the_gate_is_held(tmp_path):
    slot = 4096
    config = build_config({"cpu": {"capacity": 2 * slot}, "disk": {"path": str(tmp_path / "disk")}})
    engine = TierEngine(config, ObjectShape("a" * 16, "b" * 16, slot), CpuBuffer(2, slot, pin_memory=False))
    try:
        engine.buffer.view(0)[:] = b"x" * slot
        done = threading.Event()
        assert engine.foreground.hold()
        engine.write_down(b"k" * 32, 0, lambda result: done.set())
        assert not done.wait(0.3)
        assert not list((tmp_path / "disk").rglob("*.safetensors"))
        engine.foreground.release()
        assert done.wait(5.0)
        assert list((tmp_path / "disk").rglob("*.safetensors"))
    finally:
        engine.close()


def cpu_backend_worker(tmp_path, yield_to_loads: bool = True) -> TierCacheWorker:
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv = {name: torch.randn(8, 2, 16, 8) for name in layers}
    slot_bytes = PagedKVCopier(kv, 8).slot_bytes
    config = build_config(
        {
            "cpu": {"capacity": 4 * slot_bytes},
            "disk": {"path": str(tmp_path / "disk")},
            "movers": {"yield_to_loads": yield_to_loads},
        }
    )
    spec = KVSpec("m", "", "float32", "auto", 16, "cpu", 2, 2, 8, 1, 0, "t", slot_bytes)
    worker = TierCacheWorker(config, spec, "gate", 8, tp_rank=0, writes_lower_tiers=True, disk_share=1 << 24)
    worker.register_kv_caches(kv, slot_bytes)
    return worker


def test_the_worker_holds_the_gate_for_a_step_that_loads_a_hit_and_only_then(tmp_path):
    worker = cpu_backend_worker(tmp_path)
    gate = worker.engine.foreground
    gate.max_hold = 30.0
    try:
        store = TierCacheMetadata(stores=[BlockOp(b"h" * 32, 1, 0, CPU)])
        worker.step_arrives(store)
        worker.forward_begins(store)
        assert not gate.held  # a step that only stores
        worker.start_load_kv(store)
        worker.wait_for_save(store)
        worker.get_finished()

        hit = TierCacheMetadata(loads=[LoadJob("r", [BlockOp(b"h" * 32, 5, 0, CPU)], False)])
        worker.step_arrives(hit)
        assert gate.held  # from before vLLM prepares the step's inputs
        worker.forward_begins(hit)
        worker.start_load_kv(hit)
        worker.wait_for_save(hit)
        worker.get_finished()
        assert gate.held  # while the step's token is sampled and handed on
        worker.step_arrives(TierCacheMetadata())  # the next step: the token is out
        assert not gate.held
        # One hold over the step's two hooks, reported once (vllm:tiercache_write_holds).
        assert worker.take_stats().data["write_holds"] == 1
        assert "write_holds" not in (worker.take_stats() or TierCacheStats()).data
    finally:
        worker.shutdown()


def test_the_worker_holds_the_gate_for_a_step_over_vllms_prefix_cache(tmp_path):
    """A prefix-cache hit asked while its prompt is written down took 1.21-1.26x the
    later ones without the hold (docs/benchmarks-e2e.md, "What the investigations found")."""
    worker = cpu_backend_worker(tmp_path)
    gate = worker.engine.foreground
    gate.max_hold = 30.0
    try:
        hit = TierCacheMetadata(reuses_prefix=True)
        worker.step_arrives(hit)
        assert gate.held
        worker.forward_begins(hit)
        worker.start_load_kv(hit)
        worker.wait_for_save(hit)
        worker.get_finished()
        worker.step_arrives(TierCacheMetadata())
        assert not gate.held
        assert worker.take_stats().data["write_holds"] == 1
    finally:
        worker.shutdown()


def test_a_hold_ends_by_itself_the_output_grace_after_the_forward(tmp_path):
    """The step that loaded a hit was the last: no next step comes to end the hold."""
    worker = cpu_backend_worker(tmp_path)
    gate = worker.engine.foreground
    gate.max_hold = 30.0
    try:
        hit = TierCacheMetadata(loads=[LoadJob("r", [BlockOp(b"h" * 32, 5, 0, CPU)], False)])
        worker.step_arrives(hit)
        worker.forward_begins(hit)
        worker.start_load_kv(hit)
        worker.wait_for_save(hit)
        worker.get_finished()
        began = time.monotonic()
        gate.wait()
        assert OUTPUT_GRACE * 0.5 < time.monotonic() - began < 5.0
        assert not gate.held
    finally:
        worker.shutdown()


def test_a_step_that_finds_the_share_spent_is_counted_refused_once(tmp_path):
    """vLLM hands the step over (step_arrives) and then binds it (forward_begins): one
    step, one decision, one count in vllm:tiercache_write_holds_refused."""
    worker = cpu_backend_worker(tmp_path)
    gate = worker.engine.foreground
    gate.max_share = 0.0  # every hold refused
    try:
        hit = TierCacheMetadata(loads=[LoadJob("r", [BlockOp(b"h" * 32, 5, 0, CPU)], False)])
        worker.step_arrives(hit)
        worker.forward_begins(hit)
        assert not gate.held
        worker.start_load_kv(hit)
        worker.wait_for_save(hit)
        worker.get_finished()
        data = worker.take_stats().data
        assert data["write_holds_refused"] == 1 and "write_holds" not in data
    finally:
        worker.shutdown()


def test_by_default_the_worker_never_holds_the_gate(tmp_path):
    worker = cpu_backend_worker(tmp_path, yield_to_loads=False)
    try:
        hit = TierCacheMetadata(loads=[LoadJob("r", [BlockOp(b"h" * 32, 5, 0, CPU)], False)])
        worker.forward_begins(hit)
        assert not worker.engine.foreground.held
        worker.wait_for_save(hit)
    finally:
        worker.shutdown()


def test_a_disk_write_under_way_stops_between_pieces_while_the_gate_is_held(tmp_path):
    """A hold that starts mid-write stops the write at its next piece, not at its end."""
    slot = 4 * PIECE_BYTES
    config = build_config({"cpu": {"capacity": slot}, "disk": {"path": str(tmp_path / "disk")}})
    engine = TierEngine(config, ObjectShape("a" * 16, "b" * 16, slot), CpuBuffer(1, slot, pin_memory=False))
    engine.foreground.max_hold = 30.0
    assert engine.disk is not None and engine.disk.pace == engine.foreground.wait
    pieces = 0
    held = threading.Event()

    def pace_holding_after_the_first_piece():
        nonlocal pieces
        pieces += 1
        if pieces == 2:  # the first piece is written: a forward with hits begins
            assert engine.foreground.hold()
            held.set()
        engine.foreground.wait()

    engine.disk.pace = pace_holding_after_the_first_piece
    try:
        engine.buffer.view(0)[:] = b"x" * slot
        done = threading.Event()
        engine.write_down(b"k" * 32, 0, lambda result: done.set(), tiers=(DISK,))
        assert held.wait(10.0)
        assert not done.wait(0.3)
        (partial,) = (tmp_path / "disk").rglob(".tmp-*")
        assert partial.stat().st_size == PIECE_BYTES  # one piece, then it stopped
        engine.foreground.release()
        assert done.wait(10.0)
        assert pieces >= 4 and not list((tmp_path / "disk").rglob(".tmp-*"))
        out = memoryview(bytearray(slot))
        assert engine.read_into(b"k" * 32, out, DISK) and bytes(out) == b"x" * slot
    finally:
        engine.close()


def test_a_hold_keeps_a_write_back_no_longer_than_max_hold_however_many_pieces(tmp_path):
    """The bound is per hold, not per wait: a write of 16 pieces under a hold that never
    ends waits once, max_hold, rather than max_hold at each of its pieces (8 s here)."""
    from tiercache.tiers.disk.tier import DiskTier
    from tiercache.tiers.format import ObjectHeader, checksum

    gate = ForegroundGate(max_hold=0.5)
    tier = DiskTier(tmp_path, 1 << 30)
    tier.pace = gate.wait
    data = b"y" * (16 * PIECE_BYTES)
    key = f"{'c' * 16}/{'d' * 64}"
    gate.hold()  # a step that did not end as expected
    began = time.monotonic()
    assert tier.put(key, memoryview(data), ObjectHeader(key, "c" * 16, len(data), checksum(data)))
    assert time.monotonic() - began < 4.0

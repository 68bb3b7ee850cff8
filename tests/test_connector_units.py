"""The connector's parts without a vLLM engine: the copier on several KV layouts (the
CPU twin of the CUDA path), and the scheduler's planning and event bookkeeping with
stand-in requests and scheduler outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiercache.config import build_config
from tiercache.connector.copier import PagedKVCopier, runs, slot_runs
from tiercache.connector.metadata import (
    FILL_FAILED,
    FILLED,
    ON_DISK,
    READ_FAILED,
    RELEASED,
)
from tiercache.connector.scheduler import TierCacheScheduler
from tiercache.index.keys import KVSpec
from tiercache.tiers.cpu import CpuBuffer

from support.scheduler_steps import blocks_of, new_request, report, scheduler_output

NUM_BLOCKS = 12
LAYOUTS = {
    "cpu LBHNC [blocks, heads, block_size, 2*head]": lambda: torch.randn(NUM_BLOCKS, 2, 32, 16),
    "flash-attn [2, blocks, block_size, heads, head]": lambda: torch.randn(2, NUM_BLOCKS, 32, 2, 8),
    "flashinfer [blocks, 2, block_size, heads, head]": lambda: torch.randn(NUM_BLOCKS, 2, 32, 2, 8),
    "mla [blocks, block_size, latent]": lambda: torch.randn(NUM_BLOCKS, 32, 24),
}


def test_runs_group_consecutive_blocks_and_slots():
    assert runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert runs([1, 2], [5, 3]) == [(1, 5, 1), (2, 3, 1)]
    assert runs([], []) == []


def test_slot_runs_group_consecutive_slots_with_their_positions():
    assert slot_runs([6, 7, 0, 1, 3]) == [(6, 0, 2), (0, 2, 2), (3, 4, 1)]
    assert slot_runs([]) == []


@pytest.mark.parametrize("staged", [False, True], ids=["direct (CPU backend)", "staged (CUDA path's twin)"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_copier_round_trip_on_each_layout(layout, staged):
    torch.manual_seed(0)
    kv = {f"model.layers.{i}.attn": LAYOUTS[layout]() for i in range(3)}
    original = {name: t.clone() for name, t in kv.items()}
    copier = PagedKVCopier(kv, NUM_BLOCKS, staged=staged)
    buffer = CpuBuffer(8, copier.slot_bytes, pin_memory=False)
    blocks, slots = [3, 4, 5, 9, 0], [6, 7, 0, 1, 3]
    copier.to_slots(blocks, slots, buffer)
    for tensor in kv.values():  # wipe the paged KV, then restore it from the slots
        tensor.zero_()
    copier.from_slots(slots, [1, 2, 3, 10, 11], buffer)
    for name, tensor in kv.items():
        dim = next(d for d, s in enumerate(tensor.shape) if s == NUM_BLOCKS)
        got, want = tensor.movedim(dim, 0), original[name].movedim(dim, 0)
        for src, dst in zip(blocks, [1, 2, 3, 10, 11], strict=True):
            assert torch.equal(got[dst], want[src]), (name, src, dst)
        assert not got[4].any()  # untouched blocks stay as they were


@pytest.mark.parametrize("staging_slots", [1, 2, 64], ids=["one block a batch", "two", "all at once"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staged_copies_fill_slots_byte_for_byte_as_direct_copies_do(layout, staging_slots):
    """A slot written on a GPU host is read on CPU hosts and the other way round: the
    batched gather must lay each slot out exactly as the per-run copies do, whatever
    batches its staging buffer splits the copy into."""
    torch.manual_seed(1)
    kv = {f"model.layers.{i}.attn": LAYOUTS[layout]() for i in range(3)}
    direct = PagedKVCopier(kv, NUM_BLOCKS, staged=False)
    staged = PagedKVCopier(kv, NUM_BLOCKS, staged=True, staging_bytes=staging_slots * direct.slot_bytes)
    blocks, slots = [11, 3, 4, 5, 0, 9, 1], [6, 7, 0, 1, 2, 3, 5]
    want = CpuBuffer(8, direct.slot_bytes, pin_memory=False)
    got = CpuBuffer(8, direct.slot_bytes, pin_memory=False)
    got.tensor.fill_(0xAB)  # poisoned: a slot the gather skipped would show
    direct.to_slots(blocks, slots, want)
    staged.to_slots(blocks, slots, got)
    for slot in slots:
        assert torch.equal(got.tensor[slot], want.tensor[slot]), slot
    assert (got.tensor[4] == 0xAB).all()  # a slot outside the copy is left alone

    targets = [0, 2, 6, 7, 8, 10, 11]
    expected = {name: t.clone() for name, t in kv.items()}
    for name, tensor in expected.items():
        dim = next(d for d, s in enumerate(tensor.shape) if s == NUM_BLOCKS)
        direct_view = tensor.movedim(dim, 0)
        for src, dst in zip(blocks, targets, strict=True):
            direct_view[dst] = kv[name].movedim(dim, 0)[src]
    staged.from_slots(slots, targets, got)
    for name in kv:
        assert torch.equal(kv[name], expected[name]), name


def test_copier_refuses_tensors_without_a_block_dimension():
    with pytest.raises(ValueError, match="block count"):
        PagedKVCopier({"l0": torch.zeros(5, 7)}, NUM_BLOCKS)


BLOCK = 32
PAGE = 4096


def spec(rank: int, tp: int) -> KVSpec:
    return KVSpec(
        "m", "", "float32", "auto", BLOCK, "cpu::FullAttentionSpec", 2, 2, 16, tp, rank, "t", 2 * PAGE
    )


def kv_cache_config():
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=PAGE), layer_names=["a", "b"])
    return SimpleNamespace(kv_cache_groups=[group], num_blocks=64)


def make_scheduler(
    tp: int = 1, capacity_slots: int = 8, kv_in_host_memory: bool = False, **config
) -> TierCacheScheduler:
    cfg = build_config({"cpu": {"capacity": capacity_slots * 2 * PAGE}, **config})
    specs = [spec(r, tp) for r in range(tp)]
    return TierCacheScheduler(
        cfg, specs, kv_cache_config(), worker_count=tp, kv_in_host_memory=kv_in_host_memory
    )


def request(req_id: str, n_blocks: int, extra_tokens: int = 1):
    tokens = n_blocks * BLOCK + extra_tokens
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=[bytes([i]) * 32 for i in range(tokens // BLOCK)],
        num_tokens=tokens,
        num_prompt_tokens=tokens,
    )


def filled(op):
    return (FILLED, (op.block_hash, op.slot))


def store_prompt(sched, req, gpu_ids):
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks_of(gpu_ids), 0)
    new = new_request(req, gpu_ids)
    return sched.build_connector_meta(scheduler_output([new], scheduled={req.request_id: req.num_tokens}))


def test_a_block_counts_as_cached_only_after_every_rank_filled_it():
    sched = make_scheduler(tp=2)
    req = request("r1", 3)
    meta = store_prompt(sched, req, [10, 11, 12, 13])
    assert [op.gpu_block for op in meta.stores] == [10, 11, 12]
    first = meta.stores[0]
    report(sched, filled(first), rank=0)
    assert sched.get_num_new_matched_tokens(request("r2", 3), 0) == (0, False)
    report(sched, filled(first), rank=0)  # the same rank again is not the other rank
    assert sched.get_num_new_matched_tokens(request("r2", 3), 0) == (0, False)
    report(sched, filled(first), rank=1)
    assert sched.get_num_new_matched_tokens(request("r3", 3), 0) == (BLOCK, False)


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    sched = make_scheduler()
    req = request("r1", 3, extra_tokens=0)  # exactly three full blocks
    meta = store_prompt(sched, req, [1, 2, 3])
    report(sched, *[filled(op) for op in meta.stores])
    again = request("r2", 3, extra_tokens=0)
    assert sched.get_num_new_matched_tokens(again, 0) == (2 * BLOCK, False)


def plan_cpu_hit(sched) -> None:
    """r1's two blocks stored in the CPU tier, then r2 asking for them: vLLM allocated
    paged blocks 20-22 for r2, and the next step loads its hit into 20 and 21."""
    meta = store_prompt(sched, request("r1", 2), [5, 6, 7])
    report(sched, *[filled(op) for op in meta.stores], *[(RELEASED, op.slot) for op in meta.stores])
    hit = request("r2", 2)
    assert sched.get_num_new_matched_tokens(hit, 0) == (2 * BLOCK, False)
    sched.update_state_after_alloc(hit, blocks_of([20, 21, 22]), 2 * BLOCK)


def test_cpu_hit_is_a_sync_load_that_pins_and_releases_slots():
    sched = make_scheduler()
    plan_cpu_hit(sched)
    load_meta = sched.build_connector_meta(scheduler_output())
    (job,) = load_meta.loads
    assert not job.is_async and [op.gpu_block for op in job.ops] == [20, 21]
    assert [op.tier for op in job.ops] == ["cpu", "cpu"]
    # Pinned: a flood of new stores cannot take these slots until they are released.
    assert all(sched.slots._pins.get(op.slot) for op in job.ops)
    report(sched, *[(RELEASED, op.slot) for op in job.ops])
    assert not any(sched.slots._pins.get(op.slot) for op in job.ops)


@pytest.mark.parametrize(
    "field, value",
    [(None, None), ("new_block_ids_to_zero", [20]), ("kv_cache_block_copies", [(3, 20)])],
    ids=["plain step", "vllm zeroes new blocks", "vllm copies a shared tail"],
)
def test_a_cpu_hit_may_start_copying_early_only_where_vllm_writes_no_block_first(field, value):
    sched = make_scheduler()
    plan_cpu_hit(sched)
    step = scheduler_output()
    if field is not None:
        setattr(step, field, value)
    load_meta = sched.build_connector_meta(step)
    assert len(load_meta.loads) == 1
    assert load_meta.loads_early is (field is None)


def test_disk_hit_is_async_and_failed_fill_is_forgotten():
    sched = make_scheduler(disk={"path": "/tmp/tiercache-unit-disk-never-created"})
    meta = store_prompt(sched, request("r1", 2), [5, 6, 7])
    hashes = [op.block_hash for op in meta.stores]
    report(sched, *[(ON_DISK, h) for h in hashes], *[(RELEASED, op.slot) for op in meta.stores])
    sched.slots.clear()  # as if the CPU tier had evicted them
    hit = request("r2", 2)
    assert sched.get_num_new_matched_tokens(hit, 0) == (2 * BLOCK, True)
    sched.update_state_after_alloc(hit, blocks_of([30, 31, 32]), 2 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    assert job.is_async and [op.tier for op in job.ops] == ["disk", "disk"]
    report(sched, (FILL_FAILED, (hashes[0], job.ops[0].slot)), filled(job.ops[1]))
    assert hashes[0] not in sched.slots and hashes[1] in sched.policy.ready


DISK_ROOT = "/tmp/tiercache-unit-disk-never-created"


@pytest.mark.parametrize("load_in_forward", [True, False])
def test_with_the_kv_in_host_memory_a_disk_hit_is_read_in_the_forward_through_no_slot(load_in_forward):
    sched = make_scheduler(
        capacity_slots=2, kv_in_host_memory=True, disk={"path": DISK_ROOT, "load_in_forward": load_in_forward}
    )
    req = request("r1", 4)
    hashes = [bytes(h) for h in req.block_hashes]
    for h in hashes:
        sched.policy.on_disk[h] = None
    if not load_in_forward:  # staged as on a GPU: async, cut to the two free slots
        assert sched.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, True)
        return
    # Synchronous, and not cut to the CPU tier's two slots: no slot is needed.
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, False)
    sched.update_state_after_alloc(req, blocks_of(range(10, 15)), 4 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    assert not job.is_async
    assert [(op.tier, op.slot, op.gpu_block) for op in job.ops] == [("disk", -1, g) for g in range(10, 14)]
    assert sched.slots.pinned() == 0 and sched.gauges()["loads_in_flight"] == 0
    # A block whose read failed is not offered again: the hit stops before it.
    report(sched, (READ_FAILED, hashes[2]))
    assert sched.get_num_new_matched_tokens(request("r2", 4), 0) == (2 * BLOCK, False)


def test_with_the_kv_in_host_memory_a_hit_with_s3_blocks_is_still_staged():
    sched = make_scheduler(kv_in_host_memory=True, disk={"path": DISK_ROOT})
    req = request("r1", 3)
    hashes = [bytes(h) for h in req.block_hashes]
    sched.policy.on_disk[hashes[0]] = None
    sched.s3_index = SimpleNamespace(longest_prefix=lambda model, ranks, wanted: len(wanted))
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(req, blocks_of(range(10, 14)), 3 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    assert (
        job.is_async and [(op.tier, op.slot >= 0) for op in job.ops] == [("disk", True)] + [("s3", True)] * 2
    )


def test_a_lower_tier_hit_is_cut_to_the_cpu_slots_transfers_leave_free():
    sched = make_scheduler(capacity_slots=4, disk={"path": "/tmp/tiercache-unit-disk-never-created"})
    req = request("r1", 6)
    for h in req.block_hashes:  # all six blocks on disk, none in the CPU tier
        sched.policy.on_disk[bytes(h)] = None
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True)  # 4 slots, 4 blocks
    held = [sched.slots.allocate(f"busy{i}")[0] for i in range(3)]  # 3 slots mid-transfer
    assert sched.get_num_new_matched_tokens(req, 0) == (1 * BLOCK, True)
    sched.update_state_after_alloc(req, blocks_of(range(10, 17)), 1 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    assert [(op.tier, op.slot >= 0) for op in job.ops] == [("disk", True)]  # nothing planned to fail
    # Every slot is pinned now (3 busy, 1 staging r1's block): no room past the block
    # r1 stages, which r2 shares (it needs no slot of its own).
    assert sched.get_num_new_matched_tokens(request("r2", 6), 0) == (1 * BLOCK, True)
    for slot in held:
        sched.slots.unpin(slot)
    assert sched.get_num_new_matched_tokens(request("r3", 6), 0) == (4 * BLOCK, True)


def test_cpu_blocks_a_write_through_pins_are_not_counted_twice_against_the_room():
    sched = make_scheduler(capacity_slots=4, disk={"path": "/tmp/tiercache-unit-disk-never-created"})
    req = request("r1", 5)
    hashes = [bytes(h) for h in req.block_hashes]
    for h in hashes[:2]:  # stored by an earlier request, still being written down
        sched.slots.allocate(h)
        sched.policy.ready.add(h)
    for h in hashes[2:4]:
        sched.policy.on_disk[h] = None
    # Two slots are free for the two disk blocks: the whole prefix is a hit.
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True)


def test_preempted_request_resumes_with_new_block_ids():
    sched = make_scheduler()
    req = request("r1", 4)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks_of([1, 2, 3, 4, 5]), 0)
    new = new_request(req, [1, 2, 3, 4, 5])  # a chunked prefill: two blocks this step
    first = sched.build_connector_meta(scheduler_output([new], scheduled={"r1": 2 * BLOCK}))
    assert [op.gpu_block for op in first.stores] == [1, 2]
    # Preempted, then resumed with other blocks: the rest is stored from the new ones.
    cached = SimpleNamespace(
        req_ids=["r1"],
        resumed_req_ids={"r1"},
        new_block_ids=[([7, 8, 9, 10, 11],)],
        num_computed_tokens=[2 * BLOCK],
    )
    second = sched.build_connector_meta(scheduler_output(cached=cached, scheduled={"r1": 2 * BLOCK + 1}))
    assert [op.gpu_block for op in second.stores] == [9, 10]


def test_write_back_demotes_the_victim_of_an_eviction():
    sched = make_scheduler(capacity_slots=2, movers={"policy": "write_back"})
    meta = store_prompt(sched, request("r1", 2), [1, 2, 3])
    report(sched, *[filled(op) for op in meta.stores], *[(RELEASED, op.slot) for op in meta.stores])
    other = request("r2", 1)
    other.block_hashes = [b"\xee" * 32, b"\xef" * 32]
    meta2 = store_prompt(sched, other, [8, 9])
    assert meta2.write_backs and meta2.write_backs[0][0] == meta.stores[0].block_hash


def test_inside_vllm_tiercache_logs_through_vllms_logging(capsys):
    import logging

    from vllm.config import LoggingConfig
    from vllm.logger import configure_logging

    from tiercache.connector.connector import log_through_vllm

    ours = logging.getLogger("tiercache")
    saved = ours.handlers[:], ours.propagate, ours.level
    try:
        configure_logging(LoggingConfig(log_level="INFO"))  # what an engine does at start
        log_through_vllm()
        log_through_vllm()  # once only, however many connectors are built
        logging.getLogger("tiercache.connector").info("tiers ready: %d slots", 7)
        logging.getLogger("tiercache.connector").debug("not at INFO")
    finally:  # later tests capture tiercache's records at the root logger
        ours.handlers[:], ours.propagate = saved[0], saved[1]
        ours.setLevel(saved[2])
    err = capsys.readouterr()
    printed = err.out + err.err
    assert printed.count("tiers ready: 7 slots") == 1 and "not at INFO" not in printed

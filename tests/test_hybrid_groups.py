"""Per-group planning for hybrid models (several KV cache groups), without an engine:
what each group must hold for a hit, which blocks each group stores, and which
blocks of which group a hit loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiercache.config import build_config
from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.groups import FULL, NONE, STATE, WINDOW, GroupRule, best_end, group_key, group_rules
from tiercache.connector.metadata import FILLED
from tiercache.connector.scheduler import TierCacheScheduler, slot_bytes_for
from tiercache.index.keys import KVSpec
from tiercache.tiers.cpu import CpuBuffer

from support.scheduler_steps import report, scheduler_output

BLOCK = 32


def test_what_a_hit_needs_from_each_kind_of_group():
    assert GroupRule(FULL).needs(2, 9, BLOCK) == range(2, 9)
    # The next token's window reaches back 63 tokens: blocks 7 and 8.
    assert GroupRule(WINDOW, sliding_window=64).needs(0, 9, BLOCK) == range(7, 9)
    assert GroupRule(WINDOW, sliding_window=128).needs(0, 9, BLOCK) == range(5, 9)
    # Blocks vLLM already holds are never loaded again.
    assert GroupRule(WINDOW, sliding_window=128).needs(7, 9, BLOCK) == range(7, 9)
    assert GroupRule(STATE).needs(0, 9, BLOCK) == range(8, 9)
    assert GroupRule(NONE).needs(0, 9, BLOCK) == range(0)


def test_the_hit_is_as_long_as_every_group_can_serve():
    full, window, state = GroupRule(FULL), GroupRule(WINDOW, sliding_window=64), GroupRule(STATE)

    def holding(*held):
        return lambda group, index: index in held[group]

    everything = set(range(9))
    assert best_end([full, window], 0, 9, BLOCK, holding(everything, everything)) == 9
    # The window group lost block 8: a hit ending at 8 needs only its blocks 6 and 7.
    assert best_end([full, window], 0, 9, BLOCK, holding(everything, everything - {8})) == 8
    # Window blocks far before the end are never needed.
    assert best_end([full, window], 0, 9, BLOCK, holding(everything, {7, 8})) == 9
    # A state only where a prefill stopped: the hit ends there.
    assert best_end([full, state], 0, 9, BLOCK, holding(everything, {5})) == 6
    assert best_end([full, state], 0, 9, BLOCK, holding(everything, set())) == 0
    assert best_end([full, state], 0, 9, BLOCK, holding(set(range(4)), {5, 8})) == 0
    assert best_end([full, GroupRule(NONE)], 0, 9, BLOCK, holding(everything, everything)) == 0


def test_group_zero_keeps_vllms_hash_and_the_others_differ():
    block = bytes(range(32))
    assert group_key(block, 0) == block
    keys = {group_key(block, g) for g in range(3)}
    assert len(keys) == 3 and all(len(key) == 32 for key in keys)


def spec(kind: str):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    common = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float32}
    if kind == FULL:
        return FullAttentionSpec(**common)
    if kind == WINDOW:
        return SlidingWindowSpec(**common, sliding_window=64)
    return MambaSpec(
        block_size=BLOCK,
        shapes=((3, 16), (2, 8, 8)),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=8192,
        mamba_cache_mode="align",
    )


def hybrid_scheduler(*kinds: str, slots: int = 64) -> TierCacheScheduler:
    groups = [
        SimpleNamespace(kv_cache_spec=spec(kind), layer_names=[f"{kind}.0", f"{kind}.1"]) for kind in kinds
    ]
    kv_cache_config = SimpleNamespace(kv_cache_groups=groups, num_blocks=256)
    page = slot_bytes_for(kv_cache_config)
    cfg = build_config({"cpu": {"capacity": slots * page}})
    rank = KVSpec("m", "", "float32", "auto", BLOCK, "cpu::hybrid", 4, 2, 16, 1, 0, "t", 2 * page)
    return TierCacheScheduler(cfg, [rank], kv_cache_config, worker_count=1)


def request(req_id: str, tokens: int):
    hashes = [bytes([i]) * 32 for i in range(tokens // BLOCK)]
    return SimpleNamespace(
        request_id=req_id, block_hashes=hashes, num_tokens=tokens, num_prompt_tokens=tokens
    )


def store(sched, req, tables, scheduled: int):
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: tables), 0)
    new = SimpleNamespace(req_id=req.request_id, block_ids=tables, num_computed_tokens=0)
    meta = sched.build_connector_meta(scheduler_output([new], scheduled={req.request_id: scheduled}))
    report(sched, *[(FILLED, (op.block_hash, op.slot)) for op in meta.stores])
    return meta


def test_each_group_stores_its_own_blocks_under_its_own_name():
    sched = hybrid_scheduler(FULL, WINDOW)
    assert [rule.kind for rule in sched.group_rules] == [FULL, WINDOW]
    req = request("r1", 9 * BLOCK + 11)
    full_ids, window_ids = list(range(10, 20)), list(range(40, 50))
    meta = store(sched, req, (full_ids, window_ids), req.num_tokens)
    by_block = {op.gpu_block: op.block_hash for op in meta.stores}
    assert sorted(by_block) == full_ids[:9] + window_ids[:9]
    assert by_block[10] == req.block_hashes[0] and by_block[40] == group_key(req.block_hashes[0], 1)


def test_a_hit_loads_every_full_block_and_only_the_windows_last_ones():
    sched = hybrid_scheduler(FULL, WINDOW)
    store(sched, request("r1", 9 * BLOCK + 11), (list(range(10, 20)), list(range(40, 50))), 9 * BLOCK + 11)
    again = request("r2", 9 * BLOCK + 5)
    # Asynchronous, even from the CPU tier: only then can a failure be reported.
    assert sched.get_num_new_matched_tokens(again, 0) == (9 * BLOCK, True)
    # vLLM's table for the window group: null blocks before the window.
    tables = (list(range(60, 70)), [0] * 7 + [77, 78, 79])
    sched.update_state_after_alloc(again, SimpleNamespace(get_block_ids=lambda: tables), 9 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    assert job.is_async
    assert [op.gpu_block for op in job.ops] == [60, 61, 62, 63, 64, 65, 66, 67, 77, 68, 78]
    assert all(op.tier == "cpu" for op in job.ops)


def test_a_window_block_lost_cuts_the_hit_to_where_the_window_is_whole():
    sched = hybrid_scheduler(FULL, WINDOW)
    req = request("r1", 9 * BLOCK + 11)
    store(sched, req, (list(range(10, 20)), list(range(40, 50))), req.num_tokens)
    sched.policy.fill_failed(
        group_key(req.block_hashes[8], 1), sched.slots.slot_of(group_key(req.block_hashes[8], 1))
    )
    assert sched.get_num_new_matched_tokens(request("r2", 9 * BLOCK + 5), 0) == (8 * BLOCK, True)


@pytest.mark.parametrize("scheduled, states", [(9 * BLOCK, [48]), (9 * BLOCK + 11, [])])
def test_a_state_is_stored_only_where_a_step_ends_on_a_block_boundary(scheduled, states):
    sched = hybrid_scheduler(STATE, FULL)
    req = request("r1", 9 * BLOCK + 11)
    meta = store(sched, req, ([0] * 8 + [48, 49], list(range(10, 20))), scheduled)
    assert sorted(op.gpu_block for op in meta.stores if op.gpu_block >= 40) == states
    hit = sched.get_num_new_matched_tokens(request("r2", 9 * BLOCK + 5), 0)
    assert hit == ((9 * BLOCK, True) if states else (0, False))


def test_rules_come_from_vllms_specs():
    groups = [SimpleNamespace(kv_cache_spec=spec(kind), layer_names=["x"]) for kind in (FULL, WINDOW, STATE)]
    rules = group_rules(SimpleNamespace(kv_cache_groups=groups), BLOCK)
    assert [rule.kind for rule in rules] == [FULL, WINDOW, STATE] and rules[1].sliding_window == 64
    # Blocks of another size than vLLM's hashes cannot be matched block for block.
    assert group_rules(SimpleNamespace(kv_cache_groups=groups), 2 * BLOCK)[0].kind == NONE


NUM_BLOCKS = 8


def overlaid_kv():
    """Two groups of two layers over one allocation, as vLLM's hybrid manager lays
    them out: an attention layer of one group and a Mamba layer's state tensors (conv
    and ssm, side by side in a page) of the other view the same pages."""
    page_floats = 64
    memory = [torch.randn(NUM_BLOCKS * page_floats) for _ in range(2)]
    kv = {}
    for i, flat in enumerate(memory):
        pages = flat.view(NUM_BLOCKS, page_floats)
        kv[f"layers.{2 * i + 1}.attn"] = pages.view(NUM_BLOCKS, 2, 32)
        kv[f"layers.{2 * i}.linear"] = [pages[:, :16], pages[:, 16:48]]
    return kv, memory


def test_a_slot_holds_one_block_of_whichever_group_owns_it():
    kv, memory = overlaid_kv()
    copier = PagedKVCopier(kv, NUM_BLOCKS)
    assert copier.aliased and len(copier.regions) == 2 and copier.slot_bytes == 2 * 64 * 4
    assert copier.region_of["layers.1.attn"] == copier.region_of["layers.0.linear"]
    copier.check_groups([["layers.0.linear", "layers.2.linear"], ["layers.1.attn", "layers.3.attn"]])
    buffer = CpuBuffer(4, copier.slot_bytes)
    want = [flat.view(NUM_BLOCKS, 64)[5].clone() for flat in memory]
    copier.to_slots([5], [2], buffer)
    for flat in memory:
        flat.view(NUM_BLOCKS, 64)[5] = 0
    copier.from_slots([2], [3], buffer)
    for flat, page in zip(memory, want, strict=True):
        assert torch.equal(flat.view(NUM_BLOCKS, 64)[3], page)  # every layer's page, padding too
        assert not flat.view(NUM_BLOCKS, 64)[5].any()  # nothing else written


def cpu_build_qwen3_next_kv():
    """Qwen3-Next's KV as vLLM's CPU build registers it (scaled down): per pair of
    layers one byte allocation of pages; the full-attention layer a bf16 tensor
    `(blocks, heads, block size, 2 * head dim)` filling each page, the linear-attention
    layer one int8 tensor `(blocks, 1, 1, state bytes)` over only the start of each
    page (its state; the rest is padding)."""
    page, state = 256, 100
    memory = [torch.randint(-128, 128, (NUM_BLOCKS * page,), dtype=torch.int8) for _ in range(2)]
    kv = {}
    for i, flat in enumerate(memory):
        kv[f"layers.{2 * i + 1}.attn"] = flat.view(torch.bfloat16).view(NUM_BLOCKS, 2, 4, 16)
        kv[f"layers.{2 * i}.linear"] = flat.as_strided((NUM_BLOCKS, 1, 1, state), (page, state, state, 1))
    return kv, [flat.view(NUM_BLOCKS, page) for flat in memory]


def test_a_linear_attention_state_view_smaller_than_the_page_it_shares_copies_whole_pages():
    kv, pages = cpu_build_qwen3_next_kv()
    copier = PagedKVCopier(kv, NUM_BLOCKS)
    copier.check_groups([["layers.0.linear", "layers.2.linear"], ["layers.1.attn", "layers.3.attn"]])
    assert copier.slot_bytes == 2 * 256
    buffer = CpuBuffer(4, copier.slot_bytes)
    want = [layer[5].clone() for layer in pages]
    copier.to_slots([5], [1], buffer)
    for layer in pages:
        layer[5] = 0
    copier.from_slots([1], [2], buffer)
    for layer, page in zip(pages, want, strict=True):
        assert torch.equal(layer[2], page)  # the state and the attention block alike
        assert not layer[5].any()


def test_a_layer_that_reaches_past_the_page_it_shares_is_refused():
    kv, _ = cpu_build_qwen3_next_kv()
    flat = torch.zeros(NUM_BLOCKS * 256 + 64, dtype=torch.int8)  # room past the last page
    kv["layers.1.attn"] = flat[: NUM_BLOCKS * 256].view(torch.bfloat16).view(NUM_BLOCKS, 2, 4, 16)
    kv["layers.0.linear"] = flat.as_strided((NUM_BLOCKS, 1, 1, 300), (256, 300, 300, 1))
    with pytest.raises(ValueError, match="layers.0.linear .*reaches past the 256-byte page"):
        PagedKVCopier(kv, NUM_BLOCKS)


def test_groups_that_do_not_overlay_layer_for_layer_are_refused():
    kv, _ = overlaid_kv()
    kv["layers.4.attn"] = torch.zeros(NUM_BLOCKS, 2, 32)  # a third region, in one group only
    copier = PagedKVCopier(kv, NUM_BLOCKS)
    with pytest.raises(ValueError, match="does not overlay"):
        copier.check_groups(
            [["layers.0.linear", "layers.2.linear"], ["layers.1.attn", "layers.3.attn", "layers.4.attn"]]
        )


def test_kv_events_name_each_groups_block_by_vllms_hash_and_its_group():
    from tiercache.connector.events import TierEvents

    sched = hybrid_scheduler(FULL, WINDOW)
    events = TierEvents(sched.policy, BLOCK, publish=True, presence=None, hybrid=True)
    sched.policy.watcher = events
    block = bytes([7]) * 32
    for group in (0, 1):
        events.name(group_key(block, group), block, group)
        sched.policy.stored_on_disk(group_key(block, group))
    sched.policy.stored_on_disk(bytes([9]) * 32)  # never named (found on disk at start): not published
    stored = events.take()
    # One event per block, both under vLLM's hash (as vLLM publishes it), each with its group.
    assert [e.group_idx for e in stored] == [0, 1]
    assert stored[0].block_hashes == stored[1].block_hashes


def test_a_hit_whose_group_vllm_gave_no_block_is_planned_lost_and_pins_nothing():
    sched = hybrid_scheduler(FULL, WINDOW)
    store(sched, request("r1", 9 * BLOCK + 11), (list(range(10, 20)), list(range(40, 50))), 9 * BLOCK + 11)
    again = request("r2", 9 * BLOCK + 5)
    assert sched.get_num_new_matched_tokens(again, 0) == (9 * BLOCK, True)
    tables = (list(range(60, 70)), [0] * 10)  # (never so in vLLM: a window with no blocks)
    pinned = sched.slots.pinned()  # the stores' copies, not reported done here
    sched.update_state_after_alloc(again, SimpleNamespace(get_block_ids=lambda: tables), 9 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    assert job.ops and all(op.tier == "" and op.slot < 0 for op in job.ops)
    assert sched.slots.pinned() == pinned


def test_a_failed_step_fails_a_hybrid_models_load_by_request_never_by_block(tmp_path):
    """vLLM raises on block-level load failures once a model has several KV cache
    groups (block ids repeat across groups). A step the hook guard settles as a miss
    fails its hybrid loads by request (failed_recving), so vLLM recomputes them; before,
    the guard's path reported their blocks and vLLM's scheduler raised."""
    from tiercache.connector.metadata import BlockOp, LoadJob, TierCacheMetadata
    from tiercache.connector.worker import TierCacheWorker

    kv, _ = overlaid_kv()
    groups = [["layers.0.linear", "layers.2.linear"], ["layers.1.attn", "layers.3.attn"]]
    slot_bytes = 2 * 64 * 4
    spec = KVSpec("m", "", "float32", "auto", BLOCK, "cpu", 4, 2, 8, 1, 0, "t", slot_bytes)
    config = build_config(
        {"cpu": {"capacity": 8 * slot_bytes}, "disk": {"path": str(tmp_path / "disk")}}, environ={}
    )
    worker = TierCacheWorker(
        config,
        spec,
        "d" * 16,
        NUM_BLOCKS,
        tp_rank=0,
        writes_lower_tiers=True,
        disk_share=0,
        group_layers=groups,
    )
    worker.register_kv_caches(kv, slot_bytes)
    try:
        assert worker._loads.ends.fails_whole_requests
        ops = [BlockOp(b"h" * 32, 3, 2, "disk"), BlockOp(b"i" * 32, 4, 3, "disk")]
        job = LoadJob("r", ops, is_async=True)
        meta = TierCacheMetadata(loads=[job])
        worker.fail_step(meta)
        assert worker.take_failed_blocks() == set()
        assert worker.take_failed_requests() == {"r"}
        assert "r" in worker.get_finished()
    finally:
        worker.shutdown()

"""The peer tier for a hybrid model (two KV cache groups: full attention and a sliding
window), through the connector: two instances (`HybridDriver`s, each the scheduler and
worker halves of one engine) and a real Redis, the blocks read over NIXL (UCX on
loopback). Presence lists the full-attention group's blocks only; the window group's
blocks at the same indexes are planned from the same holder, and one it lacks is a
verified miss that fails the request's load whole (recomputed), never other bytes."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from tiercache.connector.driver import BLOCK_SIZE
from tiercache.tiers import CPU, PEER

from support.hybrid_driver import HybridDriver, keys
from support.nixl import needs_nixl
from support.peer_instance import BLOCK, config
from support.redis_commands import commands_sent

pytestmark = needs_nixl

BLOCKS = 6
FULL, WINDOW = 0, 1


@pytest.fixture
def model():
    return uuid.uuid4().hex


def instance(redis_url: str, name: str, model: str) -> HybridDriver:
    return HybridDriver(config(redis_url, name), BLOCK, model=model, num_blocks=2 * (BLOCKS + 1) + 2)


def blocks(seed: int) -> tuple[list[bytes], list[list[bytes]]]:
    """Block hashes, and per group the pages a forward computes for them."""
    rng = np.random.default_rng(seed)
    hashes = [rng.bytes(32) for _ in range(BLOCKS)]
    return hashes, [[rng.bytes(BLOCK) for _ in range(BLOCKS)] for _ in range(2)]


def computed(driver: HybridDriver, hashes: list[bytes], pages: list[list[bytes]]) -> None:
    """`driver` computes and stores both groups' blocks, and says so in Redis."""
    served = driver.serve_groups(hashes, pages)
    assert not any(t for group in served.tiers for t in group)
    driver.deliver_reports()
    for group in (FULL, WINDOW):
        assert all(key in driver.policy.ready for key in keys(hashes, group))
    assert driver.scheduler.tier_events.presence.flush()


def request(hashes: list[bytes], req_id: str = "waiting") -> SimpleNamespace:
    tokens = len(hashes) * BLOCK_SIZE + 1
    return SimpleNamespace(
        request_id=req_id, block_hashes=hashes, num_tokens=tokens, num_prompt_tokens=tokens
    )


def test_a_hybrid_prefix_one_instance_computed_is_loaded_by_another_from_its_cpu_tier(redis_url, model):
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        assert b.scheduler.peers is not None, "the peer tier is on for a hybrid model"
        hashes, pages = blocks(1)
        computed(a, hashes, pages)
        served = b.serve_groups(hashes)
        assert not served.failed
        # Every full-attention block; the window's last two only (its window at the end).
        assert served.tiers[FULL] == [PEER] * BLOCKS
        assert served.tiers[WINDOW] == [None] * (BLOCKS - 2) + [PEER] * 2
        assert [bytes(kv) for kv in served.kv[FULL]] == pages[FULL]
        assert [bytes(kv) for kv in served.kv[WINDOW][-2:]] == pages[WINDOW][-2:]
        assert b.worker.stats.data.get("loaded_blocks_peer") == BLOCKS + 2
        # Staged into b's own CPU tier: its next request is a local hit.
        b.deliver_reports()
        again = b.serve_groups(hashes)
        assert again.tiers[FULL] == [CPU] * BLOCKS and again.tiers[WINDOW][-2:] == [CPU] * 2
        assert a.worker.stats.data.get("loaded_blocks_peer") is None
    finally:
        b.close()
        a.close()


def test_a_waiting_hybrid_request_asks_redis_for_its_peer_once(redis_url, model):
    """vLLM asks about a waiting request every step: presence's answer is reused."""
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        hashes, pages = blocks(2)
        computed(a, hashes, pages)
        matched = BLOCKS * BLOCK_SIZE
        assert b.scheduler.get_num_new_matched_tokens(request(hashes), 0) == (matched, True)
        assert b.scheduler._lookups["waiting"].peer == "a"
        sent = commands_sent(b.scheduler.redis.client)
        for _ in range(3):
            assert b.scheduler.get_num_new_matched_tokens(request(hashes), 0) == (matched, True)
        assert sent == []
    finally:
        b.close()
        a.close()


def test_a_window_block_the_holder_lacks_fails_the_load_whole_and_is_not_planned_from_it_again(
    redis_url, model
):
    """Presence says the holder has the full-attention blocks, but its CPU tier has
    since reused the slot of the window's last block (its bytes overwritten, its row
    gone). The reader's load misses that block, so the whole request is recomputed
    (never the other bytes), and the next lookup plans that block from nowhere."""
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        hashes, pages = blocks(3)
        computed(a, hashes, pages)
        lost = keys(hashes, WINDOW)[-1]
        slot = a.slots.slot_of(lost)
        a.worker.peer.tier.retire(slot)
        a.buffer.tensor[slot].numpy()[:] = 0xAB
        served = b.serve_groups(hashes)  # a request that only loads: nothing computed, nothing stored
        assert served.failed
        assert served.tiers[WINDOW][-1] == PEER  # planned from the holder, then missed
        assert b.worker.stats.data.get("failed_blocks_peer", 0) >= 1
        b.deliver_reports()
        assert lost in b.scheduler.load_failures
        b.scheduler.get_num_new_matched_tokens(request(hashes, "next"), 0)
        plan = b.scheduler._lookups["next"].plan
        assert (WINDOW, BLOCKS - 1, PEER) not in plan
        assert all(index != BLOCKS - 1 or group != WINDOW for group, index, _ in plan)
        b.scheduler._lookups.clear()
        # Computed instead, by a request that computes: exactly its own bytes.
        served = b.serve_groups(hashes, pages)
        assert not served.failed
        assert [bytes(kv) for kv in served.kv[WINDOW]] == pages[WINDOW]
        assert [bytes(kv) for kv in served.kv[FULL]] == pages[FULL]
    finally:
        b.close()
        a.close()


def test_a_holder_that_lost_the_window_block_makes_the_whole_request_compute_its_own_bytes(redis_url, model):
    """Under vLLM the failed load is followed by the request's computing: the paged KV
    holds what it computed, with no byte of the failed load left in any group."""
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        hashes, pages = blocks(4)
        computed(a, hashes, pages)
        slot = a.slots.slot_of(keys(hashes, WINDOW)[-2])
        a.worker.peer.tier.retire(slot)
        mine = [[bytes([7 + g]) * BLOCK for _ in range(BLOCKS)] for g in range(2)]
        served = b.serve_groups(hashes, mine)
        assert served.failed
        assert [bytes(kv) for kv in served.kv[FULL]] == mine[FULL]
        assert [bytes(kv) for kv in served.kv[WINDOW]] == mine[WINDOW]
    finally:
        b.close()
        a.close()


def test_a_window_block_missing_before_the_full_attention_run_ends_is_read_from_the_peer(redis_url, model):
    """b loaded a hit of 6 blocks (the window's blocks 4 and 5 only); a prompt sharing
    5 of them needs the window's blocks 3 and 4: its block 3 comes from the peer,
    the rest from b's own CPU tier."""
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        hashes, pages = blocks(5)
        computed(a, hashes, pages)
        assert not b.serve_groups(hashes).failed
        b.deliver_reports()
        served = b.serve_groups(hashes[:5])
        assert not served.failed
        assert served.tiers[FULL] == [CPU] * 5
        assert served.tiers[WINDOW] == [None, None, None, PEER, CPU]
        assert [bytes(kv) for kv in served.kv[FULL]] == pages[FULL][:5]
        assert [bytes(kv) for kv in served.kv[WINDOW][3:]] == pages[WINDOW][3:5]
    finally:
        b.close()
        a.close()


def test_a_state_group_is_planned_from_the_peer_only_where_its_run_ends(redis_url, model):
    """A linear-attention (Mamba) state is kept only where a prefill stopped: of the
    holder's run, only its last block's state is planned from it, so the hit ends
    there; the full-attention blocks before it come from the holder too."""
    from test_hybrid_groups import spec as vllm_spec

    from tiercache.config import build_config
    from tiercache.connector.groups import FULL as FULL_KIND
    from tiercache.connector.groups import STATE as STATE_KIND
    from tiercache.connector.scheduler import TierCacheScheduler, slot_bytes_for
    from tiercache.index.keys import KVSpec
    from tiercache.index.presence import PresencePublisher
    from tiercache.index.redis_conn import GuardedRedis

    from support.redis_config import PATIENT

    groups = [
        SimpleNamespace(kv_cache_spec=vllm_spec(kind), layer_names=[f"{kind}.0"])
        for kind in (FULL_KIND, STATE_KIND)
    ]
    kv_cache_config = SimpleNamespace(kv_cache_groups=groups, num_blocks=64)
    page = slot_bytes_for(kv_cache_config)
    settings = {
        "cpu": {"capacity": 32 * page},
        "redis_url": redis_url,
        "instance_id": "b",
        "peer": {"enabled": True},
    }
    rank = KVSpec(model, "", "float32", "auto", 32, "cpu::hybrid", 2, 2, 16, 1, 0, "t", page)
    sched = TierCacheScheduler(build_config(settings, environ={}), [rank], kv_cache_config, worker_count=1)
    holder = PresencePublisher(GuardedRedis(redis_url, PATIENT), sched.model_digest, "a")
    try:
        hashes = [bytes([i]) * 32 for i in range(8)]
        for block in hashes[:5]:  # the holder's run: 5 of the request's 8 blocks
            holder.update(block, CPU, True)
        assert holder.flush()
        req = SimpleNamespace(
            request_id="r", block_hashes=hashes, num_tokens=8 * 32 + 1, num_prompt_tokens=8 * 32 + 1
        )
        assert sched.get_num_new_matched_tokens(req, 0) == (5 * 32, True)
        lookup = sched._lookups["r"]
        assert lookup.peer == "a"
        assert lookup.plan == [(0, i, PEER) for i in range(5)] + [(1, 4, PEER)]
    finally:
        holder.close()
        sched.close()

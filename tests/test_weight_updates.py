"""No tier serves a block computed before a weight update that vLLM is told of: a
prefix-cache reset, whichever way it is asked for (issue 38, item 3).

vLLM's default `reset_prefix_cache()`, what RL frameworks call after loading new
weights in place, never calls the connector's `reset_cache`; the scheduler half
follows the reset of vLLM's own KV cache manager instead (connector/prefix_reset.py).
The unit tests drive the scheduler half and a real vLLM KV cache manager without an
engine; the end-to-end test changes a tiny model's weights in place through
`collective_rpc` in vLLM's CPU build and compares with an engine without tiercache
given the same update."""

from __future__ import annotations

import random

import pytest
from test_scheduler_reports import BLOCK, make_scheduler, request, store

from tiercache.connector.metadata import FILLED, RELEASED

from support.scheduler_steps import blocks_of, new_request, report, scheduler_output


def cached_step(req, computed: int, new_block_ids: list[int], tokens: int):
    """A step of a running request (its blocks so far computed: `computed` tokens)."""
    from types import SimpleNamespace

    cached = SimpleNamespace(
        req_ids=[req.request_id],
        resumed_req_ids=set(),
        new_block_ids=[(new_block_ids,)],
        num_computed_tokens=[computed],
    )
    return scheduler_output(cached=cached, scheduled={req.request_id: tokens})


def prefill_in_two_chunks(sched, blocks: list[bytes]):
    """A request whose first chunk (two blocks) is computed and stored; its second
    chunk comes in the next step."""
    req = request("long", blocks)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks_of([1, 2]), 0)
    first = sched.build_connector_meta(
        scheduler_output([new_request(req, [1, 2])], scheduled={req.request_id: 2 * BLOCK})
    )
    assert len(first.stores) == 2
    return req


# -- requests running across a reset ---------------------------------------------------
def test_a_request_running_across_a_reset_stores_nothing_after_it():
    """Its second chunk is computed with the new weights over KV of the old ones:
    stored under the new epoch, it would be served to requests that never saw the
    old weights. It used to be stored."""
    sched = make_scheduler(tp=1, slots=8)
    blocks = [bytes([i]) * 32 for i in range(4)]
    req = prefill_in_two_chunks(sched, blocks)
    assert sched.reset_cache() is True
    second = sched.build_connector_meta(cached_step(req, 2 * BLOCK, [3, 4], 2 * BLOCK + 1))
    assert second.stores == []
    # Preempted and scheduled again, vLLM computes it anew: then it is stored again.
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks_of([5, 6, 7, 8]), 0)
    again = sched.build_connector_meta(
        scheduler_output([new_request(req, [5, 6, 7, 8])], scheduled={req.request_id: req.num_tokens})
    )
    assert len(again.stores) == 4 and {op.block_hash for op in again.stores}.isdisjoint(blocks)


def test_after_a_reset_vllm_refused_nothing_is_stored_until_one_it_performs():
    """vLLM refuses to clear its prefix cache while requests hold blocks; a new
    request may then start from a block of the old weights and compute the rest over
    it. Nothing is stored until vLLM clears its cache; then stores resume."""
    sched = make_scheduler(tp=1, slots=8)
    blocks = [bytes([i]) * 32 for i in range(2)]
    assert sched.reset_cache(vllm_cache_cleared=False) is True
    held = store(sched, request("after-refused", blocks), [1, 2, 3])
    assert held.stores == []
    assert sched.reset_cache(vllm_cache_cleared=True) is True
    ops = store(sched, request("after-cleared", blocks), [4, 5, 6]).stores
    assert len(ops) == 2
    report(sched, *[(FILLED, (op.block_hash, op.slot)) for op in ops], *[(RELEASED, op.slot) for op in ops])
    assert sched.get_num_new_matched_tokens(request("hit", blocks), 0) == (2 * BLOCK, False)


# -- following vLLM's own reset ----------------------------------------------------------
def kv_cache_manager(num_blocks: int = 8):
    """vLLM's KV cache manager, as its scheduler builds it (one full-attention group)."""
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    return KVCacheManager(config, max_model_len=8 * BLOCK, scheduler_block_size=BLOCK, hash_block_size=BLOCK)


def test_every_reset_of_vllms_kv_cache_manager_is_followed_with_its_outcome():
    from tiercache.connector.prefix_reset import follow_prefix_cache_resets

    manager = kv_cache_manager()
    followed: list[bool] = []
    assert follow_prefix_cache_resets(manager, followed.append) is True
    held = manager.block_pool.get_new_blocks(1)  # a running request's block
    assert manager.reset_prefix_cache() is False
    manager.block_pool.free_blocks(held)
    assert manager.reset_prefix_cache() is True
    assert followed == [False, True]
    # Another manager of the same class is left alone.
    assert kv_cache_manager().reset_prefix_cache() is True and followed == [False, True]


def connector_halves(manager):
    """The connector's scheduler half as vLLM binds it, over a stand-in scheduler."""
    from tiercache.connector.connector import TierCacheConnector

    class Scheduler:
        def __init__(self):
            self.resets: list[bool] = []

        def reset_cache(self, *, vllm_cache_cleared: bool = True) -> bool:
            self.resets.append(vllm_cache_cleared)
            return True

    connector = TierCacheConnector.__new__(TierCacheConnector)
    connector.scheduler, connector.worker, connector._reset_followed = Scheduler(), None, False
    connector._kv_cache_manager = None
    connector.bind_kv_cache_manager(manager)
    return connector


def test_the_default_reset_and_reset_connector_each_reset_the_tiers_once():
    """Before, the default reset_prefix_cache() left the tiers alone; with
    reset_connector=True vLLM resets its prefix cache, then the connector: one reset."""
    manager = kv_cache_manager()
    connector = connector_halves(manager)
    assert manager.reset_prefix_cache() is True  # vLLM's default: the manager only
    assert connector.scheduler.resets == [True]
    assert manager.reset_prefix_cache() is True and connector.reset_cache() is True  # reset_connector=True
    assert connector.scheduler.resets == [True, True]
    # A reset_cache with a step since the manager's last reset is a reset of its own.
    connector._reset_followed = False  # what build_connector_meta does each step
    assert connector.reset_cache() is True
    assert connector.scheduler.resets == [True, True, True]


# -- end to end: new weights in place, then vLLM's reset ---------------------------------
rng = random.Random(38)
PROMPT = [rng.randrange(1, 2000) for _ in range(299)]  # 9 full blocks are loadable
SCALE = 1.25  # every weight, in place: the logprobs move by far more than the tolerance
UPDATE = {"update_weights": SCALE}


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    from tiercache.ops.tiny_model import write_tiny_llama
    from tiercache.ops.vllm_runner import connector_config, loading_every_hit, run_engine

    workdir = tmp_path_factory.mktemp("weights")
    model = str(write_tiny_llama(workdir / "llama", seed=0))
    ask = {"name": "p", "ids": PROMPT}
    plain = run_engine(
        {
            "model": model,
            "prompts": [ask, UPDATE, {"reset_caches": {}}, ask, UPDATE, {"reset_caches": {}}, ask],
        },
        workdir / "runs",
    )
    extra = loading_every_hit({"cpu": {"capacity": "64MiB"}, "disk": {"path": str(workdir / "disk")}})
    cached = run_engine(
        {
            "model": model,
            "kv_transfer_config": connector_config(extra),
            "prompts": [
                ask,  # cold
                ask,  # a tier hit of the first weights
                UPDATE,
                {"reset_caches": {}},  # LLM.reset_prefix_cache() with its defaults
                ask,  # must be computed anew
                ask,  # a tier hit of the new weights
                UPDATE,
                {"reset_caches": {"reset_connector": True}},  # ?reset_external=true
                ask,
            ],
        },
        workdir / "runs",
    )
    # Another engine of the fleet, on the same disk root, started on the same
    # weights: reset on them, then given the first update and reset again.
    fleet = run_engine(
        {
            "model": model,
            "kv_transfer_config": connector_config(extra),
            "prompts": [{"reset_caches": {}}, ask, UPDATE, {"reset_caches": {}}, ask],
        },
        workdir / "runs",
    )
    return plain["results"], cached["results"], fleet["results"]


@pytest.mark.vllm
@pytest.mark.slow
def test_after_new_weights_in_place_and_a_reset_no_tier_serves_the_old_kv(e2e):
    from tiercache.ops.vllm_runner import assert_same_output

    plain, cached, _ = e2e
    before, once, twice = plain
    # The update changes the answer by more than the tolerance: the test can tell.
    shared = set(before["top_logprobs"]) & set(once["top_logprobs"])
    assert not shared or max(abs(before["top_logprobs"][t] - once["top_logprobs"][t]) for t in shared) > 0.3
    cold, hit, after_default, hit_after, after_external = cached
    assert cold["num_cached_tokens"] == 0 and hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(hit, before)
    # The default reset: before, every tier served the 288 tokens of the old weights.
    assert after_default["num_cached_tokens"] == 0
    assert_same_output(after_default, once)
    assert hit_after["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(hit_after, once)
    assert after_external["num_cached_tokens"] == 0
    assert_same_output(after_external, twice)


@pytest.mark.vllm
@pytest.mark.slow
def test_engines_given_the_same_update_share_its_blocks_and_no_other_engine_does(e2e):
    """Each reset named blocks under a random epoch of its own: after the same
    in-place update and reset on every node of a fleet (an RL step), no two nodes
    shared a block again. The epoch is now a fingerprint of the weights the workers
    hold (connector/weights_fingerprint.py): the second engine, given the update the
    first one got, loads what the first one stored after it from the disk tier and
    answers as a plain engine given that update; reset on the original weights, it
    loads none of the updated blocks."""
    from tiercache.ops.vllm_runner import assert_same_output

    (before, once, _), _, (original, updated) = e2e
    assert original["num_cached_tokens"] == 0
    assert_same_output(original, before)
    assert updated["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(updated, once)

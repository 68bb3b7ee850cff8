"""What a lookup of a hybrid model (several KV cache groups) costs on the scheduler
thread, without an engine: one Redis round trip per ask, none while a waiting
request's answer still holds, and a hit short of CPU room cut in one pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_hybrid_groups import BLOCK, spec

from tiercache.config import build_config
from tiercache.connector.groups import FULL, STATE, WINDOW, GroupRule, group_key
from tiercache.connector.scheduler import TierCacheScheduler, slot_bytes_for
from tiercache.index.keys import KVSpec
from tiercache.index.redis_index import RedisIndex, RunRecord, runs_key

from support.redis_commands import commands_sent


def scheduler(kinds, slots: int = 64, **settings) -> TierCacheScheduler:
    groups = [SimpleNamespace(kv_cache_spec=spec(kind), layer_names=[f"{kind}.0"]) for kind in kinds]
    kv_cache_config = SimpleNamespace(kv_cache_groups=groups, num_blocks=256)
    page = slot_bytes_for(kv_cache_config)
    cfg = build_config({"cpu": {"capacity": slots * page}, **settings})
    rank = KVSpec("m", "", "float32", "auto", BLOCK, "cpu::hybrid", 4, 2, 16, 1, 0, "t", 2 * page)
    return TierCacheScheduler(cfg, [rank], kv_cache_config, worker_count=1)


def prompt(req_id: str, blocks: int, salt: int = 0):
    hashes = [(salt * 100_000 + i).to_bytes(4, "big") * 8 for i in range(blocks)]
    tokens = blocks * BLOCK + 5
    return SimpleNamespace(
        request_id=req_id, block_hashes=hashes, num_tokens=tokens, num_prompt_tokens=tokens
    )


def on_disk(sched, req, group: int, indexes) -> None:
    for i in indexes:
        sched.policy.stored_on_disk(group_key(req.block_hashes[i], group))


def in_s3(sched, req, group: int, indexes) -> None:
    keys = tuple(group_key(req.block_hashes[i], group) for i in indexes)
    run_id = keys[0][:8]
    record = RunRecord(0, 0, sched.slot_bytes, keys)
    RedisIndex(sched.redis).add_run(sched.model_digest, sched.rank_digests[0], run_id, record)


@pytest.fixture
def with_s3(redis):
    """Scheduler settings with an S3 tier (never reached here: lookups ask Redis only)."""
    return {"redis_url": redis.url, "s3": {"bucket": "never-read"}, "redis": {"socket_timeout": 5.0}}


def count_commands(sched) -> list:
    """Every command the scheduler's Redis client sends from this thread from now on."""
    return commands_sent(sched.redis.client)


def test_a_hybrid_ask_is_one_round_trip_and_the_next_ask_reuses_its_answer(with_s3):
    sched = scheduler((FULL, STATE), slots=1024, **with_s3)
    req = prompt("r1", 300)
    on_disk(sched, req, 0, range(300))
    in_s3(sched, req, 1, [97])  # one state, where a prefill of 98 blocks stopped
    sched.get_num_new_matched_tokens(prompt("warm", 3, salt=1), 0)  # loads the lookup script
    sent = count_commands(sched)

    assert sched.get_num_new_matched_tokens(req, 0) == (98 * BLOCK, True)
    assert len(sent) == 1  # block by block, this was a round trip per state looked for
    # vLLM asks again every step while the request waits: the answer still holds.
    assert sched.get_num_new_matched_tokens(req, 0) == (98 * BLOCK, True)
    assert len(sent) == 1


def test_every_group_is_looked_up_in_s3_at_once(with_s3):
    sched = scheduler((FULL, WINDOW), **with_s3)
    req = prompt("r1", 50)
    in_s3(sched, req, 0, range(40))
    in_s3(sched, req, 1, [i for i in range(40) if i != 38])
    sent = count_commands(sched)
    # A hit ending at 39 or 40 needs the window group's block 38: it ends at 38.
    assert sched.get_num_new_matched_tokens(req, 0) == (38 * BLOCK, True)
    assert len([command for command in sent if command.startswith("EVAL")]) == 1


def test_a_load_failed_since_the_last_ask_cuts_the_reused_answer(with_s3):
    sched = scheduler((FULL, WINDOW), **with_s3)
    req = prompt("r1", 50)
    in_s3(sched, req, 0, range(40))
    in_s3(sched, req, 1, range(40))
    assert sched.get_num_new_matched_tokens(req, 0) == (40 * BLOCK, True)
    sched.load_failures.add(group_key(req.block_hashes[20], 0))
    sent = count_commands(sched)
    assert sched.get_num_new_matched_tokens(req, 0) == (20 * BLOCK, True)
    assert sent == []


def test_redis_down_is_a_miss_of_what_only_s3_holds(redis_server):
    sched = scheduler((FULL, WINDOW), redis_url=redis_server.url, s3={"bucket": "never-read"})
    req = prompt("r1", 50)
    on_disk(sched, req, 0, range(10))
    on_disk(sched, req, 1, range(10))
    in_s3(sched, req, 0, range(10, 40))
    redis_server.stop()
    assert sched.get_num_new_matched_tokens(req, 0) == (10 * BLOCK, True)


def longest_hit_that_fits(rules, limit: int, held, room: int) -> int:
    """The longest hit every group can serve whose blocks (all on disk here, each
    staged through a slot of its own) fit in `room` slots."""
    for end in range(limit, 0, -1):
        needs = [(group, i) for group, rule in enumerate(rules) for i in rule.needs(0, end, BLOCK)]
        if all(held(group, i) for group, i in needs) and len(needs) <= room:
            return end
    return 0


@pytest.mark.parametrize(
    "kinds, state_every, room",
    [((FULL, WINDOW), 1, 64), ((FULL, WINDOW), 1, 150), ((STATE, FULL), 7, 64), ((STATE, FULL), 5, 33)],
)
def test_a_hit_short_of_cpu_room_is_cut_to_the_longest_that_fits_in_one_pass(kinds, state_every, room):
    sched = scheduler(kinds, slots=room)
    req = prompt("r1", 200)
    for group, kind in enumerate(kinds):
        on_disk(sched, req, group, range(state_every - 1, 200, state_every) if kind == STATE else range(200))
    rules = [GroupRule(kind, sliding_window=64 if kind == WINDOW else 0) for kind in kinds]

    def held(group, i):
        return kinds[group] != STATE or i % state_every == state_every - 1

    want = longest_hit_that_fits(rules, 200, held, room)
    assert 0 < want < 190
    # Each check of the CPU tier's room asks how many slots are unpinned.
    unpinned = sched.slots.unpinned
    checks = []

    def counted():
        checks.append(1)
        return unpinned()

    sched.slots.unpinned = counted
    assert sched.get_num_new_matched_tokens(req, 0) == (want * BLOCK, True)
    assert len(checks) <= 2  # cut block by block, the whole hit was planned again per block


def test_the_cost_models_answer_for_every_prefix_of_a_hit_is_its_answer_for_that_prefix():
    import random

    from test_load_decisions import model

    from tiercache.tiers import CPU, DISK, S3

    rng = random.Random(7)
    costs = [model(), model(disk=(0.02, 0.03), s3=(0.2, 0.01)), model(per_token=0.0001, s3=(0.05, 0.05))]
    for _ in range(200):
        tiers = [rng.choice((CPU, DISK, S3)) for _ in range(rng.randrange(1, 40))]
        tiers.sort(key=lambda tier: rng.random() if rng.random() < 0.3 else (CPU, DISK, S3).index(tier))
        for cost in costs:
            by_prefix = cost.blocks_to_load_by_prefix(tiers, BLOCK)
            assert by_prefix == [cost.blocks_to_load(tiers[:m], BLOCK) for m in range(1, len(tiers) + 1)]


def test_a_routers_lookup_of_a_hybrid_model_asks_s3_once(redis):
    """The service's /v1/lookup answers for every KV cache group from one round trip."""
    import dataclasses

    from tiercache.index.redis_index import Deployment
    from tiercache.ops.service.auth import ServiceTokens
    from tiercache.ops.service.models import LookupRequest
    from tiercache.ops.service.state import ServiceState

    state = ServiceState(build_config({"redis_url": redis.url}), ServiceTokens(), gc_interval=0)
    dep = dataclasses.replace(
        Deployment("ab" * 8, "ns1", "tiny-gemma", 1, ("cd" * 8,), 1024),
        block_size=BLOCK,
        groups=("full", "window:64:0"),
    )
    RedisIndex(redis).register(dep)
    hashes = [i.to_bytes(4, "big") * 8 for i in range(500)]
    for group, held in ((0, range(300)), (1, [i for i in range(300) if i != 298])):
        keys = tuple(group_key(hashes[i], group) for i in held)
        record = RunRecord(0, 0, 1, keys)
        RedisIndex(redis).add_run(dep.model_digest, dep.rank_digests[0], bytes([group]) * 8, record)
    lookup = LookupRequest(namespace="ns1", block_hashes=[h.hex() for h in hashes])
    state.lookup(lookup)  # loads the lookup script
    sent = count_commands(SimpleNamespace(redis=state.redis))

    answer = state.lookup(lookup)

    # A hit ending at 299 or 300 needs the window group's block 298.
    assert answer.deployments[0].tiers.s3 == 298
    assert len([command for command in sent if command.startswith("EVAL")]) == 1  # per block, 500


def test_presence_answers_what_every_rank_holds_and_touches_the_runs_found(redis):
    index = RedisIndex(redis)
    ranks = ["a1" * 8, "b2" * 8]
    blocks = [bytes([i]) * 32 for i in range(8)]
    index.add_run("ee" * 8, ranks[0], b"run-0000", RunRecord(0, 0, 1, tuple(blocks[:6])), when=1.0)
    index.add_run("ee" * 8, ranks[1], b"run-0001", RunRecord(0, 0, 1, (*blocks[:2], *blocks[3:7])), when=1.0)
    prefix, each, empty = index.presence("ee" * 8, ranks, [(blocks, True), (blocks, False), ([], False)])
    assert prefix == [True, True, False]  # block 2: rank 1 lacks it, and the prefix ends there
    assert each == [True, True, False, True, True, True, False, False]
    assert empty == []
    for rank, run in zip(ranks, (b"run-0000", b"run-0001"), strict=True):
        assert redis.client.zscore(runs_key("ee" * 8, rank), run) > 1.0

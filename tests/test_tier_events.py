"""The scheduler's tier changes as vLLM KV events and as this instance's presence in
Redis, driven with stand-in requests, scheduler outputs and worker reports (no engine).
tests/test_e2e_kv_events.py checks the same against a running vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tiercache.config import build_config
from tiercache.connector.metadata import (
    FILL_FAILED,
    FILLED,
    OFF_DISK,
    ON_DISK,
    RELEASED,
)
from tiercache.connector.scheduler import TierCacheScheduler
from tiercache.index.keys import KVSpec
from tiercache.index.presence import instance_prefixes, presence_key
from tiercache.index.redis_index import REGISTRY, Deployment

from support.scheduler_steps import blocks_of, new_request, report, scheduler_output

BLOCK = 32
PAGE = 4096
DISK = {"path": "/tmp/tiercache-unit-disk-never-created"}


def spec(rank: int, tp: int) -> KVSpec:
    return KVSpec(
        "m", "", "float32", "auto", BLOCK, "cpu::FullAttentionSpec", 2, 2, 16, tp, rank, "t", 2 * PAGE
    )


def make_scheduler(tp: int = 1, slots: int = 8, kv_events: bool = True, **config) -> TierCacheScheduler:
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=PAGE), layer_names=["a", "b"])
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group], num_blocks=64)
    cfg = build_config({"cpu": {"capacity": slots * 2 * PAGE}, **config}, environ={})
    specs = [spec(r, tp) for r in range(tp)]
    return TierCacheScheduler(cfg, specs, kv_cache_config, worker_count=tp, kv_events=kv_events)


def request(req_id: str, n_blocks: int, seed: int = 0):
    tokens = n_blocks * BLOCK + 1
    hashes = [bytes([seed, i]) * 16 for i in range(n_blocks)]
    KNOWN.update({maybe_convert_block_hash(h): h for h in hashes})
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=hashes,
        num_tokens=tokens,
        num_prompt_tokens=tokens,
    )


def store(sched, req, first_gpu_block: int = 0):
    """Plan the stores of `req`'s prompt; the store ops."""
    gpu = list(range(first_gpu_block, first_gpu_block + len(req.block_hashes) + 1))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks_of(gpu), 0)
    new = new_request(req, gpu)
    meta = sched.build_connector_meta(scheduler_output([new], scheduled={req.request_id: req.num_tokens}))
    return meta.stores


def fills(ops):
    return [(FILLED, (op.block_hash, op.slot)) for op in ops] + [(RELEASED, op.slot) for op in ops]


def summary(events):
    """Each event as (kind, medium, block hashes), the hashes as vLLM's raw bytes."""
    return [(type(e).__name__, e.medium, [raw_hash(h) for h in e.block_hashes]) for e in events]


# Events carry vLLM's external form of a hash (by default its low 64 bits as an int,
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): the stand-in hashes here are told apart by it.
KNOWN: dict = {}


def raw_hash(external):
    return KNOWN[external]


def test_a_block_is_stored_to_cpu_once_every_rank_filled_it_and_to_disk_once_every_disk_holds_it():
    sched = make_scheduler(tp=2, disk=DISK)
    req = request("r1", 2)
    ops = store(sched, req)
    assert sched.take_events() == []  # planned is not stored
    report(sched, *fills(ops), rank=0)
    assert sched.take_events() == []  # one rank of two
    report(sched, *fills(ops), rank=1)
    assert summary(sched.take_events()) == [
        ("BlockStored", "CPU", [req.block_hashes[0]]),
        ("BlockStored", "CPU", [req.block_hashes[1]]),
    ]
    report(sched, (ON_DISK, ops[0].block_hash), rank=1)
    assert sched.take_events() == []
    report(sched, (ON_DISK, ops[0].block_hash), rank=0)
    (event,) = sched.take_events()
    assert summary([event]) == [("BlockStored", "STORAGE", [req.block_hashes[0]])]
    assert (event.locality, event.ownership, event.block_size, event.group_idx) == (
        "LOCAL",
        "tiercache",
        BLOCK,
        0,
    )
    assert sched.take_events() == []  # each change once


def test_eviction_failed_fills_and_disk_removal_are_published():
    sched = make_scheduler(slots=2, disk=DISK)
    first = request("r1", 2, seed=1)
    ops = store(sched, first)
    report(sched, *fills(ops), (ON_DISK, ops[0].block_hash))
    sched.take_events()
    # Two more blocks evict both of r1's from the two-slot CPU tier.
    second = request("r2", 2, seed=2)
    ops2 = store(sched, second, first_gpu_block=10)
    assert summary(sched.take_events()) == [("BlockRemoved", "CPU", first.block_hashes)]
    # One fill fails: that block is never stored, the other is.
    report(sched, (FILL_FAILED, (ops2[0].block_hash, ops2[0].slot)), *fills(ops2[1:]))
    assert summary(sched.take_events()) == [("BlockStored", "CPU", [second.block_hashes[1]])]
    report(sched, (OFF_DISK, ops[0].block_hash))
    assert summary(sched.take_events()) == [("BlockRemoved", "STORAGE", [first.block_hashes[0]])]


def test_events_encode_and_decode_as_vllms_publisher_and_subscribers_do():
    sched = make_scheduler(slots=1)
    req = request("r1", 2, seed=3)
    ops = store(sched, req)  # the second block evicts the first (filled below) from the one slot
    report(sched, *fills(ops[:1]))
    events = sched.take_events()
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert [type(e) for e in decoded.events] == [BlockStored]
    assert decoded.events[0].block_hashes == [maybe_convert_block_hash(req.block_hashes[0])]
    assert decoded.events[0].medium == "CPU"


def test_after_a_reset_events_carry_vllms_hash_not_the_epoch_key():
    sched = make_scheduler(disk=DISK)
    before = request("r1", 1, seed=4)
    ops = store(sched, before)
    report(sched, *fills(ops), (ON_DISK, ops[0].block_hash))
    sched.take_events()
    sched.reset_cache()
    # Everything held before is removed, under vLLM's hash.
    assert summary(sched.take_events()) == [
        ("BlockRemoved", "CPU", before.block_hashes),
        ("BlockRemoved", "STORAGE", before.block_hashes),
    ]
    after = request("r2", 2, seed=5)
    ops = store(sched, after)
    assert all(op.block_hash not in after.block_hashes for op in ops)  # keys are epoch keys now
    report(sched, *fills(ops), (ON_DISK, ops[1].block_hash))
    assert summary(sched.take_events()) == [
        ("BlockStored", "CPU", [after.block_hashes[0]]),
        ("BlockStored", "CPU", [after.block_hashes[1]]),
        ("BlockStored", "STORAGE", [after.block_hashes[1]]),
    ]
    # A CPU hit of that block staged from disk after eviction keeps the same name.
    sched.policy.clear()
    assert [[raw_hash(h) for h in e.block_hashes] for e in sched.take_events()] == [
        after.block_hashes,
        [after.block_hashes[1]],
    ]


def test_without_kv_events_or_redis_nothing_watches_the_tiers():
    sched = make_scheduler(kv_events=False)
    assert sched.policy.watcher is None
    ops = store(sched, request("r1", 1))
    report(sched, *fills(ops))
    assert sched.take_events() == []


def test_presence_follows_the_tiers_and_reaches_redis_in_batches(redis, redis_url):
    sched = make_scheduler(
        slots=2, disk=DISK, kv_events=False, redis_url=redis_url, instance_id="node-a:8000"
    )
    try:
        presence = sched.tier_events.presence
        req = request("r1", 2, seed=6)
        ops = store(sched, req)
        report(sched, *fills(ops), (ON_DISK, ops[0].block_hash))
        assert presence.holds() == {req.block_hashes[0]: 3, req.block_hashes[1]: 1}
        assert presence.flush()
        key = presence_key(sched.model_digest, "node-a:8000")
        assert redis.client.hgetall(key) == {req.block_hashes[0]: b"3", req.block_hashes[1]: b"1"}
        assert 0 < redis.client.pttl(key) <= 30_000
        (found,) = instance_prefixes(redis, sched.model_digest, req.block_hashes + [b"\x00" * 32])
        assert (found.instance, found.cpu, found.disk, found.local) == ("node-a:8000", 2, 1, 2)
        # The registration carries what the service needs to hash token ids.
        registered = Deployment.from_json(redis.client.hget(REGISTRY, sched.model_digest))
        assert registered.tp_size == 1 and registered.namespace == "default"
        # Evicted from the CPU tier: only the disk bit is left.
        store(sched, request("r2", 2, seed=7), first_gpu_block=10)
        assert presence.flush()
        assert redis.client.hgetall(key) == {req.block_hashes[0]: b"2"}
    finally:
        sched.close()
    assert not redis.client.exists(key)
    assert instance_prefixes(redis, sched.model_digest, req.block_hashes) == []

"""Defects the serving load test (test_e2e_serve_load.py) found, each pinned down
here without a vLLM engine, and the connector's gauges on vLLM's /metrics."""

from __future__ import annotations

from types import SimpleNamespace

from tiercache.config import build_config
from tiercache.connector.metadata import FILLED, RELEASED
from tiercache.connector.scheduler import TierCacheScheduler
from tiercache.connector.stats import STORES_DROPPED, GaugeReport, TierCachePromMetrics, TierCacheStats
from tiercache.index.keys import KVSpec

from support.scheduler_steps import blocks_of, report, scheduler_output
from support.single_blocks import add_block

BLOCK = 32
PAGE = 4096
DISK = {"path": "/tmp/tiercache-unit-disk-never-created"}


def make_scheduler(capacity_slots: int = 16, **config) -> TierCacheScheduler:
    cfg = build_config({"cpu": {"capacity": capacity_slots * 2 * PAGE}, **config})
    spec = KVSpec("m", "", "float32", "auto", BLOCK, "cpu::FullAttentionSpec", 2, 2, 16, 1, 0, "t", 2 * PAGE)
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=PAGE), layer_names=["a", "b"])
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group], num_blocks=64)
    return TierCacheScheduler(cfg, [spec], kv_cache_config, worker_count=1)


def request(req_id: str, n_blocks: int):
    tokens = n_blocks * BLOCK + 1
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=[bytes([i]) * 32 for i in range(n_blocks)],
        num_tokens=tokens,
        num_prompt_tokens=tokens,
    )


def test_two_requests_for_one_prefix_on_disk_both_get_async_loads():
    """vLLM puts a request told "load asynchronously" in WAITING_FOR_REMOTE_KVS
    until a worker reports it in finished_recving, and the worker reports only jobs
    marked async. The second of two requests for the same disk prefix in one step
    finds every block's slot already taken by the first's staging: it shares that
    staging (waits for it, then copies from the same slots), where it used to have
    every block planned as lost and recomputed after waiting for nothing."""
    sched = make_scheduler(disk=DISK)
    first, second = request("r1", 3), request("r2", 3)
    for h in first.block_hashes:
        sched.policy.on_disk[bytes(h)] = None
    for req, gpu in ((first, [1, 2, 3, 4]), (second, [5, 6, 7, 8])):
        assert sched.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
        sched.update_state_after_alloc(req, blocks_of(gpu), 3 * BLOCK)
    jobs = {job.req_id: job for job in sched.build_connector_meta(scheduler_output()).loads}
    assert jobs["r1"].is_async and [op.tier for op in jobs["r1"].ops] == ["disk"] * 3
    assert jobs["r2"].is_async
    shared = [(op.tier, op.after_fill, op.slot) for op in jobs["r2"].ops]
    assert shared == [("cpu", True, op.slot) for op in jobs["r1"].ops]
    assert sched.gauges()["loads_in_flight"] == 2
    # Each slot is pinned by both loads: neither's release frees it for the other.
    assert sched.slots.pinned() == 3
    for op in jobs["r1"].ops:
        report(sched, (FILLED, (op.block_hash, op.slot)), (RELEASED, op.slot))
    assert sched.slots.pinned() == 3
    for op in jobs["r2"].ops:
        report(sched, (RELEASED, op.slot))
    assert sched.slots.pinned() == 0


def test_a_sync_hit_stays_sync_when_its_block_left_the_cpu_tier_since_the_lookup():
    """The other direction: vLLM was told "sync" and schedules the request's forward
    this step, so the job must not turn into an async load (whose finished_recving
    would name a running request)."""
    sched = make_scheduler(disk=DISK)
    req = request("r1", 2)
    for h in req.block_hashes:
        h = bytes(h)
        slot, _ = sched.slots.allocate(h)
        sched.slots.unpin(slot)
        sched.policy.ready.add(h)
        sched.policy.on_disk[h] = None
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, False)
    evicted = bytes(req.block_hashes[1])  # by another request's store since the lookup
    sched.policy.ready.discard(evicted)
    sched.slots.remove(evicted)
    sched.update_state_after_alloc(req, blocks_of([4, 5, 6]), 2 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    assert not job.is_async


def ready_in_cpu_tier(sched: TierCacheScheduler, block: bytes) -> None:
    """`block` filled into a CPU slot and no longer pinned: a CPU hit, evictable."""
    slot, _ = sched.slots.allocate(block)
    sched.slots.unpin(slot)
    sched.policy.ready.add(block)


def test_staging_a_hit_never_evicts_the_hits_own_cpu_blocks():
    """A long prompt's front goes to disk first (it is the oldest), so its hit is disk
    blocks then CPU blocks, the CPU ones the least recently used in the tier. The
    slot claimed to stage the disk block evicted the least recently used unpinned
    block, the hit's own next one, pinned only after: planned lost (or read back from
    disk, had it been written there), though the lookup had counted a slot to spare."""
    sched = make_scheduler(capacity_slots=4, disk=DISK)
    req = request("r1", 3)
    front, *rest = [bytes(h) for h in req.block_hashes]
    sched.policy.on_disk[front] = None
    for block in rest:  # the hit's CPU blocks, oldest in the tier
        ready_in_cpu_tier(sched, block)
    for other in (b"x" * 32, b"y" * 32):  # blocks used since: what a staging should evict
        ready_in_cpu_tier(sched, other)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(req, blocks_of([1, 2, 3, 4]), 3 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    assert [op.tier for op in job.ops] == ["disk", "cpu", "cpu"]
    assert all(op.slot >= 0 for op in job.ops)
    assert all(block in sched.policy.ready for block in rest)
    assert b"x" * 32 not in sched.slots  # the least recently used block outside the hit


def test_a_staged_hit_is_cut_only_where_its_slots_run_out():
    """A hit of two disk blocks then four CPU blocks, in a tier of five slots (the
    hit's four and one other, none pinned). Loading its first five blocks stages two
    blocks into the other slot and the hit's own last CPU block (which this request
    computes next) while pinning the three CPU blocks before it: five slots. The
    lookup counted the slots of all four CPU blocks as taken, cut past the cut too,
    and loaded one block."""
    sched = make_scheduler(capacity_slots=5, disk=DISK)
    req = request("r1", 6)
    hashes = [bytes(h) for h in req.block_hashes]
    for block in hashes[:2]:
        sched.policy.on_disk[block] = None
    for block in hashes[2:]:
        ready_in_cpu_tier(sched, block)
    ready_in_cpu_tier(sched, b"x" * 32)
    assert sched.get_num_new_matched_tokens(req, 0) == (5 * BLOCK, True)
    sched.update_state_after_alloc(req, blocks_of(list(range(1, 8))), 5 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    assert [op.tier for op in job.ops] == ["disk", "disk", "cpu", "cpu", "cpu"]
    assert len({op.slot for op in job.ops}) == 5 and all(op.slot >= 0 for op in job.ops)
    assert all(block in sched.policy.ready for block in hashes[2:5])


def test_a_hit_cut_for_want_of_cpu_slots_is_counted():
    """A disk hit staged through CPU slots while transfers hold every slot is cut to
    nothing (vLLM computes the prompt): counted as a no_room decision, where it used
    to leave no trace at all, neither a load nor a skip."""
    sched = make_scheduler(capacity_slots=2, disk=DISK)
    for held in (b"x" * 32, b"y" * 32):  # stores whose write-down is still running
        sched.policy.claim(held)
    req = request("r1", 2)
    for h in req.block_hashes:
        sched.policy.on_disk[bytes(h)] = None
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks_of([1, 2, 3]), 0)
    assert sched.take_decisions() == {("disk", "no_room"): 1}
    assert sched.stats["decision_no_room_disk"] == 1


def prom_metrics(labelnames: list[str], labelvalues: list[str]):
    """tiercache's metrics for vLLM, in a registry of their own: (metrics, registry)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def bound(cls):
        return lambda *args, **kwargs: cls(*args, registry=registry, **kwargs)

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    return TierCachePromMetrics(config, types, labelnames, {0: labelvalues}), registry


def test_gauges_reach_metrics_as_the_sum_of_each_sources_latest_report():
    prom, registry = prom_metrics(["model_name", "engine"], ["m", "0"])

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0"})

    assert value("vllm:tiercache_pinned_slots") == 0  # there before any report

    scheduler, rank0, rank1 = GaugeReport("scheduler"), GaugeReport("rank0"), GaugeReport("rank1")
    step = TierCacheStats()
    scheduler.add_to(step, {"pinned_slots": 5, "loads_in_flight": 1})
    for rank, queued in ((rank0, 3), (rank1, 4)):
        worker = TierCacheStats()
        rank.add_to(worker, {"stores_in_flight": queued})
        step.aggregate(worker)  # as vLLM sums the workers' stats and the scheduler's
    prom.observe(step.to_dict())
    assert value("vllm:tiercache_pinned_slots") == 5
    assert value("vllm:tiercache_stores_in_flight") == 7
    assert step.reduce()["stores_in_flight"] == 7

    # Next step only rank 0 changed: rank 1's last report still counts.
    later = TierCacheStats()
    scheduler.add_to(later, {"pinned_slots": 5, "loads_in_flight": 1})  # unchanged: not sent
    rank0.add_to(later, {"stores_in_flight": 0})
    assert list(later.data["gauges"]) == ["rank0"]
    prom.observe(later.to_dict())
    assert value("vllm:tiercache_stores_in_flight") == 4
    assert value("vllm:tiercache_loads_in_flight") == 1


def test_dropped_stores_reach_their_counter():
    prom, registry = prom_metrics(["engine"], ["0"])
    for dropped in (3, 0, 2):
        step = TierCacheStats()
        step.add(STORES_DROPPED, dropped)
        prom.observe(step.to_dict())
    assert registry.get_sample_value("vllm:tiercache_stores_dropped_total", {"engine": "0"}) == 5


def test_a_waiting_request_reuses_its_s3_lookup_but_never_a_stale_hit(redis_url, redis):
    """vLLM asks about a waiting request every step until it can schedule it. Its
    S3 lookup (a Redis round trip on the scheduler's thread, which also touches the
    blocks' last-access scores) is made once and reused while the request waits; its
    local tiers are looked at afresh each time, and a block whose load failed or
    that left the disk since is not offered."""
    from tiercache.connector.metadata import OFF_DISK, READ_FAILED
    from tiercache.index.redis_index import RedisIndex

    s3 = {"bucket": "kv", "endpoint_url": "http://127.0.0.1:9"}
    sched = make_scheduler(disk=DISK, redis_url=redis_url, s3=s3, presence={"enabled": False})
    req = request("r1", 4)
    blocks = [bytes(h) for h in req.block_hashes]
    sched.policy.stored_on_disk(blocks[0])
    for block in blocks[1:]:
        add_block(RedisIndex(redis), sched.model_digest, sched.rank_digests[0], block)
    asked = []
    longest_prefix = sched.s3_index.longest_prefix
    sched.s3_index.longest_prefix = lambda *args: asked.append(args) or longest_prefix(*args)

    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True)
    sched.build_connector_meta(scheduler_output())  # no room: the request waits
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True)
    sched.build_connector_meta(scheduler_output())
    assert len(asked) == 1
    report(sched, (READ_FAILED, blocks[2]))  # its load failed for another request
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, True)
    assert len(asked) == 1
    report(sched, (OFF_DISK, blocks[0]))  # evicted from the disk: S3 is asked about it
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert len(asked) == 2

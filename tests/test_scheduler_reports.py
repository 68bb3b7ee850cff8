"""The scheduler's account of worker reports (connector/ledger.py), and the scheduler
and workers driven together the way vLLM drives them: with each step's worker output
seen before the next step is scheduled (the CPU backend), or one step late (vLLM's
async scheduling, the default on GPUs)."""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tiercache.config import build_config
from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.ledger import ReportLedger
from tiercache.connector.metadata import (
    FILL_FAILED,
    FILLED,
    OFF_DISK,
    ON_DISK,
    RELEASED,
    STORE_VOID,
    BlockOp,
    LoadJob,
    TierCacheMetadata,
    TierCacheWorkerMetadata,
)
from tiercache.connector.scheduler import TierCacheScheduler
from tiercache.connector.worker import TierCacheWorker
from tiercache.index.keys import KVSpec
from tiercache.tiers import CPU

from support.scheduler_steps import blocks_of, new_request, report, scheduler_output

BLOCK = 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
LAYER_SHAPE = (2, BLOCK, 16)  # per block: kv heads, block size, 2 * head size (CPU backend)
PAGE = 2 * BLOCK * 16 * 4  # float32


def spec(rank: int, tp: int) -> KVSpec:
    page_bytes = PAGE * len(LAYERS)
    return KVSpec("m", "", "float32", "auto", BLOCK, "cpu", len(LAYERS), 2, 16, tp, rank, "t", page_bytes)


def kv_cache_config(num_blocks: int):
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=PAGE), layer_names=LAYERS)
    return SimpleNamespace(kv_cache_groups=[group], num_blocks=num_blocks)


def make_scheduler(tp: int, slots: int, **config) -> TierCacheScheduler:
    cfg = build_config({"cpu": {"capacity": slots * PAGE * len(LAYERS)}, **config})
    return TierCacheScheduler(cfg, [spec(r, tp) for r in range(tp)], kv_cache_config(64), worker_count=tp)


def request(req_id: str, hashes: list[bytes]):
    tokens = len(hashes) * BLOCK + 1
    return SimpleNamespace(
        request_id=req_id, block_hashes=hashes, num_tokens=tokens, num_prompt_tokens=tokens
    )


def store(sched, req, gpu_ids):
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks_of(gpu_ids), 0)
    new = new_request(req, gpu_ids)
    return sched.build_connector_meta(scheduler_output([new], scheduled={req.request_id: req.num_tokens}))


# -- the account, report by report ---------------------------------------------------
def test_two_releases_of_one_slot_in_one_step_unpin_it_twice():
    """A write-down of a block ends in the step that releases a CPU hit on the same
    slot: two pins, two releases from the one rank, in one report."""
    sched = make_scheduler(tp=1, slots=4)
    (op,) = store(sched, request("r1", [b"a" * 32]), [3, 4]).stores
    report(sched, (FILLED, (op.block_hash, op.slot)), rank=0)
    hit = request("r2", [b"a" * 32])
    assert sched.get_num_new_matched_tokens(hit, 0) == (BLOCK, False)
    sched.update_state_after_alloc(hit, blocks_of([7, 8]), BLOCK)
    assert sched.slots._pins[op.slot] == 2  # the write-down's and the hit's
    report(sched, (RELEASED, op.slot), (RELEASED, op.slot), rank=0)
    assert sched.slots.pinned() == 0
    assert sched.ledger.open_entries() == 0


def test_one_ranks_releases_never_stand_in_for_another_ranks():
    sched = make_scheduler(tp=2, slots=4)
    (op,) = store(sched, request("r1", [b"a" * 32]), [3, 4]).stores
    report(sched, (RELEASED, op.slot), (RELEASED, op.slot), rank=0)  # rank 0 twice, rank 1 not yet
    assert sched.slots._pins[op.slot] == 1
    report(sched, (RELEASED, op.slot), rank=1)
    assert sched.slots.pinned() == 0
    # Rank 0's extra release waits for a pin of rank 1's to match; it unpins nothing alone.
    assert sched.ledger.open_entries() == 1


def test_a_fill_left_over_from_a_failed_fill_never_marks_a_later_fill_ready():
    """TP=2: rank 0 filled the block, rank 1 failed, so the block is dropped. When it
    is stored again, rank 0's report of the first fill must not count for the second:
    only once both ranks filled it again may it be served."""
    sched = make_scheduler(tp=2, slots=4)
    block = b"a" * 32
    (first,) = store(sched, request("r1", [block]), [3, 4]).stores
    report(sched, (FILLED, (block, first.slot)), rank=0)
    report(sched, (FILL_FAILED, (block, first.slot)), (RELEASED, first.slot), rank=1)
    report(sched, (RELEASED, first.slot), rank=0)
    assert block not in sched.slots and block not in sched.policy.ready
    (second,) = store(sched, request("r2", [block]), [5, 6]).stores
    report(sched, (FILLED, (block, second.slot)), rank=0)
    assert block not in sched.policy.ready  # rank 1 has not copied it yet
    assert sched.get_num_new_matched_tokens(request("r3", [block]), 0) == (0, False)
    report(sched, (FILLED, (block, second.slot)), rank=1)
    assert block in sched.policy.ready


def test_a_late_fill_of_a_block_that_moved_to_another_slot_is_ignored():
    sched = make_scheduler(tp=2, slots=4)
    block = b"a" * 32
    (first,) = store(sched, request("r1", [block]), [3, 4]).stores
    report(sched, (FILL_FAILED, (block, first.slot)), (RELEASED, first.slot), rank=1)
    (second,) = store(sched, request("r2", [block]), [5, 6]).stores
    assert second.slot != first.slot  # the first slot is still pinned by rank 0
    report(sched, (FILLED, (block, first.slot)), (RELEASED, first.slot), rank=0)  # rank 0, late
    report(sched, (FILLED, (block, second.slot)), rank=1)
    assert block not in sched.policy.ready
    report(sched, (FILLED, (block, second.slot)), rank=0)
    assert block in sched.policy.ready and sched.slots._pins == {second.slot: 1}  # the store's own pin


def test_disk_presence_is_counted_per_rank():
    sched = make_scheduler(tp=2, slots=4, disk={"path": "/tmp/tiercache-unit-disk-never-created"})
    block = b"d" * 32
    report(sched, (ON_DISK, block), (ON_DISK, block), rank=0)  # rank 0 wrote it twice
    assert block not in sched.policy.on_disk
    report(sched, (ON_DISK, block), rank=1)
    assert block in sched.policy.on_disk
    report(sched, (OFF_DISK, block), rank=0)
    report(sched, (ON_DISK, block), rank=0)  # rank 0 again: rank 1 still holds its copy
    assert block in sched.policy.on_disk
    report(sched, (OFF_DISK, block), rank=1)
    assert block not in sched.policy.on_disk


def test_stores_no_slot_is_free_for_are_dropped_and_counted():
    """Two slots, both held by the write-down of a first prompt: the next prompt's
    blocks are not stored (a later request recomputes them) and the scheduler counts
    them for vLLM's stats (vllm:tiercache_stores_dropped)."""
    sched = make_scheduler(tp=1, slots=2)
    held = store(sched, request("r1", [b"a" * 32, b"b" * 32]), [1, 2]).stores
    assert len(held) == 2 and sched.take_dropped_stores() == 0
    assert store(sched, request("r2", [b"c" * 32, b"d" * 32]), [3, 4]).stores == []
    assert sched.take_dropped_stores() == 2
    assert sched.take_dropped_stores() == 0
    for op in held:
        report(sched, (FILLED, (op.block_hash, op.slot)), (RELEASED, op.slot), rank=0)
    (later,) = store(sched, request("r3", [b"e" * 32]), [5, 6]).stores  # a slot is free again
    assert later.block_hash == b"e" * 32 and sched.take_dropped_stores() == 0


def test_the_ledger_keeps_nothing_once_every_rank_reported():
    ledger = ReportLedger(ranks=2, disk_ranks=2)
    for slot in range(1000):
        assert not ledger.fill(0, b"h", slot)
        assert ledger.fill(1, b"h", slot)
        assert ledger.release(1, slot) == 0
        assert ledger.release(0, slot) == 1
    assert ledger.open_entries() == 0


# -- scheduler and workers, step by step, outputs on time or one step late -----------
def content(block_hash: bytes, rank: int, layer: int) -> float:
    """What the forward writes for a block: distinct per block, rank and layer."""
    return int.from_bytes(hashlib.sha256(block_hash).digest()[:2], "little") + 70000.0 * rank + 0.25 * layer


class MiniEngine:
    """Enough of vLLM's engine to drive the connector's two halves: prompts of whole
    blocks, a block pool, loads (CPU hits in the step that needs them, disk hits
    waiting for the workers' `finished_recving`), stores, requests finishing after
    their prefill, and the forward checking every block it reads from a load."""

    def __init__(
        self,
        tmp_path,
        tp: int,
        lag: int,
        cpu_slots: int,
        *,
        time_forwards: bool = False,
        forward_seconds: float = 0.0,
        movers: dict | None = None,
        disk_share: int = 1 << 29,
    ):
        self.lag = lag
        self.num_blocks = 48
        # vLLM binds each step's metadata before its forward, which times it for the
        # cost model; left out, the prefill is never measured and every hit is loaded.
        self.time_forwards = time_forwards
        self.forward_seconds = forward_seconds
        disk = {"path": str(tmp_path / "disk"), "capacity": 1 << 30}
        movers = movers or {}
        self.sched = TierCacheScheduler(
            build_config(
                {"cpu": {"capacity": cpu_slots * PAGE * len(LAYERS)}, "disk": disk, "movers": movers}
            ),
            [spec(r, tp) for r in range(tp)],
            kv_cache_config(self.num_blocks),
            worker_count=tp,
        )
        self.kv = []
        self.workers = []
        for rank in range(tp):
            kv = {name: torch.zeros(self.num_blocks, *LAYER_SHAPE) for name in LAYERS}
            slot_bytes = PagedKVCopier(kv, self.num_blocks).slot_bytes
            config = build_config(
                {"cpu": {"capacity": cpu_slots * slot_bytes}, "disk": disk, "movers": movers}
            )
            worker = TierCacheWorker(
                config,
                spec(rank, tp),
                "m",
                self.num_blocks,
                tp_rank=rank,
                writes_lower_tiers=True,
                disk_share=disk_share,
            )
            worker.register_kv_caches(kv, slot_bytes)
            self.kv.append(kv)
            self.workers.append(worker)
        self.free = list(range(self.num_blocks))
        self.waiting: list = []  # requests not yet scheduled
        self.remote: dict[str, tuple] = {}  # waiting for a disk load: req -> (request, blocks, tokens)
        self.outputs: list = []  # worker outputs not yet seen by the scheduler
        self.loaded = Counter()  # tier -> blocks checked after a load
        self.finishing: list = []
        self.recved: set[str] = set()  # requests whose disk load every worker finished
        self.recv_reports: Counter = Counter()  # req -> ranks that reported its load done

    def submit(self, req_id: str, hashes: list[bytes]) -> None:
        self.waiting.append(request(req_id, hashes))

    def step(self) -> None:
        sched = self.sched
        new_reqs, scheduled, loads, computes = [], {}, {}, {}
        for req in list(self.waiting):
            tokens, is_async = sched.get_num_new_matched_tokens(req, 0)
            blocks = [self.free.pop() for _ in req.block_hashes] + [self.free.pop()]
            sched.update_state_after_alloc(req, blocks_of(blocks), tokens)
            self.waiting.remove(req)
            if is_async:
                self.remote[req.request_id] = (req, blocks, tokens)
                continue
            self._schedule(req, blocks, tokens, new_reqs, scheduled, loads, computes)
        for req_id, (req, blocks, tokens) in list(self.remote.items()):
            if req_id in self.recved:
                del self.remote[req_id]
                sched.update_state_after_alloc(req, blocks_of(blocks), 0)
                self._schedule(req, blocks, tokens, new_reqs, scheduled, loads, computes)
        meta = sched.build_connector_meta(scheduler_output(new_reqs, scheduled=scheduled))
        # Async scheduling: the step before's output arrives only now, after this
        # step was scheduled.
        while len(self.outputs) > self.lag:
            self._deliver(self.outputs.pop(0))
        self.outputs.append(self._execute(meta, loads, computes))

    def _schedule(self, req, blocks, tokens, new_reqs, scheduled, loads, computes):
        loaded = tokens // BLOCK
        new = SimpleNamespace(req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=tokens)
        new_reqs.append(new)
        scheduled[req.request_id] = req.num_tokens - tokens
        loads.update({blocks[i]: req.block_hashes[i] for i in range(loaded)})
        computes.update({blocks[i]: req.block_hashes[i] for i in range(loaded, len(req.block_hashes))})
        self.finishing.append((req, blocks))

    def _execute(self, meta, loads, computes):
        reports, hits, timings, recving = [], Counter(), [], []
        failed: set[int] = set()
        for rank, worker in enumerate(self.workers):
            kv = self.kv[rank]
            if self.time_forwards:
                worker.forward_begins(meta)
            worker.start_load_kv(meta)
            if computes:  # a forward that computes blocks takes this long
                time.sleep(self.forward_seconds)
            for layer, name in enumerate(LAYERS):
                worker.wait_for_layer(name)
                for block, block_hash in loads.items():  # attention reads the loaded KV
                    if block not in failed:
                        assert torch.all(kv[name][block] == content(block_hash, rank, layer)), (rank, name)
                for block, block_hash in computes.items():  # and writes the new KV
                    kv[name][block] = content(block_hash, rank, layer)
                worker.save_layer(name, meta)
            worker.wait_for_save(meta)
            recving.append(worker.get_finished())
            failed |= worker.take_failed_blocks()
            worker_meta = worker.take_worker_meta()
            if worker_meta is not None:
                reports.extend(worker_meta.reports)
                hits.update(worker_meta.hits)
                timings.extend(worker_meta.timings)
        assert not failed, "nothing in this workload may fail to load"
        self.loaded.update(hits)
        # As vLLM's output aggregator: finished once every rank has said so, in
        # whatever steps they did.
        for finished in recving:
            self.recv_reports.update(finished)
        done = {req_id for req_id, count in self.recv_reports.items() if count == len(self.workers)}
        for req_id in done:
            del self.recv_reports[req_id]
        return SimpleNamespace(
            kv_connector_worker_meta=TierCacheWorkerMetadata(reports, hits, timings), finished_recving=done
        )

    def _deliver(self, output) -> None:
        self.sched.update_connector_output(output)
        self.recved |= output.finished_recving
        # Requests computed in that step are done: their blocks go back to the pool.
        for req, blocks in self.finishing:
            self.sched.request_finished(req)
            self.free.extend(blocks)
        self.finishing = []

    def drain(self) -> None:
        for _ in range(200):
            for worker in self.workers:
                assert worker.engine.flush(10)
            self.step()
            idle = not self.waiting and not self.remote and not self.finishing
            if idle and self.sched.slots.pinned() == 0 and self.sched.ledger.open_entries() == 0:
                break
        while self.outputs:
            self._deliver(self.outputs.pop(0))

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()


@pytest.mark.parametrize("lag", [0, 1], ids=["outputs seen before the next step", "one step late (async)"])
def test_scheduler_and_workers_serve_the_same_kv_whenever_outputs_arrive(tmp_path, lag):
    """Twelve prompts over six prefixes, TP=2, a CPU tier of eight slots over a disk
    tier: stores, CPU hits, evictions, disk hits and their staging, with every worker
    output delivered on time or one step late. Every block a forward reads from a load
    holds exactly what the prefix's first request computed on that rank; once quiet,
    no slot is pinned, no report is waiting and no load is in flight."""
    engine = MiniEngine(tmp_path, tp=2, lag=lag, cpu_slots=8)
    try:
        prefixes = [[bytes([p, b]) * 16 for b in range(3)] for p in range(6)]
        order = [0, 1, 0, 2, 3, 1, 4, 5, 0, 2, 5, 3]
        for i, p in enumerate(order):
            engine.submit(f"r{i}", prefixes[p])
            engine.step()
        engine.drain()
        sched = engine.sched
        assert sched.slots.pinned() == 0
        assert sched.ledger.open_entries() == 0
        assert not sched._load_slots
        assert engine.loaded["cpu"] + engine.loaded["disk"] > 0  # hits were served and checked
    finally:
        engine.close()


@pytest.mark.parametrize("lag", [0, 1], ids=["outputs seen before the next step", "one step late (async)"])
def test_a_burst_on_one_prefix_on_disk_loads_each_block_once(tmp_path, lag):
    """After a restart, a prefix only the disk holds is asked for by several requests
    at once: two in one step, a third while their staging may still be in flight.
    Each block is read from disk once; the other requests share that staging (the
    same CPU slot, copied once it is filled), and every forward reads what the
    prefix's first request computed: none is told of a hit that is then lost."""
    prefix = [bytes([7, b]) * 16 for b in range(4)]
    first = MiniEngine(tmp_path, tp=1, lag=lag, cpu_slots=8)
    try:
        first.submit("computes", prefix)
        first.step()
        first.drain()
    finally:
        first.close()
    engine = MiniEngine(tmp_path, tp=1, lag=lag, cpu_slots=8)  # restarted: the CPU tier is empty
    try:
        assert all(engine.sched.policy.local_tier(block) == "disk" for block in prefix)
        engine.submit("a", prefix)
        engine.submit("b", prefix)
        engine.step()
        engine.submit("c", prefix)
        engine.drain()
        assert engine.loaded["disk"] == len(prefix)  # and MiniEngine saw no block fail
        assert engine.loaded["cpu"] == 2 * len(prefix)
        assert engine.sched.slots.pinned() == 0 and not engine.sched._load_slots
    finally:
        engine.close()


def test_a_disk_hit_evicted_after_the_plan_is_still_loaded(tmp_path):
    """The scheduler plans a disk load from the workers' last reports. A write-down
    running beside the step evicts the disk tier's least recently used object, the
    very block the plan reads, before the read: the load failed and its request was
    recomputed with nothing wrong (issue 39, item 9). The evicted object's file now
    lingers long enough for the loads planned before the eviction was reported."""
    prefix = [bytes([9, b]) * 16 for b in range(4)]
    others = [[bytes([10 + r, b]) * 16 for b in range(4)] for r in range(15)]
    first = MiniEngine(tmp_path, tp=1, lag=0, cpu_slots=64)  # room for every store
    try:
        for i, blocks in enumerate([prefix, *others]):
            first.submit(f"computes{i}", blocks)
            first.step()
        first.drain()
        tier = first.workers[0].engine
        assert len(tier.disk) == 64  # a 32nd of these may linger: 2 objects
        held_bytes = tier.disk.usage_bytes()
        # The prefix is the least recently used on disk, whatever order the write-down
        # threads finished in: in the root's index (and by mtime, for a root without one).
        with tier.disk.index.write() as index:
            for block in prefix:
                key = tier.shape.key(block)
                path = tier.disk.path_of(key)
                index.add(key, key.split("/")[0], path.stat().st_size, 1.0)
                os.utime(path, (1, 1))
    finally:
        first.close()
    # Restarted with a disk tier holding exactly these objects (the CPU tier empty).
    engine = MiniEngine(tmp_path, tp=1, lag=0, cpu_slots=8, disk_share=held_bytes)
    try:
        assert engine.sched.policy.local_tier(prefix[0]) == "disk"
        disk_tier = engine.workers[0].engine
        newcomer = b"n" * 32  # written down by another request while this step is planned
        data = memoryview(bytearray(disk_tier.shape.slot_bytes))
        header = disk_tier.shape.header(newcomer, data, disk_tier.integrity_key)
        assert disk_tier.disk.put(disk_tier.shape.key(newcomer), data, header)
        assert disk_tier.shape.key(prefix[0]) not in disk_tier.disk  # evicted, not yet reported
        engine.submit("hit", prefix)
        engine.drain()
        assert engine.loaded["disk"] == len(prefix)  # and MiniEngine saw no block fail
    finally:
        engine.close()


# -- vLLM's own accounting: hits by tier, and /reset_prefix_cache ---------------------
def test_hits_are_split_by_the_tier_that_holds_them():
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from tiercache.connector import TierCacheConnector

    sched = make_scheduler(tp=1, slots=8, disk={"path": "/tmp/tiercache-unit-disk-never-created"})
    blocks = [bytes([i]) * 32 for i in range(3)]
    ops = store(sched, request("r1", blocks[:2]), [1, 2, 3]).stores
    report(sched, *[(FILLED, (op.block_hash, op.slot)) for op in ops], rank=0)
    report(sched, *[(RELEASED, op.slot) for op in ops], rank=0)
    sched.policy.on_disk[blocks[2]] = None
    hit = request("r2", blocks)
    assert sched.get_num_new_matched_tokens(hit, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(hit, blocks_of([5, 6, 7, 8]), 3 * BLOCK)
    # The scheduler half alone, its hooks run unguarded.
    connector = SimpleNamespace(scheduler=sched, _guarded=lambda hook, call, recover, default: call())
    sources = TierCacheConnector.get_external_cache_hit_sources(connector, hit, 3 * BLOCK)
    assert sources == {CacheHitSource.HOST: 2 * BLOCK, CacheHitSource.DISK: BLOCK}
    # Asked with a count the plan does not add up to: vLLM's own fallback decides.
    assert TierCacheConnector.get_external_cache_hit_sources(connector, hit, 3 * BLOCK) == {}


def test_after_a_cache_reset_no_block_computed_before_is_served():
    sched = make_scheduler(tp=1, slots=8, disk={"path": "/tmp/tiercache-unit-disk-never-created"})
    blocks = [bytes([i]) * 32 for i in range(2)]
    ops = store(sched, request("r1", blocks), [1, 2, 3]).stores
    report(sched, *[(FILLED, (op.block_hash, op.slot)) for op in ops], rank=0)  # write-downs still pin
    sched.policy.on_disk[blocks[0]] = None
    assert sched.get_num_new_matched_tokens(request("r2", blocks), 0) == (2 * BLOCK, False)

    assert sched.reset_cache() is True
    assert sched.get_num_new_matched_tokens(request("r3", blocks), 0) == (0, False)
    # The old blocks' write-downs end after the reset: their late reports serve nothing.
    report(sched, (ON_DISK, blocks[0]), *[(RELEASED, op.slot) for op in ops], rank=0)
    assert sched.get_num_new_matched_tokens(request("r4", blocks), 0) == (0, False)
    assert sched.slots.pinned() == 0
    # Computed again under the new weights, stored under new names, served again.
    again = store(sched, request("r5", blocks), [4, 5, 6]).stores
    assert {op.block_hash for op in again}.isdisjoint(blocks)
    report(sched, *[(FILLED, (op.block_hash, op.slot)) for op in again], rank=0)
    assert sched.get_num_new_matched_tokens(request("r6", blocks), 0) == (2 * BLOCK, False)


# -- a failed load is not offered again at once ----------------------------------------
def test_a_block_whose_load_failed_is_not_offered_again_to_the_rescheduled_request():
    """A transient failure (an S3 timeout) leaves the block indexed, on purpose. vLLM
    reschedules the request and asks again: offered the same block, it would wait
    out the same timeout and fail again, for ever. For a while the block is a miss."""
    from tiercache.connector.load_failures import RecentLoadFailures

    sched = make_scheduler(tp=1, slots=8, disk={"path": "/tmp/tiercache-unit-disk-never-created"})
    now = [0.0]
    sched.load_failures = RecentLoadFailures(seconds=30, clock=lambda: now[0])
    blocks = [bytes([i]) * 32 for i in range(3)]
    for block in blocks:
        sched.policy.stored_on_disk(block)
    req = request("r1", blocks)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(req, blocks_of([1, 2, 3, 4]), 3 * BLOCK)
    (job,) = store(sched, request("other", [b"z" * 32]), [9, 10]).loads
    report(sched, (FILLED, (blocks[0], job.ops[0].slot)), (FILL_FAILED, (blocks[1], job.ops[1].slot)), rank=0)
    # Rescheduled: the blocks up to the failed one are still offered, not past it.
    assert sched.get_num_new_matched_tokens(req, 0) == (BLOCK, False)
    now[0] = 31.0  # the tier may have recovered: the block is offered again
    assert sched.get_num_new_matched_tokens(request("r2", blocks), 0) == (3 * BLOCK, True)


def test_blocks_recomputed_after_a_failed_load_are_stored_and_offered_at_once():
    """A load of blocks 0-2 whose block 1 failed: vLLM sets the request back to block
    1 and computes it again. Those blocks were counted as loaded, not computed, and
    were never stored: now they are, and once stored the failed block is offered
    again at once (its backoff is for a copy that may still be bad, not for this one)."""
    sched = make_scheduler(tp=1, slots=8, disk={"path": "/tmp/tiercache-unit-disk-never-created"})
    blocks = [bytes([i]) * 32 for i in range(3)]
    for block in blocks:
        sched.policy.stored_on_disk(block)
    # Staged from disk, block 1 failing its check (its object is then deleted).
    req = request("r1", blocks)
    gpu = [1, 2, 3, 4]
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, True)
    sched.update_state_after_alloc(req, blocks_of(gpu), 3 * BLOCK)
    (job,) = sched.build_connector_meta(scheduler_output()).loads
    staged = [(FILLED, (op.block_hash, op.slot)) for op in job.ops]
    staged[1] = (FILL_FAILED, (blocks[1], job.ops[1].slot))
    report(sched, *staged, *[(RELEASED, op.slot) for op in job.ops], (OFF_DISK, blocks[1]), rank=0)
    # vLLM schedules the request from block 1 on.
    sched.update_state_after_alloc(req, blocks_of(gpu), 0)
    new = new_request(req, gpu, num_computed_tokens=BLOCK)
    meta = sched.build_connector_meta(scheduler_output([new], scheduled={"r1": 2 * BLOCK + 1}))
    (op,) = meta.stores  # block 2 is in the CPU tier and on disk
    assert (op.block_hash, op.gpu_block) == (blocks[1], 2)
    assert sched.get_num_new_matched_tokens(request("r2", blocks), 0) == (BLOCK, False)
    report(sched, (FILLED, (op.block_hash, op.slot)), (RELEASED, op.slot), rank=0)
    assert sched.get_num_new_matched_tokens(request("r3", blocks), 0) == (3 * BLOCK, False)


@pytest.mark.parametrize("tp", [1, 2])
def test_disk_hits_are_read_in_the_forward_with_one_rank_only(tp):
    """Each rank checks only its own objects: with two, a rank whose read failed could
    void its stores of that step, while the other stored its shards of the same
    blocks, computed over the bad one through the all-reduce. So with tensor
    parallelism a disk hit is staged and checked before the forward."""
    disk = {"path": "/tmp/tiercache-unit-disk-never-created"}
    cfg = build_config({"cpu": {"capacity": 4 * PAGE * len(LAYERS)}, "disk": disk})
    sched = TierCacheScheduler(
        cfg, [spec(r, tp) for r in range(tp)], kv_cache_config(64), worker_count=tp, kv_in_host_memory=True
    )
    block = b"d" * 32
    sched.policy.stored_on_disk(block)
    assert sched.get_num_new_matched_tokens(request("r", [block]), 0) == (BLOCK, tp > 1)


def test_a_void_store_frees_its_slot_and_leaves_the_block_unstored():
    """A worker voids a store whose block was computed over a failed load: the slot
    is free, the block is not in the CPU tier, and nothing keeps it from being
    stored, or offered, when it is computed again."""
    sched = make_scheduler(tp=2, slots=2)
    (op,) = store(sched, request("r1", [b"v" * 32]), [3, 4]).stores
    report(sched, (STORE_VOID, (op.block_hash, op.slot)), (RELEASED, op.slot), rank=0)
    report(sched, (FILLED, (op.block_hash, op.slot)), (RELEASED, op.slot), rank=1)  # its rank stored it
    assert op.block_hash not in sched.slots and sched.slots.pinned() == 0
    assert op.block_hash not in sched.load_failures
    (again,) = store(sched, request("r2", [b"v" * 32]), [5, 6]).stores
    report(sched, *[(FILLED, (again.block_hash, again.slot)), (RELEASED, again.slot)], rank=0)
    report(sched, *[(FILLED, (again.block_hash, again.slot)), (RELEASED, again.slot)], rank=1)
    assert sched.get_num_new_matched_tokens(request("r3", [b"v" * 32]), 0) == (BLOCK, False)


def test_each_store_names_the_synchronous_loads_its_request_reads():
    """r1 loads two CPU-tier blocks this step. r2, scheduled after it in the same step,
    shares them through vLLM's prefix cache (the same paged-KV blocks) and loads
    nothing; r3 shares nothing. The blocks r1 and r2 compute are computed over r1's
    loads, so the workers must know to void their stores should a load fail."""
    sched = make_scheduler(tp=1, slots=8)
    a, b = b"a" * 32, b"b" * 32
    for op in store(sched, request("r0", [a, b]), [1, 2, 3]).stores:
        report(sched, (FILLED, (op.block_hash, op.slot)), (RELEASED, op.slot))
    r1, r2, r3 = (
        request("r1", [a, b, b"c" * 32]),
        request("r2", [a, b, b"d" * 32]),
        request("r3", [b"e" * 32]),
    )
    assert sched.get_num_new_matched_tokens(r1, 0) == (2 * BLOCK, False)
    sched.update_state_after_alloc(r1, blocks_of([10, 11, 12]), 2 * BLOCK)
    assert sched.get_num_new_matched_tokens(r2, 2 * BLOCK) == (0, False)  # vLLM's own hit
    sched.update_state_after_alloc(r2, blocks_of([10, 11, 13]), 0)
    assert sched.get_num_new_matched_tokens(r3, 0) == (0, False)
    sched.update_state_after_alloc(r3, blocks_of([14]), 0)
    new = [
        new_request(r1, [10, 11, 12], 2 * BLOCK),
        new_request(r2, [10, 11, 13], 2 * BLOCK),
        new_request(r3, [14]),
    ]
    meta = sched.build_connector_meta(
        scheduler_output(new, scheduled={"r1": BLOCK + 1, "r2": BLOCK + 1, "r3": BLOCK + 1})
    )
    assert [(job.req_id, job.is_async) for job in meta.loads] == [("r1", False)]
    assert sorted(op.gpu_block for op in meta.stores) == [12, 13, 14]
    assert meta.store_reads == {"r1": [10, 11], "r2": [10, 11]}


def test_a_worker_voids_the_stores_computed_over_a_failed_synchronous_load():
    """A step loads r1's block synchronously, and the block is gone (evicted since the
    lookup): the forward computes r1's next block over whatever that page held, and
    r2's, which shares that block through vLLM's prefix cache. vLLM drops both
    outputs; the worker must not store those blocks either. r3's store, in the same
    step, is sound."""
    kv = {name: torch.zeros(16, *LAYER_SHAPE) for name in LAYERS}
    slot_bytes = PagedKVCopier(kv, 16).slot_bytes
    worker = TierCacheWorker(
        build_config({"cpu": {"capacity": 4 * slot_bytes}}),
        spec(0, 1),
        "m",
        16,
        tp_rank=0,
        writes_lower_tiers=False,
        disk_share=0,
    )
    worker.register_kv_caches(kv, slot_bytes)
    lost, over_it, shares_it, sound = b"l" * 32, b"a" * 32, b"s" * 32, b"b" * 32
    meta = TierCacheMetadata(
        loads=[LoadJob("r1", [BlockOp(lost, 1, -1, "")], is_async=False)],
        stores=[
            BlockOp(over_it, 2, 0, CPU, "r1"),
            BlockOp(shares_it, 4, 2, CPU, "r2"),
            BlockOp(sound, 3, 1, CPU, "r3"),
        ],
        store_reads={"r1": [1], "r2": [1]},
    )
    worker.start_load_kv(meta)
    for name in LAYERS:
        worker.wait_for_layer(name)
    worker.wait_for_save(meta)
    reports = [(kind, value) for _, kind, value in worker.take_worker_meta().reports]
    for void, slot in ((over_it, 0), (shares_it, 2)):
        assert (STORE_VOID, (void, slot)) in reports and (RELEASED, slot) in reports
        assert not [value for kind, value in reports if kind == FILLED and value[0] == void]
    assert (FILLED, (sound, 1)) in reports
    assert worker.take_failed_blocks() == {1}
    assert worker.take_stats().data["stored_blocks"] == 1
    worker.shutdown()


def test_a_prompt_chunked_over_steps_ends_its_s3_run_group_with_its_last_block():
    """Issue 18: a request's S3 run waited for the request to finish or for a short
    timer; a chunked prefill's next chunk came a forward later, and the timer split
    its run. The step that stores the prompt's last full block now says so."""
    sched = make_scheduler(tp=1, slots=16)
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
    req = request("r", hashes)
    gpu = list(range(6))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks_of(gpu), 0)
    first = sched.build_connector_meta(scheduler_output([new_request(req, gpu)], scheduled={"r": 3 * BLOCK}))
    assert [op.req_id for op in first.stores] == ["r"] * 3 and first.stores_done == []
    cached = SimpleNamespace(
        req_ids=["r"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[3 * BLOCK]
    )
    rest = sched.build_connector_meta(
        scheduler_output(cached=cached, scheduled={"r": req.num_tokens - 3 * BLOCK})
    )
    assert len(rest.stores) == 3 and rest.stores_done == ["r"]

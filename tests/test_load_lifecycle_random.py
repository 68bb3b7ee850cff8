"""The connector's two halves driven through random interleavings of what happens to
loads in a serving engine: arrivals sharing prefixes, hits from the CPU tier and
from disk, hook failures (before or after a hook's work), loads past their deadline
(the stagers held up), objects gone from disk, aborts while a load is in flight,
preemptions and sleeps. For a model with one KV cache group and one with two (full
attention and a sliding window), after every run:

- every request told "asynchronous hit" is reported exactly once (finished or failed);
- no block id is ever reported failed for the two-group model (vLLM's engine core
  raises on that), and for the one-group model only blocks of a request vLLM still
  looks at (one waiting for remote KV and reported in that step, or one scheduled in
  that step);
- a hit vLLM was told loaded holds in the paged KV what was stored for it;
- every CPU slot is released once the engine is idle.

A small stand-in for vLLM's scheduler plays vLLM's part; every decision is the
connector's own, on real worker copies and a real disk tier."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiercache.config import build_config
from tiercache.connector.groups import group_key
from tiercache.connector.metadata import TierCacheMetadata
from tiercache.connector.scheduler import TierCacheScheduler, slot_bytes_for
from tiercache.connector.worker import TierCacheWorker
from tiercache.index.keys import KVSpec

from support.scheduler_steps import no_cached_requests

BLOCK = 32  # tokens per block
NUM_BLOCKS = 96  # the paged KV's blocks, shared by the groups as vLLM's one pool is
PAGE_FLOATS = 2 * BLOCK * 2 * 16  # K and V, 2 heads of 16: vLLM's page for these specs
LAYERS_PER_GROUP = 2


def kv_specs(groups: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float32}
    specs = [FullAttentionSpec(**common)]
    if groups == 2:
        specs.append(SlidingWindowSpec(**common, sliding_window=2 * BLOCK))
    return specs


@dataclass
class Req:
    request_id: str
    block_hashes: list[bytes]
    num_tokens: int
    num_prompt_tokens: int
    state: str = "waiting"  # waiting, remote, running, sending, done
    blocks: tuple[list[int], ...] = ()
    hit: int = 0  # tokens the connector said it loads
    told_async: bool = False
    aborted: bool = False
    reported: int = 0
    failed_whole: bool = False
    failed_blocks: set[int] = field(default_factory=set)


class Harness:
    def __init__(self, tmp_path: Path, groups: int, seed: int):
        self.rng = random.Random(seed)
        self.groups = groups
        specs = kv_specs(groups)
        names = [[f"g{g}.layer{i}" for i in range(LAYERS_PER_GROUP)] for g in range(groups)]
        kv_config = SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(kv_cache_spec=spec, layer_names=layers)
                for spec, layers in zip(specs, names, strict=True)
            ],
            num_blocks=NUM_BLOCKS,
        )
        self.slot_bytes = slot_bytes_for(kv_config)
        settings = {
            "cpu": {"capacity": 12 * self.slot_bytes},  # small: blocks go to disk and come back
            "disk": {"path": str(tmp_path / "disk"), "load_in_forward": False},
            "movers": {"cost_model": "off", "load_deadline_seconds": 0.3, "workers": 2},
        }
        config = build_config(settings, environ={})
        rank = KVSpec("m", "", "float32", "auto", BLOCK, "rand", 2, 2, 16, 1, 0, "t", self.slot_bytes)
        self.sched = TierCacheScheduler(config, [rank], kv_config, worker_count=1)  # type: ignore[arg-type]
        # vLLM's hybrid layout: the i-th layer of every group views the same pages.
        memory = [torch.zeros(NUM_BLOCKS, PAGE_FLOATS) for _ in range(LAYERS_PER_GROUP)]
        self.kv = {name: memory[i] for layers in names for i, name in enumerate(layers)}
        self.memory = memory
        self.layers = [name for layers in names for name in layers]
        self.worker = TierCacheWorker(
            config,
            rank,
            rank.model_digest(),
            NUM_BLOCKS,
            tp_rank=0,
            writes_lower_tiers=True,
            disk_share=1 << 28,
            group_layers=names,
        )
        self.worker.register_kv_caches(self.kv, self.slot_bytes)
        assert self.worker.engine is not None, self.worker.disabled_reason
        self.disk = tmp_path / "disk"
        self.free = list(range(1, NUM_BLOCKS))  # block 0 is vLLM's null block
        self.requests: dict[str, Req] = {}
        self.count = 0
        self.gate: threading.Event | None = None
        self.preempted: set[str] = set()
        self.finished: set[str] = set()  # requests finished since the last step

    # -- what the forward computes: a pattern per block and group ------------------
    @staticmethod
    def pattern(key: bytes) -> float:
        return float(int.from_bytes(key[:3], "little") % 100_003 + 1)

    def compute(self, req: Req, first: int) -> None:
        for g, ids in enumerate(req.blocks):
            for i in range(first, len(req.block_hashes)):
                value = self.pattern(group_key(req.block_hashes[i], g))
                for pages in self.memory:
                    pages[ids[i]] = value

    def check_loaded(self, req: Req, meta_ops) -> None:
        """The blocks vLLM was told loaded hold what was stored under their keys."""
        good = len(meta_ops)
        for index, op in enumerate(meta_ops):
            if op.gpu_block in req.failed_blocks:
                good = min(good, index)
        if req.failed_whole:
            return
        for op in meta_ops[:good]:
            for pages in self.memory:
                assert torch.all(pages[op.gpu_block] == self.pattern(op.block_hash)), (req.request_id, op)

    # -- vLLM's part ---------------------------------------------------------------
    def arrive(self) -> None:
        prefix = self.rng.randrange(3)
        length = self.rng.randint(2, 5)
        hashes = [bytes([prefix, i]) * 16 for i in range(length)]
        if self.rng.random() < 0.3:
            hashes.append(self.rng.randbytes(32))  # a block no one else has
        self.count += 1
        tokens = len(hashes) * BLOCK + self.rng.randint(1, BLOCK - 1)
        req_id = f"r{self.count}"
        self.requests[req_id] = Req(req_id, hashes, tokens, tokens)

    def allocate(self, req: Req) -> bool:
        need = (len(req.block_hashes) + 1) * self.groups
        if len(self.free) < need:
            return False
        per_group = len(req.block_hashes) + 1
        req.blocks = tuple([self.free.pop() for _ in range(per_group)] for _ in range(self.groups))
        return True

    def release(self, req: Req) -> None:
        for ids in req.blocks:
            self.free.extend(ids)
        req.blocks = ()

    def step(self, fail_at: int | None, fail_after: bool, fail_finish: bool) -> None:
        sched = self.sched
        new, scheduled = [], {}
        loads_of: dict[str, list] = {}
        for req in list(self.requests.values()):
            if req.state == "waiting" and self.rng.random() < 0.7:
                tokens, is_async = sched.get_num_new_matched_tokens(req, 0)
                if not self.allocate(req):
                    continue
                tokens = tokens or 0
                blocks = SimpleNamespace(get_block_ids=lambda req=req: req.blocks)
                sched.update_state_after_alloc(req, blocks, tokens)
                req.hit, req.failed_blocks, req.failed_whole = tokens, set(), False
                if is_async:
                    req.state, req.told_async, req.reported = "remote", True, 0
                    continue
                new.append(req)
            elif req.state == "remote" and req.reported and not req.aborted:
                blocks = SimpleNamespace(get_block_ids=lambda req=req: req.blocks)
                sched.update_state_after_alloc(req, blocks, 0)
                new.append(req)
        for req in new:
            computed = 0 if req.failed_whole else req.hit
            for i, block in enumerate(req.blocks[0] if req.blocks else []):
                if block in req.failed_blocks:
                    computed = min(computed, i * BLOCK)
            req.hit = computed
            scheduled[req.request_id] = req.num_tokens - computed
            req.state = "running"
        output = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=r.request_id, block_ids=r.blocks, num_computed_tokens=r.hit)
                for r in new
            ],
            scheduled_cached_reqs=no_cached_requests(),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            preempted_req_ids=self.preempted,
        )
        self.preempted = set()
        meta: TierCacheMetadata = sched.build_connector_meta(output)
        for job in meta.loads:
            loads_of.setdefault(job.req_id, []).extend(job.ops)
            self.requests[job.req_id].loads = job.ops  # type: ignore[attr-defined]
        for req in new:
            self.compute(req, req.hit // BLOCK)
        self.run_worker(meta, fail_at, fail_after)
        # vLLM always asks for what finished, whatever happened to the step.
        finished, self.finished = self.finished, set()
        worker = self.worker
        try:
            if fail_finish:
                raise RuntimeError("injected")
            done = worker.get_finished(finished)
        except RuntimeError:
            done = worker.fail_loads_in_flight()
        failed_requests = worker.take_failed_requests()
        failed_blocks = worker.take_failed_blocks()
        sending = worker.take_finished_sending()
        self.check_reports(done | failed_requests, failed_requests, failed_blocks, new)
        worker_meta = worker.take_worker_meta()
        sched.update_connector_output(
            SimpleNamespace(kv_connector_worker_meta=worker_meta, finished_recving=done | failed_requests)
        )
        for req in new:  # a prompt and one token: over after its step, or preempted
            if self.rng.random() < 0.15:
                self.release(req)
                req.state = "waiting"
                self.preempted.add(req.request_id)
                continue
            self.finish(req)
        for req_id in sending:
            req = self.requests[req_id]
            if req.state == "sending":
                self.release(req)
                req.state = "done"

    def finish(self, req: Req) -> None:
        delay, _ = self.sched.request_finished(req)
        self.finished.add(req.request_id)
        if delay:
            req.state = "sending"
        else:
            self.release(req)
            req.state = "done"

    def check_reports(self, done: set[str], failed_requests: set[str], failed_blocks: set[int], new) -> None:
        if self.groups > 1:
            assert not failed_blocks, f"block ids reported for a multi-group model: {failed_blocks}"
        looked_at: set[int] = set()
        for req_id in done:
            req = self.requests[req_id]
            assert req.told_async and req.state == "remote", f"{req_id} reported but not waiting for it"
            req.reported += 1
            assert req.reported == 1, f"{req_id} reported {req.reported} times"
            req.failed_whole = req_id in failed_requests
            looked_at.update(req.blocks[0])
        for req in new:
            looked_at.update(req.blocks[0])
        stray = failed_blocks - looked_at
        assert not stray, f"failed blocks of no request vLLM looks at: {stray}"
        for req_id in done:
            req = self.requests[req_id]
            req.failed_blocks = failed_blocks & set(req.blocks[0])
            if not req.aborted:
                self.check_loaded(req, getattr(req, "loads", []))
            else:
                self.release(req)
                req.state = "done"
        for req in new:
            req.failed_blocks |= failed_blocks & set(req.blocks[0])

    def run_worker(self, meta: TierCacheMetadata, fail_at: int | None, fail_after: bool) -> None:
        """The step's hooks as the connector runs them: a hook that raises settles the
        step as a miss (`fail_step`) and the rest of its hooks do nothing."""
        worker = self.worker
        worker.track(meta)
        hooks = [
            lambda: worker.step_arrives(meta),
            lambda: worker.forward_begins(meta),
            lambda: worker.start_load_kv(meta),
        ]
        for name in self.layers:
            hooks.append(lambda name=name: worker.wait_for_layer(name))
            hooks.append(lambda name=name: worker.save_layer(name, meta))
        hooks.append(lambda: worker.wait_for_save(meta))
        for index, hook in enumerate(hooks):
            if index == fail_at and not fail_after:
                worker.fail_step(meta)
                return
            hook()
            if index == fail_at:
                worker.fail_step(meta)
                return

    # -- what goes wrong -------------------------------------------------------------
    def disturb(self) -> tuple[int | None, bool, bool]:
        rng = self.rng
        engine = self.worker.engine
        assert engine is not None
        if self.gate is None and rng.random() < 0.08:
            self.gate = threading.Event()
            for _ in range(2):
                engine._stagers.submit(self.gate.wait)  # loads wait past their deadline
        elif self.gate is not None and rng.random() < 0.4:
            if rng.random() < 0.5:
                time.sleep(0.35)
            self.gate.set()
            self.gate = None
        if rng.random() < 0.1:
            objects = [path for path in self.disk.rglob("*.safetensors") if not path.name.startswith(".")]
            if objects:
                rng.choice(objects).unlink(missing_ok=True)
        remote = [req for req in self.requests.values() if req.state == "remote" and not req.aborted]
        if remote and rng.random() < 0.1:
            req = rng.choice(remote)
            req.aborted = True
            self.sched.request_finished(req)
            self.finished.add(req.request_id)
            if req.reported:  # vLLM frees its blocks at once; else once it is reported
                self.release(req)
                req.state = "done"
        if rng.random() < 0.05:
            self.worker.unregister_kv_caches()  # sleep, then wake up on the same memory
            self.worker.restore_kv_caches()
        fail_at = rng.randrange(12) if rng.random() < 0.15 else None
        return fail_at, rng.random() < 0.5, rng.random() < 0.03

    def close(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self.worker.shutdown()
        self.sched.close()


@pytest.mark.parametrize("groups", [1, 2], ids=["one group", "two groups"])
@pytest.mark.parametrize("seed", range(4))
def test_every_load_ends_once_and_never_by_block_for_a_hybrid_model(tmp_path, groups, seed):
    harness = Harness(tmp_path, groups, seed)
    try:
        for _ in range(80):
            if harness.rng.random() < 0.5:
                harness.arrive()
            harness.step(*harness.disturb())
        # No more arrivals or faults: run until every request is done and every
        # write-down has ended.
        if harness.gate is not None:
            harness.gate.set()
            harness.gate = None
        deadline = time.monotonic() + 60
        while True:
            harness.step(None, False, False)
            busy = [r.request_id for r in harness.requests.values() if r.state not in ("done",)]
            assert harness.worker.engine is not None
            if not busy and harness.worker.engine.flush(0.01) and harness.sched.slots.pinned() == 0:
                break
            states = [
                (r.request_id, r.state, r.aborted, r.reported)
                for r in harness.requests.values()
                if r.state != "done"
            ]
            assert time.monotonic() < deadline, (states, len(harness.free), harness.sched.slots.pinned())
            time.sleep(0.005)
        told = [req for req in harness.requests.values() if req.told_async]
        assert told, "the run made no asynchronous load"
        assert all(req.reported == 1 for req in told)  # the last load of each
    finally:
        harness.close()

"""The GPU step path without host waits (issue 41), on CPU tensors: the worker's copies
run on a stand-in copy stream whose events read done only when the test lets them
(tests/support/fake_cuda.py), so what waits for a copy's end is seen to wait for its
event, polled in later hooks, and never for the host."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_layerwise import NUM_BLOCKS
from test_layerwise import make_worker as make_layerwise_worker

from tiercache.config import build_config
from tiercache.connector import worker as worker_module
from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.metadata import FILLED, RELEASED, BlockOp, LoadJob, TierCacheMetadata
from tiercache.connector.scheduler import TierCacheScheduler
from tiercache.connector.worker import TierCacheWorker
from tiercache.index.keys import KVSpec

from support.fake_cuda import FakeCopyStream
from support.scheduler_steps import blocks_of, new_request, scheduler_output
from support.worker_steps import vllm_step

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def paged_kv() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: torch.randn(NUM_BLOCKS, 2, 32, 16) for name in LAYERS}


@pytest.fixture
def stream() -> FakeCopyStream:
    return FakeCopyStream(lag=0)


def make_worker(kv, stream: FakeCopyStream, monkeypatch, fused: bool = False) -> TierCacheWorker:
    """A worker on the CUDA path's twin: copies queued on `stream`, whose events end late."""
    copier = functools.partial(PagedKVCopier, staged=True, fused=fused, stream=stream)
    monkeypatch.setattr(worker_module, "PagedKVCopier", copier)
    return make_layerwise_worker(kv)


def step(worker: TierCacheWorker, meta: TierCacheMetadata, finished=frozenset(), layers=LAYERS):
    """One step as vLLM's GPU model runner calls it; returns (reports, finished_sending)."""
    vllm_step(worker, meta, layers, finished)
    sending = worker.take_finished_sending()
    worker_meta = worker.take_worker_meta()
    return (worker_meta.counts() if worker_meta is not None else {}), sending


def stores(req_id: str, blocks: list[int], slots: list[int]) -> list[BlockOp]:
    return [BlockOp(bytes([b]) * 32, b, s, "cpu", req_id) for b, s in zip(blocks, slots, strict=True)]


def test_a_store_reaches_the_movers_and_frees_its_request_only_once_its_copy_event_reads_done(
    stream, monkeypatch
):
    kv = paged_kv()
    worker = make_worker(kv, stream, monkeypatch)
    try:
        stream.held = True  # the GPU has not got there yet
        reports, _ = step(worker, TierCacheMetadata(stores=stores("r1", [2, 3], [0, 1])))
        assert (FILLED, (bytes([2]) * 32, 0)) not in reports and (RELEASED, 0) not in reports
        # vLLM finished r1 and keeps its blocks (request_finished said so): not reported yet.
        reports, sending = step(worker, TierCacheMetadata(finished_storing=["r1"]), finished={"r1"})
        assert sending == set() and not reports
        assert stream.host_waits == 0  # every hook went straight on
        stream.held = False
        reports, sending = step(worker, TierCacheMetadata())
        assert sending == {"r1"}
        assert reports[(FILLED, (bytes([2]) * 32, 0))] == 1 and reports[(RELEASED, 1)] == 1
        for region in worker.copier.regions:  # the slot holds the block, layer after layer
            got = worker.buffer.tensor[0, region.offset : region.offset + region.nbytes]
            assert torch.equal(got, kv[region.name][2].reshape(-1).view(torch.uint8)), region.name
        assert stream.host_waits == 0
    finally:
        worker.shutdown()


def test_a_request_with_no_copy_in_flight_is_reported_at_once(stream, monkeypatch):
    worker = make_worker(paged_kv(), stream, monkeypatch)
    try:
        _, sending = step(worker, TierCacheMetadata(finished_storing=["r9"]), finished={"r9"})
        assert sending == {"r9"}
    finally:
        worker.shutdown()


def test_the_old_way_waits_in_the_hook_that_queued_the_copy(stream, monkeypatch):
    """benchmarks/gpu_step.py's comparison: the switch brings back a host wait per copy."""
    worker = make_worker(paged_kv(), stream, monkeypatch)
    worker.copies.host_waits = True
    try:
        stream.held = True
        reports, _ = step(worker, TierCacheMetadata(stores=stores("r1", [2], [0])))
        assert reports[(FILLED, (bytes([2]) * 32, 0))] == 1 and stream.host_waits == 1
    finally:
        worker.shutdown()


def test_a_preemption_makes_the_forward_wait_for_the_store_copies_in_flight(stream, monkeypatch):
    """vLLM frees a preempted request's blocks at once (no connector hook can delay
    it), and this step's forward may write them: its stream waits for the copies still
    reading them, on the GPU; a step with nothing to fence waits for nothing."""
    worker = make_worker(paged_kv(), stream, monkeypatch)
    try:
        stream.held = True
        step(worker, TierCacheMetadata(stores=stores("r1", [2, 3], [0, 1])))
        store_event = stream.events[-1]
        step(worker, TierCacheMetadata())
        assert store_event not in stream.forward_waited
        meta = TierCacheMetadata(fence_stores=True)
        worker.step_arrives(meta)  # vLLM's first call of the step, before it prepares inputs
        assert stream.forward_waited[-1] is store_event and stream.host_waits == 0
    finally:
        worker.shutdown()


def test_a_step_that_may_replay_a_full_graph_loads_whole_before_its_forward(stream, monkeypatch, interpreted):
    """A full CUDA graph replay calls no layer hook: the hit is copied whole in
    start_load_kv and the forward's stream waits for it; its slots go back once the
    copy's event reads done."""
    kv = paged_kv()
    worker = make_worker(kv, stream, monkeypatch, fused=True)
    want = {name: t[[0, 1]].clone() for name, t in kv.items()}
    worker.copier.to_slots([0, 1], [3, 4], worker.buffer)  # the hit, in its slots (set-up: waits)
    stream.host_waits = 0
    try:
        step(worker, TierCacheMetadata())  # every layer's hook came: layer by layer from now on
        assert worker._loads.layer_order is not None
        stream.held = True
        ops = [BlockOp(bytes([i]) * 32, gpu, slot, "cpu") for i, (gpu, slot) in enumerate([(8, 3), (9, 4)])]
        meta = TierCacheMetadata(loads=[LoadJob("r", ops, False)], full_graph=True)
        worker.step_arrives(meta)
        worker.forward_begins(meta)
        worker.start_load_kv(meta)
        assert worker._loads.layerwise == []  # not left for hooks a replay would skip
        assert stream.forward_waited[-1] is stream.events[-1]
        assert all(torch.equal(kv[n][[8, 9]], want[n]) for n in LAYERS)
        worker.wait_for_save(meta)  # no layer hook in between: a graph replay
        worker.get_finished()
        assert (RELEASED, 3) not in worker.take_worker_meta().counts()
        stream.held = False
        worker.get_finished()
        assert worker.take_worker_meta().counts()[(RELEASED, 3)] == 1
        assert stream.host_waits == 0
    finally:
        worker.shutdown()


# -- the scheduler's half --------------------------------------------------------------
BLOCK = 32
PAGE = 4096


def make_scheduler(kv_in_host_memory: bool) -> TierCacheScheduler:
    spec = KVSpec("m", "", "float32", "auto", BLOCK, "cpu::FullAttentionSpec", 2, 2, 16, 1, 0, "t", 2 * PAGE)
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=PAGE), layer_names=["a", "b"])
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group], num_blocks=64)
    config = build_config({"cpu": {"capacity": 16 * 2 * PAGE}})
    return TierCacheScheduler(
        config, [spec], kv_cache_config, worker_count=1, kv_in_host_memory=kv_in_host_memory
    )


def request(req_id: str, n_blocks: int, first_hash: int):
    tokens = n_blocks * BLOCK + 1
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=[bytes([first_hash + i]) * 32 for i in range(n_blocks)],
        num_tokens=tokens,
        num_prompt_tokens=tokens,
    )


def prefill(sched: TierCacheScheduler, req, blocks: list[int], preempted=()) -> TierCacheMetadata:
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks_of(blocks), 0)
    output = scheduler_output([new_request(req, blocks)], scheduled={req.request_id: req.num_tokens})
    output.preempted_req_ids = set(preempted)
    return sched.build_connector_meta(output)


def test_the_scheduler_keeps_blocks_only_of_requests_whose_store_copies_may_be_in_flight():
    sched = make_scheduler(kv_in_host_memory=False)
    stored, nothing = request("stored", 2, 10), request("nothing", 0, 20)
    assert prefill(sched, stored, [1, 2, 3]).stores
    assert not prefill(sched, nothing, [4]).stores
    assert sched.request_finished(stored) == (True, None)
    assert sched.request_finished(nothing) == (False, None)
    # The workers hear of it in the next step, and only once.
    assert sched.build_connector_meta(scheduler_output()).finished_storing == ["stored"]
    assert sched.build_connector_meta(scheduler_output()).finished_storing == []


def test_on_the_cpu_backend_copies_end_in_their_hook_and_nothing_is_kept():
    sched = make_scheduler(kv_in_host_memory=True)
    req = request("r", 2, 10)
    assert prefill(sched, req, [1, 2, 3]).stores
    assert sched.request_finished(req) == (False, None)


def test_a_preempted_storing_request_fences_the_next_forward_instead_of_keeping_blocks():
    sched = make_scheduler(kv_in_host_memory=False)
    req, other = request("r", 2, 10), request("o", 2, 30)
    prefill(sched, req, [1, 2, 3])
    meta = prefill(sched, other, [5, 6, 7], preempted={"r"})
    assert meta.fence_stores
    assert sched.request_finished(req) == (False, None)  # its copies are fenced already
    assert not sched.build_connector_meta(scheduler_output()).fence_stores


# -- benchmarks/gpu_step.py ------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_step_benchmark_runs_both_variants_on_the_cpu_backend(tmp_path):
    """What a lent GPU runs (8, 32 and 80 layers x batch 1, 8 and 64), here tiny: every
    (layers, batch) with and without host waits, each replay reading every block right."""
    out = tmp_path / "gpu_step.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--device", "cpu"]
    command += [
        "--layers",
        "2",
        "3",
        "--batches",
        "1",
        "2",
        "--repeats",
        "1",
        "--heads",
        "2",
        "--head-size",
        "8",
    ]
    done = subprocess.run(command + ["--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(run["layers"], run["batch"], run["variant"]): run for run in report["runs"]}
    assert set(rows) == {
        (layers, batch, variant) for layers in (2, 3) for batch in (1, 2) for variant in ("waits", "events")
    }
    steps = report["steps_per_run"]
    for (layers, batch, _), run in rows.items():
        assert set(run) >= {"hook_ms_per_step", "syncs_per_step", "step_ms"}
        # Every decode and hit step reads every stored block at every layer.
        assert run["reads_checked"] == layers * 2 * batch * (steps - 1)
        assert run["syncs_per_step"] == 0  # the CPU backend has no stream to wait for
    lines = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["2"], ["3"])]
    assert len(lines) == 8 and all(len(line) == 6 for line in lines)

"""vLLM's GPU call order, replayed (issue 20, item 3).

tests/data/connector_calls.json holds the connector calls of one real engine session
on vLLM's CPU build (whose model runner is the GPU model runner), recorded by
scripts/record_connector_calls.py: hits from the CPU tier, disk and S3, stores,
preemptions and aborts. Here the worker half replays them without vLLM, on CPU
tensors in FlashAttention's and FlashInfer's GPU layouts, copied by the CPU backend's
threads or by the CUDA path's kernels under Triton's interpreter; the forward checks,
layer by layer, that every block it reads holds the KV of its block hash
(tests/support/replay.py). The CUDA path's twin runs with a stand-in for the copy
stream whose events read done only later (tests/support/fake_cuda.py), and no hook
may wait for the GPU. On a lent GPU, scripts/gpu_replay.py runs the same
replay on CUDA tensors, where the CUDA streams and events are exercised too."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.connector import worker as worker_module
from tiercache.connector.copier import PagedKVCopier

from support.fake_cuda import FakeCopyStream
from support.replay import Replay, expected_result, recorded_reports, with_swapped_slots

ROOT = Path(__file__).resolve().parent.parent
RECORDING = ROOT / "tests" / "data" / "connector_calls.json"
# How vLLM's model runner ends every step, forward or not.
STEP_END = [
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "build_connector_worker_meta",
    "clear_connector_metadata",
]


@pytest.fixture(scope="module")
def recording() -> dict:
    return json.loads(RECORDING.read_text())


@pytest.fixture
def tiers(tmp_path, redis, redis_url, s3_endpoint, bucket) -> dict:
    # `redis` empties the shared Redis: an index entry left by an earlier replay would
    # make this one skip its upload, as a writer does for an object already indexed.
    return {
        "redis_url": redis_url,
        "disk": {"path": str(tmp_path / "disk"), "capacity": 1 << 30},
        "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1", "capacity": 1 << 30},
    }


def steps(calls: list) -> list[list]:
    """The calls grouped by step: from a handle_preemptions to the next one (set-up
    and shutdown apart)."""
    out: list[list] = []
    for call in calls:
        if call[0] in ("handle_preemptions", "shutdown") or not out:
            out.append([])
        out[-1].append(call)
    return out


def test_the_recording_holds_what_the_replay_needs(recording):
    summary = recording["summary"]
    assert {"cpu", "disk", "s3"} <= set(summary["loaded_blocks_by_tier"])
    assert set(summary["loaded_reads_checked"]) == {"cpu", "disk", "s3"}
    assert summary["preemptions"] > 0 and summary["resumed"] > 0
    assert len(summary["aborted"]) == 2
    assert summary["failed_blocks"] == 0
    assert RECORDING.stat().st_size < 1 << 20


def test_the_recording_shows_vllms_gpu_call_order(recording):
    """start_load_kv comes before the forward exactly in steps with synchronous loads;
    the forward waits for each layer before saving it; the step ends as vLLM's model
    runner ends it."""
    schedule = {step["step"]: step for step in recording["schedule"]}
    layers = recording["kv"]["layers"]
    sync_steps = forward_steps = 0
    for calls in steps(recording["workers"]["0"]):
        names = [call[0] for call in calls]
        if names == ["register_kv_caches"] or names == ["shutdown"]:
            continue
        assert names[:2] == ["handle_preemptions", "bind"], names
        step = schedule[calls[1][1]["step"]]
        assert calls[0][1] == step["step"]
        forward = [i for i, name in enumerate(names) if name in ("wait_for_layer_load", "save_kv_layer")]
        start = names.index("start_load_kv")
        if forward:
            forward_steps += 1
            layer_calls = [calls[i] for i in forward]
            # Per layer: wait for its load, (attention), hand its KV over; in that order.
            assert [c[0] for c in layer_calls] == ["wait_for_layer_load", "save_kv_layer"] * len(layers)
            assert [c[1] for c in layer_calls[::2]] == [c[1] for c in layer_calls[1::2]]
            assert {c[1] for c in layer_calls} == set(layers)
            before = start < forward[0]
            assert before == step["sync_loads"], (step["step"], names)
            sync_steps += before
        else:
            assert not step["tokens"]
        assert names[-len(STEP_END) :] == STEP_END, names
        if not step["sync_loads"]:  # started right after the forward was launched
            assert names[start + 1] == "wait_for_save", names
    assert sync_steps == recording["summary"]["steps_with_sync_loads"] > 0
    assert forward_steps == recording["summary"]["steps_with_forward"]


@pytest.fixture(params=["threads (CPU backend)", "per-layer kernels (CUDA path's twin)"])
def copy_path(request, monkeypatch):
    """The copy path, and the stand-in copy stream it runs on (None: none)."""
    stream = None
    if request.param.startswith("per-layer"):
        request.getfixturevalue("interpreted")
        stream = FakeCopyStream(lag=1)  # each event reads done a query after it is first asked
        kernels = functools.partial(PagedKVCopier, staged=True, fused=True, stream=stream)
        monkeypatch.setattr(worker_module, "PagedKVCopier", kernels)
    return request.param, stream


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer"])
def test_replay_in_vllms_order_reads_every_block_as_written(recording, tiers, layout, copy_path):
    _, stream = copy_path
    result = Replay(recording, layout, tiers).run()  # fails should any hook wait for the GPU
    assert not result.hook_waits
    if stream is not None:
        # Copies were ordered by events: stores and loads marked, the forward made to
        # wait for loads, and nothing waited for on the host until shutdown.
        assert len(stream.events) > 10 and stream.forward_waited
        assert stream.host_waits <= 1  # shutdown's drain, if anything was left
    expected = expected_result(recording)
    assert result.steps == expected["steps"]
    # Every loaded block, checked at every layer of every forward that reads it.
    assert dict(result.loaded_reads_checked) == expected["loaded_reads_checked"]
    assert result.reads_checked == expected["reads_checked"]
    assert dict(result.hits) == expected["hits"]
    # Fills (stores and staged loads) are reported in the same steps as recorded;
    # releases of write-downs may come later than the engine's last step.
    recorded = recorded_reports(recording)
    for kind in ("filled", "fill_failed"):
        assert {k: v for k, v in result.reports.items() if k[0] == kind} == {
            k: v for k, v in recorded.items() if k[0] == kind
        }
    released = {k: v for k, v in recorded.items() if k[0] == "released"}
    assert all(result.reports[k] >= v for k, v in released.items())


def test_replay_fails_when_loads_start_after_the_forward_that_reads_them(recording, tiers):
    """vLLM's order broken on purpose: a synchronous CPU hit started after the forward."""
    with pytest.raises(AssertionError, match="loaded from cpu.*does not hold its KV"):
        Replay(recording, "flashinfer", tiers, loads_after_forward=True).run()


def test_replay_fails_when_a_load_puts_the_wrong_bytes_in_a_block(recording, tiers):
    """Two blocks of the first CPU hit swap slots: each gets the other's KV."""
    with pytest.raises(AssertionError, match="loaded from cpu.*does not hold its KV"):
        Replay(with_swapped_slots(recording), "flash_attn", tiers).run()


def test_replay_fails_when_a_hook_waits_for_the_gpu(recording, tiers, interpreted, monkeypatch):
    """The old way, each copy waited for in the hook that queued it (kept for
    benchmarks/gpu_step.py): the replay names the first hook that held the host."""
    stream = FakeCopyStream(lag=1)
    kernels = functools.partial(PagedKVCopier, staged=True, fused=True, stream=stream)
    monkeypatch.setattr(worker_module, "PagedKVCopier", kernels)
    replay = Replay(recording, "flash_attn", tiers)
    replay.worker.copies.host_waits = True
    with pytest.raises(AssertionError, match=r"step \d+: \w+ waited for the GPU"):
        replay.run()


def test_the_gpu_replay_script_passes_on_the_cpu_backend(tmp_path):
    """scripts/gpu_replay.py is what runs this replay on a lent GPU (with the stream
    variants only CUDA has). Here it runs its CPU path end to end: both layouts read
    every block as written, and both broken variants are caught."""
    out = tmp_path / "replay.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_replay.py"), "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    for layout in ("flash_attn", "flashinfer"):
        run = report["replays"][layout]
        assert {key: run[key] for key in report["expected"]} == report["expected"]
    assert set(report["broken"]) == {"loads after the forward", "swapped slots"}
    assert all(not run["ok"] and "does not hold its KV" in run["error"] for run in report["broken"].values())

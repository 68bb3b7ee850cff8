"""vLLM's recorded connector calls (tests/data/connector_calls.json) replayed on a CUDA
GPU: the worker's CUDA path against vLLM's call order, with a real redis-server, moto's
S3 server and a disk folder (tests/support/replay.py). On CUDA the worker copies
through page-locked CPU slots on the copier's stream, the forward's stream waits on
each loaded layer's event, and stores are copied out layer by layer as the forward
writes them; the replay's forward checks what each layer reads on the forward's
stream, so an unordered copy shows up as wrong KV.

It passes when the replay reads every block as written, in both GPU layouts, and when
each broken variant fails, which shows that the check sees what it is there to see:

  loads after the forward   vLLM's order broken: every start_load_kv after the forward
  swapped slots             two blocks of the first CPU hit swap their slots
  copies not after forward  the copy stream no longer waits for the forward's stream,
                            so a store copies a layer before the forward wrote it
  forward not waiting       the forward's stream no longer waits for a layer's load
                            (and the copy stream is held back a little)

The last two exist on CUDA only. It also counts the host synchronisations inside the
worker's per-layer hooks (`wait_for_layer_load`, `save_kv_layer`), which should be
none: each would hold vLLM's host thread mid-forward; an explicit wait for the GPU
(connector/sync.host_wait) in any hook of a step fails the replay.

Needs torch, Triton, a CUDA GPU, redis-server (on PATH) and tiercache's Python
dependencies; no vLLM, no install of tiercache:

    python scripts/gpu_replay.py --out replay.json
    python scripts/gpu_replay.py --device cpu    # the CPU backend's path, for comparison
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The tests' helpers (tests/support/) import as `support.*`.
sys.path.insert(0, str(ROOT / "tests"))
import tiercache  # noqa: E402

if not (Path(tiercache.__path__[0]) / "tiers").exists():
    # From a checkout, tiers/ and connector/ sit beside tiercache/ (pyproject maps them).
    tiercache.__path__.append(str(ROOT))

import boto3  # noqa: E402

from tiercache.connector import copier as copier_module  # noqa: E402
from tiercache.connector import layerwise_gpu  # noqa: E402
from tiercache.ops.local_stack import RedisServer, start_moto  # noqa: E402

from support.replay import Replay, expected_result, with_swapped_slots  # noqa: E402

RECORDING = ROOT / "tests" / "data" / "connector_calls.json"
LAYOUTS = ("flash_attn", "flashinfer")
WRONG_KV = "does not hold its KV"


@contextmanager
def copies_not_after_forward():
    """The copier's stream no longer waits for the forward's stream."""
    original = copier_module.PagedKVCopier.queued_after_forward

    @contextmanager
    def unordered(self):
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream.stream):
            yield

    copier_module.PagedKVCopier.queued_after_forward = unordered
    try:
        yield
    finally:
        copier_module.PagedKVCopier.queued_after_forward = original


@contextmanager
def forward_not_waiting(hold_cycles: int):
    """The forward's stream no longer waits for a layer's load; each load's copies are
    queued behind a GPU sleep, as a busy PCIe link would hold them."""
    load_class = layerwise_gpu.StreamLayerwiseLoad
    original_init, original_wait = load_class.__init__, load_class.wait

    def held_init(self, copier, *args, **kwargs):
        if copier.stream is not None:
            with copier.queued_after_forward():
                torch.cuda._sleep(hold_cycles)
        original_init(self, copier, *args, **kwargs)

    load_class.__init__ = held_init
    load_class.wait = lambda self, name: None
    try:
        yield
    finally:
        load_class.__init__, load_class.wait = original_init, original_wait


def replay_once(recording, layout, tiers_for, device, cycles, **kwargs) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = Replay(
            recording, layout, tiers_for(), device=device, attention_cycles=cycles, **kwargs
        ).run()
    except AssertionError as error:
        return {"ok": False, "error": str(error), "seconds": round(time.perf_counter() - started, 2)}
    return {
        "ok": True,
        "seconds": round(time.perf_counter() - started, 2),
        "steps": result.steps,
        "reads_checked": result.reads_checked,
        "loaded_reads_checked": dict(result.loaded_reads_checked),
        "hits": dict(result.hits),
        # Host synchronisations inside vLLM's per-layer hooks (CUDA): each one would
        # hold vLLM's host thread mid-forward until the GPU caught up.
        "hook_syncs": dict(result.hook_syncs),
        # Explicit waits for the GPU in any hook (connector/sync.host_wait): the replay
        # fails on the first, so a run that passed counted none.
        "hook_waits": dict(result.hook_waits),
        "sync_sites": dict(result.sync_sites),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--attention-cycles",
        type=int,
        default=2_000_000,
        help="GPU sleep per layer between the forward's reads and writes (about 1 ms on an H200)",
    )
    parser.add_argument(
        "--hold-cycles", type=int, default=2_000_000, help="copy-stream hold, 'forward not waiting'"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    recording = json.loads(RECORDING.read_text())
    expected = expected_result(recording)

    redis_server = RedisServer().start()
    s3 = start_moto()
    workdir = Path(tempfile.mkdtemp(prefix="tiercache-gpu-replay-"))
    s3_client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")

    def tiers_for() -> dict[str, Any]:
        """Fresh tiers for each replay: an empty Redis, disk folder and bucket, as the
        recording's first step found them."""
        import redis

        redis.Redis.from_url(redis_server.url).flushdb()
        bucket = f"replay-{uuid.uuid4().hex[:10]}"
        s3_client.create_bucket(Bucket=bucket)
        disk = workdir / bucket
        return {
            "redis_url": redis_server.url,
            "disk": {"path": str(disk), "capacity": 1 << 30},
            "s3": {"bucket": bucket, "endpoint_url": s3.url, "region": "us-east-1", "capacity": 1 << 30},
        }

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "torch": torch.__version__,
        "attention_cycles": args.attention_cycles if on_cuda else 0,
        "expected": expected,
        "replays": {},
        "broken": {},
    }
    failures: list[str] = []
    try:
        for layout in LAYOUTS:
            run = replay_once(recording, layout, tiers_for, device, args.attention_cycles)
            report["replays"][layout] = run
            got = {key: run.get(key) for key in expected}
            if not run["ok"] or got != expected:
                failures.append(f"{layout}: {run.get('error') or got}")
            print(f"replay {layout}: {json.dumps(run)}", flush=True)

        broken: dict[str, tuple[dict[str, Any], dict[str, Any], Any]] = {
            "loads after the forward": (recording, {"loads_after_forward": True}, None),
            "swapped slots": (with_swapped_slots(recording), {}, None),
        }
        if on_cuda:
            broken["copies not after forward"] = (recording, {}, copies_not_after_forward)
            broken["forward not waiting"] = (recording, {}, lambda: forward_not_waiting(args.hold_cycles))
        for name, (data, kwargs, patch) in broken.items():
            layout = LAYOUTS[len(report["broken"]) % 2]
            if patch is None:
                run = replay_once(data, layout, tiers_for, device, args.attention_cycles, **kwargs)
            else:
                with patch():
                    run = replay_once(data, layout, tiers_for, device, args.attention_cycles, **kwargs)
            run["layout"] = layout
            report["broken"][name] = run
            if run["ok"] or WRONG_KV not in run["error"]:
                failures.append(f"broken variant '{name}' was not caught: {run}")
            print(f"broken '{name}' ({layout}): {json.dumps(run)}", flush=True)
    finally:
        s3.stop()
        redis_server.close()
        shutil.rmtree(workdir, ignore_errors=True)

    report["failures"] = failures
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

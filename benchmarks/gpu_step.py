"""The GPU step path with and without host waits (issue 41), in one run.

Replays vLLM's connector call order (tests/support/replay.py) on workloads made
here: per batch size B, a prefill of B requests whose prompt blocks are stored, decode
steps reading them, then B requests that hit those blocks in the CPU tier (loaded
layer by layer) and decode. Each workload runs with 8, 32 and 80 layers at batch sizes
1, 8 and 64, twice:

  waits   the old way: each copy waited for on the host in the hook that queued it
          (TierCacheWorker.copies.host_waits, kept for this comparison only)
  events  this change: copies ordered by CUDA events, polled in later hooks

and prints per step, for each: the host time spent in the connector's hooks, the
explicit host synchronisations (connector/sync.host_wait) in them, and the step's
wall time from binding its metadata to its worker metadata. The replay checks every
block the forward reads at every layer (read back at each step's end, as vLLM reads
back a step's sampled tokens), so both variants also prove they load and store right.

On CUDA the forward is a GPU sleep per layer (`--attention-cycles`) plus the replay's
reads and writes; each slot holds `--heads` x `--head-size` x 16 tokens of float32 K and
V per layer. Needs torch (and Triton for the one-launch copy) and tiercache's
dependencies; no vLLM, Redis or S3:

    python benchmarks/gpu_step.py --out gpu_step.json           # a CUDA GPU, under 8 minutes
    python benchmarks/gpu_step.py --device cpu --layers 2 --batches 1 2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
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

from support import replay as replay_module  # noqa: E402
from support.replay import Replay  # noqa: E402

PROMPT_BLOCKS = 2  # full blocks per prompt, each stored then hit
DECODE_STEPS = 3
VARIANTS = {"waits": True, "events": False}  # name -> host waits for copies


def workload(layers: int, batch: int) -> dict[str, Any]:
    """A recording of vLLM's calls for one rank (the format of
    scripts/record_connector_calls.py): B prompts prefilled and stored, decoded, then
    B prompts hitting them in the CPU tier, decoded."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    stored = PROMPT_BLOCKS * batch
    prefix = [(i, j) for i in range(batch) for j in range(PROMPT_BLOCKS)]
    number = {pair: 1 + k for k, pair in enumerate(prefix)}  # a block's hash, as a number
    first_gpu = {pair: k for k, pair in enumerate(prefix)}
    partial = [stored + i for i in range(batch)]
    hit_gpu = {pair: stored + batch + k for k, pair in enumerate(prefix)}
    hit_partial = [2 * stored + batch + i for i in range(batch)]
    num_blocks = 2 * stored + 2 * batch
    while num_blocks in (2, replay_module.BLOCK_SIZE, replay_module.HEADS, replay_module.HEAD_SIZE):
        num_blocks += 1  # no block interior dimension may share the block count
    slot = {pair: k for k, pair in enumerate(prefix)}

    calls: list[list] = [["register_kv_caches"]]
    schedule: list[dict[str, Any]] = []

    def meta(n: int, stores=(), loads=()) -> dict[str, Any]:
        return {"step": n, "write_backs": [], "loads": list(loads), "stores": list(stores), "idle": False}

    def add_step(m, reads, writes, sync_loads, stats, hits, reports) -> None:
        n = m["step"]
        schedule.append(
            {"step": n, "sync_loads": sync_loads, "tokens": len(writes), "reads": reads, "writes": writes}
        )
        calls.append(["handle_preemptions", n])
        calls.append(["bind", m])
        if sync_loads:
            calls.append(["start_load_kv"])
        for name in names:
            calls.append(["wait_for_layer_load", name])
            calls.append(["save_kv_layer", name])
        if not sync_loads:
            calls.append(["start_load_kv"])
        calls.extend(
            [
                ["wait_for_save"],
                ["get_finished", [], None],
                ["get_block_ids_with_load_errors", []],
                ["get_kv_connector_stats", stats],
                ["build_connector_worker_meta", reports, hits],
                ["clear_connector_metadata"],
            ]
        )

    n = 1
    stores = [[number[p], first_gpu[p], slot[p], "cpu"] for p in prefix]
    writes = [[first_gpu[p], number[p]] for p in prefix] + [[b, -1] for b in partial]
    add_step(meta(n, stores=stores), [], writes, False, {"stored_blocks": stored}, {}, [])
    reads = [[first_gpu[p], number[p], None] for p in prefix]
    for _ in range(DECODE_STEPS):
        n += 1
        add_step(meta(n), reads, [[b, -1] for b in partial], False, {}, {}, [])
    n += 1
    loads = [
        {
            "req": f"hit{i}",
            "async": False,
            "ops": [[number[(i, j)], hit_gpu[(i, j)], slot[(i, j)], "cpu"] for j in range(PROMPT_BLOCKS)],
        }
        for i in range(batch)
    ]
    hit_reads = [[hit_gpu[p], number[p], "cpu"] for p in prefix]
    add_step(
        meta(n, loads=loads),
        hit_reads,
        [[b, -1] for b in hit_partial],
        True,
        {"loaded_blocks_cpu": stored},
        {"cpu": stored},
        [],
    )
    for _ in range(DECODE_STEPS):
        n += 1
        add_step(meta(n), hit_reads, [[b, -1] for b in hit_partial], False, {}, {}, [])
    calls.append(["shutdown"])
    return {
        "kv": {"layers": {name: {} for name in names}, "num_blocks": num_blocks, "cpu_slots": stored + 1},
        "schedule": schedule,
        "workers": {"0": calls},
    }


def run_once(recording, device: str, cycles: int, waits: bool) -> dict[str, float]:
    result = Replay(
        recording, "flashinfer", {}, device=device, attention_cycles=cycles, host_waits_for_copies=waits
    ).run()
    steps = result.steps
    return {
        "hook_ms_per_step": 1000 * sum(result.hook_seconds.values()) / steps,
        "syncs_per_step": sum(result.hook_waits.values()) / steps,
        "implicit_syncs_per_step": sum(result.hook_syncs.values()) / steps,
        "step_ms": 1000 * statistics.mean(result.step_seconds),
        "reads_checked": result.reads_checked,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 80])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, after one warm-up")
    parser.add_argument("--heads", type=int, default=8, help="KV heads per layer in the replay's blocks")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument(
        "--attention-cycles", type=int, default=200_000, help="GPU sleep per layer of the forward (CUDA)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    replay_module.HEADS, replay_module.HEAD_SIZE = args.heads, args.head_size
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "block": {"tokens": replay_module.BLOCK_SIZE, "heads": args.heads, "head_size": args.head_size},
        "attention_cycles": args.attention_cycles if args.device == "cuda" else 0,
        "steps_per_run": 2 + 2 * DECODE_STEPS,
        "runs": [],
    }
    header = (
        f"{'layers':>6} {'batch':>5} {'variant':>7} {'hook ms/step':>12} {'syncs/step':>10} {'step ms':>8}"
    )
    print(header, flush=True)
    for layers in args.layers:
        for batch in args.batches:
            recording = workload(layers, batch)
            for variant, waits in VARIANTS.items():
                run_once(recording, args.device, args.attention_cycles, waits)  # warm-up: kernels built
                runs = [
                    run_once(recording, args.device, args.attention_cycles, waits)
                    for _ in range(args.repeats)
                ]
                row = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                row.update(layers=layers, batch=batch, variant=variant)
                report["runs"].append(row)
                print(
                    f"{layers:>6} {batch:>5} {variant:>7} {row['hook_ms_per_step']:>12.3f} "
                    f"{row['syncs_per_step']:>10.2f} {row['step_ms']:>8.3f}",
                    flush=True,
                )
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"done in {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

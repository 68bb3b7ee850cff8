"""Record vLLM's calls to the connector on a real engine, for the replay test
(tests/test_replay_vllm_calls.py, issue 20 item 3).

One engine session of vLLM's CPU build with a tiny random Llama, redis-server and an
S3 server (moto) on loopback, and the connector wrapped by
support.recording. The workload gives hits from every tier (CPU, disk, S3),
stores, preemptions (a KV cache too small for three decoding requests) and aborts (one
request waiting for its disk or S3 load, one decoding). The per-process call logs are
merged into one JSON file:

    .venv/bin/python scripts/record_connector_calls.py [--out tests/data/connector_calls.json]

In the file, block hashes are numbered in order of appearance; each step of the
schedule says which blocks its forward reads (every full block below the request's
computed tokens, with the tier it was loaded from, if any) and writes, each as
(GPU block, hash number); "workers" holds each rank's calls in the order vLLM made
them. The script refuses a recording in which a tier gave no hit or a load failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# The tests' helpers (tests/support/) import as `support.*`.
TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

BLOCK = 32
LAYERS = 4
KV_HEADS = 2
HEAD_SIZE = 64  # hidden 256 over 4 heads
BLOCK_BYTES = LAYERS * KV_HEADS * BLOCK * 2 * HEAD_SIZE * 4  # float32, every layer
NUM_BLOCKS = 20  # three requests decoding to 8 blocks each do not fit: preemption
CPU_SLOTS = 10
DISK_OBJECTS = 14  # more than the CPU tier: a block falls out of the CPU tier first


def prompts() -> dict[str, list[int]]:
    rng = random.Random(20)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 2000) for _ in range(n)]

    out = {name: tokens(4 * BLOCK + 5) for name in "ABCD"}  # four loadable blocks each
    out.update({name: tokens(3 * BLOCK) for name in "EFG"})
    out["I"] = tokens(3 * BLOCK + 3)
    out["nudge"] = tokens(7)  # less than a block: carries worker reports, stores nothing
    return out


def drive(llm) -> dict:
    """The workload, step by step through the engine; returns what it did."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    ids = prompts()
    done: dict[str, list] = {"submitted": [], "aborted": []}
    counter = Counter()

    def submit(name: str, max_tokens: int = 1) -> str:
        counter[name] += 1
        req_id = f"{name}{counter[name]}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False, ignore_eos=True)
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=ids[name]), params)
        done["submitted"].append(req_id)
        return req_id

    def run() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    def settle() -> None:
        # Write-downs to disk and S3 end in the background; a request with no full
        # block then carries their reports to the scheduler before the next lookup.
        time.sleep(0.6)
        submit("nudge")
        run()

    submit("A")  # cold: stored
    run()
    settle()
    submit("A")  # a CPU hit, loaded before the forward
    run()
    for name in "BCD":  # cold: A leaves the CPU tier, then A's first blocks the disk
        submit(name)
        run()
        settle()
    submit("A")  # from S3 (promoted to disk on the way)
    run()
    settle()
    submit("B")  # from disk, the rest from the CPU tier
    run()
    settle()
    for name in "EFG":  # decode past the KV cache: preempted, resumed with a CPU hit
        submit(name, max_tokens=140)
    run()
    settle()
    waiting = submit("A")  # a disk or S3 hit again: aborted while its load is in flight
    engine.step()
    engine.abort_request([waiting])
    done["aborted"].append(waiting)
    decoding = submit("I", max_tokens=64)
    for _ in range(6):
        engine.step()
    engine.abort_request([decoding])
    done["aborted"].append(decoding)
    run()
    settle()
    return done


def run_engine(model: str, extra: dict, record_dir: Path) -> dict:
    from vllm import LLM

    from support.recording import RECORD_DIR_ENV

    os.environ[RECORD_DIR_ENV] = str(record_dir)
    # vLLM's engine core (another process) imports the recording connector too.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("PYTHONHASHSEED", "0")
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=16 * BLOCK,
        kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_BYTES,
        enable_prefix_caching=False,
        enforce_eager=True,
        kv_transfer_config={
            "kv_connector": "RecordingTierCacheConnector",
            "kv_connector_module_path": "support.recording",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    done = drive(llm)
    # Each worker's connector shuts down (and records it) with the engine core.
    llm.llm_engine.engine_core.shutdown()
    return done


# -- merging the logs ----------------------------------------------------------------
class Hashes:
    """Block hashes numbered in order of first appearance."""

    def __init__(self):
        self.numbers: dict[str, int] = {}

    def __call__(self, hex_hash: str) -> int:
        return self.numbers.setdefault(hex_hash, len(self.numbers))


def _meta(meta: dict, h: Hashes) -> dict:
    return {
        "step": meta["step"],
        "write_backs": [[h(x), slot] for x, slot in meta["write_backs"]],
        "loads": [
            {"req": job["req"], "async": job["async"], "ops": [[h(x), *rest] for x, *rest in job["ops"]]}
            for job in meta["loads"]
        ],
        "stores": [[h(x), *rest] for x, *rest in meta["stores"]],
        "idle": meta["idle"],
        "timed_tokens": meta["timed_tokens"],
    }


def _report(kind: str, value, h: Hashes):
    if kind in ("filled", "fill_failed"):
        return [h(value[0]), value[1]]
    if kind in ("on_disk", "off_disk"):
        return h(value)
    return value


def merge(record_dir: Path, done: dict) -> dict:
    h = Hashes()
    steps = [json.loads(line) for line in (record_dir / "scheduler.jsonl").read_text().splitlines()]
    schedule = []
    loaded: dict[tuple[str, int], str] = {}  # (request, GPU block) -> tier it was loaded from
    for step in steps:
        for req_id in step["resumed"]:
            loaded = {key: tier for key, tier in loaded.items() if key[0] != req_id}
        for job in step["meta"]["loads"]:
            for _, gpu_block, _, tier in job["ops"]:
                if tier:
                    loaded[(job["req"], gpu_block)] = tier
        reads, writes = [], []
        for req in step["requests"]:
            computed, tokens, table = req["computed"], req["tokens"], req["blocks"]
            hashes = [h(x) for x in req["hashes"]]
            for i in range(min(computed // BLOCK, len(hashes), len(table))):
                reads.append([table[i], hashes[i], loaded.get((req["req"], table[i]), "")])
            end = computed + tokens
            for i in range(computed // BLOCK, min(-(-end // BLOCK), len(table))):
                full = (i + 1) * BLOCK <= end and i < len(hashes)
                writes.append([table[i], hashes[i] if full else -1])
        for req_id in step["finished"]:
            loaded = {key: tier for key, tier in loaded.items() if key[0] != req_id}
        schedule.append(
            {
                "step": step["step"],
                "sync_loads": step["sync_loads"],
                "tokens": step["tokens"],
                "requests": [[r["req"], r["computed"], r["tokens"]] for r in step["requests"]],
                "reads": reads,
                "writes": writes,
                "finished": step["finished"],
                "preempted": step["preempted"],
                "resumed": step["resumed"],
                "events": step["events"],
            }
        )
    workers: dict[str, list] = {}
    header: dict = {}
    for path in sorted(record_dir.glob("worker-rank*.jsonl")):
        calls = []
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            name = entry["call"]
            if name == "register_kv_caches":
                header = {k: v for k, v in entry.items() if k != "call"}
                calls.append([name])
            elif name == "bind":
                calls.append([name, _meta(entry["meta"], h)])
            elif name == "handle_preemptions":
                calls.append([name, entry["step"]])
            elif name in ("wait_for_layer_load", "save_kv_layer"):
                calls.append([name, entry["layer"]])
            elif name == "get_finished":
                calls.append([name, entry["finished_req_ids"], entry["recving"]])
            elif name == "get_block_ids_with_load_errors":
                calls.append([name, entry["result"]])
            elif name == "get_kv_connector_stats":
                calls.append([name, entry["counts"]])
            elif name == "build_connector_worker_meta":
                reports = entry["reports"]
                calls.append(
                    [
                        name,
                        None
                        if reports is None
                        else [[rank, kind, _report(kind, value, h)] for rank, kind, value in reports],
                        entry["hits"],
                    ]
                )
            else:
                calls.append([name])
        workers[path.stem.removeprefix("worker-rank")] = calls
    recording = {
        "about": "vLLM's connector calls on its CPU build (GPU model runner order), made by "
        "scripts/record_connector_calls.py; replayed by tests/test_replay_vllm_calls.py",
        "vllm": _vllm_version(),
        "kv": header,
        "hashes": len(h.numbers),
        "workload": done,
        "schedule": schedule,
        "workers": workers,
    }
    recording["summary"] = summarize(recording)
    return recording


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def summarize(recording: dict) -> dict:
    calls: Counter = Counter()
    hits: Counter = Counter()
    failed = 0
    for worker_calls in recording["workers"].values():
        for call in worker_calls:
            calls[call[0]] += 1
            if call[0] == "bind":
                for job in call[1]["loads"]:
                    hits.update(op[3] or "lost" for op in job["ops"])
            if call[0] == "get_block_ids_with_load_errors":
                failed += len(call[1])
    schedule = recording["schedule"]
    return {
        "steps": len(schedule),
        "steps_with_forward": sum(1 for s in schedule if s["tokens"]),
        "steps_with_sync_loads": sum(1 for s in schedule if s["sync_loads"]),
        "calls": dict(calls),
        "loaded_blocks_by_tier": dict(hits),
        "loaded_reads_checked": dict(Counter(r[2] for s in schedule for r in s["reads"] if r[2])),
        "failed_blocks": failed,
        "preemptions": sum(len(s["preempted"]) for s in schedule),
        "resumed": sum(len(s["resumed"]) for s in schedule),
        "aborted": recording["workload"]["aborted"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tests/data/connector_calls.json")
    args = parser.parse_args()

    from tiercache.ops.local_stack import local_stack
    from tiercache.ops.tiny_model import write_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="tiercache-record-"))
    model = str(write_tiny_llama(work / "model", num_layers=LAYERS, seed=3))
    with local_stack("tc-record", s3_process=True) as (redis_server, s3):
        extra = {
            "namespace": "record",
            "redis_url": redis_server.url,
            "s3": {"bucket": "tc-record", "endpoint_url": s3.url, "region": "us-east-1", "capacity": "1GiB"},
            "cpu": {"capacity": CPU_SLOTS * BLOCK_BYTES},
            # Recomputing this tiny model's blocks beats any load: with the cost model
            # on, the scheduler would soon stop loading from disk and S3.
            "movers": {"cost_model": "off"},
            "disk": {"path": str(work / "disk"), "capacity": DISK_OBJECTS * (BLOCK_BYTES + 4096)},
        }
        done = run_engine(model, extra, work / "calls")
    recording = merge(work / "calls", done)
    summary = recording["summary"]
    print(json.dumps(summary, indent=1))
    missing = {"cpu", "disk", "s3"} - set(summary["loaded_blocks_by_tier"])
    if missing or summary["failed_blocks"] or not summary["preemptions"]:
        sys.exit(
            f"the workload missed what the replay needs (tiers {missing or 'all hit'}, "
            f"{summary['failed_blocks']} failed blocks, {summary['preemptions']} preemptions)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(recording, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes); logs in {work}")
    sys.stdout.flush()
    os._exit(0)  # vLLM's teardown can hang on these machines; everything is written


if __name__ == "__main__":
    main()

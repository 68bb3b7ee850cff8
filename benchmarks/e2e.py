"""tiercache inside vLLM against baselines measured in the same run.

    python benchmarks/e2e.py ttft  --lengths 1000,2000,4000 --repeats 3
    python benchmarks/e2e.py s3hit --s3-server seaweedfs --lengths 2000 --repeats 3
    python benchmarks/e2e.py followup --lengths 2000 --repeats 4
    python benchmarks/e2e.py store --lengths 2000 --repeats 5 --s3-server sink
    python benchmarks/e2e.py table   (the saved TTFT run as a table)
    python benchmarks/e2e.py plot    (docs/img/e2e-ttft.png and e2e-store.png)

`ttft`: time to first token cold, on vLLM's prefix-cache hit, on the ExampleConnector's
hit and on tiercache hits from CPU, disk and S3, with plain reads and plain boto3 GETs
of as many objects as the floors of the lower-tier hits. `s3hit`: the S3 hit against
the CPU hit of the same prompt, on one S3 server. `store`: cold TTFT and decode
tokens/s while storing, by tier set. `followup`: the CPU hit that comes right after the
request that stored it (its write-down to disk in flight) against the same prompt's hit
after an idle pause, in one engine over CPU and disk.

Every engine is a fresh vLLM process that first runs unrelated warm-up prompts; figures
are medians over `--repeats` distinct prompts. Every hit is checked: its cached tokens,
and its first-step top logprobs against the cold run of the same prompt. TTFT is vLLM's
first_token_latency; decode tokens/s is (generated - 1) / (last token - first token).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import (
    BLOCK,
    IMG,
    MODEL,
    RESULTS,
    Requests,
    decode_rate,
    machine,
    median,
    model_params,
    print_ttft_table,
    prompt,
    request,
    results_by,
    save,
    service_cpus,
    summarize_rows,
    ttft,
    ttft_runner,
)

# -- TTFT -----------------------------------------------------------------------------

# How long a storing engine idles before the same prompt's quiet CPU hit: every
# write-down of the cold run has ended by then.
IDLE_SECONDS = 5.0

# Disk hits staged into CPU slots (as on GPUs), so that the same prompt asked again
# is a CPU-tier hit: the disk hit / CPU hit pairs below need one.
STAGED_DISK = {"load_in_forward": False}


def tiercache_kv(extra: dict[str, Any]) -> dict[str, Any]:
    from tiercache.ops.vllm_runner import connector_config

    return connector_config({"namespace": "bench-e2e", **extra})


def example_kv(path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


@contextlib.contextmanager
def every_tier(args: argparse.Namespace, work: Path) -> Iterator[tuple[dict, dict, str]]:
    """redis-server and the S3 server (`--s3-server`: moto, or SeaweedFS, which checks
    signatures and serves ranged GETs from its volumes) on the cores the model does not
    use. Yields the connector config of an engine over every tier, storing to
    `disk-full`; of one that reads through the empty `disk-empty` to S3; the S3 URL."""
    from tiercache.ops.local_stack import local_stack

    if args.s3_server not in ("moto", "seaweedfs"):
        raise SystemExit(f"--s3-server {args.s3_server}: ttft and s3hit read back, so moto or seaweedfs")
    for name in ("disk-full", "disk-empty"):
        shutil.rmtree(work / name, ignore_errors=True)
    cpus = service_cpus(args)
    with local_stack("tiercache-bench", s3_process=True, cpus=cpus, s3_server=args.s3_server) as (
        redis_server,
        s3,
    ):
        shared = {
            "cpu": {"capacity": args.cpu_capacity},
            "redis_url": redis_server.url,
            "s3": {"bucket": "tiercache-bench", "endpoint_url": s3.url, "prefix": "e2e/"},
            "movers": {"shutdown_flush_seconds": 300, "cost_model": "off"},  # each tier's own hit
        }
        yield (
            tiercache_kv({**shared, "disk": {"path": str(work / "disk-full")}}),
            tiercache_kv({**shared, "disk": {"path": str(work / "disk-empty")}}),
            s3.url,
        )


def run_ttft(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    asks = Requests(lengths, args.repeats)
    decode = args.decode_tokens
    runner = ttft_runner(args, work, max(lengths), work / "partial.json")
    engine, warm, colds, hits = runner.run, asks.warm, asks.colds, asks.hits

    # 1. No connector, no prefix cache: cold TTFT and decode rate (the baseline of all).
    engine("none", warm(False) + colds(decode, False))
    # 2. vLLM's own prefix cache: the floor.
    engine("prefix_cache", warm(True) + colds(1, True), enable_prefix_caching=True)
    # 3. vLLM's ExampleConnector: hit in the same engine, then from a fresh engine.
    example = example_kv(work / "example")
    shutil.rmtree(work / "example", ignore_errors=True)
    engine("example", warm(True, stored=True) + colds(1, True), kv_transfer_config=example)
    engine("example_fresh", warm(False, stored=True) + hits(), kv_transfer_config=example)

    with every_tier(args, work) as (storing, through_empty_disk, s3_url):
        # 4. tiercache with every tier (CPU + disk + Redis/S3, write-through).
        engine(
            "tiercache",
            warm(True, stored=True) + colds(decode, True, idle_hit_after=IDLE_SECONDS),
            kv_transfer_config=storing,
        )
        # 5. A fresh engine, disk tier only: disk hits, then the same prompt again (now a
        #    CPU hit, with no write-through in flight).
        disk_only = tiercache_kv(
            {"cpu": {"capacity": args.cpu_capacity}, "disk": STAGED_DISK | {"path": str(work / "disk-full")}}
        )
        engine("tiercache_disk", warm(False, stored=True) + hits(twice=True), kv_transfer_config=disk_only)
        # 6. A fresh engine with an empty disk: S3 hits (via one Redis lookup).
        engine(
            "tiercache_s3", warm(False, stored=True) + hits(twice=True), kv_transfer_config=through_empty_disk
        )
        # 7. The floors of those hits' extra time: as many objects read with plain reads
        #    and plain boto3, in as many threads as tiercache uses.
        blocks = max(lengths) // BLOCK
        raw = {
            "blocks": blocks,
            "disk_read_seconds": [raw_disk_read(work / "disk-full", blocks) for _ in range(args.repeats)],
            "s3_get_seconds": [
                raw_s3_get(s3_url, "tiercache-bench", "e2e/", blocks) for _ in range(args.repeats)
            ],
        }
    runner.stop()
    return {**summarize_ttft(runner.engines, lengths, args), "raw_transfers": raw}


def run_followup(args: argparse.Namespace) -> dict[str, Any]:
    """A follow-up turn right after the request that stored its prefix: each prompt
    cold (stored to the CPU tier and written through to disk), its CPU hit at once,
    then its CPU hit after `IDLE_SECONDS` of quiet, paired prompt by prompt."""
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    shutil.rmtree(work / "disk-followup", ignore_errors=True)
    asks = Requests(lengths, args.repeats)
    runner = ttft_runner(args, work, max(lengths), work / "partial-followup.json")
    storing = tiercache_kv(
        {"cpu": {"capacity": args.cpu_capacity}, "disk": {"path": str(work / "disk-followup")}}
    )
    runner.run(
        "tiercache",
        asks.warm(True, stored=True) + asks.colds(args.decode_tokens, True, idle_hit_after=IDLE_SECONDS),
        kv_transfer_config=storing,
    )
    runner.stop()
    table, _ = summarize_rows(runner.engines, FOLLOWUP_ROWS, lengths, (), reference_engine="tiercache")
    return {
        "machine": machine(),
        "args": vars(args),
        "lengths": lengths,
        "table": table,
        "decode": {},
        "followup_vs_idle_hit": paired_hits(runner.engines, "tiercache", lengths, "hit", "idlehit"),
        "raw": runner.engines,
    }


FOLLOWUP_ROWS = {
    "cold (storing)": ("tiercache", "cold"),
    "CPU hit right after (write-down in flight)": ("tiercache", "hit"),
    f"CPU hit after {IDLE_SECONDS:.0f} s idle": ("tiercache", "idlehit"),
}


def run_s3_hit(args: argparse.Namespace) -> dict[str, Any]:
    """Steps 4 and 6 of `ttft` on one S3 server: a storing engine (each prompt cold, then
    its CPU hit), then a fresh engine with an empty disk: each prompt's S3 hit, then the
    same prompt again, a CPU hit after the promote. Ratios are paired prompt by prompt
    inside that engine."""
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    asks = Requests(lengths, args.repeats)
    runner = ttft_runner(args, work, max(lengths), work / f"partial-s3hit-{args.s3_server}.json")
    with every_tier(args, work) as (storing, through_empty_disk, _):
        runner.run(
            "tiercache", asks.warm(True, stored=True) + asks.colds(1, True), kv_transfer_config=storing
        )
        # The warm-ups store their own prompts, uploaded as each request ends: the settle
        # (longer than s3.pack_flush_seconds) keeps those uploads out of the timed S3 hits.
        settle = [{"sleep": 8}]
        runner.run(
            "tiercache_s3",
            asks.warm(False, stored=True) + settle + asks.hits(twice=True),
            kv_transfer_config=through_empty_disk,
        )
    runner.stop()
    table, _ = summarize_rows(runner.engines, S3HIT_ROWS, lengths, (), reference_engine="tiercache")
    return {
        "machine": machine(),
        "args": vars(args),
        "s3_server": args.s3_server,
        "lengths": lengths,
        "table": table,
        "decode": {},
        "s3_hit_vs_cpu_hit_paired": paired_hits(runner.engines, "tiercache_s3", lengths),
        "raw": runner.engines,
    }


S3HIT_ROWS = {
    "cold (storing engine)": ("tiercache", "cold"),
    "CPU hit (storing engine, write-through in flight)": ("tiercache", "hit"),
    "S3 hit (fresh engine, empty disk)": ("tiercache_s3", "hit"),
    "CPU hit (after the S3 promote)": ("tiercache_s3", "hit2"),
}


def paired_hits(
    engines: dict[str, Any], engine: str, lengths: list[int], label: str = "hit", baseline: str = "hit2"
) -> dict[int, dict[str, Any]]:
    """Inside one engine, prompt by prompt (robust to other load on the machine): each
    prompt's `label` request against its `baseline` request (by default: its lower-tier
    hit against its CPU hit right after), as a ratio and in seconds."""
    first, second = results_by(engines, engine, label), results_by(engines, engine, baseline)
    out = {}
    for n in lengths:
        keys = [k for k in sorted(first) if k[0] == n and k in second]
        out[n] = {
            "median": median([ttft(first[k]) / ttft(second[k]) for k in keys]),
            "all": [ttft(first[k]) / ttft(second[k]) for k in keys],
            "extra_seconds_median": median([ttft(first[k]) - ttft(second[k]) for k in keys]),
        }
    return out


def print_paired(paired: dict[Any, dict[str, Any]], what: str) -> None:
    for n, v in paired.items():
        print(
            f"{what}, {n} tokens, paired in one engine: median {v['median']:.2f} "
            f"(range {min(v['all'], default=float('nan')):.2f}-{max(v['all'], default=float('nan')):.2f}), "
            f"{v['extra_seconds_median'] * 1000:.0f} ms more"
        )


def print_s3_hit(data: dict[str, Any]) -> None:
    print(f"\nS3 server: {data['s3_server']}")
    print_ttft_table(data)
    print_paired(data["s3_hit_vs_cpu_hit_paired"], "S3 hit / CPU hit")


def raw_disk_read(root: Path, count: int) -> float:
    """Seconds to read `count` of the disk tier's objects under `root` into memory with
    plain reads, in as many threads as tiercache's disk readers (movers.workers)."""
    from tiercache.config import MoverConfig

    files = sorted(root.rglob("*.safetensors"))[:count]
    size = max(f.stat().st_size for f in files)
    buffers = threading.local()

    def allocate() -> None:
        # Each thread's buffer, touched once, before the timing starts.
        buffers.one = bytearray(b"\1" * size)

    def read(path: Path) -> int:
        with open(path, "rb", buffering=0) as f:
            return f.readinto(buffers.one)

    workers = MoverConfig().workers
    with ThreadPoolExecutor(workers, initializer=allocate) as pool:
        # Start every thread (the pool starts one per task until it has them all).
        list(pool.map(time.sleep, [0.05] * workers))
        start = time.perf_counter()
        list(pool.map(read, files))
        return time.perf_counter() - start


def raw_s3_get(url: str, bucket: str, prefix: str, count: int) -> float:
    """Seconds to GET `count` objects under `prefix` with a plain boto3 client, in as
    many threads as tiercache's S3 tier (s3.max_concurrency)."""
    import boto3
    from botocore.config import Config

    from tiercache.config import S3TierConfig

    threads = S3TierConfig(bucket=bucket).max_concurrency
    client = boto3.client("s3", endpoint_url=url, config=Config(max_pool_connections=threads))
    names = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]][:count]

    def get(name: str) -> int:
        return len(client.get_object(Bucket=bucket, Key=name)["Body"].read())

    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(get, names))
        return time.perf_counter() - start


# The fresh engines whose hits come from a lower tier: what they load, the floor of it.
LOWER_TIERS = {
    "tiercache_disk": ("disk hit", "disk_read_seconds"),
    "tiercache_s3": ("S3 hit", "s3_get_seconds"),
}

TTFT_ROWS = {
    "cold (no connector)": ("none", "cold"),
    "tiercache cold (storing)": ("tiercache", "cold"),
    "vLLM prefix cache hit": ("prefix_cache", "hit"),
    "ExampleConnector hit (same engine)": ("example", "hit"),
    "ExampleConnector hit (fresh engine)": ("example_fresh", "hit"),
    "tiercache CPU hit (same engine, write-through in flight)": ("tiercache", "hit"),
    f"tiercache CPU hit (same engine, after {IDLE_SECONDS:.0f} s idle)": ("tiercache", "idlehit"),
    "tiercache CPU hit (after disk promote, quiet)": ("tiercache_disk", "hit2"),
    "tiercache disk hit (fresh engine)": ("tiercache_disk", "hit"),
    "tiercache S3 hit (fresh engine, empty disk)": ("tiercache_s3", "hit"),
    "tiercache CPU hit (after S3 promote, quiet)": ("tiercache_s3", "hit2"),
}


def summarize_ttft(engines: dict[str, Any], lengths: list[int], args) -> dict[str, Any]:
    table, decode = summarize_rows(engines, TTFT_ROWS, lengths, ("none", "tiercache"))
    return {
        "machine": machine(),
        "args": vars(args),
        "model": {**MODEL, "params": model_params(Path(args.workdir) / "model")},
        "lengths": lengths,
        "table": table,
        "decode": decode,
        "engines": {
            k: {
                "startup_seconds": v["startup_seconds"],
                "wall_seconds": v["wall_seconds"],
                "loadavg": v.get("loadavg"),
            }
            for k, v in engines.items()
        },
        "raw": engines,
        "paired_lower_tier": {eng: paired_hits(engines, eng, lengths) for eng in LOWER_TIERS},
        "followup_vs_idle_hit": paired_hits(engines, "tiercache", lengths, "hit", "idlehit"),
    }


def print_ttft(data: dict[str, Any]) -> None:
    print_ttft_table(data)
    if "followup_vs_idle_hit" in data:
        print_paired(data["followup_vs_idle_hit"], "CPU hit right after its store / after idle")
    for eng, paired in data.get("paired_lower_tier", {}).items():
        what, floor = LOWER_TIERS[eng]
        print_paired(paired, f"{what} / CPU hit")
        blocks, seconds = data["raw_transfers"]["blocks"], median(data["raw_transfers"][floor])
        print(f"   {blocks} objects read by {floor.removesuffix('_seconds')} alone: {seconds * 1000:.0f} ms")


@contextlib.contextmanager
def store_services(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """redis-server and the S3 endpoint the store engines write through to, on the
    cores the model does not use: moto, or with `--s3-server sink` a sink that reads and
    discards each body (s3_sink.py). moto keeps every object in memory, copying and
    hashing it on the memory bus the model's decode is bound by, work a remote S3 does
    on its own machines; against the sink, what is left on this box is tiercache's own
    cost. Yields the Redis URL and the S3 URL."""
    from s3_sink import running

    from tiercache.ops.local_stack import RedisServer, local_stack

    if args.s3_server not in ("moto", "sink"):
        raise SystemExit(f"--s3-server {args.s3_server}: store writes through to moto or the sink")
    cpus = service_cpus(args)
    if args.s3_server == "moto":
        with local_stack("tiercache-store", s3_process=True, cpus=cpus) as (redis_server, s3):
            yield redis_server.url, s3.url
        return
    redis_server = RedisServer(cpus=cpus).start()
    try:
        with running(cpus) as url:
            yield redis_server.url, url
    finally:
        redis_server.close()


def run_store(args: argparse.Namespace) -> dict[str, Any]:
    """The same cold prompts (each generating `--decode-tokens`) with no connector, the
    ExampleConnector (the cost of any connector), and tiercache storing into CPU,
    CPU + disk, CPU + disk + S3; then, in each engine, the same prompts again storing
    nothing, for a ratio of decode rates taken inside one engine."""
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(args.workdir).resolve()
    # Prompts of their own (seed offset), so nothing is already on disk or in S3.
    colds = {(n, r): prompt(500_000 + 1000 * n + r, n) for n in lengths for r in range(args.repeats)}
    items = [request("warm", prompt(11, 64)), request("warm", prompt(12, 512))]
    items += [request(f"cold/{n}/{r}", ids, args.decode_tokens) for (n, r), ids in colds.items()]
    # The same prompts again once every write has ended: the same decode with nothing
    # being stored (a hit where there is a cache, else cold again). Engines differ by up
    # to 10% in decode rate, so this is the ratio to trust.
    items.append({"sleep": 10})
    items += [request(f"again/{n}/{r}", ids, args.decode_tokens) for (n, r), ids in colds.items()]
    # The 512-token warm-up prompt must fit too.
    runner = ttft_runner(args, work, max([*lengths, 512]), work / "partial-store.json")
    out: dict[str, Any] = {"machine": machine(), "args": vars(args), "engines": {}}
    with store_services(args) as (redis_url, s3_url):
        configs = {
            "none": None,
            "example": example_kv(work / "store-example"),
            "cpu": {},
            "cpu+disk": {"disk": {"path": str(work / "store-disk-a")}},
            "cpu+disk+s3": {
                "disk": {"path": str(work / "store-disk-b")},
                "redis_url": redis_url,
                "s3": {"bucket": "tiercache-store", "endpoint_url": s3_url, "prefix": "store/"},
                "movers": {"shutdown_flush_seconds": 300, "cost_model": "off"},
            },
        }
        for name, extra in configs.items():
            for d in ("store-disk-a", "store-disk-b", "store-example"):
                shutil.rmtree(work / d, ignore_errors=True)
            if extra is None or "kv_connector" in extra:
                kv = extra
            else:
                kv = tiercache_kv({"cpu": {"capacity": args.cpu_capacity}, **extra})
            rows = runner.run(name, items, kv_transfer_config=kv)
            cold = {r["name"].split("/", 1)[1]: r for r in rows if r["name"].startswith("cold/")}
            again = {r["name"].split("/", 1)[1]: r for r in rows if r["name"].startswith("again/")}
            e = out["engines"][name] = {
                "ttft_median": median([ttft(r) for r in cold.values()]),
                "decode_tokens_per_s_median": median([decode_rate(r) for r in cold.values()]),
                "decode_again_tokens_per_s_median": median([decode_rate(r) for r in again.values()]),
                # Prompt by prompt: decoding while its blocks are written down, over
                # decoding the same prompt with nothing to write.
                "decode_storing_vs_not": median([decode_rate(cold[k]) / decode_rate(again[k]) for k in cold]),
                "foreign_cores_median": median([r["foreign_cores"] for r in cold.values()]),
                "results": rows,
            }
            print(
                f"   TTFT {e['ttft_median']:.3f}s decode {e['decode_tokens_per_s_median']:.2f} tok/s "
                f"(again, storing nothing: {e['decode_again_tokens_per_s_median']:.2f}; storing / not, "
                f"prompt by prompt: {e['decode_storing_vs_not']:.3f}) "
                f"other load {e['foreign_cores_median']:.2f} cores",
                flush=True,
            )
    runner.stop()
    base = out["engines"]["none"]
    for e in out["engines"].values():
        e["ttft_vs_none"] = e["ttft_median"] / base["ttft_median"]
        e["decode_vs_none"] = e["decode_tokens_per_s_median"] / base["decode_tokens_per_s_median"]
    return out


# -- plots --------------------------------------------------------------------------------


def plot_ttft(plt, data: dict[str, Any]) -> None:
    lengths = [str(n) for n in data["lengths"]]
    peer_file = RESULTS / "lmcache.json"
    if peer_file.exists():  # LMCache's hits, measured by lmcache_peer.py
        peer = json.loads(peer_file.read_text())["table"]
        data["table"].update({f"{r} [own run]": v for r, v in peer.items() if r.startswith("LMCache")})
    rows = [r for r in data["table"] if "cold" not in r]
    cold = data["table"]["cold (no connector)"]
    colds = ", ".join(f"{n}: {cold[n]['ttft_median']:.1f} s" for n in lengths if n in cold)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    width = 0.8 / len(lengths)
    for j, n in enumerate(lengths):
        vals = [data["table"][r].get(n, {}).get("ttft_median", float("nan")) * 1000 for r in rows]
        bars = ax.barh([i + j * width for i in range(len(rows))], vals, height=width, label=f"{n} tokens")
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ax.set_yticks([i + width * (len(lengths) - 1) / 2 for i in range(len(rows))])
    ax.set_yticklabels(rows, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time to first token, ms (median)")
    ax.set_title(f"TTFT on a hit, by source of the KV (cold, no cache: {colds})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "e2e-ttft.png", dpi=110)
    print("wrote", IMG / "e2e-ttft.png")


def plot_store(plt, data: dict[str, Any]) -> None:
    names = list(data["engines"])
    engines = [data["engines"][n] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4.6))
    xs = range(len(names))
    for offset, key, label in (
        (-0.27, "ttft_vs_none", "cold TTFT / no connector"),
        (0.0, "decode_vs_none", "decode tokens/s / no connector"),
        (0.27, "decode_storing_vs_not", "decode storing / same prompt storing nothing, same engine"),
    ):
        bars = ax.bar([x + offset for x in xs], [e[key] for e in engines], width=0.27, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    labels = {"none": "no connector", "example": "ExampleConnector"}
    ax.set_xticks(list(xs), [labels.get(n, f"tiercache\n{n}") for n in names], fontsize=8)
    ax.set_ylim(0, 1.35)
    ax.set_ylabel("ratio to no connector (median)")
    ax.set_title("Store path: 2000-token cold prompts, 32 tokens generated")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    fig.savefig(IMG / "e2e-store.png", dpi=110)
    print("wrote", IMG / "e2e-store.png")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["ttft", "s3hit", "followup", "store", "plot", "table"])
    parser.add_argument("--lengths", default="2000", help="prompt lengths in tokens, comma separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens generated by the cold runs")
    parser.add_argument("--cpu-capacity", default="4GiB")
    parser.add_argument("--kv-fraction", type=float, default=0.25, help="vLLM gpu_memory_utilization")
    parser.add_argument("--workdir", default="/tmp/tiercache-bench-e2e")
    parser.add_argument(
        "--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine"
    )
    parser.add_argument(
        "--s3-server",
        choices=["moto", "seaweedfs", "sink"],
        default="moto",
        help="ttft and s3hit: moto or seaweedfs (a real S3-compatible store); "
        "store: moto or sink (an endpoint that discards what it is sent)",
    )
    parser.add_argument("--name", default=None, help="results file name (default: the subcommand)")
    args = parser.parse_args()
    if args.what == "ttft":
        data = run_ttft(args)
        save(args.name or "ttft", data)
        print_ttft(data)
    elif args.what == "s3hit":
        data = run_s3_hit(args)
        save(args.name or f"s3hit-{args.s3_server}", data)
        print_s3_hit(data)
    elif args.what == "followup":
        data = run_followup(args)
        save(args.name or "followup", data)
        print_ttft_table(data)
        print_paired(data["followup_vs_idle_hit"], "CPU hit right after its store / after idle")
    elif args.what == "store":
        save(args.name or "store", run_store(args))
    elif args.what == "table":
        print_ttft(json.loads((RESULTS / f"{args.name or 'ttft'}.json").read_text()))
    else:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        IMG.mkdir(parents=True, exist_ok=True)
        for name, draw in (("ttft", plot_ttft), ("store", plot_store)):
            if (RESULTS / f"{name}.json").exists():
                draw(plt, json.loads((RESULTS / f"{name}.json").read_text()))


if __name__ == "__main__":
    main()

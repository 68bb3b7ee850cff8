"""Hit against hit in one engine: tiercache's CPU-tier hit and vLLM's own prefix-cache
hit of the same prompt, alternated in the same process, so that the ratio between them
is not the difference between two engines' start-ups or the machine's load at two
different minutes (single requests here spread by 10-15% between engines).

    python benchmarks/hit_pairs.py --lengths 1000,2000,4000 --repeats 3 --rounds 3 --name hit-pairs-1

Engines, each a fresh vLLM process with prefix caching on and the same core
reservation:
  prefix_cache   no connector: cold, then prefix-cache hits (the floor of all).
  tiercache      CPU + disk + S3 with write-through and the Redis index (S3 is a sink
                 that discards the bodies, as a remote endpoint's work is done
                 elsewhere; `--s3-server moto` for moto on this host): cold;
                 vLLM's prefix cache reset; a CPU-tier hit while the prompt's own
                 write-through to disk and S3 still runs ("in flight"); a pause until
                 it is quiet; then rounds of [prefix-cache hit; reset; CPU-tier hit].
                 --inflight-repeats prompts a length get the in-flight hit, the first
                 --repeats of them the rounds too: one in-flight hit a prompt, so the
                 in-flight median needs more prompts than the paired ratios do.
                 Each in-flight hit is paired with vLLM's prefix-cache hit of the same
                 prompt, also asked while its write-through runs ("pc_at_once"): the
                 two follow the cold run back to back, the prefix-cache hit first for
                 even prompts and second for odd ones, so that neither always gets
                 the place right after the cold run. Whether the write-through was
                 still under way at each is read from the disk tier: the objects of
                 the prompt renamed into place after the request began.
                 Between them, --inflight-pc-repeats other prompts (none by default)
                 are asked cold and then at once again without the reset: the
                 unpaired floor of runs 31-42.
                 After each pause, a short stored prompt is asked before the rounds
                 ("wake"), so that the rounds' first prefix-cache hit does not carry
                 the first request after an idle pause alone.
  example        vLLM's ExampleConnector (safetensors files, in the page cache):
                 cold; rounds of [prefix-cache hit; reset; ExampleConnector hit].
  tiercache_disk a fresh engine on the disk the tiercache engine left, its CPU tier
                 the size of the longest prompt: first, over every prompt, [reset;
                 disk hit], the first read of its objects, which may have left the
                 page cache since they were written (the benchmark VM drops page
                 cache idle for a minute; its time and the MiB the machine read from
                 storage meanwhile are reported apart); then rounds over every prompt
                 of [reset; disk hit; prefix-cache hit], read from the page cache. A
                 disk hit read in the forward (vLLM's CPU backend,
                 disk.load_in_forward) does not go to the CPU
                 tier, so no CPU hit of the same prompt can follow it in this
                 engine: "disk hit / CPU hit" is the disk hit's paired ratio to the
                 prefix-cache hit here over the CPU hit's paired ratio to it in the
                 tiercache engine, each against the same floor.

Each engine first warms each length with a prompt of its own (the first request of a
new length pays one-off set-up). Every hit is checked against the cold run of its
prompt in the same engine (first token equal, top logprobs within 0.3) and must have
the whole prompt but the last block cached. Ratios are medians over every pair of one
length (a pair is two requests of one prompt, one after the other). TTFT is vLLM's first_token_latency."""

from __future__ import annotations

import argparse
import bisect
import shutil
import time
from pathlib import Path
from typing import Any

from harness import (
    BLOCK,
    LOGPROB_TOLERANCE,
    NAMESPACE,
    engine_arguments,
    engine_runner,
    logprob_gap,
    machine,
    median,
    prompt,
    request,
    save,
    store_services,
    ttft,
)

RESET = {"reset_prefix_cache": True}
# Asked after a pause, before the rounds: the first request after an idle pause is
# slower than the next (docs/benchmarks-e2e.md, "The first request after an idle
# pause"), and it should not be the rounds' first prefix-cache hit alone. One of the
# warm-up prompts, stored already, so it starts no write-through.
WAKE = prompt(1, 64)
# The connector's blocks loaded by tier, read after every request: which tier each hit
# came from (a "disk" hit that came from the CPU tier would flatter the disk).
LOADED_BLOCKS = "vllm:tiercache_loaded_blocks"


def prompts(lengths: list[int], repeats: int, first: int = 0) -> dict[tuple[int, int], list[int]]:
    # The seeds of e2e.py's TTFT prompts, so the two benchmarks ask the same prompts.
    return {(n, r): prompt(1000 * n + r, n) for n in lengths for r in range(first, repeats)}


def inflight_only(lengths: list[int], args: argparse.Namespace) -> dict[tuple[int, int], list[int]]:
    """The prompts asked only for their in-flight hit, past the --repeats ones."""
    return prompts(lengths, args.inflight_repeats, first=args.repeats)


def inflight_pc_only(lengths: list[int], args: argparse.Namespace) -> dict[tuple[int, int], list[int]]:
    """The prompts whose prefix-cache hit is asked in flight, past the in-flight ones."""
    return prompts(lengths, args.inflight_repeats + args.inflight_pc_repeats, first=args.inflight_repeats)


Ask = tuple[str, tuple[int, int], list[int]]  # label, (length, prompt number), token ids


def in_flight_order(lengths: list[int], args: argparse.Namespace) -> list[Ask]:
    """Each length's in-flight asks (label, key, prompt), the CPU hits and the
    prefix-cache hits taking turns, so that the machine's drift over the run falls on
    both alike."""
    order: list[Ask] = []
    for n in lengths:
        cpu = [("inflight", *ask) for ask in prompts([n], args.inflight_repeats).items()]
        pc = [("pc_inflight", *ask) for ask in inflight_pc_only([n], args).items()]
        for i in range(max(len(cpu), len(pc))):
            order += cpu[i : i + 1] + pc[i : i + 1]
    return order


def in_flight_pair(key: tuple[int, int], ids: list[int], paired: bool) -> list[dict[str, Any]]:
    """What follows a prompt's cold run while its write-through runs: the in-flight
    CPU hit (after vLLM's prefix cache is reset) and, `paired`, vLLM's own hit of it,
    first for even prompts and second for odd ones. A prefix-cache hit asked after the
    CPU hit runs while the writes that hit kept back go on; one asked before it, while
    they have not been kept back: alternating puts each case on half the pairs."""
    cpu_hit = [RESET, request(name("inflight", key), ids)]
    if not paired:
        return cpu_hit
    pc_hit = [request(name("pc_at_once", key), ids)]
    return pc_hit + cpu_hit if key[1] % 2 == 0 else cpu_hit + pc_hit


def renamed_at(disk: Path) -> list[float]:
    """When each object on the disk tier was renamed into place (its ctime), sorted:
    a write-through's disk writes are over once its prompt's last object is."""
    from tiercache.tiers.disk import SUFFIX, TMP_PREFIX

    return sorted(p.stat().st_ctime for p in disk.rglob(f"*{SUFFIX}") if not p.name.startswith(TMP_PREFIX))


def warm_up(lengths: list[int], connector: bool) -> list[dict[str, Any]]:
    """Unrelated prompts first: the CPU backend's first requests pay one-off set-up,
    and so does the first request of each new length (a first 4000-token hit took
    three times the next one). Each length is warmed with a prompt of its own, computed
    and hit from the prefix cache and, with a connector, hit from the connector."""
    a, b = prompt(1, 64), prompt(2, 512)
    items = [request("warm", a), request("warm", b), request("warm", b)]
    for n in lengths:
        ids = prompt(7000 + n, n)
        items += [request("warm", ids), request("warm", ids)]
        if connector:
            items += [RESET, request("warm", ids)]
    return items


def tiercache_kv(extra: dict[str, Any]) -> dict[str, Any]:
    from tiercache.testing.vllm_runner import connector_config

    return connector_config({"namespace": NAMESPACE, **extra})


def name(label: str, key: tuple[int, int], round_: int = 0) -> str:
    return f"{label}/{key[0]}/{key[1]}/{round_}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every engine's results, by engine name."""
    lengths = [int(x) for x in args.lengths.split(",")]
    asks = prompts(lengths, args.repeats)
    work, runner = engine_runner(args, max(lengths))
    quiet = {"sleep": args.quiet_seconds}

    items: list[dict[str, Any]] = warm_up(lengths, connector=False)
    for key, ids in asks.items():
        items.append(request(name("cold", key), ids))
        items += [request(name("pc", key, i), ids) for i in range(args.rounds)]
    runner.run("prefix_cache", items)

    example_dir = work / "example"
    shutil.rmtree(example_dir, ignore_errors=True)
    items = warm_up(lengths, connector=True)
    for key, ids in asks.items():
        items.append(request(name("cold", key), ids))
        for i in range(args.rounds):
            items += [request(name("pc", key, i), ids), RESET, request(name("example", key, i), ids)]
    runner.run(
        "example",
        items,
        kv_transfer_config={
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(example_dir)},
        },
    )

    disk = work / "disk"
    shutil.rmtree(disk, ignore_errors=True)
    cpu = {"capacity": args.cpu_capacity}
    with store_services(args) as (redis_server, s3_url):
        everything = {
            "cpu": cpu,
            "disk": {"path": str(disk)},
            "redis_url": redis_server.url,
            "s3": {"bucket": "tiercache-store", "endpoint_url": s3_url, "prefix": "pairs/"},
            "movers": {"shutdown_flush_seconds": 300, "cost_model": "off"},
        }
        # --write-through names the lower tiers the prompt's write-through goes to, to
        # tell what of the in-flight hit's cost each one brings.
        for tier in ("disk", "s3"):
            if tier not in args.write_through.split(","):
                everything.pop(tier)
        items = warm_up(lengths, connector=True)
        for label, key, ids in in_flight_order(lengths, args):
            if label == "pc_inflight":
                items += [request(name("cold", key), ids), request(name(label, key), ids), quiet]
                continue
            items += [request(name("cold", key), ids), *in_flight_pair(key, ids, args.inflight_pairs), quiet]
            if key in asks:
                items.append(request(name("wake", key), WAKE))
            for i in range(args.rounds if key in asks else 0):
                items += [request(name("pc", key, i), ids), RESET, request(name("cpu", key, i), ids)]
        runner.run("tiercache", items, kv_transfer_config=tiercache_kv(everything), counters=LOADED_BLOCKS)
        runner.engines["tiercache"]["disk_renamed_at"] = renamed_at(disk)

    # A CPU tier that holds the longest prompt and little more: by the time a prompt
    # comes round again the others have evicted it, so each round starts from disk.
    longest_hit = (max(lengths) - 1) // BLOCK * BLOCK * args.kv_bytes_per_token
    small_cpu = {"capacity": longest_hit + 4 * BLOCK * args.kv_bytes_per_token}
    items = warm_up(lengths, connector=True)
    for key, ids in asks.items():
        items += [RESET, request(name("disk_first", key), ids)]
    for i in range(args.rounds):
        for key, ids in asks.items():
            items += [RESET, request(name("disk", key, i), ids), request(name("disk_pc", key, i), ids)]
    disk_only = {
        "cpu": small_cpu,
        "disk": {"path": str(disk)},
        "movers": {"cost_model": "off"},
    }
    runner.run("tiercache_disk", items, kv_transfer_config=tiercache_kv(disk_only), counters=LOADED_BLOCKS)
    runner.stop()
    return runner.engines


def raw_copy_ms(nbytes: int, threads: int, repeats: int = 7) -> float:
    """The floor of a copying cache's hit: `nbytes` copied host to host by torch, in
    one or two threads (the copy of a CPU-tier hit may use the spare core too)."""
    import threading

    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    parts = list(zip(src.chunk(threads), dst.chunk(threads), strict=True))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        helpers = [threading.Thread(target=d.copy_, args=(s,)) for s, d in parts[1:]]
        for helper in helpers:
            helper.start()
        parts[0][1].copy_(parts[0][0])
        for helper in helpers:
            helper.join()
        times.append(time.perf_counter() - began)
    return 1000 * median(times)


def by_name(engine: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each result by name, with `loaded`: the blocks it loaded per tier, where the
    engine counted them."""
    out = {}
    before: dict[str, float] = {}
    for r in engine["warm"] + engine["results"]:
        now = r.get("counters")
        if now is not None:
            r["loaded"] = {k.removeprefix("tier="): v - before.get(k, 0) for k, v in now.items()}
            before = now
        out[r["name"]] = r
    return out


def hit_problems(
    r: dict[str, Any], cold: dict[str, Any], length: int, tier: str | None, hit: bool = True
) -> list[str]:
    """What is wrong with request `r` against its prompt's cold run (`length` tokens):
    as a hit, fewer than every whole block but the last cached; another first token or
    top logprobs; given `tier`, blocks loaded from anywhere else (read from the
    connector's counters, where the engine has them)."""
    problems = []
    want_cached = (length - 1) // BLOCK * BLOCK
    if hit and r["num_cached_tokens"] < want_cached:
        problems.append(f"{r['name']}: {r['num_cached_tokens']} cached, want {want_cached}")
    if r["token_ids"][:1] != cold["token_ids"][:1]:
        problems.append(f"{r['name']}: first token differs from the cold run")
    if logprob_gap(r["top_logprobs"], cold["top_logprobs"]) > LOGPROB_TOLERANCE:
        problems.append(f"{r['name']}: logprobs differ from the cold run")
    if tier is not None and "loaded" in r and r["loaded"].get(tier, 0) != want_cached // BLOCK:
        problems.append(f"{r['name']}: loaded {r['loaded']}, want every block from {tier}")
    return problems


def summarize(engines: dict[str, Any], asks: dict[tuple[int, int], list[int]], args) -> dict[str, Any]:
    """Per length: each label's median TTFT, and the median ratio of paired requests.
    Raises if any hit missed or answered differently from its prompt's cold run."""
    colds = {e: by_name(engines[e]) for e in engines}
    problems: list[str] = []

    def sample(engine: str, label: str, key, round_: int = 0) -> dict[str, Any]:
        r = colds[engine][name(label, key, round_)]
        cold = colds[engine if engine != "tiercache_disk" else "tiercache"][name("cold", key)]
        tier = {"disk": "disk", "disk_first": "disk", "cpu": "cpu", "inflight": "cpu"}.get(label)
        found = hit_problems(r, cold, key[0], tier, hit=label != "cold")
        if label in ("pc_inflight", "pc_at_once") and any(r.get("loaded", {}).values()):
            found.append(f"{r['name']}: loaded {r['loaded']} from tiercache, want a prefix-cache hit")
        problems.extend(f"{engine} {problem}" for problem in found)
        return r

    def pairs(keys: list[tuple[int, int]], with_rounds: bool) -> list[tuple[tuple[int, int], int]]:
        return [(k, i) for k in keys for i in (range(args.rounds) if with_rounds else [0])]

    out: dict[str, Any] = {}
    for n in sorted({k[0] for k in asks}):
        keys = [k for k in asks if k[0] == n]
        inflight_keys = keys + list(inflight_only([n], args))

        def times(engine: str, label: str, with_rounds: bool = True, keys=keys) -> list[float]:
            return [ttft(sample(engine, label, k, i)) for k, i in pairs(keys, with_rounds)]

        def storage(engine: str, label: str, with_rounds: bool = True, keys=keys) -> list[float]:
            return [sample(engine, label, k, i)["storage_read_mib"] for k, i in pairs(keys, with_rounds)]

        def ratios(engine: str, top: str, bottom: str, with_rounds: bool = True, keys=keys) -> list[float]:
            return [
                ttft(sample(engine, top, k, i)) / ttft(sample(engine, bottom, k, i))
                for k, i in pairs(keys, with_rounds)
            ]

        pc_floor = median(times("prefix_cache", "pc"))
        row = {
            "cold_ms": 1000 * median(times("prefix_cache", "cold", False)),
            "prefix_cache_ms": 1000 * pc_floor,
            "tiercache_pc_ms": 1000 * median(times("tiercache", "pc")),
            "cpu_ms": 1000 * median(times("tiercache", "cpu")),
            "inflight_ms": 1000 * median(times("tiercache", "inflight", False, inflight_keys)),
            "inflight_hits": len(inflight_keys),
            "example_ms": 1000 * median(times("example", "example")),
            "example_pc_ms": 1000 * median(times("example", "pc")),
            "disk_ms": 1000 * median(times("tiercache_disk", "disk")),
            "disk_pc_ms": 1000 * median(times("tiercache_disk", "disk_pc")),
            "disk_first_ms": 1000 * median(times("tiercache_disk", "disk_first", False)),
            # What the machine read from storage during each hit: about the hit's size
            # where its objects were not in the page cache, about 0 where they were.
            "disk_first_storage_mib": median(storage("tiercache_disk", "disk_first", False)),
            "disk_storage_mib": median(storage("tiercache_disk", "disk")),
            # The paired ratios: each hit against the prefix-cache hit just before it.
            "cpu_over_pc_paired": median(ratios("tiercache", "cpu", "pc")),
            "example_over_pc_paired": median(ratios("example", "example", "pc")),
            "disk_over_pc_paired": median(ratios("tiercache_disk", "disk", "disk_pc")),
        }
        row["disk_over_cpu_paired"] = row["disk_over_pc_paired"] / row["cpu_over_pc_paired"]
        # What the hit moves: every whole block of the prompt but the one vLLM recomputes.
        hit_bytes = (n - 1) // BLOCK * BLOCK * args.kv_bytes_per_token
        row["hit_mib"] = hit_bytes / (1 << 20)
        row["raw_copy_ms_1_thread"] = raw_copy_ms(hit_bytes, 1)
        row["raw_copy_ms_2_threads"] = raw_copy_ms(hit_bytes, 2)
        row["cpu_extra_ms_paired"] = 1000 * median(
            [
                ttft(sample("tiercache", "cpu", k, i)) - ttft(sample("tiercache", "pc", k, i))
                for k, i in pairs(keys, True)
            ]
        )
        row["cpu_over_pc_floor"] = row["cpu_ms"] / row["prefix_cache_ms"]
        row["inflight_over_pc_floor"] = row["inflight_ms"] / row["prefix_cache_ms"]
        # Not paired with the prefix-cache hit right after it: the writes the in-flight
        # hit kept back (tiercache/foreground.py) run during that one.
        row["inflight_over_pc_same_engine"] = row["inflight_ms"] / row["tiercache_pc_ms"]
        pc_inflight_keys = list(inflight_pc_only([n], args))
        if pc_inflight_keys:
            # vLLM's own hit in the in-flight hit's place: what that place costs any hit.
            row["pc_inflight_ms"] = 1000 * median(times("tiercache", "pc_inflight", False, pc_inflight_keys))
            row["pc_inflight_hits"] = len(pc_inflight_keys)
            row["inflight_over_pc_inflight"] = row["inflight_ms"] / row["pc_inflight_ms"]
            row["pc_inflight_over_pc_same_engine"] = row["pc_inflight_ms"] / row["tiercache_pc_ms"]
        if name("pc_at_once", keys[0]) in colds["tiercache"]:
            row.update(at_once_pairs(engines["tiercache"], colds["tiercache"], inflight_keys, sample))
        row["cpu_over_example"] = row["cpu_ms"] / row["example_ms"]
        row["cpu_over_example_paired"] = row["cpu_over_pc_paired"] / row["example_over_pc_paired"]
        out[str(n)] = row
    if problems:
        raise SystemExit("hits that were not right:\n  " + "\n  ".join(problems))
    return out


def objects_left(
    engine: dict[str, Any], named: dict[str, dict[str, Any]], key: tuple[int, int]
) -> dict[str, int]:
    """For the in-flight pair of prompt `key`: how many of the prompt's disk objects
    were renamed into place after each of its two hits began (0: its disk writes were
    over). The prompt's objects are those renamed between its cold run and the next
    cold run of the engine (a pause follows each pair, so writes do not overlap)."""
    renamed = engine["disk_renamed_at"]
    began = named[name("cold", key)]["started_at"]
    later = [
        r["started_at"]
        for r in engine["results"]
        if r["name"].startswith("cold/") and r["started_at"] > began
    ]
    end = bisect.bisect_right(renamed, min(later, default=float("inf")))
    return {
        label: end - bisect.bisect_right(renamed, named[name(label, key)]["started_at"])
        for label in ("inflight", "pc_at_once")
    }


def at_once_pairs(engine: dict[str, Any], named: dict[str, dict[str, Any]], keys, sample) -> dict[str, Any]:
    """The in-flight CPU hit against vLLM's hit of the same prompt asked at once too,
    paired: the median ratio over all pairs and over each order apart, and how many
    pairs had the prompt's disk writes still under way at both hits."""
    pc = {k: ttft(sample("tiercache", "pc_at_once", k)) for k in keys}
    ratios = {k: ttft(sample("tiercache", "inflight", k)) / pc[k] for k in keys}
    left = {k: objects_left(engine, named, k) for k in keys}
    return {
        "pc_at_once_ms": 1000 * median(list(pc.values())),
        "inflight_over_pc_at_once_paired": median(list(ratios.values())),
        "inflight_over_pc_at_once_pc_first": median([r for k, r in ratios.items() if k[1] % 2 == 0]),
        "inflight_over_pc_at_once_cpu_first": median([r for k, r in ratios.items() if k[1] % 2 == 1]),
        "pairs_in_flight": sum(1 for k in keys if min(left[k].values()) > 0),
        "disk_objects_left_at_inflight": median([left[k]["inflight"] for k in keys]),
        "disk_objects_left_at_pc_at_once": median([left[k]["pc_at_once"] for k in keys]),
    }


# The table's rows: label, summary key, format.
TABLE = [
    ("cold", "cold_ms", "{:.0f}"),
    ("prefix-cache hit, no connector (floor)", "prefix_cache_ms", "{:.0f}"),
    ("prefix-cache hit, tiercache engine", "tiercache_pc_ms", "{:.0f}"),
    ("tiercache CPU hit, quiet", "cpu_ms", "{:.0f}"),
    ("tiercache CPU hit, write-through in flight", "inflight_ms", "{:.0f}"),
    ("in-flight hits (one a prompt)", "inflight_hits", "{}"),
    ("prefix-cache hit in the in-flight hit's place", "pc_inflight_ms", "{:.0f}"),
    ("such prefix-cache hits (one a prompt)", "pc_inflight_hits", "{}"),
    ("prefix-cache hit of the in-flight prompt, asked at once too", "pc_at_once_ms", "{:.0f}"),
    ("pairs with the prompt's disk writes under way at both hits", "pairs_in_flight", "{}"),
    (
        "disk objects still to write at the in-flight CPU hit, median",
        "disk_objects_left_at_inflight",
        "{:.0f}",
    ),
    (
        "disk objects still to write at that prefix-cache hit, median",
        "disk_objects_left_at_pc_at_once",
        "{:.0f}",
    ),
    ("ExampleConnector hit", "example_ms", "{:.0f}"),
    ("tiercache disk hit, first read of its objects in the fresh engine", "disk_first_ms", "{:.0f}"),
    ("MiB read from storage meanwhile", "disk_first_storage_mib", "{:.0f}"),
    ("tiercache disk hit, fresh engine, from the page cache", "disk_ms", "{:.0f}"),
    ("MiB read from storage meanwhile", "disk_storage_mib", "{:.0f}"),
    ("prefix-cache hit after it", "disk_pc_ms", "{:.0f}"),
    ("CPU hit / prefix-cache hit, paired in one engine", "cpu_over_pc_paired", "{:.3f}x"),
    ("CPU hit / prefix-cache floor", "cpu_over_pc_floor", "{:.3f}x"),
    ("in-flight CPU hit / prefix-cache floor", "inflight_over_pc_floor", "{:.3f}x"),
    ("in-flight CPU hit / prefix-cache hit, same engine", "inflight_over_pc_same_engine", "{:.3f}x"),
    ("in-flight CPU hit / prefix-cache hit in its place", "inflight_over_pc_inflight", "{:.3f}x"),
    ("prefix-cache hit in that place / later ones", "pc_inflight_over_pc_same_engine", "{:.3f}x"),
    ("in-flight CPU hit / prefix-cache hit at once, paired", "inflight_over_pc_at_once_paired", "{:.3f}x"),
    ("  the same, prefix-cache hit first", "inflight_over_pc_at_once_pc_first", "{:.3f}x"),
    ("  the same, CPU hit first", "inflight_over_pc_at_once_cpu_first", "{:.3f}x"),
    ("ExampleConnector hit / prefix-cache hit, paired", "example_over_pc_paired", "{:.3f}x"),
    ("CPU hit / ExampleConnector hit", "cpu_over_example", "{:.3f}x"),
    ("disk hit / prefix-cache hit, paired", "disk_over_pc_paired", "{:.3f}x"),
    ("disk hit / CPU hit (each paired with the prefix-cache hit)", "disk_over_cpu_paired", "{:.3f}x"),
    ("MiB a hit copies", "hit_mib", "{:.1f}"),
    ("CPU hit's extra time over the prefix-cache hit, paired (ms)", "cpu_extra_ms_paired", "{:.1f}"),
    ("raw copy of those bytes, 1 thread (ms)", "raw_copy_ms_1_thread", "{:.1f}"),
    ("raw copy of those bytes, 2 threads (ms)", "raw_copy_ms_2_threads", "{:.1f}"),
]


def show(summary: dict[str, Any]) -> None:
    lengths = list(summary)
    print("| run (ms) | " + " | ".join(lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for label, key, form in TABLE:
        if all(key in summary[n] for n in lengths):
            print(f"| {label} | " + " | ".join(form.format(summary[n][key]) for n in lengths) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="1000,2000,4000")
    parser.add_argument("--repeats", type=int, default=3, help="distinct prompts per length")
    parser.add_argument("--rounds", type=int, default=3, help="hit pairs per prompt")
    parser.add_argument(
        "--inflight-repeats", type=int, default=6, help="prompts per length whose in-flight hit is measured"
    )
    parser.add_argument(
        "--inflight-pairs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pair each in-flight hit with a prefix-cache hit of its prompt, also asked in flight",
    )
    parser.add_argument(
        "--inflight-pc-repeats",
        type=int,
        default=0,
        help="prompts per length whose prefix-cache hit is asked in the in-flight hit's place",
    )
    parser.add_argument("--quiet-seconds", type=float, default=8.0, help="pause after the in-flight hit")
    engine_arguments(parser, "/tmp/tiercache-bench-pairs")
    parser.add_argument(
        "--kv-bytes-per-token", type=int, default=64 << 10, help="the benchmark model's KV (harness.MODEL)"
    )
    parser.add_argument(
        "--write-through",
        default="disk,s3",
        help="the lower tiers of the CPU-hit engine, comma separated, of disk and s3 ('' for none); "
        "the disk-hit engine always has its disk",
    )
    parser.add_argument("--name", default="hit-pairs")
    args = parser.parse_args()
    if args.inflight_repeats < args.repeats:
        parser.error(
            "--inflight-repeats must be at least --repeats: each prompt of the rounds is asked in flight"
        )
    data: dict[str, Any] = {"engines": run(args), "machine": machine(), "args": vars(args)}
    save(args.name, data)  # kept even if a check below fails
    lengths = [int(x) for x in args.lengths.split(",")]
    data["summary"] = summarize(data["engines"], prompts(lengths, args.repeats), args)
    save(args.name, data)
    show(data["summary"])


if __name__ == "__main__":
    main()

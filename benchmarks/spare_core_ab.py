"""vLLM's prefix-cache hit with the spare core idle, and with a process on it that
wakes every millisecond and does nothing else: whether a hit on this VM is faster
while the other core is kept from sleeping. The engine has no connector.

    python benchmarks/spare_core_ab.py --length 1000 --prompts 24

Why: in hit_pairs.py run 42, vLLM's own prefix-cache hit asked while its prompt's
write-through was held back (the upload process polling the hold every millisecond,
tiercache/foreground.py) took 0.877x the same engine's later, quiet prefix-cache hits,
while in an engine without a connector a hit right after its cold run is no faster
than later ones.

Each prompt is computed cold, then hit twice from the prefix cache, once with the
waker running on the core the model does not use and once without, the order
alternating from prompt to prompt; every hit is checked against its prompt's cold
run (the whole prompt but the last block cached, the same first token). The waker is
a separate process that follows marker files the engine's driver writes between
requests, and acknowledges each switch before the next request goes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from harness import (
    engine_arguments,
    engine_runner,
    machine,
    median,
    prompt,
    request,
    save,
    ttft,
    vllm_processes,
)
from hit_pairs import by_name, hit_problems

# How often the waker wakes while on, and looks for its next switch while off.
WAKE_SECONDS = 0.001
IDLE_LOOK_SECONDS = 0.05


def model_cpus() -> set[int]:
    """The cores vLLM's worker processes are bound to (the model's OMP cores)."""
    cpus: set[int] = set()
    for proc in vllm_processes("VLLM::Worker"):
        try:
            cpus |= set(proc.cpu_affinity())
        except psutil.Error:
            continue  # the process ended meanwhile
    return cpus


def waker(folder: Path, spin: bool) -> None:
    """Runs until killed: off until `on-N` appears, then wakes every WAKE_SECONDS (with
    `spin`, runs without a break at the lowest priority) until `off-N`; acknowledges
    each switch with `ack-on-N` / `ack-off-N`. Moves to the cores the model does not
    use at the first switch (the engine is up by then) and writes them to `cpus`."""
    if spin:
        os.nice(19)
    n = 0
    while True:
        while not (folder / f"on-{n}").exists():
            time.sleep(IDLE_LOOK_SECONDS)
        if n == 0:
            model = model_cpus()
            spare = set(range(os.cpu_count() or 1)) - model
            if not model or not spare:
                (folder / "cpus").write_text(f"no spare core: model on {sorted(model)}")
                raise SystemExit(1)
            os.sched_setaffinity(0, spare)
            (folder / "cpus").write_text(f"model on {sorted(model)}, waker on {sorted(spare)}")
        (folder / f"ack-on-{n}").touch()
        while not (folder / f"off-{n}").exists():
            if spin:
                until = time.monotonic() + WAKE_SECONDS
                while time.monotonic() < until:
                    pass
            else:
                time.sleep(WAKE_SECONDS)
        (folder / f"ack-off-{n}").touch()
        n += 1


def switch(folder: Path, state: str, n: int) -> list[dict[str, Any]]:
    return [
        {"touch": str(folder / f"{state}-{n}")},
        {"wait_for": str(folder / f"ack-{state}-{n}"), "timeout": 30},
    ]


def items_for(asks: list[list[int]], length: int, folder: Path) -> list[dict[str, Any]]:
    warm = prompt(7000 + length, length)
    items = [request("warm", prompt(1, 64)), request("warm", warm), request("warm", warm)]
    for i, ids in enumerate(asks):
        awake = [*switch(folder, "on", i), request(f"awake/{i}", ids), *switch(folder, "off", i)]
        idle = [request(f"idle/{i}", ids)]
        items += [request(f"cold/{i}", ids), *(awake + idle if i % 2 == 0 else idle + awake)]
    return items


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument(
        "--mode",
        choices=["wake", "spin"],
        default="wake",
        help="what the process on the spare core does while on: wake every millisecond, "
        "or run without a break (nice 19)",
    )
    parser.add_argument("--waker", help=argparse.SUPPRESS)  # the waker process's own entry
    engine_arguments(parser, "/tmp/tiercache-bench-spare-core")
    parser.add_argument("--name", default="spare-core-ab")
    args = parser.parse_args()
    if args.waker:
        waker(Path(args.waker), args.mode == "spin")
        return
    work, runner = engine_runner(args, args.length)
    folder = work / "waker"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    asks = [prompt(80_000 + i, args.length) for i in range(args.prompts)]
    process = subprocess.Popen([sys.executable, __file__, "--waker", str(folder), "--mode", args.mode])
    try:
        runner.run("no_connector", items_for(asks, args.length, folder))
    finally:
        process.kill()
        runner.stop()
    by = by_name(runner.engines["no_connector"])
    problems = [
        problem
        for i in range(args.prompts)
        for label in ("awake", "idle")
        for problem in hit_problems(by[f"{label}/{i}"], by[f"cold/{i}"], args.length, None)
    ]
    if problems:
        raise SystemExit("hits that were not right:\n  " + "\n  ".join(problems))
    awake = [1000 * ttft(by[f"awake/{i}"]) for i in range(args.prompts)]
    idle = [1000 * ttft(by[f"idle/{i}"]) for i in range(args.prompts)]
    ratios = [a / b for a, b in zip(awake, idle, strict=True)]
    summary = {
        "awake_ms": median(awake),
        "idle_ms": median(idle),
        "awake_over_idle_paired": median(ratios),
        "awake_faster_in": sum(r < 1 for r in ratios),
        "cores": (folder / "cpus").read_text(),
        "mode": args.mode,
    }
    save(args.name, {"engines": runner.engines, "summary": summary, "machine": machine(), "args": vars(args)})
    print(summary["cores"])
    print("| prefix-cache hit | median TTFT (ms) |")
    print("|---|---:|")
    print(f"| spare core idle | {summary['idle_ms']:.1f} |")
    busy = "kept busy (nice 19)" if args.mode == "spin" else f"woken every {1000 * WAKE_SECONDS:.0f} ms"
    print(f"| spare core {busy} | {summary['awake_ms']:.1f} |")
    print(
        f"| woken / idle, paired by prompt | {summary['awake_over_idle_paired']:.3f}x "
        f"(faster in {summary['awake_faster_in']} of {args.prompts}) |"
    )


if __name__ == "__main__":
    main()

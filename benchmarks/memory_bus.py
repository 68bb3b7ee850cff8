"""Is a forward on this host bound by its memory bus? A forward-like loop (the
benchmark model's shapes: 16 query tokens through float32 weight matrices, 512 MiB of
them, one thread on one core) timed alone, then with a plain copy loop (a CPU-tier
hit's copy, or a write-down's) running on another core. On vLLM's CPU backend the
paged KV, the CPU tier, the page cache and the weights share one bus: where the loop
slows down, a copy beside the forward costs TTFT whatever core it runs on.

    python benchmarks/memory_bus.py [--copy-mib 124] [--weights-mib 512]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

import torch
from harness import machine, median, save


def forward_like(weights: list[torch.Tensor], x: torch.Tensor) -> None:
    for w in weights:
        torch.mm(x, w.t())


def pinned_forward_like(weights_mib: int) -> tuple[list[int], Callable[[], None]]:
    """This process's cores, and the forward-like loop (16 query tokens through
    `weights_mib` of float32 weights) on one thread bound to the first of them: the
    other cores are the copy's."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one for the forward-like loop, one for the copy")
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {cores[0]})
    matrix_mib = 8  # 2048 x 1024 float32
    weights = [torch.randn(2048, 1024) for _ in range(weights_mib // matrix_mib)]
    x = torch.randn(16, 1024)
    return cores, lambda: forward_like(weights, x)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1000 * median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--weights-mib", type=int, default=512)
    parser.add_argument("--copy-mib", type=int, default=124, help="a 2000-token hit of the benchmark model")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--name", default="memory-bus")
    args = parser.parse_args()
    cores, forward = pinned_forward_like(args.weights_mib)
    forward()
    alone = timed(forward, args.repeats)

    src = torch.ones(args.copy_mib << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_alone = timed(lambda: dst.copy_(src), args.repeats)
    stop = threading.Event()

    def copy_loop() -> None:
        os.sched_setaffinity(0, {cores[1]})
        while not stop.is_set():
            dst.copy_(src)

    copier = threading.Thread(target=copy_loop)
    copier.start()
    time.sleep(0.2)
    beside = timed(forward, args.repeats)
    stop.set()
    copier.join()
    result = {
        "machine": machine(),
        "args": vars(args),
        "forward_like_ms_alone": alone,
        "forward_like_ms_with_copy_beside": beside,
        "slowdown": beside / alone,
        "copy_ms": copy_alone,
        "copy_gb_per_s": (args.copy_mib << 20) / copy_alone / 1e6,
    }
    save(args.name, result)
    print(
        f"forward-like loop: {alone:.1f} ms alone, {beside:.1f} ms with a copy loop on another core "
        f"({beside / alone:.2f}x); a {args.copy_mib} MiB copy alone: {copy_alone:.1f} ms "
        f"({result['copy_gb_per_s']:.1f} GB/s)"
    )


if __name__ == "__main__":
    main()

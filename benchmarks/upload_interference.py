"""What S3 write-through costs a forward pass running in the same process.

A decode-like loop (matrix-vector products over 400 MB of float32 weights, one
thread, bound to the first CPU as vLLM's CPU backend binds its worker) runs while a
TierEngine writes rounds of 63 blocks of 2 MiB down to S3, with the uploads either in
the engine's own threads ("in_process") or in the upload process that reads the
blocks from shared memory ("process", tiercache/uploader.py). The figure is the
loop's rate while the write-down runs over its rate just before it, in the same run.

The endpoint is moto's server or, by default, `s3_sink.py`, which reads and discards
each body, so that what is measured is the writer's cost and not moto's: a real S3
endpoint does not run on the host. Both, and redis-server, run on the last CPU.

With `--pace S`, a round starts at most every S seconds, spreading the same writes
over more time; each row also gives the loop's time lost to them, in seconds.

With `--pieces MIB_PER_S`, the upload process and, in turn, neighbours that each do one
piece of its work on 2 MiB bodies at that rate: a copy, a SHA-256, a plain HTTP PUT to
the sink. Which piece costs the loop what the uploads do says where the cost is.

With `--neighbours`, no uploads: the loop's rate while another process on the last
CPU either spins (CPU only) or copies 64 MiB buffers (memory traffic), over its rate
just before. On a small VM the second shows how much the loop is bound by the memory
bus it shares with whatever runs on the other core.

    .venv/bin/python benchmarks/upload_interference.py [--endpoint sink|moto] [--repeats 3]
        [--pace S] [--neighbours]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SLOT = 2 << 20
BLOCKS = 63  # a 2000-token prompt of the e2e model


def forward_loop():
    import torch

    torch.set_num_threads(1)
    weights = [torch.randn(4096, 1024) for _ in range(24)]
    x = torch.randn(1024)

    def step() -> None:
        y = x
        for w in weights:
            y = torch.nn.functional.silu((w @ y)[:1024]) + y

    return step


def rate(step, seconds: float) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        n += 1
    return n / (time.perf_counter() - start)


@contextlib.contextmanager
def endpoint(kind: str, cpus: set[int]):
    from s3_sink import running

    from tiercache.testing.servers import moto_process

    server = moto_process("interference", cpus) if kind == "moto" else running(cpus)
    with server as url:
        yield url


# Each neighbour moves 2 MiB a turn and prints its running byte count; with a rate it
# sleeps to hold that many MiB/s, so that its cost per byte can be set beside the
# upload process's at the same rate.
_PACED_LOOP = """
import sys, time
rate = float(sys.argv[1]) * 2**20
moved, start = 0, time.perf_counter()
while True:
    turn()
    moved += 2 << 20
    print(time.perf_counter(), moved, flush=True)
    if rate:
        time.sleep(max(0.0, start + moved / rate - time.perf_counter()))
"""
NEIGHBOURS = {
    "spin": "while True: pass",
    "memcpy": (
        "import torch\ntorch.set_num_threads(1)\n"
        "a = torch.empty(64 << 20, dtype=torch.uint8)\nb = torch.empty_like(a)\n"
        "while True: a.copy_(b)"
    ),
    # The pieces of an upload, apart: a copy of 2 MiB, a SHA-256 of 2 MiB, and a
    # plain HTTP PUT of 2 MiB to the same sink (no botocore, no hashing).
    "copy-2mib": (
        "import torch\ntorch.set_num_threads(1)\n"
        "a = torch.empty(2 << 20, dtype=torch.uint8)\nb = torch.empty_like(a)\n"
        "def turn(): a.copy_(b)\n" + _PACED_LOOP
    ),
    "sha256": (
        "import hashlib, os\nbody = os.urandom(2 << 20)\n"
        "def turn(): hashlib.sha256(body).digest()\n" + _PACED_LOOP
    ),
    "put": (
        "import http.client, os, sys, urllib.parse\nbody = os.urandom(2 << 20)\n"
        "url = urllib.parse.urlsplit(sys.argv[2])\n"
        "connection = http.client.HTTPConnection(url.hostname, url.port)\n"
        "def turn():\n"
        "    connection.request('PUT', '/interference/k', body, {'Content-Length': str(len(body))})\n"
        "    connection.getresponse().read()\n" + _PACED_LOOP
    ),
}


def measure_neighbour(step, kind: str, cpus: set[int], mib_per_s: float = 0.0, url: str = "") -> dict:
    before = rate(step, 3.0)
    process = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOURS[kind], str(mib_per_s), url],
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2.5)  # its imports and buffers
        began = time.perf_counter()
        during = rate(step, 3.0)
        window = (began, time.perf_counter())
    finally:
        process.kill()
        output, _ = process.communicate()
    # perf_counter is one clock across processes on Linux (CLOCK_MONOTONIC).
    counts = [tuple(map(float, line.split())) for line in output.splitlines() if line.count(" ") == 1]
    inside = [moved for at, moved in counts if window[0] <= at <= window[1]]
    moved_mib_per_s = (inside[-1] - inside[0]) / 2**20 / (window[1] - window[0]) if len(inside) > 1 else None
    return {
        "mode": f"beside {kind}",
        "before_steps_per_s": before,
        "during_steps_per_s": during,
        "ratio": during / before,
        "neighbour_mib_per_s": moved_mib_per_s,
    }


def measure(step, mode: str, url: str, redis_url: str, rounds: int, pace: float = 0.0) -> dict:
    from tiercache.config import TierCacheConfig
    from tiercache.engine import ObjectShape, TierEngine
    from tiercache.tiers.cpu import CpuBuffer

    buffer = CpuBuffer(BLOCKS, SLOT, pin_memory=False, shared=mode == "process")
    config = TierCacheConfig.model_validate(
        {"redis_url": redis_url, "s3": {"bucket": "interference", "endpoint_url": url}}
    )
    engine = TierEngine(config, ObjectShape(os.urandom(8).hex(), os.urandom(8).hex(), SLOT), buffer)
    assert (engine.uploads is not None) == (mode == "process")
    try:
        time.sleep(2)  # the upload process's imports
        before = rate(step, 3.0)
        done, stored, count = threading.Event(), [], [0]
        round_started = [0.0]

        def round_of_writes() -> None:
            round_started[0] = time.perf_counter()
            for slot in range(BLOCKS):
                engine.write_down(os.urandom(32), slot, on_done)

        def on_done(result) -> None:
            count[0] += 1
            stored.append(bool(result.stored.get("s3")))
            if count[0] == BLOCKS * rounds:
                done.set()
            elif count[0] % BLOCKS == 0:
                wait = max(0.0, round_started[0] + pace - time.perf_counter())
                threading.Timer(wait, round_of_writes).start()

        start, steps = time.perf_counter(), 0
        round_of_writes()
        while not done.is_set():
            step()
            steps += 1
        seconds = time.perf_counter() - start
        during = steps / seconds
        return {
            "mode": mode,
            "before_steps_per_s": before,
            "during_steps_per_s": during,
            "ratio": during / before,
            "lost_seconds": seconds * (1 - during / before),
            "write_mib_per_s": BLOCKS * rounds * SLOT / 2**20 / seconds,
            "stored": sum(stored),
            "asked": len(stored),
        }
    finally:
        engine.close()
        buffer.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoint", choices=["sink", "moto"], default="sink")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of 63 x 2 MiB per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pace", type=float, default=0.0, help="start a round at most every S seconds")
    parser.add_argument(
        "--neighbours", action="store_true", help="a spinning or copying neighbour, no uploads"
    )
    parser.add_argument(
        "--pieces",
        type=float,
        default=None,
        metavar="MIB_PER_S",
        help="neighbours doing one piece of an upload each (copy, SHA-256, plain PUT) at this rate, "
        "beside the upload process itself",
    )
    parser.add_argument("--out", default=None, help="JSON results file")
    args = parser.parse_args()
    if args.pieces is not None:
        modes = ("process", "beside copy-2mib", "beside sha256", "beside put")
    elif args.neighbours:
        modes = ("beside spin", "beside memcpy")
    else:
        modes = ("in_process", "process")

    from tiercache.testing.servers import RedisServer, create_bucket

    allowed = sorted(os.sched_getaffinity(0))
    model_cpu, service_cpus = allowed[0], {allowed[-1]}
    os.sched_setaffinity(0, {model_cpu})  # threads started from here on inherit it
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        os.environ.setdefault(name, value)
    step = forward_loop()
    redis_server = RedisServer(cpus=service_cpus).start()
    rows = []
    try:
        with endpoint(args.endpoint, service_cpus) as url:
            if args.endpoint == "moto":
                create_bucket(url, "interference")
            for _ in range(args.repeats):
                for mode in modes:
                    if mode.startswith("beside"):
                        row = measure_neighbour(step, mode.split()[1], service_cpus, args.pieces or 0.0, url)
                        rows.append(row)
                        moved = row["neighbour_mib_per_s"]
                        print(
                            f"{mode:16s} forward {row['before_steps_per_s']:.1f} -> "
                            f"{row['during_steps_per_s']:.1f} steps/s ({row['ratio']:.2f}x)"
                            + (f" while it moved {moved:.0f} MiB/s" if moved else ""),
                            flush=True,
                        )
                        continue
                    row = measure(step, mode, url, redis_server.url, args.rounds, args.pace)
                    rows.append(row)
                    print(
                        f"{mode:10s} forward {row['before_steps_per_s']:.1f} -> "
                        f"{row['during_steps_per_s']:.1f} "
                        f"steps/s ({row['ratio']:.2f}x, {row['lost_seconds']:.2f} s lost) while writing "
                        f"{row['write_mib_per_s']:.0f} MiB/s, stored {row['stored']}/{row['asked']}",
                        flush=True,
                    )
    finally:
        redis_server.close()
    summary = {mode: statistics.median(r["ratio"] for r in rows if r["mode"] == mode) for mode in modes}
    print(
        "median forward rate while writing, over the rate before:",
        {k: round(v, 2) for k, v in summary.items()},
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "cpus": {"model": model_cpu, "services": sorted(service_cpus)},
                    "rows": rows,
                    "median_ratio": summary,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

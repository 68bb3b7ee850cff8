"""The peer tier's data plane alone: N blocks read from another process's CPU tier over
NIXL (UCX on loopback) into this process's CPU slots, each verified (directory rows,
slot headers before and after, xxh3 checksum), against a local memcpy of the same
bytes between two of this process's buffers, in the same run:

    .venv/bin/python benchmarks/peer_tier.py                      # 64 blocks of 1 MiB
    .venv/bin/python benchmarks/peer_tier.py --blocks 256 --block-bytes 262144 --json

It starts its own redis-server on a free loopback port (the peer's record lives there)
and the holder in a process of its own. The peer read and the memcpy alternate repeat
by repeat; medians over the repeats after one warm-up, the ratio a median of the
per-repeat ratios. The connector does not use the peer tier yet: this times the data
plane, not a load inside vLLM."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from tiercache.config import RedisConfig
from tiercache.index.keys import KVSpec
from tiercache.index.redis_conn import GuardedRedis
from tiercache.object_shape import ObjectShape
from tiercache.ops.local_stack import RedisServer
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.format import checksum
from tiercache.tiers.peer import PeerTier
from tiercache.tiers.peer.agent import load_nixl

REDIS = RedisConfig(socket_timeout=5.0)


def shape_for(block_bytes: int) -> ObjectShape:
    spec = KVSpec("bench", "r1", "bfloat16", "bfloat16", 32, "bench", 1, 1, 1, 1, 0, "bench", block_bytes)
    return ObjectShape(spec.model_digest(), spec.digest(), block_bytes)


def block_hash(i: int) -> bytes:
    return i.to_bytes(32, "little")


def hold(url: str, blocks: int, block_bytes: int) -> None:
    """The holder process: fill every slot, publish it, wait for stdin to close."""
    nixl = load_nixl()
    if nixl is None:
        sys.exit("NIXL is not installed")
    buffer = CpuBuffer(blocks, block_bytes, pin_memory=False)
    buffer.tensor.numpy()[:] = np.random.default_rng(0).integers(0, 256, buffer.tensor.shape, dtype=np.uint8)
    tier = PeerTier(nixl, shape_for(block_bytes), buffer, GuardedRedis(url, REDIS), "holder")
    for slot in range(blocks):
        tier.publish(slot, block_hash(slot))
    print("READY", flush=True)
    sys.stdin.read()
    tier.close()


def measure(blocks: int, block_bytes: int, repeats: int) -> dict:
    nixl = load_nixl()
    if nixl is None:
        sys.exit("NIXL is not installed")
    redis_server = RedisServer().start()
    holder = subprocess.Popen(
        [sys.executable, __file__, "--hold", redis_server.url, "--blocks", str(blocks)]
        + ["--block-bytes", str(block_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "READY":
            sys.exit(f"the holder exited with {holder.wait()}")
        buffer = CpuBuffer(blocks, block_bytes, pin_memory=False)
        reader = PeerTier(
            nixl, shape_for(block_bytes), buffer, GuardedRedis(redis_server.url, REDIS), "reader"
        )
        source = CpuBuffer(blocks, block_bytes, pin_memory=False)
        target = CpuBuffer(blocks, block_bytes, pin_memory=False)
        source.tensor.numpy()[:] = 1
        wanted = [(block_hash(i), i) for i in range(blocks)]
        peer_s, memcpy_s, verify_s, ratios = [], [], [], []
        for repeat in range(repeats + 1):
            started = time.perf_counter()
            result = reader.read("holder", wanted, time.monotonic() + 30)
            peer = time.perf_counter() - started
            if result.missed:
                sys.exit(
                    f"peer read missed {len(result.missed)} blocks: {next(iter(result.missed.values()))}"
                )
            started = time.perf_counter()
            for slot in range(blocks):
                np.copyto(target.tensor.numpy()[slot], source.tensor.numpy()[slot])
            memcpy = time.perf_counter() - started
            # What verification alone costs: the checksum of every block read.
            started = time.perf_counter()
            for slot in range(blocks):
                checksum(buffer.view(slot))
            verify = time.perf_counter() - started
            if repeat:  # the first is a warm-up (connection set-up, page faults)
                peer_s.append(peer)
                memcpy_s.append(memcpy)
                verify_s.append(verify)
                ratios.append(peer / memcpy)
        reader.close()
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(timeout=30)
        redis_server.close()
    total = blocks * block_bytes
    return {
        "blocks": blocks,
        "block_bytes": block_bytes,
        "repeats": repeats,
        "peer_read_gb_s": total / statistics.median(peer_s) / 1e9,
        "memcpy_gb_s": total / statistics.median(memcpy_s) / 1e9,
        "checksum_gb_s": total / statistics.median(verify_s) / 1e9,
        "peer_over_memcpy_time": statistics.median(ratios),
        "peer_read_ms": statistics.median(peer_s) * 1e3,
        "memcpy_ms": statistics.median(memcpy_s) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--hold", metavar="REDIS_URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold:
        hold(args.hold, args.blocks, args.block_bytes)
        return
    figures = measure(args.blocks, args.block_bytes, args.repeats)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"{figures['blocks']} blocks of {figures['block_bytes']} bytes, median of {figures['repeats']}:")
    peer_ms, peer_gb_s = figures["peer_read_ms"], figures["peer_read_gb_s"]
    print(f"  peer read (NIXL, verified): {peer_ms:.2f} ms, {peer_gb_s:.2f} GB/s")
    print(f"  local memcpy:               {figures['memcpy_ms']:.2f} ms, {figures['memcpy_gb_s']:.2f} GB/s")
    print(f"  checksum alone:             {figures['checksum_gb_s']:.2f} GB/s")
    print(f"  peer read / memcpy (time):  {figures['peer_over_memcpy_time']:.2f}x")


if __name__ == "__main__":
    main()

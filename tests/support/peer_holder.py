"""An instance holding blocks in its CPU tier for other instances to read over NIXL, in
a process of its own, as a second vLLM instance would: it fills its slots with known
bytes, publishes them (peer record and presence), prints READY, then obeys one line
per command on stdin until stdin closes:

  rewrite <slot>   the slot is reused: retired, refilled with other bytes, left unlisted

Usage: python peer_holder.py REDIS_URL INSTANCE SLOTS SLOT_BYTES [NAMESPACE]
Block i's hash and bytes are `block_hash(i)` and `block_bytes(i, slot_bytes)`."""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from tiercache.index.keys import KVSpec
from tiercache.index.presence import PresencePublisher
from tiercache.index.redis_conn import GuardedRedis
from tiercache.object_shape import ObjectShape
from tiercache.tiers import CPU
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.peer import PeerTier
from tiercache.tiers.peer.agent import load_nixl

from support.redis_config import PATIENT


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def block_bytes(i: int, slot_bytes: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, slot_bytes, dtype=np.uint8)


def shape_for(slot_bytes: int, namespace: str = "default", model: str = "tiny") -> ObjectShape:
    spec = KVSpec(
        model=model,
        revision="r1",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        block_size=32,
        layout="test",
        num_layers=2,
        num_kv_heads=2,
        head_size=64,
        tp_size=1,
        tp_rank=0,
        namespace=namespace,
        page_bytes=slot_bytes,
    )
    return ObjectShape(spec.model_digest(), spec.digest(), slot_bytes)


def fill(tier: PeerTier, presence: PresencePublisher | None, slot: int, index: int) -> bytes:
    """Put block `index` into `slot` as a store would: retire, copy, publish."""
    tier.retire(slot)
    tier.buffer.tensor[slot].numpy()[:] = block_bytes(index, tier.buffer.slot_bytes)
    tier.publish(slot, block_hash(index))
    if presence is not None:
        presence.update(block_hash(index), CPU, True)
    return block_hash(index)


def main(argv: list[str]) -> None:
    url, instance, slots, slot_bytes = argv[0], argv[1], int(argv[2]), int(argv[3])
    namespace = argv[4] if len(argv) > 4 else "default"
    redis = GuardedRedis(url, PATIENT)
    shape = shape_for(slot_bytes, namespace)
    buffer = CpuBuffer(slots, slot_bytes, pin_memory=False)
    nixl = load_nixl()
    assert nixl is not None
    tier = PeerTier(nixl, shape, buffer, redis, instance)
    presence = PresencePublisher(redis, shape.model_digest, instance)
    for slot in range(slots):
        fill(tier, presence, slot, slot)
    presence.flush()
    print("READY", flush=True)
    for line in sys.stdin:
        command = line.split()
        if command and command[0] == "rewrite":
            slot = int(command[1])
            tier.retire(slot)
            buffer.tensor[slot].numpy()[:] = 0xAB
        print("OK", flush=True)
    tier.close()
    presence.close()


if __name__ == "__main__":
    main(sys.argv[1:])

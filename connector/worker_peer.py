"""A worker's side of the peer tier (tiers/peer): this rank's CPU tier shared with the
other live instances of the deployment, and their CPU tiers read into this rank's
staging slots. The worker tells it when a step is about to write slots (`retire`),
when a slot holds a block (`published`), and hands it the peer blocks of a load
(`read`, from worker_loads.py)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from tiercache.config import TierCacheConfig
from tiercache.engine import TierEngine
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.peer import PeerTier

from .load_lifecycle import stages_into_slot
from .metadata import BlockOp, TierCacheMetadata

log = logging.getLogger("tiercache.connector")


class WorkerPeer:
    def __init__(self, tier: PeerTier):
        self.tier = tier
        # One read at a time per tier (its lock): one thread of its own, so a staging
        # never holds a mover or a disk reader while it waits on a peer.
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="tiercache-stage-peer")

    @classmethod
    def start(
        cls, config: TierCacheConfig, engine: TierEngine, buffer: CpuBuffer, instance: str, rank: int
    ) -> WorkerPeer | None:
        """This rank's CPU tier shared under `instance` (the scheduler's name for this
        instance); None where the tier is off or cannot start (logged)."""
        tier = PeerTier.create(config, engine.shape, buffer, engine.redis, instance)
        if tier is None:
            return None
        log.info("tiercache: rank %d shares its CPU tier with peers as %s", rank, instance)
        return cls(tier)

    def retire(self, meta: TierCacheMetadata) -> None:
        """Before anything of the step writes into a CPU slot (a store's copy, a
        staging): no peer takes what those slots held from now on."""
        for op in meta.stores:
            self.tier.retire(op.slot)
        for job in meta.loads:
            for op in job.ops:
                if stages_into_slot(op):
                    self.tier.retire(op.slot)

    def published(self, block_hash: bytes, slot: int) -> None:
        """`slot` holds `block_hash` now (a store copied out, a staging verified)."""
        self.tier.publish(slot, block_hash)

    def read(self, instance: str, ops: list[BlockOp], deadline: float) -> Future:
        """Read `ops`' blocks from `instance`'s CPU tier into their slots by `deadline`
        (time.monotonic()); the future's result says per op whether it came, verified.
        It never raises, and is done only once nothing writes into the slots any more."""
        tier = self.tier
        blocks = [(op.block_hash, op.slot) for op in ops]

        def read() -> list[bool]:
            result = tier.read(instance, blocks, deadline)
            if result.missed:
                log.info(
                    "tiercache: %d of %d blocks missed from peer %s (%s)",
                    len(result.missed),
                    len(blocks),
                    instance,
                    next(iter(result.missed.values())),
                )
            loaded = set(result.loaded)
            return [i in loaded for i in range(len(blocks))]

        return self._reads.submit(read)

    def close(self) -> None:
        """Stop sharing (the record leaves Redis) once the read under way, if any, ends."""
        self._reads.shutdown(wait=True, cancel_futures=True)
        self.tier.close()


def missed(ops: list[BlockOp]) -> Future:
    """The answer of a read that cannot be made (no peer tier, no holder named)."""
    future: Future = Future()
    future.set_result([False] * len(ops))
    return future

"""The scheduler half's view of the peer tier (tiers/peer): which other live instance
of this deployment holds a request's next blocks in its CPU tier, from the presence
every instance publishes in Redis (tiercache/index/presence.py). The worker then reads
them from that instance over NIXL; the scheduler never touches a peer itself."""

from __future__ import annotations

import logging

from tiercache.index.presence import instance_prefixes
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable

log = logging.getLogger("tiercache.connector")


class PeerLookup:
    def __init__(self, redis: GuardedRedis, model_digest: str, instance: str):
        self.redis = redis
        self.model_digest = model_digest
        self.instance = instance  # this one: never its own peer

    def holder(self, block_hashes: list[bytes]) -> tuple[str, int] | None:
        """(instance, leading blocks of `block_hashes` in its CPU tier) for the live
        instance other than this one that holds the most of them; None when none does
        or Redis does not answer (a miss, never an error)."""
        if not block_hashes:
            return None
        try:
            found = instance_prefixes(self.redis, self.model_digest, block_hashes)
        except RedisUnavailable:
            return None
        best = max(
            (p for p in found if p.instance != self.instance and p.cpu > 0),
            key=lambda p: p.cpu,
            default=None,
        )
        return None if best is None else (best.instance, best.cpu)

"""The scheduler half's view of the peer tier (tiers/peer): which other live instance
of this deployment holds a request's next blocks in its CPU tier, from the presence
every instance publishes in Redis (tiercache/index/presence.py). The worker then reads
them from that instance over NIXL; the scheduler never touches a peer itself."""

from __future__ import annotations

import time

from tiercache.index.presence import instance_prefixes, live_instances
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable

# How long the list of live instances is trusted: an instance alone in its deployment
# (the common case) then costs one Redis round trip per this many seconds, not one per
# lookup. A peer that starts is seen this much later at most.
LIVE_INSTANCES_SECONDS = 1.0


class PeerLookup:
    def __init__(self, redis: GuardedRedis, model_digest: str, instance: str):
        self.redis = redis
        self.model_digest = model_digest
        self.instance = instance  # this one: never its own peer
        self._others_at: float | None = None  # when `_others` was last read
        self._others = False  # whether another instance of the deployment was live then

    def holder(self, block_hashes: list[bytes]) -> tuple[str, int] | None:
        """(instance, leading blocks of `block_hashes` in its CPU tier) for the live
        instance other than this one that holds the most of them; None when none does
        or Redis does not answer (a miss, never an error)."""
        if not block_hashes:
            return None
        try:
            if not self._another_is_live():
                return None
            found = instance_prefixes(self.redis, self.model_digest, block_hashes)
        except RedisUnavailable:
            return None
        best = max(
            (p for p in found if p.instance != self.instance and p.cpu > 0),
            key=lambda p: p.cpu,
            default=None,
        )
        return None if best is None else (best.instance, best.cpu)

    def _another_is_live(self) -> bool:
        """Raises RedisUnavailable."""
        now = time.monotonic()
        if self._others_at is None or now - self._others_at >= LIVE_INSTANCES_SECONDS:
            live = live_instances(self.redis, self.model_digest)
            self._others = any(name != self.instance for name in live)
            self._others_at = now
        return self._others

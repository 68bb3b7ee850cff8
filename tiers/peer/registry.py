"""Where peers find each other: each worker's NIXL record in Redis, with a TTL it
refreshes from a thread of its own, and the choice of a holder through presence.

  tc:{<model_digest>}:peer:<rank_digest>:<instance>   HASH  agent, metadata, layout

The model digest names the deployment (model, weights, namespace, layout, TP size);
the rank digest, one worker of it (its TP rank, pipeline stage and layers). A worker
looks up only its own rank digest, so rank r reads from rank r of the same
deployment, and another namespace or deployment is never found."""

from __future__ import annotations

import contextlib
import logging
import threading

from tiercache.index.presence import instance_prefixes
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.tiers.peer.agent import PeerRecord

log = logging.getLogger(__name__)


def record_key(model_digest: str, rank_digest: str, instance: str) -> str:
    return f"tc:{{{model_digest}}}:peer:{rank_digest}:{instance}"


class PeerRegistry:
    def __init__(
        self,
        redis: GuardedRedis,
        model_digest: str,
        rank_digest: str,
        instance: str,
        ttl: float,
    ):
        self.redis = redis
        self.model_digest = model_digest
        self.rank_digest = rank_digest
        self.instance = instance
        self.ttl = ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._record: PeerRecord | None = None

    # -- this worker's record -----------------------------------------------------
    def publish(self, record: PeerRecord) -> bool:
        """Write this worker's record and (re)start its TTL. False when Redis did not take it."""
        self._record = record
        key = record_key(self.model_digest, self.rank_digest, self.instance)
        fields = {
            "agent": record.agent,
            "metadata": record.metadata,
            "layout": record.layout(),
            "host": record.host,
            "port": record.port,
        }

        def write():
            pipe = self.redis.client.pipeline(transaction=False)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, int(self.ttl * 1000))
            pipe.execute()

        try:
            self.redis.call("peer_publish", write)
            return True
        except RedisUnavailable:
            return False

    def start(self, record: PeerRecord) -> None:
        self.publish(record)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tiercache-peer-record", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        # A third of the TTL: two refreshes may fail before the record expires.
        while not self._stop.wait(self.ttl / 3):
            if self._record is not None:
                try:
                    self.publish(self._record)
                except Exception:  # the thread must outlive any one refresh
                    log.exception("tiercache: refreshing the peer record failed")

    def close(self) -> None:
        """Stop refreshing and remove the record (a clean shutdown; the TTL otherwise)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        key = record_key(self.model_digest, self.rank_digest, self.instance)
        with contextlib.suppress(RedisUnavailable):  # the TTL removes it
            self.redis.call("peer_publish", lambda: self.redis.client.delete(key))

    # -- other workers ------------------------------------------------------------
    def record_of(self, instance: str) -> PeerRecord | None:
        """The live record of `instance`'s worker of this rank; None when there is none
        or it cannot be read. Raises RedisUnavailable."""
        key = record_key(self.model_digest, self.rank_digest, instance)
        fields = self.redis.call("peer_lookup", lambda: self.redis.client.hgetall(key))
        try:
            return PeerRecord.from_fields(fields[b"agent"], fields[b"metadata"], fields[b"layout"])
        except (KeyError, ValueError, TypeError):
            return None

    def holders(self, block_hashes: list[bytes]) -> list[tuple[str, int]]:
        """Other live instances holding a leading run of `block_hashes` in their CPU
        tiers, as (instance, blocks), most blocks first. Raises RedisUnavailable."""
        found = instance_prefixes(self.redis, self.model_digest, block_hashes)
        ranked = [(p.instance, p.cpu) for p in found if p.instance != self.instance and p.cpu > 0]
        return sorted(ranked, key=lambda item: -item[1])

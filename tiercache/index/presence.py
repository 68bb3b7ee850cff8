"""Which blocks each vLLM instance holds in its own CPU and disk tiers, kept in Redis
for routers (the service's `/v1/lookup` reads it).

Layout (the deployment's hash tag, so one lookup reads every instance in one call,
in Redis Cluster too):
  tc:{<model_digest>}:at:<instance>   HASH  field = vLLM's block hash (raw bytes),
                                            value = tier bits: "1" CPU, "2" disk, "3" both;
                                            expires `ttl` seconds after its last refresh
  tc:{<model_digest>}:instances       ZSET  member = instance id, score = unix time its
                                            hash expires; past that the instance is gone

A field is about 100 bytes of Redis (a hashtable entry, a 32-byte key, a 1-byte value;
tests/test_service.py measures it under the 200-byte budget). The scheduler only
records changes in memory (`PresencePublisher.update`, a dict write under a lock);
a thread writes them in batches every `interval` seconds, never on the request path,
and refreshes the TTL. When a batch is lost (Redis down) or the hash expired, the
thread rewrites the whole hash from its own copy, under a temporary name renamed over
the live one, so a reader never sees a half-written instance."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.tiers import CPU, DISK

log = logging.getLogger(__name__)

TIER_BITS = {CPU: 1, DISK: 2}
DEFAULT_TTL = 30.0
DEFAULT_INTERVAL = 1.0
# Fields per HSET/HDEL command, and per pipeline round trip of a full rewrite.
_BATCH = 2000
_CHUNK = 1000  # HMGET arguments per call in the lookup script (Lua's unpack limit)

# KEYS: each instance's presence hash, then (optionally) other keys of the deployment.
# ARGV: member width, members concatenated, and how many of KEYS are presence hashes
# (absent: all). Returns, per instance, three numbers: leading blocks in its CPU tier,
# on its disk, and in either (what it can load without recomputing or going to S3);
# then each other key's PTTL.
_LOOKUP = (
    """
local width = tonumber(ARGV[1])
local blob = ARGV[2]
local holders = tonumber(ARGV[3]) or #KEYS
local n = #blob / width
local out = {}
for k = 1, holders do
  local key = KEYS[k]
  local cpu, disk, any = -1, -1, -1
  local i = 1
  while i <= n and any < 0 do
    local last = math.min(n, i + %d - 1)
    local fields = {}
    for j = i, last do
      fields[#fields + 1] = string.sub(blob, (j - 1) * width + 1, j * width)
    end
    local values = redis.call('HMGET', key, unpack(fields))
    for j = 1, #values do
      local bits = tonumber(values[j] or '0') or 0
      local before = i + j - 2
      if cpu < 0 and bits %% 2 ~= 1 then cpu = before end
      if disk < 0 and math.floor(bits / 2) %% 2 ~= 1 then disk = before end
      if bits == 0 then
        any = before
        break
      end
    end
    i = last + 1
  end
  if any < 0 then any = n end
  if cpu < 0 then cpu = n end
  if disk < 0 then disk = n end
  out[#out + 1] = cpu
  out[#out + 1] = disk
  out[#out + 1] = any
end
for k = holders + 1, #KEYS do
  out[#out + 1] = redis.call('PTTL', KEYS[k])
end
return out
"""
    % _CHUNK
)


def presence_key(model_digest: str, instance: str) -> str:
    return f"tc:{{{model_digest}}}:at:{instance}"


def instances_key(model_digest: str) -> str:
    return f"tc:{{{model_digest}}}:instances"


@dataclass(frozen=True)
class InstancePrefix:
    instance: str
    cpu: int  # leading blocks in the instance's CPU tier
    disk: int  # leading blocks on its disk (every rank's)
    local: int  # leading blocks in either


def live_instances(redis: GuardedRedis, model_digest: str, now: float | None = None) -> list[str]:
    """The instances of a deployment whose presence has not expired."""
    now = time.time() if now is None else now
    key = instances_key(model_digest)
    raw = redis.call("instances", lambda: redis.client.zrangebyscore(key, now, "+inf"))
    return sorted(m.decode() if isinstance(m, bytes) else m for m in raw)


def instance_prefixes(
    redis: GuardedRedis, model_digest: str, block_hashes: list[bytes]
) -> list[InstancePrefix]:
    """Per live instance, how many leading `block_hashes` it holds in CPU, on disk and
    in either: two round trips (the instance list, then one script over all of them).
    Raises RedisUnavailable."""
    if not block_hashes:  # every count is 0: no script to run
        return [InstancePrefix(name, 0, 0, 0) for name in live_instances(redis, model_digest)]
    return instance_prefixes_and_ttls(redis, model_digest, block_hashes, lambda _: ())[0]


def instance_prefixes_and_ttls(
    redis: GuardedRedis,
    model_digest: str,
    block_hashes: list[bytes],
    keys_of: Callable[[str], Sequence[str]],
) -> tuple[list[InstancePrefix], dict[str, list[int]]]:
    """As `instance_prefixes`, and for each live instance the time to live of each of
    `keys_of(instance)` (keys under the deployment's hash tag), in milliseconds as
    PTTL answers (-2: no such key), read by the same script as the prefixes: the
    service asks so whether each instance's peer records are live at no extra round
    trip (a script, not a pipeline: redis-py refuses EVALSHA in a cluster pipeline).
    Raises RedisUnavailable."""
    instances = live_instances(redis, model_digest)
    if not instances:
        return [], {}
    asked = {name: list(keys_of(name)) for name in instances}
    keys = [presence_key(model_digest, name) for name in instances]
    keys += [key for name in instances for key in asked[name]]
    # No blocks: one byte wide and none of them, so every count is 0.
    width = len(block_hashes[0]) if block_hashes else 1
    cut = next((i for i, h in enumerate(block_hashes) if len(h) != width), len(block_hashes))
    blob = b"".join(block_hashes[:cut])
    script = redis.script(_LOOKUP)
    counts = redis.call("presence", lambda: script(keys=keys, args=[width, blob, len(instances)]))
    results = counts[3 * len(instances) :]
    prefixes = [
        InstancePrefix(name, int(counts[3 * i]), int(counts[3 * i + 1]), int(counts[3 * i + 2]))
        for i, name in enumerate(instances)
    ]
    ttls: dict[str, list[int]] = {}
    for name in instances:
        answers, results = results[: len(asked[name])], results[len(asked[name]) :]
        ttls[name] = [int(answer) for answer in answers]
    return prefixes, ttls


class PresencePublisher:
    """One instance's presence: what its CPU and disk tiers hold, kept in Redis from a
    thread of its own. `update` and `clear` are all the scheduler calls."""

    def __init__(
        self,
        redis: GuardedRedis,
        model_digest: str,
        instance: str,
        *,
        ttl: float = DEFAULT_TTL,
        interval: float = DEFAULT_INTERVAL,
    ):
        if ttl <= 2 * interval:
            raise ValueError(f"presence ttl ({ttl}s) must exceed twice the refresh interval ({interval}s)")
        self.redis = redis
        self.model_digest = model_digest
        self.instance = instance
        self.ttl = ttl
        self.interval = interval
        self.key = presence_key(model_digest, instance)
        self._ttl_ms = int(ttl * 1000)
        self._lock = threading.Lock()
        self._bits: dict[bytes, int] = {}  # what this instance holds: the truth
        self._dirty: set[bytes] = set()  # changed since the last batch
        self._rewrite = True  # Redis's copy is unknown: write it whole
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the scheduler's side -------------------------------------------------------
    def update(self, block: bytes, tier: str, present: bool) -> None:
        bit = TIER_BITS[tier]
        with self._lock:
            old = self._bits.get(block, 0)
            new = old | bit if present else old & ~bit
            if new == old:
                return
            if new:
                self._bits[block] = new
            else:
                del self._bits[block]
            self._dirty.add(block)

    def holds(self) -> dict[bytes, int]:
        with self._lock:
            return dict(self._bits)

    # -- the thread's side ----------------------------------------------------------
    def flush(self) -> bool:
        """Write what changed (or everything, when Redis's copy is in doubt) and
        refresh the TTL. False when Redis did not take it: the next flush rewrites."""
        with self._lock:
            rewrite = self._rewrite
            if rewrite:
                changes = dict(self._bits)
            else:
                changes = {block: self._bits.get(block, 0) for block in self._dirty}
            expected = len(self._bits)
            self._dirty.clear()
            self._rewrite = False
        try:
            if rewrite:
                self._write_all(changes)
            else:
                self._write_changes(changes, expected)
            return True
        except RedisUnavailable:
            with self._lock:
                self._rewrite = True
            return False

    def _write_all(self, bits: dict[bytes, int]) -> None:
        staging = f"{self.key}:rewrite"
        items = list(bits.items())
        self.redis.call("presence", lambda: self.redis.client.delete(staging))

        def stage(mapping: dict[bytes, int]) -> None:
            pipe = self.redis.client.pipeline(transaction=False)
            pipe.hset(staging, mapping=mapping)
            # A process that dies before the rename leaves the staging copy to expire,
            # as its live copy does; the rename carries the TTL over.
            pipe.pexpire(staging, self._ttl_ms)
            pipe.execute()

        for start in range(0, len(items), _BATCH):
            mapping = dict(items[start : start + _BATCH])
            self.redis.call("presence", lambda m=mapping: stage(m))

        def publish():
            # The rename on its own: redis-py's cluster pipeline refuses RENAME.
            if items:
                self.redis.client.rename(staging, self.key)  # the whole new copy appears at once
            pipe = self.redis.client.pipeline(transaction=False)
            if items:
                pipe.pexpire(self.key, self._ttl_ms)
            else:
                pipe.delete(self.key)
            self._heartbeat(pipe)
            pipe.execute()

        self.redis.call("presence", publish)

    def _write_changes(self, changes: dict[bytes, int], expected: int) -> None:
        present = [(block, bits) for block, bits in changes.items() if bits]
        gone = [block for block, bits in changes.items() if not bits]

        def write():
            pipe = self.redis.client.pipeline(transaction=False)
            pipe.pexpire(self.key, self._ttl_ms)  # first: it says whether the hash was there
            for start in range(0, len(present), _BATCH):
                pipe.hset(self.key, mapping=dict(present[start : start + _BATCH]))
            for start in range(0, len(gone), _BATCH):
                pipe.hdel(self.key, *gone[start : start + _BATCH])
            pipe.pexpire(self.key, self._ttl_ms)
            self._heartbeat(pipe)
            return pipe.execute()

        results = self.redis.call("presence", write)
        # The hash was missing although it should have held more than this batch
        # added: it expired (this thread stalled past the TTL) or was deleted.
        if not results[0] and expected > len(present):
            with self._lock:
                self._rewrite = True

    def _heartbeat(self, pipe) -> None:
        now = time.time()
        instances = instances_key(self.model_digest)
        pipe.zadd(instances, {self.instance: now + self.ttl})
        pipe.zremrangebyscore(instances, "-inf", now)  # instances that stopped refreshing

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # the thread must outlive any one batch
                log.exception("tiercache: presence batch failed")
                with self._lock:
                    self._rewrite = True

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tiercache-presence", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop refreshing and remove this instance's presence (a clean shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:

            def drop():
                pipe = self.redis.client.pipeline(transaction=False)
                pipe.delete(self.key)
                pipe.zrem(instances_key(self.model_digest), self.instance)
                pipe.execute()

            self.redis.call("presence", drop)
        except RedisUnavailable:
            pass  # the TTL removes it

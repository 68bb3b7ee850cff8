"""The shared index in Redis: which blocks of which deployment are in the S3 tier,
with last-access scores for GC.

Layout (all keys of one deployment share a hash tag, so a lookup over every TP rank
is one round trip, in Redis Cluster too):
  tc:{<model_digest>}:idx:<rank_digest>   ZSET  member = raw block hash, score = last access
  tc:registry                             HASH  model_digest -> JSON describing the deployment
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields

from tiercache.metrics import LOOKUP_BLOCKS, LOOKUP_HITS
from tiercache.redis_conn import GuardedRedis

REGISTRY = "tc:registry"
# Lua's unpack() has a bounded stack: ask ZMSCORE for at most this many members a call.
_CHUNK = 1000

# KEYS: one index ZSET per rank. ARGV: now, touch (0/1), member length, members
# concatenated into one string. One argument rather than thousands: packing and
# unpacking a few thousand arguments costs both sides more than the lookup itself.
# Returns how many leading members are present in every rank's ZSET.
_LOOKUP = """
local now = ARGV[1]
local touch = ARGV[2] == '1'
local width = tonumber(ARGV[3])
local blob = ARGV[4]
local n = #blob / width
local member = {}  -- split on first use, once
local function upto(last)
  for i = #member + 1, last do
    member[i] = string.sub(blob, (i - 1) * width + 1, i * width)
  end
end
local found = n
for _, key in ipairs(KEYS) do
  local i = 1
  while i <= found do
    local last = math.min(found, i + %d - 1)
    upto(last)
    local scores = redis.call('ZMSCORE', key, unpack(member, i, last))
    for j = 1, #scores do
      if not scores[j] then
        found = i + j - 2
        break
      end
    end
    i = last + 1
  end
  if found == 0 then return 0 end
end
if touch then
  for _, key in ipairs(KEYS) do
    local i = 1
    while i <= found do
      local last = math.min(found, i + %d - 1)
      local args = {}
      for j = i, last do
        args[#args + 1] = now
        args[#args + 1] = member[j]
      end
      redis.call('ZADD', key, 'XX', unpack(args))
      i = last + 1
    end
  end
end
return found
""" % (_CHUNK, _CHUNK // 2)


@dataclass(frozen=True)
class Deployment:
    """What the registry records of one model deployment (all its TP ranks).

    The last three fields say how the deployment names its blocks, so that the
    service can turn a router's token ids into the same hashes (tiercache/block_hashing.py):
    tokens per block, vLLM's `prefix_caching_hash_algo`, and the seed NONE_HASH comes
    from. They are empty in registrations written before they existed, and `hash_seed`
    is None where the engine's seed is a random one only it knows."""

    model_digest: str
    namespace: str
    model: str
    tp_size: int
    rank_digests: tuple[str, ...]
    object_bytes: int  # size of one rank's object (header + pages)
    block_size: int = 0
    hash_algo: str = ""
    hash_seed: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Deployment:
        data = json.loads(raw)
        data["rank_digests"] = tuple(data["rank_digests"])
        # A field a newer tiercache added is ignored here rather than making the entry
        # unreadable: instances of two versions share one registry during an upgrade.
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

def index_key(model_digest: str, rank_digest: str) -> str:
    return f"tc:{{{model_digest}}}:idx:{rank_digest}"


class RedisIndex:
    def __init__(self, redis: GuardedRedis):
        self.redis = redis

    def register(self, deployment: Deployment) -> None:
        self.redis.call(
            "register",
            lambda: self.redis.client.hset(REGISTRY, deployment.model_digest, deployment.to_json()),
        )

    def deployments(self) -> list[Deployment]:
        raw = self.redis.call("registry", lambda: self.redis.client.hgetall(REGISTRY))
        return [Deployment.from_json(value) for value in raw.values()]

    def unregister(self, model_digest: str) -> None:
        self.redis.call("unregister", lambda: self.redis.client.hdel(REGISTRY, model_digest))

    def longest_prefix(
        self,
        model_digest: str,
        rank_digests: list[str] | tuple[str, ...],
        block_hashes: list[bytes],
        touch: bool = True,
    ) -> int:
        """How many leading blocks every rank holds in S3: one round trip.
        Raises RedisUnavailable (the caller counts a miss)."""
        if not block_hashes:
            return 0
        LOOKUP_BLOCKS.inc(len(block_hashes))
        keys = [index_key(model_digest, digest) for digest in rank_digests]
        widths = set(map(len, block_hashes))
        if len(widths) != 1 or 0 in widths:
            # The script splits one string into equal parts: a mixed list (never seen
            # from vLLM) is looked up as its longest run of hashes of the first width.
            width = len(block_hashes[0])
            cut = next((i for i, h in enumerate(block_hashes) if len(h) != width), len(block_hashes))
            if not width or cut == 0:
                return 0
            block_hashes = block_hashes[:cut]
        width = len(block_hashes[0])
        script = self.redis.script(_LOOKUP)
        args = [repr(time.time()), "1" if touch else "0", width, b"".join(block_hashes)]
        # On the scheduler's path: a slow answer counts as a failure, so a slow Redis
        # costs one slow lookup and then none while the breaker is open.
        bound = self.redis.settings.socket_timeout
        found = int(self.redis.call("lookup", lambda: script(keys=keys, args=args), slow_after=bound))
        if found:
            LOOKUP_HITS.labels("s3").inc(found)
        return found

    def add(self, model_digest: str, rank_digest: str, block_hash: bytes) -> None:
        key = index_key(model_digest, rank_digest)
        self.redis.call("add", lambda: self.redis.client.zadd(key, {block_hash: time.time()}))

    def remove(self, model_digest: str, rank_digest: str, block_hash: bytes) -> None:
        key = index_key(model_digest, rank_digest)
        self.redis.call("remove", lambda: self.redis.client.zrem(key, block_hash))

    def count(self, model_digest: str, rank_digest: str) -> int:
        key = index_key(model_digest, rank_digest)
        return int(self.redis.call("count", lambda: self.redis.client.zcard(key)))

    def oldest(self, model_digest: str, rank_digest: str, n: int) -> list[tuple[bytes, float]]:
        key = index_key(model_digest, rank_digest)
        return self.redis.call("oldest", lambda: self.redis.client.zrange(key, 0, n - 1, withscores=True))

    def members(self, model_digest: str, rank_digest: str):
        key = index_key(model_digest, rank_digest)
        return self.redis.call(
            "members", lambda: [m for m, _ in self.redis.client.zscan_iter(key, count=1000)]
        )

    def drop_deployment(self, deployment: Deployment) -> int:
        """Delete a deployment's index entries (objects are left to the orphan sweep)."""
        keys = [index_key(deployment.model_digest, d) for d in deployment.rank_digests]

        def drop() -> int:
            removed = sum(int(self.redis.client.zcard(k)) for k in keys)
            for k in keys:  # one key per call: ranks share a slot, but DEL per key is simplest
                self.redis.client.delete(k)
            self.redis.client.hdel(REGISTRY, deployment.model_digest)
            return removed

        return self.redis.call("drop", drop)

    def memory_usage(self, model_digest: str, rank_digest: str) -> int:
        key = index_key(model_digest, rank_digest)
        return int(self.redis.call("memory", lambda: self.redis.client.memory_usage(key) or 0))

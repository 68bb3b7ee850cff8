"""The shared index in Redis: which blocks of which deployment are in the S3 tier,
in which run object and at which position, with last-access scores per object for GC.

Layout (all keys of one deployment share a hash tag, so a lookup over every TP rank
is one round trip, in Redis Cluster too):
  tc:{<model_digest>}:blk:<rank_digest>   HASH  raw block hash -> location: run id (8 bytes)
                                                + position in the run (2 bytes, big-endian)
  tc:{<model_digest>}:runs:<rank_digest>  ZSET  run id -> last access (any of its blocks)
  tc:{<model_digest>}:run:<rank_digest>   HASH  run id -> RunRecord: where its frames lie and
                                                its blocks' hashes (GC unindexes a run whole)
  tc:{<model_digest>}:hits:<rank_digest>  HASH  run id -> lookups that found any of its blocks
                                                since GC last spared it (absent: none)
  tc:registry                             HASH  model_digest -> JSON describing the deployment

A block costs one HASH field (about 110 bytes of Redis) plus its share of its run's
ZSET member and record (about 150 / blocks per run, plus its 32-byte hash): about
150 bytes at 16 blocks a run, against 145 for the per-block ZSET this replaced and
its location nowhere (tests/test_runs.py measures it with MEMORY USAGE).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from tiercache.index.redis_conn import GuardedRedis
from tiercache.metrics import LOOKUP_BLOCKS, LOOKUP_HITS

REGISTRY = "tc:registry"
# Lua's unpack() has a bounded stack: ask HMGET for at most this many fields a call.
_CHUNK = 1000
RUN_ID_BYTES = 8
_POSITION = struct.Struct(">H")
# A run record's fixed part: data_start, frame header bytes, slot bytes, hash width.
_RECORD = struct.Struct(">IIQB")

# Lua shared by the lookup scripts: give runs (`args`: now, run, now, run, ...) their
# last access in a runs ZSET, only those already there, a bounded number a call, and
# count a hit for each in the hits HASH (GC spares a run hit lately once, tiers/s3/gc.py).
# Every run passed holds a block just found in the block HASH, so it is indexed: the
# count never outlives its run (GC's unindex drops both at once).
_TOUCH_RUNS = (
    """
local function touch_runs(key, hits_key, args)
  local i = 1
  while i <= #args do
    local last = math.min(#args, i + %d - 1)
    redis.call('ZADD', key, 'XX', unpack(args, i, last))
    i = last + 1
  end
  for j = 2, #args, 2 do redis.call('HINCRBY', hits_key, args[j], 1) end
end
"""
    % _CHUNK
)

# KEYS: per rank, its block HASH, its runs ZSET, its hits HASH. ARGV: now, touch (0/1), member
# length, members concatenated into one string. One argument rather than thousands:
# packing and unpacking a few thousand arguments costs both sides more than the
# lookup itself. Returns how many leading members are present in every rank's HASH;
# with touch, the runs holding them get `now` as their last access.
_LOOKUP = (
    _TOUCH_RUNS
    + """
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
local locs = {}
for r = 1, #KEYS, 3 do
  local key = KEYS[r]
  locs[r] = {}
  local i = 1
  while i <= found do
    local last = math.min(found, i + %d - 1)
    upto(last)
    local values = redis.call('HMGET', key, unpack(member, i, last))
    for j = 1, #values do
      if not values[j] then
        found = i + j - 2
        break
      end
      locs[r][i + j - 1] = values[j]
    end
    i = last + 1
  end
  if found == 0 then return 0 end
end
if touch then
  for r = 1, #KEYS, 3 do
    local seen = {}
    local args = {}
    for j = 1, found do
      local run = string.sub(locs[r][j], 1, %d)
      if not seen[run] then
        seen[run] = true
        args[#args + 1] = now
        args[#args + 1] = run
      end
    end
    touch_runs(KEYS[r + 1], KEYS[r + 2], args)
  end
end
return found
"""
    % (_CHUNK, RUN_ID_BYTES)
)


# KEYS: as _LOOKUP. ARGV: now, touch (0/1), then per probe: member length, prefix
# (0/1), members concatenated. Returns per probe a string of '1' (every rank holds the
# member) and '0'; a prefix probe is read up to its first miss only, and its string
# ends there. With touch, the runs holding any member found get `now`.
_PRESENCE = (
    _TOUCH_RUNS
    + """
local now = ARGV[1]
local touch = ARGV[2] == '1'
local answers = {}
local runs = {}
for r = 1, #KEYS, 3 do runs[r] = {} end
for p = 1, (#ARGV - 2) / 3 do
  local width = tonumber(ARGV[3 * p])
  local prefix = ARGV[3 * p + 1] == '1'
  local blob = ARGV[3 * p + 2]
  local n = #blob / width
  local member, held = {}, {}
  for i = 1, n do
    member[i] = string.sub(blob, (i - 1) * width + 1, i * width)
    held[i] = true
  end
  local asked, answered = n, n
  local locs = {}
  for r = 1, #KEYS, 3 do
    locs[r] = {}
    local i = 1
    while i <= asked do
      local last = math.min(asked, i + %d - 1)
      local values = redis.call('HMGET', KEYS[r], unpack(member, i, last))
      for j = 1, #values do
        local k = i + j - 1
        if values[j] then
          locs[r][k] = values[j]
        else
          held[k] = false
          if prefix then
            answered, asked = k, k - 1
            break
          end
        end
      end
      i = last + 1
    end
  end
  local out = {}
  for i = 1, answered do
    if held[i] then
      out[i] = '1'
      for r = 1, #KEYS, 3 do runs[r][string.sub(locs[r][i], 1, %d)] = true end
    else
      out[i] = '0'
    end
  end
  answers[p] = table.concat(out)
end
if touch then
  for r = 1, #KEYS, 3 do
    local args = {}
    for run in pairs(runs[r]) do
      args[#args + 1] = now
      args[#args + 1] = run
    end
    touch_runs(KEYS[r + 1], KEYS[r + 2], args)
  end
end
return answers
"""
    % (_CHUNK, RUN_ID_BYTES)
)

# KEYS: runs ZSET, hits HASH. ARGV: now, then per run: run id, hits kept. A run no
# longer indexed (another pass took it) is left alone, so no count outlives its run.
_SPARE = """
for i = 2, #ARGV, 2 do
  local run = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], run) then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], run)
    if ARGV[i + 1] == '0' then
      redis.call('HDEL', KEYS[2], run)
    else
      redis.call('HSET', KEYS[2], run, ARGV[i + 1])
    end
  end
end
return 1
"""


@dataclass(frozen=True)
class RunRecord:
    """What the index keeps of one run object: where its frames lie (tiers/s3/runs.py, RunGeometry)
    and its blocks' hashes in order (GC unindexes a run whole; reindex rebuilds it)."""

    data_start: int
    frame_header: int
    slot_bytes: int
    block_hashes: tuple[bytes, ...]

    def encode(self) -> bytes:
        width = len(self.block_hashes[0]) if self.block_hashes else 0
        head = _RECORD.pack(self.data_start, self.frame_header, self.slot_bytes, width)
        return head + b"".join(self.block_hashes)

    @classmethod
    def decode(cls, raw: bytes) -> RunRecord:
        data_start, frame_header, slot_bytes, width = _RECORD.unpack_from(raw)
        blob = raw[_RECORD.size :]
        hashes = tuple(blob[i : i + width] for i in range(0, len(blob), width)) if width else ()
        return cls(data_start, frame_header, slot_bytes, hashes)


def location(run_id: bytes, position: int) -> bytes:
    """A block's value in the block HASH: its run id and position, 10 bytes."""
    return run_id + _POSITION.pack(position)


def parse_location(raw: bytes) -> tuple[bytes, int]:
    return raw[:RUN_ID_BYTES], _POSITION.unpack_from(raw, RUN_ID_BYTES)[0]


@dataclass(frozen=True)
class Deployment:
    """What the registry records of one model deployment (all its TP ranks).

    The last three fields say how the deployment names its blocks, so that the
    service can turn a router's token ids into the same hashes (tiercache/index/block_hashing.py):
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
    # A hybrid model's KV cache groups, each as the rule of what a hit needs of it
    # (tiercache/index/kv_groups.py); empty for a model with one full-attention group.
    groups: tuple[str, ...] = ()
    # After new weights in place, the epoch its blocks are named under (hex; see
    # keys.block_key): the service keys the hashes it looks up with it. Empty before.
    weights_epoch: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Deployment:
        data = json.loads(raw)
        data["rank_digests"] = tuple(data["rank_digests"])
        data["groups"] = tuple(data.get("groups") or ())
        # A field a newer tiercache added is ignored here rather than making the entry
        # unreadable: instances of two versions share one registry during an upgrade.
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def blocks_key(model_digest: str, rank_digest: str) -> str:
    return f"tc:{{{model_digest}}}:blk:{rank_digest}"


def runs_key(model_digest: str, rank_digest: str) -> str:
    return f"tc:{{{model_digest}}}:runs:{rank_digest}"


def run_records_key(model_digest: str, rank_digest: str) -> str:
    return f"tc:{{{model_digest}}}:run:{rank_digest}"


def run_hits_key(model_digest: str, rank_digest: str) -> str:
    return f"tc:{{{model_digest}}}:hits:{rank_digest}"


def lookup_keys(model_digest: str, rank_digest: str) -> tuple[str, str, str]:
    """What a lookup reads and touches: the block HASH, the runs ZSET, the hits HASH."""
    return (
        blocks_key(model_digest, rank_digest),
        runs_key(model_digest, rank_digest),
        run_hits_key(model_digest, rank_digest),
    )


def legacy_index_key(model_digest: str, rank_digest: str) -> str:
    """The per-block ZSET tiercache kept before runs: never read now; GC
    deletes what is left of it."""
    return f"tc:{{{model_digest}}}:idx:{rank_digest}"


def index_keys(model_digest: str, rank_digest: str) -> tuple[str, str, str]:
    return (
        blocks_key(model_digest, rank_digest),
        runs_key(model_digest, rank_digest),
        run_records_key(model_digest, rank_digest),
    )


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
        keys = [key for digest in rank_digests for key in lookup_keys(model_digest, digest)]
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

    def presence(
        self,
        model_digest: str,
        rank_digests: list[str] | tuple[str, ...],
        probes: Sequence[tuple[Sequence[bytes], bool]],
        touch: bool = True,
    ) -> list[list[bool]]:
        """Which blocks of each probe (hashes, prefix) every rank holds in S3, every
        probe in one round trip: one True or False per block, in order. A prefix probe
        is read up to its first miss only (as `longest_prefix`): its answer ends with
        that miss. Raises RedisUnavailable (the caller counts misses)."""
        if not probes:
            return []
        keys = [key for digest in rank_digests for key in lookup_keys(model_digest, digest)]
        args: list = [repr(time.time()), "1" if touch else "0"]
        for hashes, prefix in probes:
            # One width per probe: a mixed list (never seen from vLLM) is asked as far
            # as its first width goes, and the rest answered as misses.
            width = len(hashes[0]) if hashes else 0
            cut = next((i for i, h in enumerate(hashes) if len(h) != width), len(hashes)) if width else 0
            args += [width or 1, "1" if prefix else "0", b"".join(hashes[:cut])]
        script = self.redis.script(_PRESENCE)
        bound = self.redis.settings.socket_timeout
        raw = self.redis.call("lookup", lambda: script(keys=keys, args=args), slow_after=bound)
        answers = []
        for (hashes, prefix), text in zip(probes, raw, strict=True):
            held = [mark == ord("1") for mark in text]
            if len(held) < len(hashes) and (not prefix or not held or held[-1]):
                held += [False] * (1 if prefix else len(hashes) - len(held))
            answers.append(held)
        return answers

    def add_run(
        self, model_digest: str, rank_digest: str, run_id: bytes, record: RunRecord, when: float | None = None
    ) -> None:
        blk, runs, records = index_keys(model_digest, rank_digest)
        mapping = {h: location(run_id, i) for i, h in enumerate(record.block_hashes)}

        def write() -> None:
            pipe = self.redis.client.pipeline(transaction=True)
            pipe.hset(blk, mapping=mapping)
            pipe.zadd(runs, {run_id: time.time() if when is None else when})
            pipe.hset(records, run_id, record.encode())
            pipe.execute()

        self.redis.call("add", write)

    def remove(self, model_digest: str, rank_digest: str, block_hash: bytes) -> None:
        """Forget one block (its object is missing, or its frame corrupt). Its run stays
        indexed for its other blocks; GC collects the object with the run."""
        key = blocks_key(model_digest, rank_digest)
        self.redis.call("remove", lambda: self.redis.client.hdel(key, block_hash))

    def count(self, model_digest: str, rank_digest: str) -> int:
        """Blocks indexed for one rank."""
        key = blocks_key(model_digest, rank_digest)
        return int(self.redis.call("count", lambda: self.redis.client.hlen(key)))

    def run_count(self, model_digest: str, rank_digest: str) -> int:
        key = runs_key(model_digest, rank_digest)
        return int(self.redis.call("count", lambda: self.redis.client.zcard(key)))

    def oldest(self, model_digest: str, rank_digest: str, n: int) -> list[tuple[bytes, float]]:
        """The `n` runs of least recent access: (run id, last access)."""
        key = runs_key(model_digest, rank_digest)
        return self.redis.call("oldest", lambda: self.redis.client.zrange(key, 0, n - 1, withscores=True))

    def run_hits(self, model_digest: str, rank_digest: str, run_ids: Sequence[bytes]) -> list[int]:
        """Per run, the lookups that found it since GC last spared it."""
        if not run_ids:
            return []
        key = run_hits_key(model_digest, rank_digest)
        raw = self.redis.call("hits", lambda: self.redis.client.hmget(key, list(run_ids)))
        return [int(value) if value else 0 for value in raw]

    def spare(
        self, model_digest: str, rank_digest: str, spared: Sequence[tuple[bytes, int]], now: float
    ) -> None:
        """GC's second chance for runs hit lately (`spared`: run id, its hits): each
        still indexed goes to the recent end of the runs ZSET and keeps half its hits."""
        if not spared:
            return
        keys = [runs_key(model_digest, rank_digest), run_hits_key(model_digest, rank_digest)]
        args: list = [repr(now)]
        for run, count in spared:
            args += [run, count // 2]
        script = self.redis.script(_SPARE)
        self.redis.call("spare", lambda: script(keys=keys, args=args))

    def members(self, model_digest: str, rank_digest: str) -> list[bytes]:
        """Every block hash indexed for one rank."""
        key = blocks_key(model_digest, rank_digest)
        return self.redis.call(
            "members", lambda: [m for m, _ in self.redis.client.hscan_iter(key, count=1000)]
        )

    def locate(self, model_digest: str, rank_digest: str, block_hash: bytes) -> tuple[bytes, int] | None:
        """(run id, position) of an indexed block, else None."""
        key = blocks_key(model_digest, rank_digest)
        raw = self.redis.call("locate", lambda: self.redis.client.hget(key, block_hash))
        return parse_location(raw) if raw else None

    def run_record(self, model_digest: str, rank_digest: str, run_id: bytes) -> RunRecord | None:
        key = run_records_key(model_digest, rank_digest)
        raw = self.redis.call("run", lambda: self.redis.client.hget(key, run_id))
        return RunRecord.decode(raw) if raw else None

    def drop_deployment(self, deployment: Deployment) -> int:
        """Delete a deployment's index entries (objects are left to the orphan sweep);
        returns how many blocks were indexed."""
        ranks = deployment.rank_digests

        def drop() -> int:
            removed = sum(int(self.redis.client.hlen(blocks_key(deployment.model_digest, r))) for r in ranks)
            for rank in ranks:  # one key per call: ranks share a slot, but DEL per key is simplest
                for key in (
                    *index_keys(deployment.model_digest, rank),
                    run_hits_key(deployment.model_digest, rank),
                    legacy_index_key(deployment.model_digest, rank),
                ):
                    self.redis.client.delete(key)
            self.redis.client.hdel(REGISTRY, deployment.model_digest)
            return removed

        return self.redis.call("drop", drop)

    def memory_usage(self, model_digest: str, rank_digest: str) -> int:
        """Bytes of Redis this rank's index takes (MEMORY USAGE over its three keys)."""

        def usage() -> int:
            client = self.redis.client
            return sum(
                int(client.memory_usage(k, samples=0) or 0) for k in index_keys(model_digest, rank_digest)
            )

        return int(self.redis.call("memory", usage))

"""Lease locks in Redis.

Write lease: a claim to upload one block, so that of N writers racing on one block
exactly one uploads it. A writer claims every block of a run in one call; the claim
of a block is refused when it is already indexed, and the whole run is indexed (and
its leases released) in one step after its PUT.

Read lease: a run object under a live read lease is never deleted by GC. A reader
leases the runs holding the blocks it loads, in the same call that tells it where
they are, and only while they are indexed; GC unindexes a run only when no read
lease on it is live, both atomically in Redis: a reader either holds a lease on an
object that stays, or gets a miss.

Tokens make sure only the holder releases; TTLs free what a dead holder kept.
Keys a script reaches beyond its KEYS (a run's read lease, named from the index) are
in the same hash tag, so in the same Redis Cluster slot.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from enum import Enum

from tiercache.index.redis_conn import GuardedRedis
from tiercache.index.redis_index import (
    RUN_ID_BYTES,
    RunRecord,
    blocks_key,
    index_keys,
    parse_location,
    run_hits_key,
)
from tiercache.metrics import LEASE_CONFLICTS

# KEYS: block hash, then one write lease per block. ARGV: token, ttl_ms, width, blocks.
# Returns a string of one letter per block: p(resent), a(cquired), h(eld).
_CLAIM = """
local width = tonumber(ARGV[3])
local out = {}
for i = 2, #KEYS do
  local block = string.sub(ARGV[4], (i - 2) * width + 1, (i - 1) * width)
  if redis.call('HEXISTS', KEYS[1], block) == 1 then
    out[#out + 1] = 'p'
  elseif redis.call('SET', KEYS[i], ARGV[1], 'NX', 'PX', ARGV[2]) then
    out[#out + 1] = 'a'
  else
    out[#out + 1] = 'h'
  end
end
return table.concat(out)
"""
# KEYS: block hash, runs zset, run records, then one write lease per block.
# ARGV: now, token, run id, run record, width, blocks, then each block's location.
_PUBLISH = """
local width = tonumber(ARGV[5])
for i = 4, #KEYS do
  local block = string.sub(ARGV[6], (i - 4) * width + 1, (i - 3) * width)
  redis.call('HSET', KEYS[1], block, ARGV[6 + i - 3])
  if redis.call('GET', KEYS[i]) == ARGV[2] then redis.call('DEL', KEYS[i]) end
end
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
return 1
"""
# KEYS: one lease each. ARGV: token
_RELEASE = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then n = n + redis.call('DEL', key) end
end
return n
"""
# KEYS: block hash, run records. ARGV: token, now_ms, ttl_ms, width, blocks, lease
# key prefix (the run's hex follows it). For the leading blocks that are indexed:
# their locations, and the distinct runs' records, each run leased for the reader.
_READ = (
    """
local width = tonumber(ARGV[4])
local n = #ARGV[5] / width
local expiry = tonumber(ARGV[2]) + tonumber(ARGV[3])
local locs, runs, records, seen = {}, {}, {}, {}
for i = 1, n do
  local loc = redis.call('HGET', KEYS[1], string.sub(ARGV[5], (i - 1) * width + 1, i * width))
  if not loc then break end
  local run = string.sub(loc, 1, %d)
  if not seen[run] then
    local record = redis.call('HGET', KEYS[2], run)
    if not record then break end
    seen[run] = true
    local hex = string.gsub(run, '.', function(c) return string.format('%%02x', string.byte(c)) end)
    local lease = ARGV[6] .. hex
    redis.call('ZADD', lease, expiry, ARGV[1])
    if redis.call('PTTL', lease) < tonumber(ARGV[3]) then redis.call('PEXPIRE', lease, ARGV[3]) end
    runs[#runs + 1] = run
    records[#records + 1] = record
  end
  locs[#locs + 1] = loc
end
return {locs, runs, records}
"""
    % RUN_ID_BYTES
)
# KEYS: read-lease zsets. ARGV: token
_READ_RELEASE = """
for _, key in ipairs(KEYS) do redis.call('ZREM', key, ARGV[1]) end
return 1
"""
# KEYS: block hash, runs zset, run records, the run's read-lease zset, run hits.
# ARGV: run id, now_ms. Unindexes a whole run unless a read lease on it is live: every
# block still located in it (a block published again in a newer run since stays), its
# record, its last access and its hits. Returns the blocks removed, -1 when leased, -2 when not indexed.
_GC_UNINDEX = (
    """
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[2])
if redis.call('ZCARD', KEYS[4]) > 0 then return -1 end
local record = redis.call('HGET', KEYS[3], ARGV[1])
local ranked = redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
if not record then
  if ranked == 1 then return 0 end
  return -2
end
redis.call('HDEL', KEYS[3], ARGV[1])
local width = string.byte(record, 17)
local removed = 0
if width > 0 then
  for i = 18, #record, width do
    local block = string.sub(record, i, i + width - 1)
    local loc = redis.call('HGET', KEYS[1], block)
    if loc and string.sub(loc, 1, %d) == ARGV[1] then
      redis.call('HDEL', KEYS[1], block)
      removed = removed + 1
    end
  end
end
return removed
"""
    % RUN_ID_BYTES
)
# Where in a run record the hash width and the hashes begin (index._RECORD: >IIQB).
assert RunRecord(0, 0, 0, ()).encode().__len__() == 17


class Claim(str, Enum):
    ACQUIRED = "acquired"
    PRESENT = "present"  # already uploaded by someone: nothing to do
    HELD = "held"  # another writer is uploading it now


def write_lease_key(model_digest: str, rank_digest: str, block_hex: str) -> str:
    return f"tc:{{{model_digest}}}:wl:{rank_digest}:{block_hex}"


def read_lease_prefix(model_digest: str, rank_digest: str) -> str:
    return f"tc:{{{model_digest}}}:rl:{rank_digest}:"


def read_lease_key(model_digest: str, rank_digest: str, run_hex: str) -> str:
    """A run's read leases: a ZSET of reader tokens scored by their expiry."""
    return read_lease_prefix(model_digest, rank_digest) + run_hex


def new_token() -> str:
    return uuid.uuid4().hex


class Leases:
    def __init__(self, redis: GuardedRedis, write_ttl: float = 30.0, read_ttl: float = 30.0):
        self.redis = redis
        self.write_ttl_ms = int(write_ttl * 1000)
        self.read_ttl_ms = int(read_ttl * 1000)

    def _run(self, op: str, source: str, keys: list[str], args: list):
        script = self.redis.script(source)
        return self.redis.call(op, lambda: script(keys=keys, args=args))

    # -- writers ----------------------------------------------------------------------
    def claim_blocks(self, model: str, rank: str, blocks: Sequence[bytes], token: str) -> list[Claim]:
        """Claim the write of each block, in one call: ACQUIRED (upload it), PRESENT
        (indexed already) or HELD (another writer is uploading it)."""
        _check_width(blocks)
        keys = [blocks_key(model, rank)] + [write_lease_key(model, rank, b.hex()) for b in blocks]
        args = [token, self.write_ttl_ms, len(blocks[0]), b"".join(blocks)]
        result = self._run("claim", _CLAIM, keys, args)
        letters = result.decode() if isinstance(result, bytes) else result
        claims = [_CLAIMS[letter] for letter in letters]
        if Claim.HELD in claims:
            LEASE_CONFLICTS.inc()
        return claims

    def publish_run(self, model: str, rank: str, run_id: bytes, record: RunRecord, token: str) -> None:
        """Index every block of the uploaded run, its record and its last access, and
        release the writer's leases on its blocks, atomically."""
        blocks = record.block_hashes
        _check_width(blocks)
        keys = [*index_keys(model, rank)] + [write_lease_key(model, rank, b.hex()) for b in blocks]
        from tiercache.index.redis_index import location

        locs = [location(run_id, i) for i in range(len(blocks))]
        args = [repr(time.time()), token, run_id, record.encode(), len(blocks[0]), b"".join(blocks), *locs]
        self._run("publish", _PUBLISH, keys, args)

    def release_writes(self, model: str, rank: str, blocks: Sequence[bytes], token: str) -> int:
        keys = [write_lease_key(model, rank, b.hex()) for b in blocks]
        return int(self._run("release", _RELEASE, keys, [token])) if keys else 0

    # -- readers ----------------------------------------------------------------------
    def acquire_read_blocks(
        self, model: str, rank: str, blocks: Sequence[bytes], token: str
    ) -> tuple[list[tuple[bytes, int]], dict[bytes, RunRecord]]:
        """Where the leading indexed blocks are, (run id, position) each, and the
        records of the runs holding them, each run now under a read lease for `token`
        (release with release_runs). Blocks from the first unindexed one on are
        missing from the answer: a miss."""
        if not blocks:
            return [], {}
        _check_width(blocks)
        blk, _, records = index_keys(model, rank)
        now_ms = int(time.time() * 1000)
        args = [
            token,
            now_ms,
            self.read_ttl_ms,
            len(blocks[0]),
            b"".join(blocks),
            read_lease_prefix(model, rank),
        ]
        locs, runs, raw = self._run("read_lease", _READ, [blk, records], args)
        return [parse_location(loc) for loc in locs], {
            run: RunRecord.decode(rec) for run, rec in zip(runs, raw, strict=True)
        }

    def release_runs(self, model: str, rank: str, run_ids: Sequence[bytes], token: str) -> None:
        keys = [read_lease_key(model, rank, run.hex()) for run in run_ids]
        if keys:
            self._run("read_release", _READ_RELEASE, keys, [token])

    # -- GC ---------------------------------------------------------------------------
    def gc_unindex_run(self, model: str, rank: str, run_id: bytes) -> int:
        """Unindex a whole run unless it is read-leased: the blocks removed (>= 0), -1
        leased (it stays), -2 not indexed (someone else removed it)."""
        lease = read_lease_key(model, rank, run_id.hex())
        keys = [*index_keys(model, rank), lease, run_hits_key(model, rank)]
        return int(self._run("gc", _GC_UNINDEX, keys, [run_id, int(time.time() * 1000)]))


_CLAIMS = {"a": Claim.ACQUIRED, "p": Claim.PRESENT, "h": Claim.HELD}


def _check_width(blocks: Sequence[bytes]) -> None:
    """The scripts split one string into equal parts: every hash must be as long."""
    if not blocks or len({len(b) for b in blocks}) != 1 or not blocks[0]:
        raise ValueError("block hashes of one call must be non-empty and of one length")

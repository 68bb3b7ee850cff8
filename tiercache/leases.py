"""Lease locks in Redis.

Write lease: a claim to upload one object, so that of N writers racing on one key
exactly one uploads. The claim is refused when the object is already indexed, and
the index entry is written (and the lease released) in one step after the PUT.

Read lease: an object under a live read lease is never deleted by GC. A read lease is
granted only while the object is indexed, and GC removes the index entry only when
no read lease is live, both atomically in Redis: a reader either holds a lease on an
object that stays, or gets a miss.

Tokens make sure only the holder releases or renews; TTLs free what a dead holder kept.
"""

from __future__ import annotations

import time
import uuid
from enum import Enum

from tiercache.index import index_key
from tiercache.metrics import LEASE_CONFLICTS
from tiercache.redis_conn import GuardedRedis

# KEYS: index zset, write lease. ARGV: member, token, ttl_ms
_CLAIM = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 'present' end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then return 'acquired' end
return 'held'
"""
# KEYS: index zset, write lease. ARGV: member, now, token
_PUBLISH = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""
# KEYS: lease. ARGV: token
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: lease. ARGV: token, ttl_ms
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# KEYS: index zset, read-lease zset. ARGV: member, token, now_ms, ttl_ms
_READ = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local expiry = tonumber(ARGV[3]) + tonumber(ARGV[4])
redis.call('ZADD', KEYS[2], expiry, ARGV[2])
local ttl = redis.call('PTTL', KEYS[2])
if ttl < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
return 1
"""
# KEYS: read-lease zset. ARGV: token
_READ_RELEASE = "return redis.call('ZREM', KEYS[1], ARGV[1])"
# KEYS: index zset, read-lease zset. ARGV: member, now_ms
# Removes the index entry unless a read lease is live; 1 = removed, 0 = leased, -1 = absent.
_GC_UNINDEX = """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
if redis.call('ZCARD', KEYS[2]) > 0 then return 0 end
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then return 1 end
return -1
"""


class Claim(str, Enum):
    ACQUIRED = "acquired"
    PRESENT = "present"  # already uploaded by someone: nothing to do
    HELD = "held"  # another writer is uploading it now


def write_lease_key(model_digest: str, rank_digest: str, block_hex: str) -> str:
    return f"tc:{{{model_digest}}}:wl:{rank_digest}:{block_hex}"


def read_lease_key(model_digest: str, rank_digest: str, block_hex: str) -> str:
    return f"tc:{{{model_digest}}}:rl:{rank_digest}:{block_hex}"


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

    def claim_write(self, model: str, rank: str, block: bytes, token: str) -> Claim:
        keys = [index_key(model, rank), write_lease_key(model, rank, block.hex())]
        result = self._run("claim", _CLAIM, keys, [block, token, self.write_ttl_ms])
        claim = Claim(result.decode() if isinstance(result, bytes) else result)
        if claim is Claim.HELD:
            LEASE_CONFLICTS.inc()
        return claim

    def publish(self, model: str, rank: str, block: bytes, token: str) -> None:
        """Index the uploaded object and release the write lease, atomically."""
        keys = [index_key(model, rank), write_lease_key(model, rank, block.hex())]
        self._run("publish", _PUBLISH, keys, [block, repr(time.time()), token])

    def release_write(self, model: str, rank: str, block: bytes, token: str) -> bool:
        key = write_lease_key(model, rank, block.hex())
        return bool(self._run("release", _RELEASE, [key], [token]))

    def renew_write(self, model: str, rank: str, block: bytes, token: str) -> bool:
        key = write_lease_key(model, rank, block.hex())
        return bool(self._run("renew", _RENEW, [key], [token, self.write_ttl_ms]))

    def acquire_read(self, model: str, rank: str, block: bytes, token: str) -> bool:
        """True while the object is indexed (and now protected from GC); else a miss."""
        keys = [index_key(model, rank), read_lease_key(model, rank, block.hex())]
        now_ms = int(time.time() * 1000)
        return bool(self._run("read_lease", _READ, keys, [block, token, now_ms, self.read_ttl_ms]))

    def release_read(self, model: str, rank: str, block: bytes, token: str) -> None:
        key = read_lease_key(model, rank, block.hex())
        self._run("read_release", _READ_RELEASE, [key], [token])

    def gc_unindex(self, model: str, rank: str, block: bytes) -> int:
        keys = [index_key(model, rank), read_lease_key(model, rank, block.hex())]
        return int(self._run("gc", _GC_UNINDEX, keys, [block, int(time.time() * 1000)]))

"""How many requests asked for each block across the fleet lately, kept in Redis for
the `selective` policy's S3 admission (tiercache/admission.py): a prefix two nodes
each saw once is worth uploading, though neither saw it twice.

Layout (the deployment's hash tag, next to its index):
  tc:{<model_digest>}:asked:<window>   HASH  field = block hash (raw bytes), value = the
                                             requests that asked for it in that window;
                                             expires two windows after it begins

A window is `ttl` seconds; a block's count is its current window's plus the previous
one's, so a request counts for `ttl` to 2 `ttl` seconds. A field is about 95 bytes of
Redis (MEMORY USAGE over 20,000 of them), and each block asked for in the last two
windows has at most two.

The scheduler never waits on it: `requested` appends a request's blocks to a list, and
a thread of its own sends them in one script call per `interval`, which returns each
block's count; `count` reads the last answer from memory. So a node knows the fleet's
count of a block as of its own last request for it: of two nodes that each compute a
prefix once, the second knows it was asked for twice. When Redis is down the batch is
dropped and counts are local only (the admission takes the larger of the two).

Cost: per block asked for, one HINCRBY and one HGET inside one script call per batch,
on the shard that holds the deployment's index (about what its lookup costs)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 0.05
# The most blocks whose last answer a scheduler keeps (about 200 bytes each): a block
# forgotten before its CPU tier evicts it is admitted on the node's own count.
FLEET_COUNTS_REMEMBERED = 100_000
# Blocks waiting to be sent: past this a burst's oldest are dropped (counts stay local).
_MAX_PENDING = 100_000
_CHUNK = 5000  # blocks per script call
_MAX_POPULAR = 4096

# KEYS: this window's HASH, the previous window's. ARGV: the window's expiry (ms), member
# width, members concatenated. Counts each member once more in this window; returns
# per member its count over both windows.
_COUNT = """
local width = tonumber(ARGV[2])
local blob = ARGV[3]
local out = {}
for i = 1, #blob / width do
  local member = string.sub(blob, (i - 1) * width + 1, i * width)
  local now = redis.call('HINCRBY', KEYS[1], member, 1)
  out[i] = now + (tonumber(redis.call('HGET', KEYS[2], member)) or 0)
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return out
"""


def asked_key(model_digest: str, window: int) -> str:
    return f"tc:{{{model_digest}}}:asked:{window}"


class FleetRequestCounts:
    """One scheduler's side of the fleet's request counts. `remembered`: how many
    blocks' last answers are kept (the oldest forgotten first)."""

    def __init__(
        self,
        redis: GuardedRedis,
        model_digest: str,
        *,
        ttl: float,
        remembered: int,
        interval: float = DEFAULT_INTERVAL,
        popular_at: int = 0,
    ):
        """`popular_at` > 0: blocks whose count reaches it are kept for
        `take_popular` (once each time they reach it)."""
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        self.redis = redis
        self.model_digest = model_digest
        self.ttl = ttl
        self.interval = interval
        self.remembered = max(1, remembered)
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._counts: OrderedDict[bytes, int] = OrderedDict()  # last answers, oldest first
        self.popular_at = popular_at
        self._popular: list[bytes] = []
        self._wake = threading.Event()
        self._sent = threading.Condition(self._lock)
        self._batches = 0  # batches ended (sent or dropped), for `wait`
        self._queued = 0  # batches queued so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiercache-request-counts", daemon=True)
        self._thread.start()

    # -- the scheduler's side -------------------------------------------------------
    def requested(self, blocks: Iterable[bytes]) -> None:
        """A request asked for these blocks (once each)."""
        with self._lock:
            self._pending.extend(blocks)
            if len(self._pending) > _MAX_PENDING:
                del self._pending[: len(self._pending) - _MAX_PENDING]
            self._queued += 1
        self._wake.set()

    def count(self, block: bytes) -> int:
        """Requests the fleet asked for `block` with lately, as of this node's last
        request for it; 0 when unknown."""
        with self._lock:
            return self._counts.get(block, 0)

    def take_popular(self) -> list[bytes]:
        """The blocks whose count reached `popular_at` since the last call."""
        with self._lock:
            popular, self._popular = self._popular, []
            return popular

    def wait(self, timeout: float = 5.0) -> bool:
        """Until every request so far is counted (or dropped): for tests and the replay,
        which want the same answers every run. False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self._queued
            self._wake.set()
            while self._batches < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._sent.wait(left)
        return True

    # -- the thread's side ----------------------------------------------------------
    def _send(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            queued = self._queued
        try:
            if pending:
                self._count(pending)
        except RedisUnavailable:
            pass  # dropped: the admission falls back on this node's own counts
        except Exception:  # the thread must outlive any one batch
            log.exception("tiercache: request counts batch failed")
        with self._lock:
            self._batches = queued
            self._sent.notify_all()

    def _count(self, blocks: list[bytes]) -> None:
        window = int(time.time() // self.ttl)
        keys = [asked_key(self.model_digest, window), asked_key(self.model_digest, window - 1)]
        expiry = int(2 * self.ttl * 1000) + 1000
        script = self.redis.script(_COUNT)
        for width in {len(block) for block in blocks} - {0}:
            same = [block for block in blocks if len(block) == width]
            for start in range(0, len(same), _CHUNK):
                chunk = same[start : start + _CHUNK]
                args = [expiry, width, b"".join(chunk)]
                answers = self.redis.call("asked", lambda k=keys, a=args: script(keys=k, args=a))
                self._remember(chunk, [int(answer) for answer in answers])

    def _remember(self, blocks: list[bytes], counts: list[int]) -> None:
        with self._lock:
            known = self._counts
            popular_at = self.popular_at
            for block, count in zip(blocks, counts, strict=True):
                if popular_at and count >= popular_at > known.get(block, 0):
                    self._popular.append(block)
                known[block] = count
                known.move_to_end(block)
            if len(self._popular) > _MAX_POPULAR:
                del self._popular[: len(self._popular) - _MAX_POPULAR]
            while len(known) > self.remembered:
                known.popitem(last=False)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            self._send()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

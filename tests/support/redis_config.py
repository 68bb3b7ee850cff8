"""Redis settings for tests that check what the index and leases answer, not how fast.

The shipped socket timeout (0.25 s) also bounds a whole lookup: one that answers later
opens the breaker, and the next call is a miss. On a busy 2-core CI host a lookup of a
few thousand blocks once took 0.82 s, and a test of lookup arithmetic failed on the
breaker. Tests of slow or unreachable Redis build their own settings instead."""

from tiercache.config import RedisConfig

PATIENT = RedisConfig(socket_timeout=5.0)

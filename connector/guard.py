"""Keeps tiercache's own failures out of vLLM.

Every hook vLLM calls on the connector runs under a `HookGuard` (connector.py): an
unexpected exception is logged, counted, and answered as a miss (the step's loads
fail and vLLM recomputes them; its stores are dropped), never raised into vLLM's
engine. A cache that keeps failing is worse than none, so after `TRIP_AFTER` failures
within `TRIP_WINDOW_SECONDS` the guard turns the connector off for `OFF_SECONDS`:
lookups miss, nothing is stored, and then it tries again by itself."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable

from tiercache.metrics import CONNECTOR_OFF, HOOK_FAILURES

log = logging.getLogger("tiercache.connector")

# Failures close enough together to mean something is broken, not a passing fault.
TRIP_AFTER = 5
TRIP_WINDOW_SECONDS = 60.0
# Long enough for a flood of failing steps to stop; short enough that a transient
# fault costs a minute of misses, not the rest of the engine's life.
OFF_SECONDS = 60.0

HOOK_FAILURES_KEY = "hook_failures"  # connector stats: failures since the last report
OFF_TRIPS_KEY = "connector_off_trips"  # connector stats: times the guard turned it off


class HookGuard:
    def __init__(
        self,
        role: str,
        *,
        trip_after: int = TRIP_AFTER,
        window: float = TRIP_WINDOW_SECONDS,
        off_seconds: float = OFF_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.role = role
        self.trip_after = trip_after
        self.window = window
        self.off_seconds = off_seconds
        self.clock = clock
        self._recent: deque[float] = deque()  # when the latest failures happened
        self._off_until: float | None = None
        self._unreported: Counter[str] = Counter()  # HOOK_FAILURES_KEY / OFF_TRIPS_KEY

    @property
    def off(self) -> bool:
        """Whether the connector is turned off now; it comes back by itself."""
        if self._off_until is None:
            return False
        if self.clock() < self._off_until:
            return True
        self._off_until = None
        CONNECTOR_OFF.labels(self.role).set(0)
        log.warning("tiercache: the %s half of the connector is on again", self.role)
        return False

    def failed(self, hook: str, error: BaseException) -> None:
        """`hook` raised `error`: log and count it, and turn the connector off when
        failures come too often."""
        log.error(
            "tiercache: %s failed; this step's loads are recomputed and its stores dropped",
            hook,
            exc_info=error,
        )
        HOOK_FAILURES.labels(hook).inc()
        self._unreported[HOOK_FAILURES_KEY] += 1
        now = self.clock()
        self._recent.append(now)
        while self._recent and self._recent[0] <= now - self.window:
            self._recent.popleft()
        if len(self._recent) >= self.trip_after and self._off_until is None:
            self._recent.clear()
            self._off_until = now + self.off_seconds
            self._unreported[OFF_TRIPS_KEY] += 1
            CONNECTOR_OFF.labels(self.role).set(1)
            log.error(
                "tiercache: %d connector failures within %.0f s: the %s half is off for %.0f s "
                "(every lookup misses, nothing is stored)",
                self.trip_after,
                self.window,
                self.role,
                self.off_seconds,
            )

    def take_counts(self) -> Counter[str]:
        """Failures and trips since the last call, for vLLM's connector stats."""
        counts, self._unreported = self._unreported, Counter()
        return counts

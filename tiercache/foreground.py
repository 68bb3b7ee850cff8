"""Background writes step aside while a hit is copied into the paged KV.

On vLLM's CPU backend the forward, the copy of a hit into the paged KV and the movers'
write-down (a disk write is a copy into the page cache; an upload, a copy into a
socket) all share one memory bus, and the forward is bound by it: a copy running on the
other core slows a forward-like loop down (benchmarks/memory_bus.py; figures in
docs/architecture.md, "Threads and cores"). A hit
that arrives while its own prompt is still being written down (the usual case: the
same prefix asked again at once) paid for both. So while a step that loads hits runs,
the movers start no new block: what is already being written finishes, the rest waits
for the step's end.

Stores must not starve under a steady stream of hits, so a hold lasts at most
`max_hold` seconds, and no hold starts while holds took more than `max_share` of the
last `window` seconds: past that, hits and writes share the bus as before."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ForegroundGate:
    def __init__(
        self,
        max_hold: float = 0.5,
        max_share: float = 0.5,
        window: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_hold = max_hold
        self.max_share = max_share
        self.window = window
        self.clock = clock
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._held_since: float | None = None
        # Hold time in the current window, decayed as the window moves on.
        self._held_seconds = 0.0
        self._counted_at = clock()
        self.holds = 0  # holds started (for tests and stats)
        self.skipped = 0  # holds refused because the budget was spent

    def hold(self) -> bool:
        """A step that loads hits starts its forward. False (and nothing held) when
        holds already took their share of the recent window."""
        with self._lock:
            if self._held_since is not None:
                return True
            now = self.clock()
            self._decay(now)
            if self._held_seconds >= self.max_share * self.window:
                self.skipped += 1
                return False
            self._held_since = now
            self.holds += 1
            self._open.clear()
            return True

    def release(self) -> None:
        """The step's forward ended: the movers may go on."""
        with self._lock:
            if self._held_since is None:
                return
            now = self.clock()
            self._decay(now)
            self._held_seconds += min(now - self._held_since, self.max_hold)
            self._held_since = None
            self._open.set()

    def wait(self) -> None:
        """A mover about to start a block: waits while a hold lasts, at most max_hold."""
        self._open.wait(self.max_hold)

    @property
    def held(self) -> bool:
        return not self._open.is_set()

    def _decay(self, now: float) -> None:
        elapsed = now - self._counted_at
        self._counted_at = now
        if elapsed > 0:
            self._held_seconds *= max(0.0, 1.0 - elapsed / self.window)

"""Background writes step aside while a hit is copied into the paged KV.

On vLLM's CPU backend the forward, the copy of a hit into the paged KV and the movers'
write-down (a disk write is a copy into the page cache; an upload, a copy into a
socket) all share one memory bus, and the forward is bound by it: a copy running on the
other core slows a forward-like loop down (figures in docs/design.md, "Threads and
cores"). A hit
that arrives while its own prompt is still being written down (the usual case: the
same prefix asked again at once) paid for both. So while a step that loads hits runs,
the movers start no new block, and the writes already under way stop between pieces:
a disk write between its pieces (tiers/disk/tier.py, PIECE_BYTES), a block's copy for its
S3 run before it starts, an upload between the reads of its body. The rest goes on at
the step's end.

A hold covers the whole step that loads hits, not only its forward: it starts when
the worker is handed the step (before vLLM prepares the step's inputs) and, once the
forward is over, lingers until the next step begins or `OUTPUT_GRACE` seconds pass,
while the step samples its token and hands it through the engine core to the front
end. Those processes share the spare core with the movers: a 2000-token hit asked
while its prompt was being written down spent about 2.5 ms more preparing its inputs
and 4-5 ms more handing its token on than a quiet one, with the hold covering the
forward only. Steps that load hits one after another share one hold, so its
`max_hold` bounds how long the whole run of them keeps writes back.

Stores must not starve under a steady stream of hits, so a hold keeps writes back for
at most `max_hold` seconds, however many pieces they wait at, and no hold starts while
holds took more than `max_share` of the last `window` seconds: past that, hits and
writes share the bus as before."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# How long a hold lingers after the forward of a step that loaded hits, when no next
# step begins sooner: the step's sampling and the trip of its token through the engine
# core to the front end (about 13 ms for a 2000-token hit on a 2-core host).
OUTPUT_GRACE = 0.03


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
        # When a lingering hold ends by itself (release_after); None: held until release.
        self._until: float | None = None
        # Hold time in the current window, decayed as the window moves on.
        self._held_seconds = 0.0
        self._counted_at = clock()
        self.holds = 0  # holds started (for tests and stats)
        self.skipped = 0  # holds refused because the budget was spent

    def hold(self) -> bool:
        """A step that loads hits starts its forward. False (and nothing held) when
        holds already took their share of the recent window."""
        with self._lock:
            now = self.clock()
            self._end_if_over(now)
            if self._held_since is not None:
                # A hold still lingering after the last step goes on for this one.
                self._until = None
                return True
            self._decay(now)
            if self._held_seconds >= self.max_share * self.window:
                self.skipped += 1
                return False
            self._held_since = now
            self.holds += 1
            self._open.clear()
            return True

    def release(self) -> None:
        """The step that loaded hits is over: the movers may go on."""
        with self._lock:
            if self._held_since is not None:
                self._end(self.clock())

    def release_after(self, seconds: float) -> None:
        """The step's forward ended but its token is not handed on yet: the hold ends by
        itself `seconds` from now (never later than it would have, never past its
        max_hold), or at the next release()."""
        with self._lock:
            if self._held_since is None:
                return
            until = min(self.clock() + seconds, self._held_since + self.max_hold)
            if self._until is None or until < self._until:
                self._until = until

    def _end_if_over(self, now: float) -> None:
        if self._held_since is not None and self._until is not None and now >= self._until:
            self._end(self._until)

    def _end(self, at: float) -> None:
        assert self._held_since is not None  # ends only a hold under way
        end = min(at, self._until) if self._until is not None else at
        self._decay(end)
        self._held_seconds += min(max(0.0, end - self._held_since), self.max_hold)
        self._held_since = None
        self._until = None
        self._open.set()

    def wait(self) -> None:
        """A mover about to start a block, or a piece of one: waits while a hold lasts,
        no longer than the hold's first max_hold seconds: a write waits for one hold
        at most that long, whatever the number of its pieces."""
        ends = self._ends_at()  # no lock on the path of every piece
        if ends is None:
            return
        left = ends - self.clock()
        if left > 0:
            self._open.wait(left)

    def _ends_at(self) -> float | None:
        """When the hold under way stops holding anyone; None when there is none."""
        since, until = self._held_since, self._until
        if since is None:
            return None
        ends = since + self.max_hold
        return ends if until is None else min(ends, until)

    @property
    def held(self) -> bool:
        ends = self._ends_at()
        return ends is not None and self.clock() < ends

    def _decay(self, now: float) -> None:
        elapsed = now - self._counted_at
        if elapsed > 0:
            self._counted_at = now
            self._held_seconds *= max(0.0, 1.0 - elapsed / self.window)

"""Blocks whose load failed a moment ago, kept out of lookups for a while.

A failed load costs its request a recompute: vLLM reschedules the request and asks
the connector again. A transient S3 failure (a timeout, a 503) leaves the block
indexed on purpose (it is probably still there), so without this memory the
rescheduled request would be offered the same block again, wait out the same timeout
and fail again, for ever. Remembering the failure for a short while lets the request
compute, and lets a later request try again once the tier may have recovered."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

# Long enough for a rescheduled request to be computed; short enough that a tier
# that recovered serves the block again soon.
BACKOFF_SECONDS = 30.0
# A bound on the memory, reached only when a whole tier fails under heavy traffic.
MAX_REMEMBERED = 65536


class RecentLoadFailures:
    def __init__(self, seconds: float = BACKOFF_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self._until: OrderedDict[bytes, float] = OrderedDict()  # block -> end of its backoff

    def add(self, block: bytes) -> None:
        self._until.pop(block, None)
        self._until[block] = self.clock() + self.seconds
        while len(self._until) > MAX_REMEMBERED:
            self._until.popitem(last=False)

    def discard(self, block: bytes) -> None:
        """A sound copy of `block` was just made (a store of it recomputed, a staging
        that passed its check): it may be offered again at once."""
        self._until.pop(block, None)

    def __contains__(self, block: bytes) -> bool:
        until = self._until.get(block)
        if until is None:
            return False
        if until <= self.clock():
            del self._until[block]
            return False
        return True

    def leading_clear(self, blocks: Sequence[bytes]) -> int:
        """How many of `blocks`, from the first, have not failed lately."""
        for i, block in enumerate(blocks):
            if block in self:
                return i
        return len(blocks)

    def __len__(self) -> int:
        return len(self._until)

"""Copies on the copy stream whose end the host has yet to see (CUDA), and what waits
for each: settling its slots (a store's go to the movers, a load's come back), the
requests whose blocks it reads, and those requests' S3 runs, which ship after it.
Polled from the hooks, oldest first; never waited for on the step path (sync.py). On
the CPU backend a copy is over when it returns, and settles at once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from . import sync


@dataclass
class _InFlight:
    event: sync.Event
    settle: Callable[[], None]
    req_ids: set[str] = field(default_factory=set)
    ends: list[str] = field(default_factory=list)


class CopiesInFlight:
    def __init__(self, end_group: Callable[[str], None]):
        """`end_group(req_id)`: the request's last blocks reached the movers."""
        self._end_group = end_group
        self._copies: list[_InFlight] = []
        # The old way, for benchmarks/gpu_step.py's comparison only: hold the host until
        # each copy is over, in the hook that queued it.
        self.host_waits = False

    def __bool__(self) -> bool:
        return bool(self._copies)

    @property
    def newest(self) -> sync.Event:
        return self._copies[-1].event

    def after(self, done: sync.Event | None, settle: Callable[[], None], req_ids: Iterable[str] = ()) -> None:
        """Run `settle` once the copies queued up to `done` are over: now if they are
        (no event), else from the hook that first sees the event done (`poll`)."""
        if done is None:
            settle()
        elif self.host_waits:
            sync.host_wait(done)
            settle()
        else:
            self._copies.append(_InFlight(done, settle, set(req_ids)))

    def poll(self) -> None:
        """Settle the copies seen over, oldest first (the copy stream runs them in
        order, so the first not over ends the look)."""
        while self._copies and self._copies[0].event.query():
            self._settle(self._copies.pop(0))

    def drain(self, quietly: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Wait for every copy and settle it: never on the step path (sleep mode's
        unmapping, a failed step, shutdown). `quietly`: run each part under it, so
        one more error does not stop the rest."""
        while self._copies:
            copy = self._copies.pop(0)
            if quietly is None:
                sync.host_wait(copy.event)
                self._settle(copy)
            else:
                quietly(lambda: sync.host_wait(copy.event))  # noqa: B023 (called at once)
                quietly(lambda: self._settle(copy))  # noqa: B023

    def reading(self) -> set[str]:
        """Requests whose blocks a copy in flight still reads."""
        return {req_id for copy in self._copies for req_id in copy.req_ids}

    def end_group_after(self, req_id: str) -> bool:
        """Ship the request's partial S3 run once the copies out of its blocks are
        over; False if none is in flight (ship it now)."""
        copying = [copy for copy in self._copies if req_id in copy.req_ids]
        if not copying:
            return False
        copying[-1].ends.append(req_id)
        return True

    def _settle(self, copy: _InFlight) -> None:
        copy.settle()
        for req_id in copy.ends:
            self._end_group(req_id)

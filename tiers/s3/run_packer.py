"""Gathers the blocks bound for S3 into runs: consecutive blocks of one request go into
one object (one PUT) instead of one object each.

Each block is numbered in its group (a request) when it is queued (`expect`). The
movers write each block to disk first, in parallel, so blocks arrive (`add`) late
and out of order; a run is always a stretch of consecutive numbers, so it follows
its request's prefix. A group ships a run when its next `max_blocks` blocks have
all arrived; when the request has ended (`end_group`) and nothing of it is still in
flight; when it has had nothing in flight for `flush_seconds` (a request that stops
storing mid-prompt, or blocks written outside any request: blocks still in the
movers' queue are on their way, so waiting for them does not start the clock); or
when the owner flushes. A block stored alone ships as a run of one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Group(Generic[T]):
    arrived: dict[int, T] = field(default_factory=dict)  # number in the group -> block
    next_number: int = 0  # the number the next queued block gets
    next_ship: int = 0  # the first number not yet shipped or given up
    gone: set[int] = field(default_factory=set)  # numbers that will never arrive
    started: float | None = None  # since when blocks wait with nothing in flight
    ending: bool = False  # its request ended: ship once nothing is in flight
    in_flight: int = 0  # queued and neither arrived nor abandoned yet


class RunPacker(Generic[T]):
    def __init__(
        self,
        max_blocks: int,
        flush_seconds: float,
        ship: Callable[[list[T]], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_blocks < 1:
            raise ValueError("a run holds at least one block")
        self.max_blocks = max_blocks
        self.flush_seconds = flush_seconds
        self._ship = ship
        self._clock = clock
        self._groups: dict[Hashable, _Group[T]] = {}
        self._lock = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if max_blocks > 1:
            self._thread = threading.Thread(target=self._timer, name="tiercache-packer", daemon=True)
            self._thread.start()

    def expect(self, group: Hashable) -> int:
        """A block of `group` was queued: its number in the group, for `add` or `abandon`."""
        with self._lock:
            pending = self._groups.setdefault(group, _Group())
            pending.next_number += 1
            pending.in_flight += 1
            pending.started = None  # more is on its way: the flush clock waits for it
            return pending.next_number - 1

    def add(self, group: Hashable, number: int, item: T) -> None:
        """Block `number` of `group` arrived; ships what is ready."""
        with self._lock:
            pending = self._groups.setdefault(group, _Group())
            pending.arrived[number] = item
            pending.in_flight = max(0, pending.in_flight - 1)
            self._idle_since_now(pending)
            # Runs of one need no order: each ships as it comes.
            runs = self._ready(group, pending, everything=self._closed or self.max_blocks == 1)
        for run in runs:
            self._ship(run)

    def abandon(self, group: Hashable, number: int) -> None:
        """Block `number` will not come (its write failed before reaching S3)."""
        with self._lock:
            pending = self._groups.get(group)
            if pending is None:
                return
            pending.gone.add(number)
            pending.in_flight = max(0, pending.in_flight - 1)
            self._idle_since_now(pending)
            runs = self._ready(group, pending)
        for run in runs:
            self._ship(run)

    def end_group(self, group: Hashable) -> None:
        """The request ended: ship what it gathered once its last block arrived."""
        with self._lock:
            pending = self._groups.get(group)
            if pending is None:
                return
            pending.ending = True
            runs = self._ready(group, pending)
        for run in runs:
            self._ship(run)

    def end_all(self) -> None:
        """Every group as if its request ended (the owner is flushing)."""
        with self._lock:
            groups = list(self._groups)
        for group in groups:
            self.end_group(group)

    def flush(self) -> None:
        """Ship every block that has arrived now, in flight or not (shutdown)."""
        runs: list[list[T]] = []
        with self._lock:
            for group, pending in list(self._groups.items()):
                runs += self._ready(group, pending, everything=True)
        for run in runs:
            self._ship(run)

    @property
    def waiting(self) -> int:
        """Blocks arrived and not yet shipped."""
        with self._lock:
            return sum(len(g.arrived) for g in self._groups.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        self.flush()

    # -- under the lock ------------------------------------------------------------
    def _idle_since_now(self, pending: _Group[T]) -> None:
        """Start the group's flush clock once its last block in flight has arrived."""
        if pending.in_flight == 0 and pending.arrived and pending.started is None:
            pending.started = self._clock()
            self._lock.notify()

    def _ready(self, group: Hashable, pending: _Group[T], everything: bool = False) -> list[list[T]]:
        """Take the runs that may ship: stretches of consecutive numbers from next_ship,
        full ones always, the rest when the group ended with nothing in flight (or
        `everything`: a flush, the timer). A missing number ends a stretch."""
        tail = everything or (pending.ending and pending.in_flight == 0)
        runs: list[list[T]] = []
        while True:
            while pending.next_ship in pending.gone and pending.next_ship < pending.next_number:
                pending.gone.discard(pending.next_ship)
                pending.next_ship += 1
            run: list[T] = []
            number = pending.next_ship
            while number in pending.arrived and len(run) < self.max_blocks:
                run.append(pending.arrived[number])
                number += 1
            if not run and everything and pending.arrived:
                # A hole that is still in flight: skip past it for a flush.
                pending.next_ship = min(pending.arrived)
                continue
            if not run or (len(run) < self.max_blocks and not tail):
                break
            for n in range(pending.next_ship, number):
                del pending.arrived[n]
            pending.next_ship = number
            runs.append(run)
        if runs:
            pending.started = None
            self._idle_since_now(pending)
        if (pending.ending or everything) and pending.in_flight == 0 and not pending.arrived:
            del self._groups[group]
        return runs

    def _timer(self) -> None:
        while True:
            due: list[list[T]] = []
            with self._lock:
                if self._closed:
                    return
                now = self._clock()
                for group, pending in list(self._groups.items()):
                    if pending.started is not None and now - pending.started >= self.flush_seconds:
                        due += self._ready(group, pending, everything=True)
                if not due:
                    starts = [g.started for g in self._groups.values() if g.started is not None]
                    waits = [start + self.flush_seconds - now for start in starts]
                    self._lock.wait(max(0.001, min(waits)) if waits else None)
                    continue
            for run in due:
                self._ship(run)

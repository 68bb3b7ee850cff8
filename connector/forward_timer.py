"""Times the forward of steps that compute prompt tokens, for the scheduler's cost
model (cost_model.py): what recomputing a prompt costs on this engine, measured.

A step's forward runs from vLLM binding the step's connector metadata (just before
the forward) to `wait_for_save` (just after it). The scheduler cannot time it itself:
it hears of a step only when the step's output carries something for the connector,
and under async scheduling it plans the next step while this one runs. On CUDA the
host queues the forward and moves on, so the two points are CUDA events on the
forward's stream, read once the GPU has passed the second; elsewhere the host's clock
is the forward's."""

from __future__ import annotations

import time
from typing import Any

import torch

# A point in time: the host's perf_counter, or a recorded torch.cuda.Event on CUDA.
Mark = Any


class ForwardTimer:
    def __init__(self, on_cuda: bool):
        self.on_cuda = on_cuda
        self._open: tuple[int, Mark] | None = None  # (tokens, start) of the step being timed
        self._pending: list[tuple[int, Mark, Mark]] = []  # CUDA: (tokens, start, end) not yet done
        self._done: list[tuple[int, float]] = []

    def begin(self, tokens: int) -> None:
        """The step's forward is about to start; `tokens` 0: not a step to time."""
        if tokens <= 0:
            self._open = None
            return
        self._open = (tokens, self._mark())

    def end(self) -> None:
        """The step's forward is over (vLLM calls `wait_for_save` once per step)."""
        if self._open is None:
            return
        tokens, start = self._open
        self._open = None
        if self.on_cuda:
            self._pending.append((tokens, start, self._mark()))
        else:
            self._done.append((tokens, time.perf_counter() - start))

    def take(self) -> list[tuple[int, float]]:
        """(tokens, seconds) of every timed forward that has finished since the last call."""
        still = []
        for tokens, start, end in self._pending:
            if end.query():
                self._done.append((tokens, start.elapsed_time(end) / 1000.0))
            else:
                still.append((tokens, start, end))
        self._pending = still
        done, self._done = self._done, []
        return done

    def _mark(self) -> Mark:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

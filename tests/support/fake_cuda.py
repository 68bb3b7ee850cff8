"""A stand-in for the connector's CUDA copy stream (connector/sync.py's CopyStream) on
CPU tensors: the GPU is the one thing faked. Copies queued on it are done by the CPU
as they are queued, but the events that mark them read done only later, as a GPU's
would: `lag` queries of any of its events after they were recorded, or not at all
while the stream is `held`. What the forward's stream was told to wait for is kept,
and the host waits (`synchronize`, reached only through `sync.host_wait`) are
counted, so a test sees what the worker ordered and where it would have waited."""

from __future__ import annotations

import contextlib


class FakeEvent:
    def __init__(self, stream: FakeCopyStream):
        self._stream = stream
        self._recorded_at = stream.queries
        self._done = False

    def query(self) -> bool:
        stream = self._stream
        stream.queries += 1
        if not stream.held and stream.queries - self._recorded_at > stream.lag:
            self._done = True
        return self._done

    def synchronize(self) -> None:
        self._stream.host_waits += 1
        self._done = True


class FakeCopyStream:
    def __init__(self, lag: int = 1):
        self.lag = lag
        self.held = False
        self.queries = 0
        self.host_waits = 0
        self.events: list[FakeEvent] = []
        self.forward_waited: list[FakeEvent] = []

    @contextlib.contextmanager
    def after_forward(self):
        yield

    def mark(self) -> FakeEvent:
        event = FakeEvent(self)
        self.events.append(event)
        return event

    def forward_waits(self, event: FakeEvent) -> None:
        self.forward_waited.append(event)

    def synchronize(self) -> None:
        self.host_waits += 1
        for event in self.events:
            event._done = True

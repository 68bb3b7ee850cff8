"""Where the connector meets CUDA's ordering: its copy stream, the events that mark
its copies, and the one place the host may wait for the GPU.

On the step path (every hook vLLM calls while it serves: `start_load_kv`,
`wait_for_layer_load`, `save_kv_layer`, `wait_for_save`, `get_finished`, ...) the host
never waits. Work is ordered on the GPU instead: the copy stream waits for the
forward's stream before a copy, the forward's stream waits for a load's event before
it reads the blocks, and what the host must not do before a copy is over (hand a slot
to the movers, give a slot back, let vLLM free a request's blocks) waits for the
copy's event to read done when polled (`event.query()`), in a later hook.

`host_wait` is the only place that holds the host. Its callers are start-up (the copy
kernels' warm-up), sleep mode's unmapping of the paged KV, a step being settled after
a hook raised, and shutdown; tests count its calls per hook."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def host_wait(target: Any) -> None:
    """Hold the host until `target` (a CUDA event, or a stream: everything queued on
    it so far) is done on the GPU. Never called from a hook of a step that went well."""
    target.synchronize()


class CopyStream:
    """The copier's CUDA stream, beside the stream vLLM runs the forward on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def after_forward(self):
        """Work queued inside goes on the copy stream, after everything the forward's
        stream has queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def mark(self) -> Event:
        """An event at this point of the copy stream."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def forward_waits(self, event: Event) -> None:
        """Work the forward's stream queues from now on runs after `event`; the host
        goes straight on."""
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        self.stream.synchronize()

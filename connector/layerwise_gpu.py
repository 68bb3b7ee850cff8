"""Hits loaded into the paged KV, and stores copied out of it, layer by layer while the
forward runs, on CUDA.

The CPU backend shares the copy between two threads (layerwise.py). On CUDA the host
does not copy at all: it queues one kernel per layer on the copier's stream, in the
order the forward reaches the layers, each reading that layer's share of the slots
straight from the page-locked CPU tier (fused_copy.py), each followed by an event.
Before a layer's attention the forward's stream waits for that layer's event, so the
GPU computes layer i while layer i+1 crosses PCIe and the host never blocks. A hit's
time to first token becomes the longer of the copy and the forward, not their sum.

At the end of the forward the worker calls `end`: the forward's stream waits for the
whole load (a layer whose hook never came included), and the slots go back to the CPU
tier once the returned event reads done, polled in a later hook (sync.py).

Stores go the other way. vLLM calls `save_kv_layer` right after each attention layer
has written its KV; the copy stream waits for that point of the forward's stream and
copies the layer's new blocks out while the forward computes the next layers. At
`wait_for_save` only the last layer's copy is left to wait for (and any layer whose
hook did not come, copied then), so storing a prompt no longer adds its whole copy to
the step. `end` queues that rest and returns the event the slots are full at; the
host does not wait for it.

On CPU tensors (Triton's interpreter, in tests) the kernels run as they are queued
and there is nothing to wait for: the same launches, checked the same way."""

from __future__ import annotations

from tiercache.tiers.cpu import CpuBuffer

from . import sync
from .copier import PagedKVCopier

# Programs (thread blocks) each layer's copy kernel runs on. A copy over PCIe keeps its
# SMs waiting on host memory; given every SM it holds them all and the forward's kernels
# queue behind it (measured on an H100: the copy then overlapped almost nothing). A few
# SMs keep PCIe busy and leave the rest to the forward. On an H100
# (benchmarks/gpu_layerwise.py, docs/benchmarks-e2e.md "GPU transfers"): 16 was the
# best load grid of 8, 12, 16 and 24 in four runs out of four. For stores, 6 of 2, 4,
# 6, 8 and 16: within 0.02x of the best after an 8.5 ms forward (8: 0.2x behind), and
# 0.2x behind 8 after a 3 ms one, where 4 is 0.9x behind; a prefill's forward is
# longer than either.
LAYER_LOAD_PROGRAMS = 16
LAYER_STORE_PROGRAMS = 6


def _require_one_launch(copier: PagedKVCopier, buffer: CpuBuffer, what: str) -> None:
    if not copier.one_launch(buffer):
        raise ValueError(f"layer-by-layer {what} on CUDA need the one-launch copy and a page-locked CPU tier")


class StreamLayerwiseLoad:
    def __init__(
        self,
        copier: PagedKVCopier,
        buffer: CpuBuffer,
        slots: list[int],
        block_ids: list[int],
        order: list[str],
        programs: int = LAYER_LOAD_PROGRAMS,
    ):
        _require_one_launch(copier, buffer, "loads")
        assert copier.fused is not None  # one_launch says so
        self._stream = copier.stream
        self._ready: dict[str, sync.Event | None] = {}
        # Blocks handed to this request may still be read by work queued before it.
        with copier.queued_after_forward():
            index, rows = copier.tables(block_ids, slots)
            for name in order:
                number = copier.layer_numbers.get(name)
                if number is not None:
                    copier.fused.scatter(buffer.tensor, rows, index, range(number, number + 1), programs)
                    self._ready[name] = copier.mark()
            self._last = copier.mark()

    def wait(self, name: str) -> None:
        """Order the forward's next kernels after layer `name` is in place (a layer
        this load does not touch needs nothing). The host goes straight on."""
        ready = self._ready.get(name)
        if ready is not None and self._stream is not None:
            self._stream.forward_waits(ready)

    def wait_all(self) -> None:
        """Order everything the forward's stream queues from now on after the whole
        load (for a forward that calls no layer hook: a full CUDA graph replay)."""
        if self._last is not None and self._stream is not None:
            self._stream.forward_waits(self._last)

    def end(self) -> sync.Event | None:
        """The forward is queued: what the forward's stream queues from now on runs
        after every layer is in. The slots may be reused once the returned event reads
        done (None: they may now)."""
        self.wait_all()
        return self._last

    def finish(self) -> None:
        """Return once every layer is in the paged KV (tools and tests)."""
        done = self.end()
        if done is not None:
            sync.host_wait(done)


class StreamLayerwiseSave:
    def __init__(
        self,
        copier: PagedKVCopier,
        buffer: CpuBuffer,
        block_ids: list[int],
        slots: list[int],
        programs: int = LAYER_STORE_PROGRAMS,
    ):
        _require_one_launch(copier, buffer, "stores")
        self._copier = copier
        self._buffer = buffer
        self._programs = programs
        self._left = dict(copier.layer_numbers)  # name -> layer number, not copied yet
        with copier.queued_after_forward():
            self._index, self._rows = copier.tables(block_ids, slots)

    def _gather(self, number: int, programs: int | None) -> None:
        layer = range(number, number + 1)
        assert self._copier.fused is not None  # one_launch said so when the save began
        self._copier.fused.gather(self._index, self._rows, self._buffer.tensor, layer, programs)

    def save(self, name: str) -> None:
        """Layer `name` has been written by the forward: start copying it out."""
        number = self._left.pop(name, None)
        if number is not None:
            with self._copier.queued_after_forward():
                self._gather(number, self._programs)

    def end(self) -> sync.Event | None:
        """Queue the layers whose hook never came; every layer is in its slot once the
        returned event reads done (None: it is now)."""
        left, self._left = sorted(self._left.values()), {}
        with self._copier.queued_after_forward():
            for number in left:  # after the forward: every SM is free, so the full grid
                self._gather(number, None)
            return self._copier.mark()

    def finish(self) -> None:
        """`end`, then return once every layer is in its slot (tools and tests)."""
        done = self.end()
        if done is not None:
            sync.host_wait(done)

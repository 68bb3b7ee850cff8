"""A hit loaded from CPU slots into the paged KV layer by layer, while the forward runs:
a CPU-tier hit in the step that computes its request (with its disk blocks, read
from their objects where `disk.load_in_forward` allows, disk_reads.py), and a disk
or S3 hit, once staged into slots, from the end of the step that reports it until
the next forward (the earliest that can read it) has waited for every layer.

Copying a whole hit before the forward starts puts the full copy on the critical path
(about 20 ms for 124 MiB on a 2-core machine: 13% of a 2000-token hit's time to first
token). Here a helper thread copies the layers in the order the forward reaches them,
and the forward's own thread, when it reaches a layer that is not in place yet, copies
another still-untouched layer from the far end instead of idling: two threads share the
copy and the forward computes layer i while layer i+1 is being copied.

Correctness rests on one rule: a layer's attention runs only after `wait(layer)`
returned, which vLLM guarantees by calling the connector's `wait_for_layer_load`
before each attention layer. The worker uses this class only once it has seen a
whole step call that hook for every registered layer (see `TierCacheWorker`)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from tiercache.tiers.cpu import CpuBuffer

from .copier import PagedKVCopier, runs
from .disk_reads import DiskReads


class LayerwiseLoad:
    def __init__(
        self,
        copier: PagedKVCopier,
        buffer: CpuBuffer,
        slots: list[int],
        block_ids: list[int],
        order: list[str],
        helper: ThreadPoolExecutor,
        disk: DiskReads | None = None,
    ):
        """`disk`: blocks read from their disk objects along with each layer, each
        page checked as it lands or the block once every layer is in (disk_reads.py)."""
        self._copier = copier
        self._buffer = buffer
        self._spans = runs(block_ids, slots)
        self._regions = {region.name: region for region in copier.regions}
        self._order = [name for name in order if name in self._regions]
        self._unclaimed = list(self._order)  # front: the helper's end; back: the stealer's
        self._done = {name: threading.Event() for name in self._order}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._disk = disk
        self._unchecked = list(range(len(disk))) if disk is not None else []
        self._checks_left = len(self._unchecked)
        self._checked = threading.Event()
        if not self._checks_left:
            self._checked.set()
        helper.submit(self._run_helper)

    def _claim(self, name: str | None = None, from_back: bool = False) -> str | None:
        with self._lock:
            if not self._unclaimed:
                return None
            if name is None:
                return self._unclaimed.pop(-1 if from_back else 0)
            if name in self._unclaimed:
                self._unclaimed.remove(name)
                return name
            return None

    def _copy(self, name: str) -> None:
        try:
            # vLLM runs the forward in inference mode, and its KV tensors may only be
            # written in that mode; the mode is per thread.
            with torch.inference_mode():
                self._copier.copy_region(self._regions[name], self._spans, self._buffer, out_of_kv=False)
            if self._disk is not None:
                self._disk.read_layer(self._regions[name])
        except BaseException as error:  # surfaced to the forward's thread in wait()
            self._error = error
        finally:
            self._done[name].set()

    def _run_helper(self) -> None:
        while (name := self._claim()) is not None:
            self._copy(name)
        if self._checks_left:
            for done in self._done.values():
                done.wait()
            self._run_checks()

    def _run_checks(self) -> None:
        """Verify disk blocks until none is left unclaimed (every layer is in)."""
        assert self._disk is not None  # checks exist only with disk reads
        while True:
            with self._lock:
                if not self._unchecked:
                    return
                index = self._unchecked.pop()
            try:
                self._disk.check(index)
            finally:
                with self._lock:
                    self._checks_left -= 1
                    if not self._checks_left:
                        self._checked.set()

    def wait(self, name: str) -> None:
        """Return once layer `name` is in the paged KV (at once for a layer this load
        does not touch). Raises what its copy raised."""
        done = self._done.get(name)
        if done is None:
            return
        if self._claim(name) is not None:
            self._copy(name)
        while not done.is_set():
            # Someone else is copying it: help with the rest rather than wait idle.
            other = self._claim(from_back=True)
            if other is None:
                done.wait()
            else:
                self._copy(other)
        if self._error is not None:
            raise self._error

    def wait_all(self) -> None:
        """Every layer in place (the CPU backend has no CUDA graph to order it in)."""
        for name in self._order:
            self.wait(name)

    def end(self) -> None:
        """As `finish`: the threads' copies are the host's own work, done when it returns
        (the CUDA twin's `end` returns an event; here there is none)."""
        self.finish()

    def finish(self) -> None:
        """Wait for every layer, and for the disk blocks' checks: the step's forward is
        over, or never asked."""
        for name in self._order:
            self.wait(name)
        if self._checks_left:
            self._run_checks()
            self._checked.wait()

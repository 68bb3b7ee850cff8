"""The CPU tier: one host buffer of fixed-size slots, page-locked when CUDA is there
so copies to and from the GPU run asynchronously, with LRU eviction and no
allocation per block.

The buffer (`CpuBuffer`) and the bookkeeping (`SlotAllocator`) are apart because in
vLLM they live in different processes: the scheduler decides which slot holds which
block, and each worker holds the bytes of its own TP shard in the same slot number."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

import torch

from tiercache.errors import CpuTierFull
from tiercache.metrics import TIER_CAPACITY, TIER_EVICTIONS, TIER_USAGE
from tiercache.tiers import CPU

TIER = CPU
ALIGN = 4096

K = TypeVar("K", bound=Hashable)


class SlotAllocator(Generic[K]):
    """Maps keys to slot numbers with LRU eviction. A pinned slot (a transfer is
    reading or writing it) is never handed to another key. Keys are the caller's
    (the CPU tier's are vLLM block hashes, bytes)."""

    def __init__(self, num_slots: int, slot_bytes: int = 0):
        if num_slots < 1:
            raise ValueError(f"the CPU tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._slot_of: OrderedDict[K, int] = OrderedDict()  # oldest first
        self._pins: dict[int, int] = {}
        self._detached: set[int] = set()  # removed while pinned: freed on last unpin
        TIER_CAPACITY.labels(TIER).set(num_slots * slot_bytes)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: K) -> bool:
        return key in self._slot_of

    def slot_of(self, key: K) -> int | None:
        return self._slot_of.get(key)

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._slot_of)

    def touch(self, keys: Iterable[K]) -> None:
        with self._lock:
            for key in keys:
                if key in self._slot_of:
                    self._slot_of.move_to_end(key)

    def allocate(self, key: K, first_choice: Callable[[K], bool] | None = None) -> tuple[int, K | None]:
        """A pinned slot for `key`, and the key evicted to make room (or None): the
        least recently used unpinned key, or where `first_choice` is given, the least
        recently used unpinned one it accepts if there is one (a segmented LRU's
        probation). The caller fills the slot, then unpins it."""
        with self._lock:
            if key in self._slot_of:
                raise KeyError(f"{key} already holds a slot")
            evicted = None
            if self._free:
                slot = self._free.pop()
            else:
                if first_choice is not None:
                    evicted = self._first_accepted(first_choice)
                if evicted is None:
                    evicted = next((k for k, s in self._slot_of.items() if s not in self._pins), None)
                if evicted is None:
                    raise CpuTierFull(f"all {self.num_slots} CPU slots are in use by transfers")
                slot = self._slot_of.pop(evicted)
                TIER_EVICTIONS.labels(TIER).inc()
            self._slot_of[key] = slot
            self._pins[slot] = 1
            self._publish()
            return slot, evicted

    def _first_accepted(self, first_choice: Callable[[K], bool]) -> K | None:
        """(Under the lock.) The least recently used unpinned key `first_choice`
        accepts. The unpinned keys it passes over move to the most recent end, in their
        order (a second chance, as a clock gives), so the next search does not walk
        past them again: a search costs, over time, about one key per eviction."""
        passed: list[K] = []
        found = None
        for key, slot in self._slot_of.items():
            if slot in self._pins:
                continue
            if first_choice(key):
                found = key
                break
            passed.append(key)
        if found is not None:
            for key in passed:
                self._slot_of.move_to_end(key)
        return found

    def pin(self, key: K) -> int | None:
        """Pin `key`'s slot for a read (marks it recently used); None if absent."""
        with self._lock:
            slot = self._slot_of.get(key)
            if slot is not None:
                self._pins[slot] = self._pins.get(slot, 0) + 1
                self._slot_of.move_to_end(key)
            return slot

    def unpin(self, slot: int) -> None:
        with self._lock:
            count = self._pins.get(slot, 0) - 1
            if count > 0:
                self._pins[slot] = count
                return
            self._pins.pop(slot, None)
            if slot in self._detached:
                self._detached.discard(slot)
                self._free.append(slot)

    def remove(self, key: K) -> bool:
        """Forget `key` (a failed fill, a flush). A pinned slot is freed on its last unpin."""
        with self._lock:
            slot = self._slot_of.pop(key, None)
            if slot is None:
                return False
            if slot in self._pins:
                self._detached.add(slot)
            else:
                self._free.append(slot)
            self._publish()
            return True

    def clear(self) -> int:
        with self._lock:
            keys = list(self._slot_of)
        return sum(self.remove(key) for key in keys)

    def unpinned(self) -> int:
        """Slots no transfer holds: free ones plus ones that may be evicted."""
        with self._lock:
            return self.num_slots - len(self._pins)

    def pinned(self) -> int:
        """Slots a transfer holds now (each counted once, however many pins)."""
        with self._lock:
            return len(self._pins)

    def unpinned_among(self, keys: Iterable[K]) -> int:
        """How many of `keys` hold a slot that no transfer holds."""
        with self._lock:
            slots = (self._slot_of.get(key) for key in keys)
            return sum(1 for slot in slots if slot is not None and slot not in self._pins)

    def usage_bytes(self) -> int:
        return len(self._slot_of) * self.slot_bytes

    def _publish(self) -> None:
        TIER_USAGE.labels(TIER).set(len(self._slot_of) * self.slot_bytes)


class CpuBuffer:
    """`num_slots` x `slot_bytes` of host memory, allocated once: page-locked (pinned)
    where CUDA is, so copies to and from the GPU run asynchronously."""

    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: bool | None = None):
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pinned = pin_memory
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        nbytes = num_slots * slot_bytes
        # Start on a 4 KiB boundary so the disk tier can use O_DIRECT on whole slots.
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
        offset = (-raw.data_ptr()) % ALIGN
        self.tensor = raw[offset : offset + nbytes].view(num_slots, slot_bytes)
        # Touch every page now so the first hit does not pay for page faults.
        self.tensor.zero_()
        self._array = self.tensor.numpy()

    def view(self, slot: int) -> memoryview:
        """A writable view of one slot's bytes for file and socket I/O (no copy)."""
        return memoryview(self._array[slot]).cast("B")


def slots_for(capacity: int, slot_bytes: int) -> int:
    num_slots = capacity // slot_bytes
    if num_slots < 1:
        raise ValueError(f"cpu.capacity ({capacity} bytes) is smaller than one block ({slot_bytes} bytes)")
    return num_slots

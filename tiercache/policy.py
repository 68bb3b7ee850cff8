"""The cache policy of one node: which CPU slot holds which block, which blocks are
ready to be read, which the node's disk tier holds, what an eviction writes back and
what a hit promotes. The connector's scheduler half holds it and learns of copies
through worker reports (connector/scheduler.py).

A block is named by its hash (bytes). A slot is pinned while anything copies into or
out of it; a pinned slot is never evicted or handed to another block. A block counts
as ready only once its slot is filled (on every rank, in vLLM): a block whose slot is
taken but not filled is neither a hit nor worth storing again.

A watcher (`BlockPolicy.watcher`, optional) is told each time a block becomes
readable in a tier or stops being so: the connector turns that into vLLM's KV events
and the instance's presence in Redis (connector/events.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from tiercache.admission import Admission
from tiercache.tiers import CPU, DISK, S3
from tiercache.tiers.cpu import CpuTierFull, SlotAllocator

if TYPE_CHECKING:
    from tiercache.config import TierCacheConfig

__all__ = ["BlockPolicy", "CpuTierFull", "TierWatcher", "promotes_to_disk", "reads_disk_in_forward"]


def promotes_to_disk(tier: str, has_disk: bool, *, write_back: bool) -> bool:
    """A hit from S3 is kept on the node's disk too (it is staged in the CPU tier
    either way). Under write-back the disk gets it when the CPU tier evicts it. The
    connector's worker, which makes the copy, has no BlockPolicy of its own: this rule
    is shared by name."""
    return tier == S3 and has_disk and not write_back


def reads_disk_in_forward(config: TierCacheConfig, kv_in_host_memory: bool, tp_size: int) -> bool:
    """Whether disk hits are read straight into the paged KV during the forward
    (connector/disk_reads.py): only where the paged KV is in host memory (vLLM's CPU
    backend) and `disk.load_in_forward` allows, with one tensor-parallel rank. The
    scheduler plans such loads and the worker writes objects for them (with a checksum
    per layer): one rule for both.

    A read that fails its check is found after the forward that used it, and the
    blocks that forward computed after it are not stored (the worker voids them). Each
    rank checks only its own objects, though, and with several ranks the others would
    store their shards of those blocks, computed over a bad shard through the
    all-reduce: so with tensor parallelism disk hits are staged and checked before
    the forward, as on GPUs."""
    return kv_in_host_memory and tp_size == 1 and config.disk is not None and config.disk.load_in_forward


class TierWatcher(Protocol):
    def added(self, tier: str, block: bytes) -> None:
        """`block` can now be read from `tier` (CPU: its slot is filled; disk: every
        rank's disk holds it)."""

    def removed(self, tier: str, block: bytes) -> None:
        """`block` can no longer be read from `tier` (evicted, failed, gone, cleared)."""


class FailedLately(Protocol):
    """Blocks whose load failed lately (connector/load_failures.py): a lookup leaves them out."""

    def __contains__(self, block: bytes) -> bool: ...


class BlockPolicy:
    """`admission` (the `selective` mover policy, tiercache/admission.py): the CPU tier
    is a segmented LRU, and an evicted block is written down only to the tiers that
    admit it; it implies write-back (nothing goes down when it is stored)."""

    def __init__(
        self, num_slots: int, slot_bytes: int, *, write_back: bool, admission: Admission | None = None
    ):
        self.slots: SlotAllocator[bytes] = SlotAllocator(num_slots, slot_bytes)
        self.admission = admission
        self.write_back = write_back or admission is not None
        self.watcher: TierWatcher | None = None
        self.ready: set[bytes] = set()  # blocks whose CPU slot is filled
        # Blocks the node's disk holds, least recently stored or staged first (the
        # disk's own LRU order, as near as this node sees it).
        self.on_disk: OrderedDict[bytes, None] = OrderedDict()
        self._write_backs: list[tuple[bytes, int]] = []
        # Victims written to some lower tiers only, and which (absent: every one).
        self._write_back_tiers: dict[bytes, tuple[str, ...]] = {}

    def requested(self, blocks: list[bytes]) -> None:
        """A request's blocks, counted once when it is first looked up."""
        if self.admission is not None:
            self.admission.requested(blocks)

    # -- where a block is -------------------------------------------------------------
    def local_tier(self, block: bytes) -> str | None:
        if block in self.ready:
            return CPU
        if block in self.on_disk:
            return DISK
        return None

    def local_run(self, blocks: Iterable[bytes], failed: FailedLately) -> list[str]:
        """The tier of each leading block of `blocks` a local tier holds, up to the first
        none holds or whose load failed lately (in `failed`): a lookup's local hit."""
        run = []
        for block in blocks:
            tier = self.local_tier(block)
            if tier is None or block in failed:
                break
            run.append(tier)
        return run

    def filling(self, block: bytes) -> bool:
        """A store or a staging holds a slot for it that is not filled yet."""
        return block in self.slots and block not in self.ready

    # -- slots --------------------------------------------------------------------------
    def pin_ready(self, block: bytes) -> int | None:
        """Pin a ready block's slot for a read (a CPU hit); None if it is not ready."""
        slot = self.slots.pin(block)
        if slot is None:
            return None
        if block not in self.ready:
            self.slots.unpin(slot)
            return None
        if self.admission is not None:
            self.slots.touch(self.admission.hit(block))
        return slot

    def claim(self, block: bytes) -> int:
        """A pinned slot to fill with `block` (a store, or a staging from a lower
        tier). Evicts the least recently used unpinned block; under write-back a victim
        the disk does not hold yet is queued to be written down before the slot is
        refilled (`take_write_backs`). Raises CpuTierFull when every slot is pinned."""
        admission = self.admission
        if block in self.on_disk:  # a staging from disk: the disk read it just now
            self.on_disk.move_to_end(block)
        if admission is None:
            slot, evicted = self.slots.allocate(block)
        else:
            slot, evicted = self.slots.allocate(block, admission.on_probation)
        if evicted is not None:
            self._unready(evicted)
            if admission is not None:
                admission.left_cpu(evicted)
            if self.write_back and evicted not in self.on_disk:
                if admission is None:
                    self._write_backs.append((evicted, slot))
                else:
                    disk_victim = next(iter(self.on_disk), None)
                    tiers = admission.down_tiers(evicted, len(self.on_disk), disk_victim)
                    if tiers:
                        self._write_backs.append((evicted, slot))
                        self._write_back_tiers[evicted] = tiers
        return slot

    def queue_popular(self, most_steps: int = 8) -> None:
        """The selective policy's popular blocks (a system prompt every request shares)
        go to the lower tiers as soon as their CPU slot is filled: queued as write-backs
        of a slot that stays, which the worker copies out at its next step's start. A
        block still being filled waits up to `most_steps` steps."""
        admission = self.admission
        if admission is None:
            return
        for block in admission.take_popular():
            if block in self.ready:
                tiers = tuple(t for t in admission.lower_tiers if not (t == DISK and block in self.on_disk))
                slot = self.slots.slot_of(block)
                if tiers and slot is not None:
                    self._write_backs.append((block, slot))
                    self._write_back_tiers[block] = tiers
                admission.sent_everywhere(block)
            else:
                admission.still_waiting(block, most_steps)

    def take_write_backs(self) -> list[tuple[bytes, int]]:
        victims, self._write_backs = self._write_backs, []
        return victims

    def take_write_back_tiers(self) -> dict[bytes, tuple[str, ...]]:
        """The tiers of the victims `take_write_backs` gave that go to some only."""
        tiers, self._write_back_tiers = self._write_back_tiers, {}
        return tiers

    def release(self, slot: int) -> None:
        """One copy into or out of `slot` is over."""
        self.slots.unpin(slot)

    def room_for_staging(self, cpu_blocks: list[bytes]) -> int:
        """Slots a hit may stage lower-tier blocks into: those no transfer holds, less
        the ones its own CPU blocks are about to pin."""
        return self.slots.unpinned() - self.slots.unpinned_among(cpu_blocks)

    # -- fills ----------------------------------------------------------------------------
    def holds(self, block: bytes, slot: int) -> bool:
        """`slot` is (still) the one `block` is being filled into or sits in."""
        return self.slots.slot_of(block) == slot

    def filled(self, block: bytes, slot: int) -> bool:
        """The copy of `block` into `slot` is complete; False if that fill is stale
        (the block failed or moved since)."""
        if not self.holds(block, slot):
            return False
        if block not in self.ready:
            self.ready.add(block)
            if self.watcher is not None:
                self.watcher.added(CPU, block)
        return True

    def fill_failed(self, block: bytes, slot: int) -> None:
        """The block could not be copied in: forget it (the slot is freed on its last
        release)."""
        if self.holds(block, slot):
            self._unready(block)
            self.slots.remove(block)
            if self.admission is not None:
                self.admission.left_cpu(block)

    def _unready(self, block: bytes) -> None:
        if block in self.ready:
            self.ready.discard(block)
            if self.watcher is not None:
                self.watcher.removed(CPU, block)

    # -- the disk tier ----------------------------------------------------------------------
    def stored_on_disk(self, block: bytes) -> None:
        if block not in self.on_disk:
            self.on_disk[block] = None
            if self.watcher is not None:
                self.watcher.added(DISK, block)

    def gone_from_disk(self, block: bytes) -> None:
        if block in self.on_disk:
            del self.on_disk[block]
            if self.watcher is not None:
                self.watcher.removed(DISK, block)

    def promotes_to_disk(self, tier: str, has_disk: bool) -> bool:
        return promotes_to_disk(tier, has_disk, write_back=self.write_back)

    def clear(self) -> None:
        """Forget everything: a slot still pinned by a transfer is freed on its release."""
        if self.watcher is not None:
            # In the CPU tier's LRU order, not the ready set's (which follows the
            # process's hash seed), so that subscribers see one order every run.
            lru_order = self.slots.keys()
            for block in lru_order:
                if block in self.ready:
                    self.watcher.removed(CPU, block)
            for block in self.on_disk:
                self.watcher.removed(DISK, block)
        self.ready.clear()
        self.slots.clear()
        self.on_disk.clear()
        self._write_backs = []
        self._write_back_tiers = {}
        if self.admission is not None:
            self.admission.clear()

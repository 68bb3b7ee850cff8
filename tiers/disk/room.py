"""How a disk tier keeps its root within its capacity: evicting the least recently
used objects (those of digests no running tier uses first), unlinking the files of
evicted objects once their lingering allowance is spent, reclaiming what a tier that
stopped mid-way left, and bringing its view of the root's index up to date. The
budget is the root's, shared through its index (tiers/disk/index.py) with every tier
on it, in this process or another."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tiercache.metrics import TIER_EVICTIONS
from tiercache.tiers import DISK
from tiercache.tiers.disk.index import RootIndex
from tiercache.tiers.disk.layout import DiskLayout, clear_stale_temp, unlink

# The tier's logger: these messages keep the name operators already filter on.
log = logging.getLogger("tiercache.tiers.disk.tier")
TIER = DISK
# Reads write their recency to the root's index at least this often (seconds).
SYNC_SECONDS = 1.0
# How long a finding that a digest is unused is trusted (seconds).
UNUSED_RECHECK_SECONDS = 1.0
# Objects looked at per query while evicting.
_EVICT_BATCH = 64


class RootRoom:
    """The room-keeping half of DiskTier (tier.py), which sets these up."""

    root: Path
    digest: str | None
    layout: DiskLayout
    index: RootIndex
    linger_bytes: int
    _name: str
    _lock: threading.Lock
    _on_remove: Callable[[str], None] | None
    _recent: dict[str, float]
    _lost: set[str]
    _abandoned: set[str]
    _synced: float
    _unused: tuple[float, list[str]]
    _swept: float
    _seen: int

    def _mine(self, key: str) -> bool:
        """Whether `key` is of the digest this tier serves (every key, for None)."""
        return self.digest is None or key.startswith(f"{self.digest}/")

    def _make_room(self, index: RootIndex, budget: int) -> list[str]:
        """(Inside index.write().) Evict until the root's objects fit in `budget`:
        those of unused digests first, then the least recently used of all. The keys
        evicted."""
        over = index.total() - budget
        if over > 0 and self._sweep(index):
            over = index.total() - budget
        if over <= 0:
            return []
        evicted: list[str] = []
        unused = self._unused_digests(index)
        for among in ([unused] if unused else []) + [None]:
            while over > 0:
                victims = index.oldest(_EVICT_BATCH, among)
                if not victims:
                    break
                for key, digest, size in victims[: _needed(victims, over)]:
                    index.remove(key, self._name)
                    index.linger(key, digest, size, self._name)
                    TIER_EVICTIONS.labels(TIER).inc()
                    evicted.append(key)
                    over -= size
        self._unlink_lingering(index)
        if unused:
            self._reclaim_unused_folders(index)
        return evicted

    def _unlink_lingering(self, index: RootIndex) -> None:
        """(Inside index.write().) Unlink the root's oldest evicted files, whoever
        evicted them, while they add more than `linger_bytes`; one stored again since
        is the new object's, and stays."""
        while index.lingering_bytes() > self.linger_bytes:
            oldest = index.oldest_lingering()
            if oldest is None:
                return
            if not index.has(oldest[0]):
                unlink(self.layout.path(oldest[0]))

    def _sweep(self, index: RootIndex, now: bool = False) -> bool:
        """(Inside index.write().) Reclaim what tiers no longer running left on the
        index's books (killed with `kill -9`, or their process gone without a close):
        temporary files of writes under way, a file renamed into place before the
        commit that would have counted it, and the files they evicted that still
        linger. Looked at every UNUSED_RECHECK_SECONDS, or `now`. Whether anything
        was reclaimed."""
        if not now and time.monotonic() - self._swept < UNUSED_RECHECK_SECONDS:
            return False
        self._swept = time.monotonic()
        reclaimed = False
        names = set(index.writers())
        if now:
            names.update(index.tier_names())
        for name in sorted(names):
            if name == self._name or index.tier_alive(name):
                continue
            for tmp, key in index.writes_of(name):
                clear_stale_temp(tmp)
                index.end_write(tmp)
                if not index.has(key) and not index.is_lingering(key):
                    unlink(self.layout.path(key))  # renamed, never counted
                reclaimed = True
            while (gone := index.oldest_lingering(name)) is not None:
                if not index.has(gone[0]):
                    unlink(self.layout.path(gone[0]))
                reclaimed = True
            index.forget_tier(name)
            if reclaimed:
                log.info("disk tier %s: reclaimed the files of a tier that stopped mid-way", self.root)
        return reclaimed

    def _unused_digests(self, index: RootIndex) -> list[str]:
        """(Inside index.write().) Digests with objects that no running tier uses:
        looked at again every UNUSED_RECHECK_SECONDS."""
        checked, unused = self._unused
        if time.monotonic() - checked < UNUSED_RECHECK_SECONDS:
            return unused
        unused = [
            digest
            for digest, objects in index.digests().items()
            if objects > 0 and digest != self.digest and not index.in_use(digest)
        ]
        self._unused = (time.monotonic(), unused)
        return unused

    def _reclaim_unused_folders(self, index: RootIndex) -> None:
        """(Inside index.write(), which a tier taking a digest in use holds too.)
        Remove the folder of every digest that holds no object and no tier uses:
        what is left there is strays and dead writers' temporary files."""
        counts = index.digests()
        for digest in self.layout.digests():
            if counts.get(digest, 0) > 0 or digest == self.digest or index.in_use(digest):
                continue
            shutil.rmtree(self.layout.digest_dir(digest), ignore_errors=True)
            index.forget_lingering(digest)
            index.drop_digest(digest)
            index.forget_user(digest)
            log.info(
                "disk tier %s: removed the folder of digest %s, which no running engine uses",
                self.root,
                digest,
            )

    def _sync(self, index: RootIndex) -> list[str]:
        """(Inside index.write().) Write the recency of the reads since the last sync,
        drop the entries of objects found gone, and read the removals of this tier's
        objects by others: their keys."""
        with self._lock:
            recent, self._recent = self._recent, {}
            lost, self._lost = self._lost, set()
            abandoned, self._abandoned = self._abandoned, set()
            self._synced = time.monotonic()
        if recent:
            index.mark_used(recent)
        for key in lost:
            if not os.path.exists(self.layout.path(key)):
                index.remove(key, self._name)
                index.stop_lingering(key)
        for tmp in abandoned:
            index.end_write(tmp)
        self._seen, removed = index.removed_since(self._seen, self.digest, self._name)
        return removed

    def _sync_now(self) -> None:
        """Sync from a reader: never waits for the index, whose next write takes it."""
        try:
            with self.index.write(wait=False) as index:
                removed = self._sync(index)
        except sqlite3.Error:
            return
        self._report(removed)

    def _report(self, removed: list[str]) -> None:
        """Tell the owner which of its objects left the root (an eviction here, or a
        removal by another tier on the root)."""
        if self._on_remove is None:
            return
        for key in removed:
            if self._mine(key):
                self._on_remove(key)


def _needed(victims: list[tuple[str, str, int]], over: int) -> int:
    """How many of `victims`, in order, free at least `over` bytes (all if they cannot)."""
    freed = 0
    for count, (_, _, size) in enumerate(victims, 1):
        freed += size
        if freed >= over:
            return count
    return len(victims)

"""The disk tier: one safetensors file per object under a root directory on local
NVMe, written to a temporary name and renamed, so a process killed mid-write never
leaves a partial object under a real name. One capacity per root, LRU across every
process and digest on it, counted in an index in the root (tiers/disk/index.py) and
brought in line with the files on start."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from tiercache.index.keys import split_key
from tiercache.metrics import TIER_CAPACITY, TIER_ERRORS, TIER_USAGE, timed
from tiercache.tiers import DISK
from tiercache.tiers.disk.file_io import DiskPages, is_aligned, write_all
from tiercache.tiers.disk.index import RootIndex
from tiercache.tiers.disk.layout import (
    FILE_MODE,
    TMP_PREFIX,
    DiskLayout,
    clear_stale_temp,
    close_folders,
    make_private_dirs,
    prepare_root,
    unlink,
)
from tiercache.tiers.disk.room import SYNC_SECONDS, UNUSED_RECHECK_SECONDS, RootRoom
from tiercache.tiers.format import (
    DATA_ALIGN,
    CorruptObject,
    ObjectHeader,
    PageShape,
    check_header,
    decode_header,
    header_length,
    verify,
)

# How much the files of objects evicted a moment ago may add to the capacity, as a
# share of it, before they are unlinked (oldest first): the scheduler plans a disk load from what
# the workers last reported, and an object evicted since (by a write running beside
# the step) must still serve the load planned from it (docs/reliability.md). One
# allowance for the root, counted in its index, however many tiers evict there.
LINGER_SHARE = 32  # one 32nd

log = logging.getLogger(__name__)
TIER = DISK


class DiskTier(RootRoom):
    def __init__(
        self,
        root: str | Path,
        capacity: int,
        *,
        o_direct: bool = False,
        fsync: bool = False,
        on_remove: Callable[[str], None] | None = None,
        digest: str | None = None,
        integrity_key: bytes | None = None,
    ):
        """`capacity`: the budget of the whole root, shared with every other tier on
        it, in this process or another (tiers/disk/index.py keeps the count): a store
        evicts the least recently used objects under the root, those of digests no
        running tier uses first. `digest`: the namespace digest this tier serves; it
        is held in use while the tier runs, and `on_remove` hears of every object of
        it that leaves the root, whoever removed it. None: every digest, none held
        (tools and tests that own the whole root). `integrity_key`: objects are served
        only if their MAC was made with it (see format.sign); None checks the plain
        checksum."""
        self.root = Path(root)
        self.digest = digest
        self.capacity = capacity
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self.integrity_key = integrity_key
        self._on_remove = on_remove
        self._lock = threading.Lock()  # the fields below
        # Reads are not written to the index one by one: their recency, and objects
        # found gone, go with the tier's next write to it (at least every SYNC_SECONDS
        # while reads come).
        self._recent: dict[str, float] = {}
        self._lost: set[str] = set()
        # Writes that failed after the index counted them, not yet uncounted.
        self._abandoned: set[str] = set()
        self._synced = time.monotonic()
        self._unused: tuple[float, list[str]] = (-UNUSED_RECHECK_SECONDS, [])
        self._swept = -UNUSED_RECHECK_SECONDS
        # Evicted objects' files are not unlinked at once: out of the index (reported
        # removed), but a read planned before the report still finds them. At most
        # `linger_bytes` of them under the root, whoever evicted them, over the capacity.
        self.linger_bytes = capacity // LINGER_SHARE
        self._name = secrets.token_hex(8)  # this tier in the index (removals, writes, lingering files)
        prepare_root(self.root)
        self.layout = DiskLayout(self.root)
        self.index = RootIndex(self.root)
        # The descriptors whose locks say this tier runs and its digest is in use.
        self._held: list[int] = [self.index.hold_tier(self._name)]
        if digest is not None:
            with self.index.write() as index:
                self._held.append(index.hold_digest(digest))
        self._seen = self.index.last_removal()
        weakref.finalize(self, _close_tier, self.index, self._held)
        self._reindex()
        TIER_CAPACITY.labels(TIER).set(capacity)

    name = TIER

    # -- naming -------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        return Path(self.layout.path(key))

    # -- index --------------------------------------------------------------
    def _reindex(self) -> None:
        """Bring the root's index in line with the files present: objects it does not
        know (an older tiercache's, or one renamed just before a crash) are counted,
        recent by their modification time; entries whose file is gone are dropped.
        Temporary files no live writer holds are removed, and so are the folders of
        unused digests that hold nothing. Then evict down to the capacity."""
        found: dict[str, tuple[str, int, float]] = {}
        for digest in self.layout.digests():
            close_folders(self.layout.digest_dir(digest))
            for entry in self.layout.files(digest):
                if entry.name.startswith(TMP_PREFIX):
                    clear_stale_temp(entry.path)
                    continue
                block = self.layout.block_of(entry.name)
                if block is None:
                    continue
                key = f"{digest}/{block}"
                try:
                    split_key(key)
                    stat = entry.stat()
                    if stat.st_mode & 0o077:  # left readable by a tiercache before 0600
                        os.chmod(entry.path, FILE_MODE)
                except (ValueError, OSError):
                    continue
                found[key] = (digest, stat.st_size, stat.st_mtime)
        with self.index.write() as index:
            self._sweep(index, now=True)
            for key in index.lingering_keys():
                if key not in found:
                    index.stop_lingering(key)
            known = index.all_keys()
            # Both checked again under the index's lock: another process may have
            # stored or evicted since the scan. A lingering file is counted already.
            for key in found.keys() - known:
                if os.path.exists(self.layout.path(key)) and not index.is_lingering(key):
                    index.add(key, *found[key])
            for key in known - found.keys():
                if not os.path.exists(self.layout.path(key)):
                    index.remove(key, self._name)
            removed = self._make_room(index, self.capacity)
            self._reclaim_unused_folders(index)
            usage = index.on_disk()
        TIER_USAGE.labels(TIER).set(usage)
        log.info(
            "disk tier %s: %d objects, %d bytes under the root", self.root, len(known | found.keys()), usage
        )
        self._report(removed)

    def keys(self) -> list[str]:
        """This tier's keys (its digest's, or every one), least recently used first."""
        return self.index.keys(self.digest)

    def __len__(self) -> int:
        return self.index.usage(self.digest)[0]

    def __contains__(self, key: str) -> bool:
        return self.contains(key)

    def usage_bytes(self) -> int:
        """Bytes of this tier's objects (its digest's, or the whole root's)."""
        return self.index.usage(self.digest)[1]

    # -- operations ---------------------------------------------------------
    def put(self, key: str, data: memoryview, header: ObjectHeader) -> bool:
        """Write one object. False when it cannot be stored (full disk, no
        permission, the index busy): a store is dropped, never an error for the caller."""
        path = self.layout.path(key)
        preamble = header.encode()
        size = len(preamble) + len(data)
        if size > self.capacity:
            return False
        try:
            if self.index.has(key):
                self._used(key)
                return True
        except sqlite3.Error as error:
            return self._dropped(key, "index", error)
        return self._put_counted(key, path, preamble, data, size)

    def _put_counted(self, key: str, path: str, preamble: bytes, data: memoryview, size: int) -> bool:
        tmp = self.layout.temp_path(path)
        removed: list[str] = []
        fd: int | None = None
        counted = False  # the write, in the index's writes under way
        renamed = False  # and not yet counted by a committed transaction
        try:
            with timed(TIER, "put", len(data)):
                # The write is counted, and room made for it, before its first byte:
                # concurrent writers, of this process or another, cannot each evict
                # for themselves and together overshoot the capacity, and the file
                # of a writer killed at any point is on the index's books.
                with self.index.write() as index:
                    removed += self._sync(index)  # this tier's reads count in the order
                    index.start_write(tmp, key, size, self._name)
                    removed += self._make_room(index, self.capacity)
                counted = True
                try:
                    fd = self._write(tmp, preamble, data)
                except FileNotFoundError:  # the object's folder does not exist yet
                    make_private_dirs(os.path.dirname(path))
                    fd = self._write(tmp, preamble, data)
                with self.index.write() as index:
                    removed += self._sync(index)
                    index.end_write(tmp)
                    if index.has(key):  # another writer put it there meanwhile
                        os.unlink(tmp)
                        index.mark_used({key: time.time()})
                    else:
                        os.replace(tmp, path)
                        renamed = True
                        index.stop_lingering(key)  # the path holds the new file now
                        try:
                            index.add(key, split_key(key)[0], size, time.time())
                            removed += self._make_room(index, self.capacity)
                        except BaseException:
                            os.unlink(path)  # still under the index's lock: no one else's file
                            renamed = False
                            raise
                    TIER_USAGE.labels(TIER).set(index.on_disk())
                renamed = counted = False
        except (OSError, sqlite3.Error) as error:
            kind = "disk_full" if getattr(error, "errno", None) == errno.ENOSPC else "io"
            if isinstance(error, sqlite3.Error):
                kind = "disk_full" if "full" in str(error) else "index"
            for leftover in (tmp, path) if renamed else (tmp,):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
            if counted:
                with self._lock:
                    self._abandoned.add(tmp)
                self._sync_now()
            return self._dropped(key, kind, error)
        finally:
            if fd is not None:
                os.close(fd)
            self._report(removed)
        return True

    @staticmethod
    def _dropped(key: str, kind: str, error: Exception) -> bool:
        TIER_ERRORS.labels(TIER, kind).inc()
        log.warning("disk tier: dropped store of %s: %s", key, error)
        return False

    def _write(self, tmp: str, preamble: bytes, data: memoryview) -> int:
        """Write the object to `tmp`, a new file. Returns its descriptor, still open
        and holding the file's lock: the lock tells a cleaner that a live writer owns
        the file, until the rename (see clear_stale_temp)."""
        direct = self.o_direct and is_aligned(data)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        fd = os.open(tmp, flags, FILE_MODE)  # the umask can only narrow it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink == 0:
                # A cleaner locked it first (between the open and the lock) and took
                # it for a dead writer's.
                raise FileNotFoundError(errno.ENOENT, "temporary file removed before it was locked", tmp)
            if direct:
                # O_DIRECT needs aligned memory: copy the small preamble into an
                # anonymous (page-aligned) map; the pages go straight from the slot.
                # The map is freed with its last reference: closing it explicitly
                # would fail while a failed write's traceback still holds a view.
                aligned = mmap.mmap(-1, len(preamble))
                aligned.write(preamble)
                write_all(fd, aligned, data)
            else:
                write_all(fd, preamble, data)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def get_into(self, key: str, out: memoryview, expect: PageShape | None = None) -> bool:
        """Read one object's pages straight into `out` and verify them (and, given
        `expect`, that they hold the reader's layers and shapes). A missing object is
        False; a corrupt or mismatched one is removed, counted, and False."""
        path = self.layout.path(key)
        try:
            with timed(TIER, "get", len(out)):
                fd = os.open(path, os.O_RDONLY)
                try:
                    self._read_verified(fd, key, out, expect)
                finally:
                    os.close(fd)
        except (CorruptObject, OSError) as error:
            self.missed(key, error)
            return False
        self._used(key)
        return True

    def open_pages(self, key: str, nbytes: int, expect: PageShape | None = None) -> DiskPages | None:
        """Open one object to read its pages piece by piece (a disk hit read into the
        paged KV during the forward), its header read and checked. The caller verifies
        the pages it read against the header and closes it. A missing object is None;
        a corrupt or mismatched header is removed, counted, and None."""
        path = self.layout.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                head = os.pread(fd, DATA_ALIGN, 0)
                header, offset = self._checked_header(fd, head, key, nbytes, expect)
            except BaseException:
                os.close(fd)
                raise
        except (CorruptObject, OSError) as error:
            self.missed(key, error)
            return None
        self._used(key)
        return DiskPages(key, fd, header, offset)

    def missed(self, key: str, error: CorruptObject | OSError) -> None:
        """A read of `key` that cannot be served, whatever the reader: a file gone
        is forgotten; a corrupt one is counted, logged and removed, so it is a miss
        from now on; an I/O error is counted and logged (the file may serve later)."""
        if isinstance(error, FileNotFoundError):
            self._forget(key)
        elif isinstance(error, CorruptObject):
            TIER_ERRORS.labels(TIER, "corrupt").inc()
            log.warning("disk tier: corrupt object %s removed: %s", key, error)
            self.delete(key)
        else:
            TIER_ERRORS.labels(TIER, "io").inc()
            log.warning("disk tier: read of %s failed: %s", key, error)

    @staticmethod
    def _checked_header(
        fd: int, head: bytes | bytearray, key: str, nbytes: int, expect: PageShape | None
    ) -> tuple[ObjectHeader, int]:
        """The object's header, checked against what the reader asked for, and where
        its pages start. `head`: the file's first bytes as read (up to DATA_ALIGN);
        a longer header is read from the file."""
        length = header_length(bytes(head[:8]))
        offset = 8 + length
        if offset <= min(len(head), DATA_ALIGN):
            header = decode_header(bytes(head[8:offset]))
        else:
            header = decode_header(os.pread(fd, length, 8))
        check_header(header, key, nbytes)
        if expect is not None:
            expect.check(header)
        return header, offset

    def _used(self, key: str) -> None:
        with self._lock:
            self._recent[key] = time.time()
            due = time.monotonic() - self._synced >= SYNC_SECONDS
        if due:
            self._sync_now()

    def _read_verified(self, fd: int, key: str, out: memoryview, expect: PageShape | None = None) -> None:
        """Fill `out` with the object's pages and check them against its header.

        For the layout this tier writes (a DATA_ALIGN preamble, then the pages) one
        read takes the preamble and the pages together, then one pass hashes them.
        Reading in small chunks, each hashed while still in cache, measured slower
        (docs/benchmarks-e2e.md, "What the investigations found"). Any other
        layout reads the pages after the header. With an integrity key that one pass
        is the MAC's."""
        head = bytearray(DATA_ALIGN)
        got = os.preadv(fd, [head, out], 0)
        header, offset = self._checked_header(fd, head[: min(got, DATA_ALIGN)], key, len(out), expect)
        # The first read already holds the start of the pages only in this tier's layout.
        done = max(got - DATA_ALIGN, 0) if offset == DATA_ALIGN else 0
        DiskTier._read_into(fd, out, offset, done)
        verify(header, out, self.integrity_key)

    @staticmethod
    def _read_into(fd: int, out: memoryview, offset: int, done: int = 0) -> None:
        """Read the rest of `out` (from byte `done`) from file offset `offset`."""
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise CorruptObject(f"object truncated at {done} of {len(out)} bytes")
            done += n

    def read_header(self, key: str) -> ObjectHeader | None:
        try:
            with open(self.path_of(key), "rb") as f:
                return decode_header(f.read(header_length(f.read(8))))
        except (OSError, CorruptObject):
            return None

    def delete(self, key: str) -> bool:
        """Remove one object; whether there was one."""
        path = self.layout.path(key)
        counted: int | None = None
        unlinked = False
        try:
            with self.index.write() as index:
                counted = index.remove(key, self._name)
                index.stop_lingering(key)
                unlinked = unlink(path)
                TIER_USAGE.labels(TIER).set(index.on_disk())
        except sqlite3.Error as error:
            log.warning("disk tier: could not update the index for the removal of %s: %s", key, error)
            unlinked = unlink(path)  # its entry goes once found gone
            with self._lock:
                self._lost.add(key)
        if counted is not None or unlinked:
            self._report([key])
            return True
        return False

    def _forget(self, key: str) -> None:
        """An object whose file is already gone (another process evicted it, or a
        hand removed it): reported now, its entry dropped with the next sync."""
        with self._lock:
            self._lost.add(key)
        self._sync_now()
        self._report([key])

    def contains(self, key: str) -> bool:
        try:
            return self.index.has(key)
        except sqlite3.Error:
            return False

    def close(self) -> None:
        """Write what the reads learnt to the index and stop holding the digest in
        use (what is on disk stays readable through this tier). Nothing else is held
        open between calls: every write and read opens its file."""
        with contextlib.suppress(sqlite3.Error):
            with self.index.write() as index:
                removed = self._sync(index)
                # No load is planned from this tier any more.
                while (gone := index.oldest_lingering(self._name)) is not None:
                    if not index.has(gone[0]):
                        unlink(self.layout.path(gone[0]))
            self._report(removed)
        while self._held:
            os.close(self._held.pop())
        self.index.forget_tier(self._name)

    def touch(self, key: str) -> None:
        with contextlib.suppress(sqlite3.Error), self.index.write() as index:
            index.mark_used({key: time.time()})
        # Also the file's: a root whose index is lost is indexed again by mtime.
        with contextlib.suppress(OSError):
            now = time.time()
            os.utime(self.path_of(key), (now, now))


def _close_tier(index: RootIndex, held: list[int]) -> None:
    while held:
        os.close(held.pop())  # the digest's lock goes with it
    index.close()

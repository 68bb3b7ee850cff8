"""The disk tier: one safetensors file per object under a root directory on local
NVMe, written to a temporary name and renamed, so a process killed mid-write never
leaves a partial object under a real name. Capacity-bounded LRU, rebuilt from the
directory on start."""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import shutil
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from stat import S_IMODE

from tiercache.keys import split_key
from tiercache.metrics import TIER_CAPACITY, TIER_ERRORS, TIER_EVICTIONS, TIER_USAGE, timed
from tiercache.tiers import DISK
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

# With a pace set, a write looks at it this often (bytes): a 2 MiB block's write stops
# at most a quarter of the way past the start of a hold (tiercache/foreground.py).
PIECE_BYTES = 512 * 1024
# How much the files of objects evicted a moment ago may add to the capacity, as a
# share of it, before they are unlinked (oldest first): the scheduler plans a disk load from what
# the workers last reported, and an object evicted since (by a write running beside
# the step) must still serve the load planned from it (docs/reliability.md).
LINGER_SHARE = 32  # one 32nd

log = logging.getLogger(__name__)
TIER = DISK
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
# KV bytes can be inverted into the prompts that made them: objects, temp files and
# the folders that hold them are the owner's alone, whatever the process umask.
FILE_MODE = 0o600
DIR_MODE = 0o700
_DIGEST_DIR = re.compile(r"^[0-9a-f]{16}$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskLayout:
    """Where a disk tier root keeps what: the one place that knows the layout, for the
    tier itself and for everyone who reads the folder without owning it (the
    scheduler's scan at start, the service's stats and lookups, GC's flush, inspect).

        <root>/<rank digest>/<first 2 hex of the block>/<block hash hex>.safetensors
        <root>/<rank digest>/<xx>/.tmp-<pid>-<thread>-<block hash hex>.safetensors

    The two-hex fan-out keeps folders small; a temp file names the process writing
    it, so a restart can tell a dead writer's leftovers from a live one's."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._root = str(self.root)

    def path(self, key: str) -> str:
        """The file of `key`. A plain string: on the hot path pathlib costs more than
        the syscalls. ValueError for a key that is not `<hex digest>/<hex block>`, so
        no key can name a path outside the root."""
        digest, block = split_key(key)
        return f"{self._root}/{digest}/{block[:2]}/{block}{SUFFIX}"

    def holds(self, key: str) -> bool:
        """Whether `key`'s object is there (False for a malformed key)."""
        try:
            return os.path.isfile(self.path(key))
        except ValueError:
            return False

    def digest_dir(self, digest: str) -> Path:
        return self.root / digest

    @staticmethod
    def temp_path(path: str) -> str:
        """The name an object is written under before its rename to `path`: the
        writing process and thread, so concurrent writers of one key never share it."""
        folder, name = os.path.split(path)
        return f"{folder}/{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{name}"

    @staticmethod
    def temp_writer(name: str) -> int | None:
        """The pid that wrote temp file `name`, or None when the name does not say."""
        try:
            pid = int(name[len(TMP_PREFIX) :].split("-")[0])
        except ValueError:
            return None
        return pid if pid > 0 else None

    @staticmethod
    def block_of(name: str) -> str | None:
        """The block hash (hex) object file `name` holds; None for a temp file or
        anything else."""
        if name.startswith(TMP_PREFIX) or not name.endswith(SUFFIX):
            return None
        return name[: -len(SUFFIX)]

    def digests(self) -> list[str]:
        """The rank digests with a folder under the root (links are not followed)."""
        try:
            with os.scandir(self.root) as entries:
                return sorted(
                    e.name for e in entries if _DIGEST_DIR.match(e.name) and e.is_dir(follow_symlinks=False)
                )
        except OSError:
            return []

    def files(self, digest: str) -> Iterator[os.DirEntry]:
        """Every file in `digest`'s fan-out folders: objects, temp files and strays.
        A folder that cannot be read, or vanishes meanwhile, is passed over."""
        with contextlib.suppress(OSError), os.scandir(self.digest_dir(digest)) as shards:
            for shard in shards:
                if not shard.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError), os.scandir(shard.path) as entries:
                    yield from entries

    def objects(self, digest: str) -> Iterator[tuple[str, os.DirEntry]]:
        """(block hash hex, file) for each object of `digest`, temp files skipped."""
        for entry in self.files(digest):
            block = self.block_of(entry.name)
            if block is not None:
                yield block, entry

    def usage(self) -> dict[str, tuple[int, int]]:
        """Objects and bytes per rank digest under the root."""
        found: dict[str, tuple[int, int]] = {}
        for digest in self.digests():
            objects = size = 0
            for _, entry in self.objects(digest):
                with contextlib.suppress(OSError):
                    size += entry.stat(follow_symlinks=False).st_size
                    objects += 1
            found[digest] = (objects, size)
        return found

    def remove_digest(self, digest: str) -> int:
        """Delete every file of `digest`; the number of objects there were."""
        folder = self.digest_dir(digest)
        if not folder.is_dir():
            return 0
        count = sum(1 for _ in self.objects(digest))
        shutil.rmtree(folder, ignore_errors=True)
        return count


class DiskTier:
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
        """`digest`: the namespace digest whose objects this tier owns. Every TP rank
        of one node keeps its objects under its own digest in one root, each with its
        own share of the capacity: a tier that indexed its neighbours' files too would
        count them against its share and evict them. None indexes every digest (tools
        and tests that own the whole root). `integrity_key`: objects are served only
        if their MAC was made with it (see format.sign); None checks the plain checksum."""
        self.root = Path(root)
        self.digest = digest
        self.capacity = capacity
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self.integrity_key = integrity_key
        self._on_remove = on_remove
        self._lock = threading.Condition()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # LRU order, oldest first
        # Keys whose file is being renamed into place, or unlinked, right now (a count:
        # two writers, or two removers, of one key). A rename and an unlink of one key
        # never overlap, so a file counted is a file on disk, and one removed stays
        # removed: in either order a writer's file could be unlinked after it was
        # counted (a later miss), or a put could answer True for a file going away.
        self._renaming: Counter[str] = Counter()
        self._removing: Counter[str] = Counter()
        self._usage = 0
        self._writing = 0  # bytes of writes in flight: counted against capacity too
        # Evicted objects whose files are not unlinked yet, oldest first: no longer in
        # the tier (reported removed), but a read planned before the report still finds
        # them. At most `linger_bytes` of them, over the capacity.
        self._leaving: OrderedDict[str, int] = OrderedDict()
        self._leaving_bytes = 0
        self.linger_bytes = capacity // LINGER_SHARE
        # Called between the pieces of a write (PIECE_BYTES each): where the engine's
        # foreground gate stops a write under way while a forward loads hits.
        self.pace: Callable[[], None] | None = None
        _make_private_dirs(str(self.root))
        self.layout = DiskLayout(self.root)
        self._reindex()
        TIER_CAPACITY.labels(TIER).set(capacity)

    name = TIER

    # -- naming -------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        return Path(self.layout.path(key))

    # -- index --------------------------------------------------------------
    def _reindex(self) -> None:
        """Rebuild the LRU from the files present, oldest modification first, and
        clear temporary files left by processes that died mid-write."""
        found: list[tuple[float, str, int]] = []
        others = 0
        for digest in self.layout.digests():
            if self.digest is not None and digest != self.digest:
                others += 1  # another rank's (or model's) objects: theirs to count and evict
                continue
            _close_folders(self.layout.digest_dir(digest))
            for entry in self.layout.files(digest):
                if entry.name.startswith(TMP_PREFIX):
                    self._clear_stale_temp(entry)
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
                found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self._usage += size
        TIER_USAGE.labels(TIER).set(self._usage)
        if found:
            log.info("disk tier %s: re-indexed %d objects, %d bytes", self.root, len(found), self._usage)
        if others:
            # No tier counts or evicts a digest no running worker has: after an upgrade
            # or a model change its folder stays until someone removes it.
            log.info(
                "disk tier %s: %d other digest folders left to their owners (other TP ranks, models, "
                "or keys of an older tiercache); remove those no running engine uses",
                self.root,
                others,
            )
        self._evict_to(self.capacity)

    @staticmethod
    def _clear_stale_temp(entry: os.DirEntry) -> None:
        pid = DiskLayout.temp_writer(entry.name)
        if pid is not None and (pid == os.getpid() or _pid_alive(pid)):
            return
        with contextlib.suppress(OSError):
            os.unlink(entry.path)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def usage_bytes(self) -> int:
        return self._usage

    # -- operations ---------------------------------------------------------
    def put(self, key: str, data: memoryview, header: ObjectHeader) -> bool:
        """Write one object. False when it cannot be stored (full disk, no
        permission): a store is dropped, never an error for the caller."""
        path = self.layout.path(key)
        preamble = header.encode()
        size = len(preamble) + len(data)
        if size > self.capacity:
            return False
        with self._lock:
            self._lock.wait_for(lambda: not self._removing[key])
            if key in self._sizes:
                self._sizes.move_to_end(key)
                return True
            # Reserve the room first, so that concurrent writers cannot each evict
            # for themselves and together overshoot the capacity.
            self._writing += size
        try:
            return self._put_reserved(key, path, preamble, data, size)
        finally:
            with self._lock:
                self._writing -= size

    def _put_reserved(self, key: str, path: str, preamble: bytes, data: memoryview, size: int) -> bool:
        self._evict_to(self.capacity)
        folder = os.path.dirname(path)
        tmp = self.layout.temp_path(path)
        try:
            with timed(TIER, "put", len(data)):
                try:
                    self._write(tmp, preamble, data)
                except FileNotFoundError:  # the object's folder does not exist yet
                    _make_private_dirs(folder)
                    self._write(tmp, preamble, data)
                self._rename_and_count(key, tmp, path, size)
        except OSError as error:
            kind = "disk_full" if error.errno == errno.ENOSPC else "io"
            TIER_ERRORS.labels(TIER, kind).inc()
            log.warning("disk tier: dropped store of %s: %s", key, error)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        return True

    def _rename_and_count(self, key: str, tmp: str, path: str, size: int) -> None:
        """Put the written file in place and count it, never while it is being removed."""
        with self._lock:
            self._lock.wait_for(lambda: not self._removing[key])
            self._renaming[key] += 1
        renamed = False
        try:
            os.replace(tmp, path)
            renamed = True
        finally:
            with self._lock:
                _unmark(self._renaming, key)
                if renamed:
                    self._stop_leaving(key)  # the path holds the new file now
                    if key not in self._sizes:  # two writers of one key count it once
                        self._usage += size
                    self._sizes[key] = size
                    TIER_USAGE.labels(TIER).set(self._usage)
                self._lock.notify_all()

    def _write(self, tmp: str, preamble: bytes, data: memoryview) -> None:
        direct = self.o_direct and _aligned(data)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(tmp, flags, FILE_MODE)  # the umask can only narrow it
        try:
            if direct:
                # O_DIRECT needs aligned memory: copy the small preamble into an
                # anonymous (page-aligned) map; the pages go straight from the slot.
                # The map is freed with its last reference: closing it explicitly
                # would fail while a failed write's traceback still holds a view.
                aligned = mmap.mmap(-1, len(preamble))
                aligned.write(preamble)
                _write_all(fd, aligned, data, pace=self.pace)
            else:
                _write_all(fd, preamble, data, pace=self.pace)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

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
            if key in self._sizes:
                self._sizes.move_to_end(key)

    def _read_verified(self, fd: int, key: str, out: memoryview, expect: PageShape | None = None) -> None:
        """Fill `out` with the object's pages and check them against its header.

        For the layout this tier writes (a DATA_ALIGN preamble, then the pages) one
        read takes the preamble and the pages together, then one pass hashes them.
        Reading in small chunks, each hashed while still in cache, measured slower
        (docs/benchmarks-e2e.md, "A disk hit and an S3 hit, step by step"). Any other
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
        with self._lock:
            size = self._take(key)
        self._finish_removal(key, size)
        return size is not None

    def _forget(self, key: str) -> None:
        """Stop counting an object whose file is already gone."""
        with self._lock:
            self._stop_leaving(key)
            size = self._uncount(key)
        if size is not None and self._on_remove:
            self._on_remove(key)

    def _uncount(self, key: str) -> int | None:
        """(Under the lock.) Stop counting `key`: its size, or None if it was not counted."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self._usage -= size
            TIER_USAGE.labels(TIER).set(self._usage)
        return size

    def _take(self, key: str) -> int | None:
        """(Under the lock.) Stop counting `key` and mark its file as being removed,
        once no rename of it is under way: its size, or None if it was not counted."""
        self._lock.wait_for(lambda: not self._renaming[key])
        self._removing[key] += 1
        self._stop_leaving(key)
        return self._uncount(key)

    def _stop_leaving(self, key: str) -> None:
        """(Under the lock.) `key`'s lingering file is replaced or removed otherwise."""
        size = self._leaving.pop(key, None)
        if size is not None:
            self._leaving_bytes -= size

    def _finish_removal(self, key: str, size: int | None) -> None:
        try:
            if size is not None and self._on_remove:
                self._on_remove(key)
            with contextlib.suppress(OSError):
                os.unlink(self.layout.path(key))
        finally:
            with self._lock:
                _unmark(self._removing, key)
                self._lock.notify_all()

    def _evict_to(self, budget: int) -> None:
        """Evict the least recently used objects until those held and those being
        written fit `budget`. An evicted object is reported removed at once, but its
        file lingers (still readable) while the lingering files fit `linger_bytes`:
        past that the oldest of them are unlinked."""
        while True:
            with self._lock:
                if self._usage + self._writing <= budget or not self._sizes:
                    break
                # Picked and taken in one hold of the lock: a put of the victim that
                # comes after sees it gone and writes it again, rather than answering
                # True for a file about to go.
                victim = next(iter(self._sizes))
                size = self._take(victim)
            if size is not None:
                TIER_EVICTIONS.labels(TIER).inc()
                self._retire(victim, size)
            else:
                self._finish_removal(victim, size)
        self._unlink_lingering()

    def _unlink_lingering(self) -> None:
        while True:
            with self._lock:
                if self._leaving_bytes <= self.linger_bytes or not self._leaving:
                    return
                gone, gone_size = self._leaving.popitem(last=False)
                self._leaving_bytes -= gone_size
                while self._renaming[gone]:
                    self._lock.wait()
                if gone in self._sizes:  # written again meanwhile: the file is the new one
                    continue
                self._removing[gone] += 1
            self._finish_removal(gone, None)

    def _retire(self, key: str, size: int) -> None:
        """An evicted object: reported removed, its file left to linger."""
        try:
            if self._on_remove:
                self._on_remove(key)
        finally:
            with self._lock:
                _unmark(self._removing, key)
                self._leaving[key] = size
                self._leaving_bytes += size
                self._lock.notify_all()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes

    def close(self) -> None:
        """Nothing is held open between calls: every write and read opens its file."""

    def touch(self, key: str) -> None:
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
        # Persist recency across restarts, which re-index by mtime.
        with contextlib.suppress(OSError):
            now = time.time()
            os.utime(self.path_of(key), (now, now))


class DiskPages:
    """One object open for reading, its header checked: the pages are read piece by
    piece at offsets into them. The file stays readable while open, even if the tier
    evicts it meanwhile (the unlink frees it at the close)."""

    def __init__(self, key: str, fd: int, header: ObjectHeader, offset: int):
        self.key = key
        self.header = header
        self._fd = fd
        self._offset = offset  # of the pages in the file

    def read(self, at: int, views: list[memoryview]) -> None:
        """Fill `views`, in order, from the pages' byte `at` on; CorruptObject where
        the file ends first."""
        views = [view for view in views if len(view)]
        while views:
            got = os.preadv(self._fd, views, self._offset + at)
            if got == 0:
                raise CorruptObject(f"object {self.key} truncated before byte {at} of its pages")
            at += got
            while views and got >= len(views[0]):
                got -= len(views[0])
                views.pop(0)
            if got:
                views[0] = views[0][got:]

    def close(self) -> None:
        os.close(self._fd)


def _unmark(marks: Counter[str], key: str) -> None:
    """One rename or removal of `key` is over; a count of none is dropped."""
    marks[key] -= 1
    if not marks[key]:
        del marks[key]


def _make_private_dirs(path: str) -> None:
    """os.makedirs(path, exist_ok=True), with each folder it makes DIR_MODE exactly:
    mkdir's mode passes through the umask, so it is set again once made."""
    missing = []
    while path and not os.path.isdir(path):  # "": the top of a relative path
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:
            continue  # made a moment ago by another writer, which makes it private too
        os.chmod(folder, DIR_MODE)


def _close_folders(digest_dir: Path) -> None:
    """Make a digest's folder and its fan-out folders DIR_MODE (a tiercache before
    this one made them with the umask's mode)."""
    for folder in (digest_dir, *digest_dir.iterdir()):
        with contextlib.suppress(OSError):
            if folder.is_dir() and S_IMODE(folder.stat().st_mode) != DIR_MODE:
                folder.chmod(DIR_MODE)


def _aligned(data: memoryview) -> bool:
    if len(data) % DATA_ALIGN:
        return False
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(data)) if not data.readonly else 1
    return address % DATA_ALIGN == 0


def _write_all(
    fd: int, *parts: bytes | memoryview | mmap.mmap, pace: Callable[[], None] | None = None
) -> None:
    """Write `parts` in order with as few system calls as the kernel allows; with
    `pace`, in pieces of at most PIECE_BYTES, calling it before each piece."""
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    while views:
        if pace is not None:
            pace()
            written = os.writev(fd, _first_bytes(views, PIECE_BYTES))
        else:
            written = os.writev(fd, views)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def _first_bytes(views: list[memoryview], limit: int) -> list[memoryview]:
    """The leading `limit` bytes of `views`, as views (a multiple of the page size keeps
    O_DIRECT writes aligned)."""
    out, left = [], limit
    for view in views:
        if left <= 0:
            break
        out.append(view[:left])
        left -= len(out[-1])
    return out

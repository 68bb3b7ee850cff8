"""Where a disk tier root keeps what, and the file-system steps every reader and
writer of a root shares: its folders' modes, a dead writer's temporary files, a
root's first check."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from stat import S_IMODE

from tiercache.index.keys import split_key
from tiercache.tiers.disk.index import RootIndex, index_exists

SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
# KV bytes can be inverted into the prompts that made them: objects, temp files and
# the folders that hold them are the owner's alone, whatever the process umask.
FILE_MODE = 0o600
DIR_MODE = 0o700
_DIGEST_DIR = re.compile(r"^[0-9a-f]{16}$")


class DiskLayout:
    """Where a disk tier root keeps what: the one place that knows the layout, for the
    tier itself and for everyone who reads the folder without owning it (the
    scheduler's scan at start, the service's stats and lookups, GC's flush, inspect).

        <root>/<rank digest>/<first 2 hex of the block>/<block hash hex>.safetensors
        <root>/<rank digest>/<xx>/.tmp-<pid>-<random>-<block hash hex>.safetensors
        <root>/.tiercache/                 the root's index (tiers/disk/index.py)

    The two-hex fan-out keeps folders small. A temp file's name is unique (the pid
    is there for people reading the folder); its writer holds a lock on it until
    the rename, which is how a dead writer's leftovers are told from a live one's."""

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
        """The name an object is written under before its rename to `path`, never
        shared by two writers (of one process, or of containers whose pids collide)."""
        folder, name = os.path.split(path)
        return f"{folder}/{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}-{name}"

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
        """Delete every file of `digest`, and its entries in the root's index; the
        number of objects there were."""
        folder = self.digest_dir(digest)
        if not folder.is_dir():
            return 0
        count = sum(1 for _ in self.objects(digest))
        if not index_exists(self.root):
            shutil.rmtree(folder, ignore_errors=True)
            return count
        index = RootIndex(self.root)
        try:
            with index.write():  # the tiers on the root see it whole, or not yet
                index.remove_digest(digest, "flush")
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            index.close()
        return count


def unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def clear_stale_temp(path: str) -> bool:
    """Remove temporary file `path` if no live writer holds it, in this process, another,
    or another container: a writer holds an exclusive flock on its temporary file
    from its creation to its rename, and the kernel drops the lock with the process,
    however it dies (a pid in the name means nothing in another pid namespace).
    Whether it was removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live writer's
    else:
        return unlink(path)
    finally:
        os.close(fd)


def prepare_root(root: str | Path) -> None:
    """Make the tier's root folder if it is missing and check that a file can be
    written in it: OSError if not, at start rather than at every store."""
    make_private_dirs(str(root))
    probe = os.path.join(str(root), f"{TMP_PREFIX}{os.getpid()}-probe")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"tiercache")
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)


def disk_root_problem(root: str | Path) -> str | None:
    """Why a disk tier cannot use `root` (made if missing), or None when it can."""
    try:
        prepare_root(root)
    except OSError as error:
        return f"disk.path {str(root)!r} cannot be used ({error.strerror or error})"
    return None


def make_private_dirs(path: str) -> None:
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


def close_folders(digest_dir: Path) -> None:
    """Make a digest's folder and its fan-out folders DIR_MODE (a tiercache before
    this one made them with the umask's mode)."""
    for folder in (digest_dir, *digest_dir.iterdir()):
        with contextlib.suppress(OSError):
            if folder.is_dir() and S_IMODE(folder.stat().st_mode) != DIR_MODE:
                folder.chmod(DIR_MODE)

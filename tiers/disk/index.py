"""One budget per disk root, shared by every process on the node that uses the root:
which objects it holds, their sizes and when each was last used, in an SQLite
database inside the root (WAL mode: readers never wait for a writer).

Every change to the root's objects (a rename into place, an eviction's unlink, a
removal) happens inside one write transaction of this database, and SQLite lets one
writer in at a time across processes: that is what keeps two processes from racing
on one path (data-parallel engines of one model share their keys) and what makes the
budget one budget, however many engines fill it.

    <root>/.tiercache/index.sqlite3     the index (and its -wal and -shm files)
    <root>/.tiercache/users/<digest>    a lock file per digest: every tier using the
                                        digest holds a shared flock on it while it runs
    <root>/.tiercache/tiers/<name>      a lock file per running tier, held exclusively:
                                        what it left half done is swept once it is free

Besides the objects, the index counts the two kinds of file that are on disk but
not objects: files evicted a moment ago that still linger for loads planned before
(one allowance for the root, whoever evicted them) and writes under way (from the
first byte of the temporary file to the commit that counts the object). Both rows
outlive a writer killed with `kill -9`: whoever next sweeps the root finds its tier
lock free and removes what it left.

A digest whose lock no one holds is unused (new weights, another TP size, keys of an
older tiercache): its objects are evicted before anyone's, and its folder removed once
empty. flock is held by an open file, not a pid, so it answers across containers
(pid namespaces) on one kernel, and goes with the process, however it dies."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

INDEX_DIR = ".tiercache"
INDEX_FILE = "index.sqlite3"
USERS_DIR = "users"
# How long a write waits for another process's transaction before giving up (the
# store is dropped): a store never waits long on the disk's bookkeeping.
BUSY_SECONDS = 5.0
# Removals kept in the log for tiers of other processes to read (see `removed_since`).
REMOVALS_KEPT = 100_000
FILE_MODE = 0o600
DIR_MODE = 0o700
_SCHEMA_VERSION = 2
TIERS_DIR = "tiers"

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS objects (
        key TEXT PRIMARY KEY, digest TEXT NOT NULL, size INTEGER NOT NULL, used REAL NOT NULL
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS objects_by_use ON objects (used)",
    "CREATE INDEX IF NOT EXISTS objects_by_digest ON objects (digest, used)",
    # Objects and bytes per digest, kept by triggers: the budget's total is a sum over
    # a few rows, never over every object.
    """CREATE TABLE IF NOT EXISTS digests (
        digest TEXT PRIMARY KEY, objects INTEGER NOT NULL, bytes INTEGER NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TRIGGER IF NOT EXISTS objects_in AFTER INSERT ON objects BEGIN
        INSERT OR IGNORE INTO digests VALUES (NEW.digest, 0, 0);
        UPDATE digests SET objects = objects + 1, bytes = bytes + NEW.size WHERE digest = NEW.digest;
    END""",
    """CREATE TRIGGER IF NOT EXISTS objects_out AFTER DELETE ON objects BEGIN
        UPDATE digests SET objects = objects - 1, bytes = bytes - OLD.size WHERE digest = OLD.digest;
    END""",
    # Removals, read by the tiers of other processes that index the same digest, so
    # that their schedulers stop counting a block another process evicted.
    """CREATE TABLE IF NOT EXISTS removals (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, digest TEXT NOT NULL, remover TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS removals_by_digest ON removals (digest, seq)",
    # Files of evicted objects not unlinked yet, oldest first (their bytes in `totals`).
    """CREATE TABLE IF NOT EXISTS lingering (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL UNIQUE, digest TEXT NOT NULL,
        size INTEGER NOT NULL, evictor TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS totals (name TEXT PRIMARY KEY, bytes INTEGER NOT NULL) WITHOUT ROWID""",
    "INSERT OR IGNORE INTO totals VALUES ('lingering', 0)",
    """CREATE TRIGGER IF NOT EXISTS lingering_in AFTER INSERT ON lingering BEGIN
        UPDATE totals SET bytes = bytes + NEW.size WHERE name = 'lingering';
    END""",
    """CREATE TRIGGER IF NOT EXISTS lingering_out AFTER DELETE ON lingering BEGIN
        UPDATE totals SET bytes = bytes - OLD.size WHERE name = 'lingering';
    END""",
    # Writes under way: a temporary file, the object it becomes, and the tier writing it.
    """CREATE TABLE IF NOT EXISTS writes (
        tmp TEXT PRIMARY KEY, key TEXT NOT NULL, size INTEGER NOT NULL, writer TEXT NOT NULL
    ) WITHOUT ROWID""",
)


class RootIndex:
    """A process's connection to a root's index. Thread-safe: one transaction at a
    time per connection (a lock), one writer at a time across connections (SQLite)."""

    def __init__(self, root: Path):
        self.root = root
        self.folder = root / INDEX_DIR
        self.users = self.folder / USERS_DIR
        self.tiers = self.folder / TIERS_DIR
        for folder in (self.folder, self.users, self.tiers):
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, DIR_MODE)
            os.chmod(folder, DIR_MODE)
        path = self.folder / INDEX_FILE
        # Made 0600 before SQLite opens it: its -wal and -shm files take its mode.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE))
        # Reentrant: the reads below are also made inside write().
        self._lock = threading.RLock()
        self._db = sqlite3.connect(path, timeout=BUSY_SECONDS, isolation_level=None, check_same_thread=False)
        self._enter_wal()
        # In WAL mode a commit after a power loss may be lost, never half-applied: the
        # start-up scan puts back what the files say.
        self._db.execute("PRAGMA synchronous = NORMAL")
        with self.write():
            if self._db.execute("PRAGMA user_version").fetchone()[0] < _SCHEMA_VERSION:
                for statement in _SCHEMA:
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")

    def _enter_wal(self) -> None:
        """Switch the index to WAL. SQLite refuses the switch at once, without its
        busy timeout, while another connection holds the write lock (another engine
        starting on the root, creating the schema): tried again until BUSY_SECONDS."""
        deadline = time.monotonic() + BUSY_SECONDS
        while True:
            try:
                self._db.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    @contextlib.contextmanager
    def write(self, wait: bool = True) -> Iterator[RootIndex]:
        """A write transaction: committed when the block ends, rolled back if it
        raises. With `wait` False, sqlite3.OperationalError at once rather than wait
        for another thread or process."""
        if not self._lock.acquire(blocking=wait):
            raise sqlite3.OperationalError("index busy in this process")
        try:
            if not wait:
                self._db.execute("PRAGMA busy_timeout = 0")
            try:
                self._db.execute("BEGIN IMMEDIATE")
            finally:
                if not wait:
                    self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_SECONDS * 1000)}")
            try:
                yield self
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
        finally:
            self._lock.release()

    def _read(self, sql: str, *args) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- reads (any time) ---------------------------------------------------------
    def has(self, key: str) -> bool:
        return bool(self._read("SELECT 1 FROM objects WHERE key = ?", key))

    def total(self) -> int:
        """Bytes of every object under the root and of the writes under way: what the
        capacity bounds."""
        return int(
            self._read(
                "SELECT (SELECT coalesce(sum(bytes), 0) FROM digests)"
                " + (SELECT coalesce(sum(size), 0) FROM writes)"
            )[0][0]
        )

    def lingering_bytes(self) -> int:
        """Bytes of the evicted files not unlinked yet, whoever evicted them."""
        return int(self._read("SELECT coalesce(sum(bytes), 0) FROM totals WHERE name = 'lingering'")[0][0])

    def on_disk(self) -> int:
        """Every byte the index knows is on disk: objects, writes, lingering files."""
        return self.total() + self.lingering_bytes()

    def usage(self, digest: str | None) -> tuple[int, int]:
        """(objects, bytes) of `digest`, or of the whole root for None."""
        if digest is None:
            row = self._read("SELECT coalesce(sum(objects), 0), coalesce(sum(bytes), 0) FROM digests")
        else:
            row = self._read("SELECT objects, bytes FROM digests WHERE digest = ?", digest)
        return (int(row[0][0]), int(row[0][1])) if row else (0, 0)

    def keys(self, digest: str | None) -> list[str]:
        """The keys of `digest` (every key for None), least recently used first."""
        if digest is None:
            rows = self._read("SELECT key FROM objects ORDER BY used, key")
        else:
            rows = self._read("SELECT key FROM objects WHERE digest = ? ORDER BY used, key", digest)
        return [key for (key,) in rows]

    # -- inside write() ---------------------------------------------------------
    def add(self, key: str, digest: str, size: int, used: float) -> None:
        self._db.execute(
            "INSERT INTO objects VALUES (?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET used = excluded.used",
            (key, digest, size, used),
        )

    def remove(self, key: str, remover: str) -> int | None:
        """Stop counting `key` and log it for the other tiers of its digest: its
        size, or None if it was not counted."""
        row = self._db.execute("DELETE FROM objects WHERE key = ? RETURNING digest, size", (key,)).fetchone()
        if row is None:
            return None
        self._db.execute(
            "INSERT INTO removals (key, digest, remover) VALUES (?, ?, ?)", (key, row[0], remover)
        )
        return int(row[1])

    def mark_used(self, used: dict[str, float]) -> None:
        self._db.executemany(
            "UPDATE objects SET used = max(used, ?) WHERE key = ?", [(t, key) for key, t in used.items()]
        )

    def oldest(self, limit: int, digests: list[str] | None = None) -> list[tuple[str, str, int]]:
        """Up to `limit` (key, digest, size), least recently used first: among
        `digests` only, when given."""
        if digests is None:
            rows = self._db.execute(
                "SELECT key, digest, size FROM objects ORDER BY used LIMIT ?", (limit,)
            ).fetchall()
        else:
            marks = ",".join("?" * len(digests))
            rows = self._db.execute(
                f"SELECT key, digest, size FROM objects WHERE digest IN ({marks}) ORDER BY used LIMIT ?",
                (*digests, limit),
            ).fetchall()
        return [(key, digest, int(size)) for key, digest, size in rows]

    def digests(self) -> dict[str, int]:
        """Objects per digest the index knows (some may have none left)."""
        return {d: int(n) for d, n in self._db.execute("SELECT digest, objects FROM digests")}

    def drop_digest(self, digest: str) -> None:
        """Forget a digest whose folder was removed (its objects must be gone)."""
        self._db.execute("DELETE FROM digests WHERE digest = ? AND objects <= 0", (digest,))

    def all_keys(self) -> set[str]:
        return {key for (key,) in self._db.execute("SELECT key FROM objects")}

    def remove_digest(self, digest: str, remover: str) -> None:
        """Stop counting every object of `digest` (its folder is being removed)."""
        self._db.execute(
            "INSERT INTO removals (key, digest, remover) SELECT key, digest, ? FROM objects WHERE digest = ?",
            (remover, digest),
        )
        self._db.execute("DELETE FROM objects WHERE digest = ?", (digest,))
        self.forget_lingering(digest)

    def removed_since(self, seq: int, digest: str | None, remover: str) -> tuple[int, list[str]]:
        """Keys of `digest` (of any, for None) removed after log entry `seq` by anyone
        but `remover` and not stored again since, and the log's last entry."""
        last = self._db.execute("SELECT coalesce(max(seq), 0) FROM removals").fetchone()[0]
        gone = "seq > ? AND remover != ? AND key NOT IN (SELECT key FROM objects)"
        if digest is None:
            rows = self._db.execute(
                f"SELECT DISTINCT key FROM removals WHERE {gone}", (seq, remover)
            ).fetchall()
        else:
            rows = self._db.execute(
                f"SELECT DISTINCT key FROM removals WHERE digest = ? AND {gone}", (digest, seq, remover)
            ).fetchall()
        self._db.execute("DELETE FROM removals WHERE seq <= ?", (last - REMOVALS_KEPT,))
        return int(last), [key for (key,) in rows]

    def last_removal(self) -> int:
        return int(self._read("SELECT coalesce(max(seq), 0) FROM removals")[0][0])

    # -- lingering files (inside write()) -------------------------------------------
    def linger(self, key: str, digest: str, size: int, evictor: str) -> None:
        """`key` was evicted but its file stays, for now."""
        self._db.execute(
            "INSERT OR REPLACE INTO lingering (key, digest, size, evictor) VALUES (?, ?, ?, ?)",
            (key, digest, size, evictor),
        )

    def stop_lingering(self, key: str) -> None:
        """`key`'s file is replaced or removed otherwise."""
        self._db.execute("DELETE FROM lingering WHERE key = ?", (key,))

    def oldest_lingering(self, evictor: str | None = None) -> tuple[str, int] | None:
        """The longest lingering file (of `evictor`'s evictions, given one), forgotten:
        (key, size), or None when there is none."""
        if evictor is None:
            row = self._db.execute(
                "DELETE FROM lingering WHERE seq = (SELECT min(seq) FROM lingering) RETURNING key, size"
            ).fetchone()
        else:
            row = self._db.execute(
                "DELETE FROM lingering WHERE seq = (SELECT min(seq) FROM lingering WHERE evictor = ?)"
                " RETURNING key, size",
                (evictor,),
            ).fetchone()
        return (row[0], int(row[1])) if row else None

    def is_lingering(self, key: str) -> bool:
        return bool(self._db.execute("SELECT 1 FROM lingering WHERE key = ?", (key,)).fetchone())

    def lingering_keys(self) -> list[str]:
        return [key for (key,) in self._db.execute("SELECT key FROM lingering")]

    def forget_lingering(self, digest: str) -> None:
        """(Its folder is being removed.)"""
        self._db.execute("DELETE FROM lingering WHERE digest = ?", (digest,))

    # -- writes under way (inside write()) ------------------------------------------
    def start_write(self, tmp: str, key: str, size: int, writer: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO writes VALUES (?, ?, ?, ?)", (tmp, key, size, writer))

    def end_write(self, tmp: str) -> None:
        self._db.execute("DELETE FROM writes WHERE tmp = ?", (tmp,))

    def writers(self) -> list[str]:
        """The tiers with writes under way, or lingering files they evicted."""
        return [
            name
            for (name,) in self._db.execute(
                "SELECT writer FROM writes UNION SELECT evictor FROM lingering"
            ).fetchall()
        ]

    def writes_of(self, writer: str) -> list[tuple[str, str]]:
        """(temporary path, key) of each write under way by `writer`."""
        return [
            (tmp, key)
            for tmp, key in self._db.execute("SELECT tmp, key FROM writes WHERE writer = ?", (writer,))
        ]

    # -- running tiers ------------------------------------------------------------
    def hold_tier(self, name: str) -> int:
        """Say tier `name` runs as long as the returned descriptor stays open."""
        fd = os.open(self.tiers / name, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def tier_alive(self, name: str) -> bool:
        """Whether tier `name` runs, in any process or container on this kernel."""
        try:
            fd = os.open(self.tiers / name, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        finally:
            os.close(fd)
        return False

    def tier_names(self) -> list[str]:
        """The names with a tier lock file (running tiers, and dead ones not swept)."""
        try:
            return sorted(os.listdir(self.tiers))
        except OSError:
            return []

    def forget_tier(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tiers / name)

    # -- digests in use -----------------------------------------------------------
    def hold_digest(self, digest: str) -> int:
        """Say `digest` is in use as long as the returned descriptor stays open.
        Called inside write(), as reclaiming a folder is: never between one's check
        and its removal."""
        fd = os.open(self.users / digest, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def in_use(self, digest: str) -> bool:
        """Whether a live tier, in any process or container on this kernel, holds
        `digest` (its shared lock would refuse this exclusive one)."""
        try:
            fd = os.open(self.users / digest, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        finally:
            os.close(fd)  # the exclusive lock, if taken, goes with it
        return False

    def forget_user(self, digest: str) -> None:
        """Remove an unused digest's lock file (inside write(), after in_use said no)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.users / digest)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def index_exists(root: Path) -> bool:
    return (root / INDEX_DIR / INDEX_FILE).is_file()

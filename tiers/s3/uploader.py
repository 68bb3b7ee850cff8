"""S3 write-through from a process of its own.

In a vLLM worker every Python thread shares one interpreter lock with the forward
pass, and PyTorch gives that lock up and takes it back around every operator. An
upload holds it for long stretches (botocore builds, signs and parses each request in
Python), so the forward waits behind it many times per step; the same uploads from
a process of their own slow it far less (a benchmark since removed measured
both; docs/benchmarks-e2e.md, "Store-path overhead", has the figures). The worker's
CPU tier therefore lives in shared memory (a memory file whose descriptor this
process is handed), and this process reads the blocks to upload straight from it:
what crosses the socket between the two is a slot number, a block hash and its
header, not the pages. A block that has left its slot (it waits
for the rest of its S3 run, or is a write-back's victim) crosses as a copy, in a
frame of its own after its run's description.

It follows the worker's foreground gate (foreground.py) through a shared page: while
a forward that loads hits runs, an upload stops between the reads of its body.

If the process dies, the uploads in flight and those asked for before it is back
report "not stored" (a later read is a miss, never an error); it is started again
on the next upload after RESTART_PAUSE seconds.

    python -m tiercache.tiers.s3.uploader FD    (started by UploadProcess, never by hand)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from tiercache.config import TierCacheConfig
from tiercache.threads import run_at, run_on
from tiercache.tiers.format import ObjectHeader

log = logging.getLogger(__name__)

# Seconds between attempts to start the process again after it died.
RESTART_PAUSE = 5.0
# How vLLM's CPU backend pins a worker's OpenMP threads to the model's cores. It also
# preloads libgomp, which reads these when any process starts: a child that inherited
# them would bind itself to the model's first core, undoing where it was placed (seen
# inside vLLM: every upload thread was allowed on the model's core only).
OPENMP_BINDING_ENV = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND")
# One block of a run to upload: its hash, its CPU slot (or None), a copy of its pages
# when it has no slot, and its signed header.
RunItem = tuple[bytes, int | None, bytes | None, ObjectHeader]
# The worker signs each object's header before sending it here, so this process never
# needs the integrity key: it gets it neither in its environment nor in its setup.
SECRET_ENV = ("TIERCACHE_INTEGRITY_KEY",)


def child_env() -> dict[str, str]:
    """This process's environment without the OpenMP thread binding or secrets."""
    return {k: v for k, v in os.environ.items() if k not in OPENMP_BINDING_ENV + SECRET_ENV}


@dataclass(frozen=True)
class UploadSetup:
    """What the process needs, sent as the first message."""

    config: TierCacheConfig
    model_digest: str
    rank_digest: str
    # The CPU tier's memory file (tiers/cpu.py), passed as this descriptor: read-only here.
    shm_fd: int
    slot_bytes: int
    num_slots: int
    cpus: frozenset[int]  # where to run: the cores the model does not use (none: anywhere)
    nice: int  # the priority to run at: below the worker's
    # The worker's foreground gate (foreground.GateFlag), passed as this descriptor:
    # uploads stop between reads of their body while a forward loads hits. None: never.
    gate_fd: int | None = None


class UploadProcess:
    """The worker's side: `upload` blocks the calling mover thread (not holding the
    interpreter lock) until the process answers."""

    def __init__(self, setup: UploadSetup):
        self.setup = replace(setup, config=setup.config.model_copy(update={"integrity_key": None}))
        s3 = setup.config.s3
        assert s3 is not None  # the upload process is the S3 tier's
        # Longest an answer can take: the wait for another writer's lease, then a
        # PUT with every retry.
        self.answer_timeout = (
            setup.config.redis.write_lease_ttl + (s3.connect_timeout + s3.read_timeout) * s3.max_attempts + 5
        )
        self._lock = threading.Lock()
        # A run's description and its copies' frames go out together: one sender at a time.
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._conn: Connection | None = None
        self._process: subprocess.Popen | None = None
        self._next_start = 0.0
        self._closed = False
        # Called before each copy's pages go over the socket (the engine's foreground
        # gate); the send lock is held meanwhile, as the frames of a run must not mix.
        self.pace: Callable[[], None] | None = None
        with self._lock:
            self._start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _start(self) -> bool:
        """Start the process (the lock is held). False if that failed."""
        self._next_start = time.monotonic() + RESTART_PAUSE
        ours, theirs = socket.socketpair()
        gate = () if self.setup.gate_fd is None else (self.setup.gate_fd,)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "tiercache.tiers.s3.uploader", str(theirs.fileno())],
                pass_fds=(theirs.fileno(), self.setup.shm_fd, *gate),
                env=child_env(),
            )
        except OSError as error:
            log.warning("tiercache: could not start the upload process: %s", error)
            ours.close()
            return False
        finally:
            theirs.close()
        # Placed now, before its imports, not once it is running: those alone would
        # otherwise take a second of the model's core.
        run_on(process.pid, self.setup.cpus, self.setup.nice)
        conn = Connection(ours.detach())
        try:
            conn.send(self.setup)
        except OSError:
            conn.close()
            return False
        self._conn, self._process = conn, process
        threading.Thread(
            target=self._read_answers, args=(conn, process), name="tiercache-upload-answers", daemon=True
        ).start()
        return True

    def _read_answers(self, conn: Connection, process: subprocess.Popen) -> None:
        while True:
            try:
                _, op_id, stored = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(op_id, None)
            if future is not None:
                future.set_result(stored)
        with self._lock:
            if self._conn is conn:
                self._conn = None
            lost, self._pending = self._pending, {}
        conn.close()
        code = process.wait()
        for future in lost.values():
            future.set_result(False)
        if not self._closed:
            log.warning(
                "tiercache: the upload process exited (code %s); %d uploads in flight are dropped, "
                "and it restarts on the next upload",
                code,
                len(lost),
            )

    def upload(self, block_hash: bytes, slot: int | None, data: bytes | None, header: ObjectHeader) -> bool:
        """Upload one block as a run of its own (see upload_run)."""
        return self.upload_run([(block_hash, slot, data, header)])[0]

    def upload_run(self, blocks: list[RunItem]) -> list[bool]:
        """Upload the blocks (each in CPU slot `slot`, or `data`, a copy of one) to S3
        as one run and index them. Per block, False when it was not stored, whatever
        the reason."""
        nothing = [False] * len(blocks)
        future: Future = Future()
        with self._lock:
            if self._closed:
                return nothing
            if self._conn is None and (time.monotonic() < self._next_start or not self._start()):
                return nothing
            op_id = next(self._ids)
            self._pending[op_id] = future
            conn, process = self._conn, self._process
            assert conn is not None and process is not None  # set together by _start
        try:
            # Apart from the state's lock: a send that steps aside for a forward must
            # not keep the answers (and the slots they free) waiting.
            with self._send_lock:
                self._send_run(conn, op_id, blocks)
        except OSError:  # the process is gone (or going): its answers say "not stored"
            with self._lock:
                self._pending.pop(op_id, None)
            return nothing
        try:
            answer = future.result(timeout=self.answer_timeout)
            return list(answer) if isinstance(answer, list) else nothing
        except TimeoutError:
            with self._lock:
                self._pending.pop(op_id, None)
            log.warning(
                "tiercache: no answer from the upload process in %.0fs; it is stopped and restarts "
                "on a later upload",
                self.answer_timeout,
            )
            # The caller reuses the slot once this returns, and the process may still be
            # reading it: it goes for good first (its other uploads report "not stored").
            process.kill()
            process.wait()
            return nothing

    def _send_run(self, conn: Connection, op_id: int, blocks: list[RunItem]) -> None:
        """The run's description, then each copy's pages as a frame of their own, sent
        from the copy: pickled into the message they were copied once more, with the
        interpreter lock held (up to `s3.pack_bytes`, 16 MiB by default), and could not
        step aside for a forward that loads hits (`pace`, between frames)."""
        described = [(h, slot, data is not None, header) for h, slot, data, header in blocks]
        conn.send(("put_run", op_id, described))
        for _, _, data, _ in blocks:
            if data is not None:
                if self.pace is not None:
                    self.pace()
                conn.send_bytes(data)

    def close(self, timeout: float = 10.0) -> None:
        """Let the process finish what it was sent, then stop it."""
        with self._lock:
            self._closed = True
            conn, process = self._conn, self._process
        if conn is not None:
            with self._send_lock, contextlib.suppress(OSError):
                conn.send(("stop",))
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# -- the process --------------------------------------------------------------------


def _open_slots(setup: UploadSetup) -> memoryview:
    """The worker's CPU tier, read-only: the memory file is opened again read-only and
    the descriptor handed down (open for writing too) is closed."""
    fd = os.open(f"/proc/self/fd/{setup.shm_fd}", os.O_RDONLY)
    os.close(setup.shm_fd)
    try:
        return memoryview(mmap.mmap(fd, setup.slot_bytes * setup.num_slots, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def serve(conn: Connection) -> None:
    from tiercache.foreground import GateFollower
    from tiercache.index.leases import Leases
    from tiercache.index.redis_conn import GuardedRedis
    from tiercache.tiers.s3.tier import S3Tier
    from tiercache.tiers.s3.writer import S3Writer

    setup: UploadSetup = conn.recv()
    # Placed again from inside, before any thread starts: a library loaded at start-up
    # may have bound this process elsewhere since the worker placed it.
    run_at(setup.cpus, setup.nice)
    config = setup.config
    slots = _open_slots(setup)
    assert config.redis_url is not None and config.s3 is not None  # the worker's, which uploads to S3
    redis = GuardedRedis(config.redis_url, config.redis)
    s3 = S3Tier(config.s3)
    if setup.gate_fd is not None:
        s3.pace = GateFollower(setup.gate_fd).wait
    writer = S3Writer(
        s3,
        Leases(redis, config.redis.write_lease_ttl, config.redis.read_lease_ttl),
        setup.model_digest,
        setup.rank_digest,
        config.redis.write_lease_ttl,
    )
    send_lock = threading.Lock()

    def put_run(op_id: int, blocks: list[RunItem]) -> None:
        try:
            run = []
            for block_hash, slot, data, header in blocks:
                if data is not None:
                    view = memoryview(data)
                else:
                    assert slot is not None  # data is given when there is no slot
                    view = slots[slot * setup.slot_bytes : (slot + 1) * setup.slot_bytes]
                run.append((block_hash, view, header))
            stored = writer.upload_run(run)
        except Exception:  # an answer must go back whatever a tier throws
            log.exception("upload of a run of %d blocks failed", len(blocks))
            stored = [False] * len(blocks)
        with send_lock, contextlib.suppress(OSError):  # OSError: the worker is gone
            conn.send(("done", op_id, stored))

    with ThreadPoolExecutor(config.movers.workers, thread_name_prefix="tiercache-upload") as pool:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the worker is gone: nothing to answer to
            if message[0] == "stop":
                break
            _, op_id, described = message
            try:
                # The copies' pages follow the description, one frame each, in order.
                blocks = [
                    (h, slot, conn.recv_bytes() if has_copy else None, header)
                    for h, slot, has_copy, header in described
                ]
            except (EOFError, OSError):
                break
            pool.submit(put_run, op_id, blocks)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="tiercache-uploader %(levelname)s %(message)s")
    serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()

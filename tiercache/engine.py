"""The tier engine: what one worker (one TP rank) does with blocks once they are in
its CPU buffer. It writes them down to disk and S3 on background movers (bounded,
dropping under backpressure rather than blocking the caller), and stages them back
up from disk or S3 into CPU slots.

It decides nothing about which slot holds which block: the connector's scheduler
does (connector/scheduler.py; connector/driver.py runs both halves without vLLM)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.config import TierCacheConfig
from tiercache.index.leases import Leases
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import Deployment, RedisIndex
from tiercache.metrics import MOVER_DROPPED, MOVER_QUEUE
from tiercache.object_shape import ObjectShape
from tiercache.tiers import DISK, S3
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.disk.file_io import DiskPages
from tiercache.tiers.disk.tier import DiskTier
from tiercache.tiers.format import ObjectHeader
from tiercache.tiers.s3.reader import S3Reader
from tiercache.tiers.s3.run_packer import RunPacker
from tiercache.tiers.s3.tier import S3Tier
from tiercache.tiers.s3.writer import S3Writer

log = logging.getLogger(__name__)


@dataclass
class WriteResult:
    block_hash: bytes
    slot: int | None
    stored: dict[str, bool] = field(default_factory=dict)  # tier -> now holds the object
    # on_slot_free ran: the engine read the slot for the last time and reported then
    # what the disk said; S3's answer comes later, to on_done.
    slot_freed: bool = False


@dataclass
class _Upload:
    """A block waiting in the run packer for its S3 upload."""

    result: WriteResult
    view: memoryview  # the block: its CPU slot, or bytes of its own
    header: ObjectHeader
    on_done: Callable[[WriteResult], None]


def disk_root(config: TierCacheConfig) -> Path | None:
    return config.disk.path if config.disk else None


class TierEngine:
    def __init__(
        self,
        config: TierCacheConfig,
        shape: ObjectShape,
        buffer: CpuBuffer,
        *,
        disk_capacity: int | None = None,
        redis: GuardedRedis | None = None,
        s3: S3Tier | None = None,
        on_disk_remove: Callable[[str], None] | None = None,
    ):
        self.config = config
        self.shape = shape
        self.buffer = buffer
        # Signs every object this engine writes; its tiers serve only objects it signed.
        self._integrity_key = config.integrity_key_bytes()
        self.disk: DiskTier | None = None
        if config.disk is not None:
            try:
                self.disk = DiskTier(
                    config.disk.path,
                    disk_capacity or config.disk.capacity,
                    o_direct=config.disk.o_direct,
                    fsync=config.disk.fsync,
                    integrity_key=self._integrity_key,
                    on_remove=on_disk_remove,
                    digest=shape.rank_digest,
                )
            except OSError as error:
                # A cache without its disk tier still serves; an engine that cannot start does not.
                log.error(
                    "tiercache: disk.path %r cannot be used (%s): the disk tier is off",
                    str(config.disk.path),
                    error.strerror or error,
                )
        self.redis = redis
        if self.redis is None and config.redis_url:
            self.redis = GuardedRedis(config.redis_url, config.redis)
        self.index = RedisIndex(self.redis) if self.redis else None
        self.leases = (
            Leases(self.redis, config.redis.write_lease_ttl, config.redis.read_lease_ttl)
            if self.redis
            else None
        )
        self.s3 = s3
        if s3 is None and config.s3 is not None:
            self.s3 = S3Tier(config.s3, integrity_key=self._integrity_key)
        self.s3_writer: S3Writer | None = None
        if self.s3 is not None and self.leases is not None:
            self.s3_writer = S3Writer(
                self.s3,
                self.leases,
                shape.model_digest,
                shape.rank_digest,
                config.redis.write_lease_ttl,
                closing=lambda: self._closed,
            )
        # The object tiers this engine has, fastest first, and how each is read: the
        # disk directly, S3 under a read lease that keeps GC off the object.
        self.lower: dict[str, DiskTier | S3Tier] = {
            tier.name: tier for tier in (self.disk, self.s3) if tier is not None
        }
        self._readers = {DISK: self._read_disk, S3: self._download}
        self.s3_reader: S3Reader | None = None
        if self.s3 is not None and self.leases is not None and self.index is not None:
            self.s3_reader = S3Reader(self.s3, self.leases, self.index, shape)
        # Blocks bound for S3 gather into runs (one object, one PUT each) per request.
        self._packer: RunPacker[_Upload] | None = None
        if self.s3_writer is not None and self.s3 is not None:
            packing = self.s3.config  # the tier's own settings (a tier may be passed in)
            self._packer = RunPacker(
                packing.run_blocks(shape.slot_bytes), packing.pack_flush_seconds, self._ship_run
            )
        movers = config.movers
        self._movers = ThreadPoolExecutor(movers.workers, thread_name_prefix="tiercache-mover")
        # S3 uploads run on threads of their own, so that a slow S3 never holds up the
        # disk writes queued behind it, nor the slots those writes free.
        self._uploaders = ThreadPoolExecutor(movers.workers, thread_name_prefix="tiercache-upload")
        # An upload reads its block from the CPU slot, so the slot stays pinned until
        # S3 answers. At most this many slots are held that way: past it a block goes
        # to disk only, and a slow S3 cannot pin the whole tier and make the scheduler
        # drop stores.
        self.upload_slot_limit = max(1, int(buffer.num_slots * movers.upload_slot_share))
        self._upload_slots = 0
        self._stagers = ThreadPoolExecutor(movers.workers, thread_name_prefix="tiercache-stage")
        # A hit's S3 blocks stage on threads of their own: a few slow S3 reads holding
        # every stager would hold every disk hit queued behind them.
        self._s3_stagers = ThreadPoolExecutor(movers.workers, thread_name_prefix="tiercache-stage-s3")
        # A request waits on its disk reads: they run in parallel, off the stagers.
        self._disk_readers = ThreadPoolExecutor(movers.workers, thread_name_prefix="tiercache-disk-read")
        self._queue_limit = movers.queue_depth
        self._queued = 0
        self._queue_lock = threading.Lock()
        self._idle = threading.Condition(self._queue_lock)
        self._closed = False

    # -- registration -----------------------------------------------------------
    def register(self, deployment: Deployment) -> None:
        if self.index is None:
            return
        try:
            self.index.register(deployment)
        except RedisUnavailable:
            log.warning("could not register deployment %s in redis yet", deployment.model_digest)

    # -- write path ---------------------------------------------------------------
    def write_down(
        self,
        block_hash: bytes,
        slot: int | None,
        on_done: Callable[[WriteResult], None],
        data: bytes | None = None,
        tiers: tuple[str, ...] = (DISK, S3),
        group: Hashable = None,
        on_slot_free: Callable[[WriteResult], None] | None = None,
    ) -> bool:
        """Queue a copy of the block (slot `slot` of the buffer, or `data`) to the lower
        tiers. False if the queue is full: the write is dropped and on_done is called
        with nothing stored. The slot must stay unchanged until on_done runs, or until
        on_slot_free runs when it is given.

        A block bound for S3 may wait in the run packer for the rest of its run, which
        can take a whole prefill. With `on_slot_free`, such a block is copied out of its
        slot once the disk has it, and on_slot_free(result) says the slot is free then
        (with `slot_freed` set and the disk's answer in `stored`), so a run being
        gathered never keeps the CPU tier's slots pinned.

        When `upload_slot_limit` slots are already held for S3 uploads, a block from a
        slot goes to disk only: its S3 write is dropped, counted, and reported as not
        stored.

        `group` (a request id) says which blocks may share an S3 run: those of one
        group, in the order they were queued (see run_packer.py)."""
        result = WriteResult(block_hash, slot)
        number = 0  # the block's place in its group's runs (run_packer.py)
        tiers = tuple(t for t in tiers if t in self.lower)
        if not tiers:
            on_done(result)
            return True
        with self._queue_lock:
            if self._closed or self._queued >= self._queue_limit:
                dropped, tiers = tiers, ()
            elif S3 in tiers and slot is not None and self._upload_slots >= self.upload_slot_limit:
                dropped, tiers = (S3,), tuple(t for t in tiers if t != S3)
                result.stored[S3] = False
            else:
                dropped = ()
            if tiers:
                self._queued += 1
                MOVER_QUEUE.labels("down").set(self._queued)
                if S3 in tiers and slot is not None:
                    self._upload_slots += 1
                if S3 in tiers and self._packer is not None:
                    number = self._packer.expect(group)
        for tier in dropped:
            MOVER_DROPPED.labels(tier).inc()
        if not tiers:
            on_done(result)
            return False
        self._movers.submit(self._write_task, result, data, tiers, on_done, group, number, on_slot_free)
        return True

    def end_group(self, group: Hashable) -> None:
        """The request `group` ended: its partial run goes to S3 now."""
        if self._packer is not None:
            self._packer.end_group(group)

    @property
    def writes_in_flight(self) -> int:
        """Write-downs queued or running (each to every tier it goes to)."""
        return self._queued

    def _write_task(self, result, data, tiers, on_done, group=None, number=0, on_slot_free=None) -> None:
        upload = None
        try:
            view = memoryview(data) if data is not None else self.buffer.view(result.slot)
            header = self.shape.header(result.block_hash, view, self._integrity_key)
            if DISK in tiers:
                assert self.disk is not None  # write_down keeps only the tiers in self.lower
                result.stored[DISK] = self.disk.put(header.key, view, header)
            if S3 in tiers:
                upload = (view, header)
        except Exception:  # a mover must survive anything a tier throws
            log.exception("write of block %s failed", result.block_hash.hex())
        if upload is not None and self._packer is not None:
            if on_slot_free is not None and result.slot is not None and self._packer.max_blocks > 1:
                # The run may wait a whole prefill for the rest of its blocks: it waits
                # with a copy, and the slot is the CPU tier's again now.
                data = bytes(upload[0])
                upload = (memoryview(data), upload[1])
                self._free_slot(result, on_slot_free)
            self._packer.add(group, number, _Upload(result, *upload, on_done))
            return
        if S3 in tiers:
            result.stored.setdefault(S3, False)
            if self._packer is not None:
                self._packer.abandon(group, number)
        self._write_ended(result, tiers, on_done)

    @staticmethod
    def _free_slot(result: WriteResult, on_slot_free: Callable[[WriteResult], None]) -> None:
        result.slot_freed = True
        try:
            on_slot_free(result)
        except Exception:  # the upload still goes: the copy no longer needs the slot
            log.exception("releasing the slot of block %s failed", result.block_hash.hex())

    def _ship_run(self, run: list[_Upload]) -> None:
        """The packer's callback: upload a run on the upload threads."""
        try:
            self._uploaders.submit(self._upload_run_task, run)
        except RuntimeError:  # shut down by a close that gave up flushing
            for item in run:
                self._write_ended(item.result, (S3,), item.on_done)

    def _upload_run_task(self, run: list[_Upload]) -> None:
        try:
            assert self.s3_writer is not None  # runs are packed only where there is one (__init__)
            stored = self.s3_writer.upload_run([(u.result.block_hash, u.view, u.header) for u in run])
            for item, ok in zip(run, stored, strict=True):
                item.result.stored[S3] = ok
        except Exception:  # an uploader must survive anything a tier throws
            log.exception("upload of a run of %d blocks failed", len(run))
        finally:
            for item in run:
                self._write_ended(item.result, (S3,), item.on_done)

    def _write_ended(self, result: WriteResult, tiers: tuple[str, ...], on_done) -> None:
        try:
            on_done(result)
        finally:
            with self._queue_lock:
                self._queued -= 1
                MOVER_QUEUE.labels("down").set(self._queued)
                if S3 in tiers and result.slot is not None:
                    self._upload_slots -= 1  # its slot, or the copy made of it
                if self._queued == 0:
                    self._idle.notify_all()

    # -- read path ----------------------------------------------------------------
    def stage(self, block_hash: bytes, slot: int, tier: str) -> bool:
        """Read one block from `tier` into CPU slot `slot`, verified. False on any failure."""
        return self.read_into(block_hash, self.buffer.view(slot), tier)

    def read_into(self, block_hash: bytes, out: memoryview, tier: str) -> bool:
        if tier not in self.lower:
            return False
        return self._readers[tier](block_hash, self.shape.key(block_hash), out)

    def _read_disk(self, block_hash: bytes, key: str, out: memoryview) -> bool:
        assert self.disk is not None  # read_into reads only the tiers in self.lower
        return self.disk.get_into(key, out, self.shape.pages)

    def open_disk_pages(self, block_hash: bytes) -> DiskPages | None:
        """The block's disk object opened for a read into the paged KV during the
        forward (connector/disk_reads.py); None where it cannot be served."""
        if self.disk is None:
            return None
        return self.disk.open_pages(self.shape.key(block_hash), self.shape.slot_bytes, self.shape.pages)

    @property
    def integrity_key(self) -> bytes | None:
        """What a read must verify the pages with (None: the plain checksum)."""
        return self._integrity_key

    def _download(self, block_hash: bytes, key: str, out: memoryview) -> bool:
        return self.read_s3([(block_hash, out)])[0]

    def read_s3(self, blocks: list[tuple[bytes, memoryview]]) -> list[bool]:
        """Read consecutive blocks of a prefix from S3 into their buffers, verified, with
        one ranged GET per run they lie in (tiers/s3/reader.py). Per block, whether it came."""
        if self.s3_reader is None:
            return [False] * len(blocks)
        return self.s3_reader.read(blocks)

    def stage_many(self, items: list[tuple[bytes, int, str]]) -> Future:
        """Stage several blocks in parallel; the future's result is the list of
        booleans in order. It never raises, and it is done only once nothing writes
        into the slots any more: a caller that gave up on it may free them then."""
        # The S3 blocks of a load go together: a run they share is one ranged GET.
        s3_items = [(i, item) for i, item in enumerate(items) if item[2] == S3]

        def run() -> list[bool]:
            others = {
                i: self._disk_readers.submit(self._stage_guarded, *item)
                for i, item in enumerate(items)
                if item[2] != S3
            }
            results = [False] * len(items)
            try:
                if s3_items:
                    fetched = self.read_s3([(h, self.buffer.view(slot)) for _, (h, slot, _) in s3_items])
                    for (i, _), ok in zip(s3_items, fetched, strict=True):
                        results[i] = ok
            except Exception:  # a miss, never an error for the load that waits on it
                log.exception("staging %d blocks from S3 failed", len(s3_items))
            for i, future in others.items():
                results[i] = future.result()
            return results

        return (self._s3_stagers if s3_items else self._stagers).submit(run)

    def _stage_guarded(self, block_hash: bytes, slot: int, tier: str) -> bool:
        try:
            return self.stage(block_hash, slot, tier)
        except Exception:
            log.exception("staging block %s from %s failed", block_hash.hex(), tier)
            return False

    # -- lifecycle ----------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes are done; False if `timeout` passed first."""
        timeout = self.config.movers.shutdown_flush_seconds if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            # Partial runs ship as soon as their blocks in flight have arrived.
            if self._packer is not None:
                self._packer.end_all()
            with self._idle:
                if not self._queued:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.02))

    def close(self) -> None:
        """Flush queued writes within the configured bound, then stop."""
        if self._closed:
            return
        flushed = self.flush()
        with self._queue_lock:
            self._closed = True
        if not flushed:
            log.warning(
                "shutdown: %d queued writes abandoned after %.1fs",
                self._queued,
                self.config.movers.shutdown_flush_seconds,
            )
        self._movers.shutdown(wait=flushed, cancel_futures=not flushed)
        if self._packer is not None:
            self._packer.close()
        self._uploaders.shutdown(wait=flushed, cancel_futures=not flushed)
        self._stagers.shutdown(wait=False, cancel_futures=True)
        self._s3_stagers.shutdown(wait=False, cancel_futures=True)
        self._disk_readers.shutdown(wait=False, cancel_futures=True)
        if self.s3 is not None:
            self.s3.close()
        if self.disk is not None:
            self.disk.close()

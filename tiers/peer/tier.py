"""The peer tier: a worker reads blocks straight out of another live instance's CPU
tier into its own CPU slots over NIXL, and lets other instances read its own.

Holder side: `retire(slot)` before anything rewrites a slot, `publish(slot, hash)`
once it holds a block. Reader side: `find_holder(hashes)` names the live instance
whose CPU tier holds the longest run of them (presence), `read(instance, blocks,
deadline)` reads what it can and verifies every block before saying it is loaded.

Never a wrong block: a block is loaded only where the holder's directory, its slot
header before and after the bytes were read, and the block agree, and its checksum
(its MAC with an integrity key) holds. Anything else (a slot rewritten mid-read, a
dead, late or refusing peer, a torn row) is a miss with a reason, never an
exception; a peer that failed is not asked again for `skip_seconds`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.config import TierCacheConfig
from tiercache.errors import CorruptObject, RedisUnavailable
from tiercache.index.redis_conn import GuardedRedis
from tiercache.metrics import TIER_BYTES, TIER_ERRORS, TIER_OPS
from tiercache.object_shape import ObjectShape
from tiercache.tiers import PEER
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.format import ObjectHeader, verify
from tiercache.tiers.peer.agent import NixlAgent, PeerRecord, TransferFailed, load_nixl
from tiercache.tiers.peer.registry import PeerRegistry
from tiercache.tiers.peer.table import (
    HEADER_BYTES,
    PROBE,
    ROW_BYTES,
    Row,
    SlotHeader,
    SlotTable,
    block_digest,
)

log = logging.getLogger(__name__)

# Blocks one transfer round reads; longer lists go in several rounds.
BATCH = 512
# A reader's scratch per block: its directory rows, then the slot header twice.
_PER_BLOCK = PROBE * ROW_BYTES + 2 * HEADER_BYTES


@dataclass
class PeerRead:
    """What one `read` did: `loaded` are indices into the blocks asked for whose local
    slots now hold verified bytes; every other index is in `missed`, with why."""

    instance: str
    loaded: list[int] = field(default_factory=list)
    missed: dict[int, str] = field(default_factory=dict)


class PeerTier:
    def __init__(
        self,
        nixl,
        shape: ObjectShape,
        buffer: CpuBuffer,
        redis: GuardedRedis,
        instance: str,
        *,
        integrity_key: bytes | None = None,
        ttl: float = 15.0,
        skip_seconds: float = 10.0,
        host: str | None = None,
        port: int = 0,
    ):
        self.shape = shape
        self.buffer = buffer
        self.instance = instance
        self.skip_seconds = skip_seconds
        self._integrity_key = integrity_key
        self.table = SlotTable(buffer.num_slots)
        self.agent = NixlAgent(
            nixl,
            f"tc-{instance}-{shape.rank_digest}",
            buffer,
            self.table,
            BATCH * _PER_BLOCK,
            host=host,
            port=port,
        )
        self.registry = PeerRegistry(redis, shape.model_digest, shape.rank_digest, instance, ttl)
        self._lock = threading.Lock()  # one read at a time: one agent, one scratch
        self._skip_until: dict[str, float] = {}
        self._agent_of: dict[str, str] = {}  # instance -> the NIXL agent last read from
        self.registry.start(self.agent.record())

    @classmethod
    def create(
        cls,
        config: TierCacheConfig,
        shape: ObjectShape,
        buffer: CpuBuffer,
        redis: GuardedRedis | None,
        instance: str,
    ) -> PeerTier | None:
        """The tier as `config` asks for it; None when it is off, NIXL is missing or its
        agent cannot start (each logged), and everything else works as without it."""
        if not config.peer.enabled:
            return None
        if redis is None:
            log.warning("tiercache: the peer tier needs redis_url: it is off")
            return None
        nixl = load_nixl()
        if nixl is None:
            return None
        try:
            return cls(
                nixl,
                shape,
                buffer,
                redis,
                instance,
                integrity_key=config.integrity_key_bytes(),
                ttl=config.peer.ttl,
                skip_seconds=config.peer.skip_seconds,
                host=config.peer.host,
                port=config.peer.port,
            )
        except Exception as error:
            log.warning("tiercache: the NIXL agent cannot start (%s): the peer tier is off", error)
            return None

    # -- the holder's side ------------------------------------------------------------
    def retire(self, slot: int) -> None:
        """Call before anything writes into `slot` (a store's copy, a load's staging,
        an eviction): from now on, no reader takes what the slot held."""
        self.table.retire(slot)

    def publish(self, slot: int, block_hash: bytes, header: ObjectHeader | None = None) -> bool:
        """`slot` now holds `block_hash`: other instances may read it. `header` is the
        block's object header where the caller has it already (the write-down computes
        one), so the pages are not hashed twice. False when the block is not listed."""
        if header is None:
            header = self.shape.header(block_hash, self.buffer.view(slot), self._integrity_key)
        return self.table.publish(slot, block_hash, header.nbytes, header.checksum, header.mac)

    # -- the reader's side ------------------------------------------------------------
    def find_holder(self, block_hashes: list[bytes]) -> tuple[str, int] | None:
        """(instance, leading blocks it holds in its CPU tier) for the live instance,
        not this one and not skipped, holding the most of `block_hashes`; None when
        none does or Redis does not answer (a miss)."""
        try:
            ranked = self.registry.holders(block_hashes)
        except RedisUnavailable:
            return None
        now = time.monotonic()
        for instance, blocks in ranked:
            if self._skip_until.get(instance, 0.0) <= now:
                return instance, blocks
        return None

    def skipped(self, instance: str) -> bool:
        return self._skip_until.get(instance, 0.0) > time.monotonic()

    def read(self, instance: str, blocks: Sequence[tuple[bytes, int]], deadline: float) -> PeerRead:
        """Read each (block hash, local slot) from `instance` into the local slot by
        `deadline` (time.monotonic()). The local slots must be this worker's to write
        (allocated and pinned for the load). Never raises."""
        result = PeerRead(instance)
        if not blocks:
            return result
        if self.skipped(instance):
            return self._miss_all(result, range(len(blocks)), "peer skipped after a failure")
        with self._lock:
            try:
                record = self.registry.record_of(instance)
            except RedisUnavailable:
                return self._miss_all(result, range(len(blocks)), "redis unavailable")
            if record is None:
                return self._miss_all(result, range(len(blocks)), "peer has no live record")
            previous = self._agent_of.get(instance)
            if previous is not None and previous != record.agent:
                self.agent.forget(previous)  # the instance restarted: its old agent is gone
            self._agent_of[instance] = record.agent
            if record.slot_bytes != self.buffer.slot_bytes or record.entries < PROBE:
                self._skip(instance, "its slots differ from this worker's")
                return self._miss_all(result, range(len(blocks)), "peer slots differ")
            try:
                self.agent.connect(record)
                for start in range(0, len(blocks), BATCH):
                    chunk = blocks[start : start + BATCH]
                    self._read_batch(record, chunk, start, deadline, result)
            except TransferFailed as error:
                self.agent.forget(record.agent)
                self._skip(instance, str(error))
                done = set(result.loaded) | set(result.missed)
                self._miss_all(result, (i for i in range(len(blocks)) if i not in done), str(error))
            except Exception as error:  # never an exception to the caller
                log.exception("tiercache: peer read from %s failed", instance)
                self.agent.forget(record.agent)
                self._skip(instance, type(error).__name__)
                result.loaded.clear()
                self._miss_all(result, range(len(blocks)), f"{type(error).__name__}: {error}")
        TIER_OPS.labels(PEER, "get", "hit").inc(len(result.loaded))
        TIER_OPS.labels(PEER, "get", "miss").inc(len(result.missed))
        TIER_BYTES.labels(PEER, "get").inc(len(result.loaded) * self.buffer.slot_bytes)
        return result

    def _read_batch(
        self,
        record: PeerRecord,
        blocks: Sequence[tuple[bytes, int]],
        first: int,
        deadline: float,
        result: PeerRead,
    ) -> None:
        scratch = self.agent.scratch
        base = scratch.data_ptr()
        raw = scratch.numpy()
        digests = [block_digest(block_hash) for block_hash, _ in blocks]
        # Round 1: each block's directory rows.
        pieces = []
        for i, digest in enumerate(digests):
            for step, row_index in enumerate(SlotTable.rows_of(digest, record.entries)):
                local = base + i * _PER_BLOCK + step * ROW_BYTES
                pieces.append((record.directory_base + row_index * ROW_BYTES, local, ROW_BYTES))
        self.agent.read(record.agent, pieces, deadline)
        found: dict[int, Row] = {}
        for i, digest in enumerate(digests):
            for step in range(PROBE):
                at = i * _PER_BLOCK + step * ROW_BYTES
                row = Row.parse(raw[at : at + ROW_BYTES].tobytes())
                if row.digest == digest and row.gen and row.gen % 2 == 0 and row.slot < record.num_slots:
                    found[i] = row
                    break
            else:
                result.missed[first + i] = "not in the peer's CPU tier"
        # Round 2: the slots' bytes and headers; round 3: the headers again.
        header_at = PROBE * ROW_BYTES
        pieces = []
        for i, row in found.items():
            local_slot = blocks[i][1]
            pieces.append(
                (
                    record.data_base + row.slot * record.slot_bytes,
                    self.buffer.tensor[local_slot].data_ptr(),
                    record.slot_bytes,
                )
            )
            header = record.headers_base + row.slot * HEADER_BYTES
            pieces.append((header, base + i * _PER_BLOCK + header_at, HEADER_BYTES))
        self.agent.read(record.agent, pieces, deadline)
        again = [
            (
                record.headers_base + row.slot * HEADER_BYTES,
                base + i * _PER_BLOCK + header_at + HEADER_BYTES,
                HEADER_BYTES,
            )
            for i, row in found.items()
        ]
        self.agent.read(record.agent, again, deadline)
        for i, row in found.items():
            at = i * _PER_BLOCK + header_at
            before = SlotHeader.parse(raw[at : at + HEADER_BYTES].tobytes())
            after = SlotHeader.parse(raw[at + HEADER_BYTES : at + 2 * HEADER_BYTES].tobytes())
            why = self._check(blocks[i], row, before, after)
            if why:
                result.missed[first + i] = why
            else:
                result.loaded.append(first + i)

    def _check(self, block: tuple[bytes, int], row: Row, before: SlotHeader, after: SlotHeader) -> str:
        """Why the bytes read into the block's local slot are not the block; "" when they are."""
        if not (row.gen == before.gen == after.gen) or before.digest != row.digest:
            return "the peer rewrote the slot during the read"
        if before.nbytes > self.buffer.slot_bytes:
            TIER_ERRORS.labels(PEER, "corrupt").inc()
            return "the peer's header names more bytes than a slot holds"
        block_hash, local_slot = block
        header = ObjectHeader(
            key=self.shape.key(block_hash),
            namespace_digest=self.shape.rank_digest,
            nbytes=before.nbytes,
            checksum=before.checksum,
            layout=self.shape.layout,
            dtype=self.shape.dtype,
            shapes=self.shape.shapes,
            mac=before.mac,
        )
        try:
            verify(header, self.buffer.view(local_slot)[: before.nbytes], self._integrity_key)
        except CorruptObject as error:
            TIER_ERRORS.labels(PEER, "corrupt").inc()
            return str(error)
        return ""

    def _skip(self, instance: str, why: str) -> None:
        log.warning("tiercache: peer %s failed (%s): not asked for %.0fs", instance, why, self.skip_seconds)
        TIER_ERRORS.labels(PEER, "peer_failed").inc()
        self._skip_until[instance] = time.monotonic() + self.skip_seconds

    @staticmethod
    def _miss_all(result: PeerRead, indices, why: str) -> PeerRead:
        for i in indices:
            result.missed[i] = why
        return result

    def close(self) -> None:
        self.registry.close()
        with self._lock:
            self.agent.close()

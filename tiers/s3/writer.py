"""A run's write to S3 under the write leases: of many concurrent writers of a block
exactly one uploads it, and a run is indexed only after its PUT succeeded."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from tiercache.index.leases import Claim, Leases, new_token
from tiercache.index.redis_conn import RedisUnavailable
from tiercache.index.redis_index import RUN_ID_BYTES, RunRecord
from tiercache.tiers.format import ObjectHeader
from tiercache.tiers.s3.runs import RunGeometry, RunHeader, frame_header_bytes, run_parts
from tiercache.tiers.s3.tier import S3Tier

# One block of a run to write: its hash, its pages and its (signed) header.
RunBlock = tuple[bytes, memoryview, ObjectHeader]


class S3Writer:
    def __init__(
        self,
        s3: S3Tier,
        leases: Leases,
        model_digest: str,
        rank_digest: str,
        write_lease_ttl: float,
        closing: Callable[[], bool] = lambda: False,
    ):
        self.s3 = s3
        self.leases = leases
        self.model_digest = model_digest
        self.rank_digest = rank_digest
        self.write_lease_ttl = write_lease_ttl
        self.closing = closing

    def upload(self, block_hash: bytes, view: memoryview, header: ObjectHeader) -> bool:
        """One block alone: a run of one."""
        return self.upload_run([(block_hash, view, header)])[0]

    def upload_run(self, blocks: Sequence[RunBlock]) -> list[bool]:
        """Per block, True when it is in S3 and indexed, by this writer or another.

        The blocks this writer claims go into one object (one PUT). Blocks already
        indexed are done; blocks another writer holds are waited for (no longer than
        the write lease lives) and taken over, in another object, if the holder gives
        up or dies, so each answer says whether the block really is there."""
        model, rank = self.model_digest, self.rank_digest
        token = new_token()
        deadline = time.monotonic() + self.write_lease_ttl
        stored: dict[bytes, bool] = {}
        pending = list(blocks)
        pause = 0.002
        while pending:
            try:
                claims = self.leases.claim_blocks(model, rank, [b[0] for b in pending], token)
            except RedisUnavailable:
                break
            mine = [b for b, c in zip(pending, claims, strict=True) if c is Claim.ACQUIRED]
            stored.update({b[0]: True for b, c in zip(pending, claims, strict=True) if c is Claim.PRESENT})
            pending = [b for b, c in zip(pending, claims, strict=True) if c is Claim.HELD]
            if mine:
                ok = self._put(mine, token)
                stored.update({b[0]: ok for b in mine})
            if not pending or self.closing() or time.monotonic() + pause > deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return [stored.get(b[0], False) for b in blocks]

    def _put(self, blocks: Sequence[RunBlock], token: str) -> bool:
        model, rank = self.model_digest, self.rank_digest
        run_id = os.urandom(RUN_ID_BYTES)
        slot_bytes = len(blocks[0][1])
        if any(len(view) != slot_bytes for _, view, _ in blocks):
            raise ValueError("every block of a run must be of one size")
        hashes = tuple(b[0] for b in blocks)
        headers = [b[2] for b in blocks]
        # data_start is not in the encoded header: encode once to learn it.
        provisional = RunGeometry(0, frame_header_bytes(headers), slot_bytes)
        first = headers[0]
        toc = RunHeader(run_id.hex(), rank, hashes, provisional, first.layout, first.dtype, first.shapes)
        parts = run_parts(toc, [(h, v) for _, v, h in blocks])
        record = RunRecord(len(parts[0]), provisional.frame_header, slot_bytes, hashes)
        uploaded = self.s3.put_run(rank, run_id.hex(), parts)
        try:
            if uploaded:
                self.leases.publish_run(model, rank, run_id, record, token)
            else:
                self.leases.release_writes(model, rank, hashes, token)
        except RedisUnavailable:
            return False  # uploaded but unindexed: invisible, and swept as an orphan
        return uploaded

"""One block's write to S3 under the write lease: exactly one of many concurrent
writers of a key uploads, and the object is indexed only after its PUT succeeded.

It imports neither torch nor vLLM, so the upload process (uploader.py) can run it
too."""

from __future__ import annotations

import time
from collections.abc import Callable

from tiercache.leases import Claim, Leases, new_token
from tiercache.redis_conn import RedisUnavailable
from tiercache.tiers.format import ObjectHeader
from tiercache.tiers.s3 import S3Tier


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
        """True when the object is in S3 and indexed, by this writer or another. The
        writers that lose the claim wait for the holder (no longer than the write
        lease lives) and take over if it gives up or dies, so each writer's answer
        says whether the object really is there."""
        model, rank = self.model_digest, self.rank_digest
        token = new_token()
        deadline = time.monotonic() + self.write_lease_ttl
        pause = 0.002
        while True:
            try:
                claim = self.leases.claim_write(model, rank, block_hash, token)
            except RedisUnavailable:
                return False
            if claim is Claim.PRESENT:
                return True
            if claim is Claim.ACQUIRED:
                break
            if self.closing() or time.monotonic() + pause > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        uploaded = self.s3.put(header.key, view, header)
        try:
            if uploaded:
                self.leases.publish(model, rank, block_hash, token)
            else:
                self.leases.release_write(model, rank, block_hash, token)
        except RedisUnavailable:
            return False  # uploaded but unindexed: invisible, and swept as an orphan
        return uploaded

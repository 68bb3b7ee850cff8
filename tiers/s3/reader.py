"""Reads a prefix's blocks from S3 run objects: one Redis call says where every block
is and leases the runs holding them against GC, then one ranged GET per run (per 8
MiB of it, for large blocks) fetches the frames the prefix needs, in parallel, each
block checked on its own (tiers/s3/runs.py).

A block that is not indexed, missing or corrupt fails, and so does every block after
it (a prefix must be whole); the blocks before it are hits. A missing object or a
corrupt frame is unindexed (that block only: the run's other blocks may be good); a
timeout, 503, 403 or cut connection says nothing about the object and unindexes
nothing. Anything else that goes wrong (a run record it cannot decode, a bug) is a
miss of the whole read too, logged: never an error for the load waiting on it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future, wait

from tiercache.index.leases import Leases, new_token
from tiercache.index.redis_conn import RedisUnavailable
from tiercache.index.redis_index import RedisIndex, RunRecord
from tiercache.object_shape import ObjectShape
from tiercache.tiers.s3.runs import FrameWant, RunGeometry
from tiercache.tiers.s3.tier import Fetch, S3Tier

# The most bytes one ranged GET fetches. One stream is slower than several: AWS
# advises byte-range fetches of 8 or 16 MiB in parallel for large objects, and a GET
# costs a twelfth of a PUT. A stretch of a run up to this size (256 tokens of a 1.7B
# model's KV at 16 blocks) is one GET.
PART_BYTES = 8 * 2**20

log = logging.getLogger(__name__)


class S3Reader:
    def __init__(self, s3: S3Tier, leases: Leases, index: RedisIndex, shape: ObjectShape):
        self.s3 = s3
        self.leases = leases
        self.index = index
        self.shape = shape

    def read(self, blocks: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        """Fill each (block hash, buffer) of a prefix, in order; per block, whether it came."""
        if not blocks:
            return []
        model, rank = self.shape.model_digest, self.shape.rank_digest
        token = new_token()
        hashes = [h for h, _ in blocks]
        try:
            where, records = self.leases.acquire_read_blocks(model, rank, hashes, token)
        except RedisUnavailable:
            return [False] * len(blocks)
        except Exception:  # e.g. a run record that does not decode; its leases expire
            log.exception("S3 read of %d blocks: looking them up failed", len(blocks))
            return [False] * len(blocks)
        try:
            results = self._fetch(blocks[: len(where)], where, records)
        except Exception:
            log.exception("S3 read of %d blocks failed", len(blocks))
            results = []
        finally:
            # If Redis is gone the leases simply expire.
            with contextlib.suppress(RedisUnavailable):
                self.leases.release_runs(model, rank, list(records), token)
        ok: list[bool] = []
        for (block_hash, _), fetched in zip(blocks, results, strict=False):
            if fetched in (Fetch.MISSING, Fetch.CORRUPT):
                # The entry names no usable block: drop it so no one else asks for it.
                with contextlib.suppress(RedisUnavailable):
                    self.index.remove(model, rank, block_hash)
            ok.append(fetched is Fetch.OK)
        ok += [False] * (len(blocks) - len(ok))
        # A prefix is whole: after the first failure nothing counts as loaded.
        first_bad = ok.index(False) if False in ok else len(ok)
        return [i < first_bad for i in range(len(ok))]

    def _fetch(
        self,
        blocks: Sequence[tuple[bytes, memoryview]],
        where: Sequence[tuple[bytes, int]],
        records: dict[bytes, RunRecord],
    ) -> list[Fetch]:
        """One ranged GET per stretch of consecutive positions in one run, in parallel."""
        stretches: list[tuple[bytes, list[FrameWant]]] = []
        for (block_hash, out), (run, position) in zip(blocks, where, strict=True):
            want = FrameWant(position, self.shape.key(block_hash), out)
            last = stretches[-1] if stretches else None
            if last is not None and last[0] == run and last[1][-1].position + 1 == position:
                last[1].append(want)
            else:
                stretches.append((run, [want]))
        futures: list[Future] = []
        try:
            for run, wants in stretches:
                record = records[run]
                geometry = RunGeometry(record.data_start, record.frame_header, record.slot_bytes)
                # A stretch longer than PART_BYTES goes as that many ranged GETs in parallel.
                per_part = max(1, PART_BYTES // geometry.frame_bytes)
                for start in range(0, len(wants), per_part):
                    part = wants[start : start + per_part]
                    futures.append(
                        self.s3.pool.submit(
                            self.s3.fetch_run,
                            self.shape.rank_digest,
                            run.hex(),
                            geometry,
                            part,
                            self.shape.pages,
                        )
                    )
        finally:
            # Every GET ends before this returns, failed or not: the buffers are the
            # caller's again then, and may be reused.
            wait(futures)
        results: list[Fetch] = []
        for future in futures:
            results.extend(future.result())
        return results

"""One block as a run of its own in the S3 tier, for tests of the tier alone: the
run format the writer uploads (tiers/s3/writer.py), without the index and leases."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tiercache.index.keys import split_key
from tiercache.index.redis_index import RUN_ID_BYTES
from tiercache.tiers.format import ObjectHeader, PageShape
from tiercache.tiers.s3.runs import FrameWant, RunGeometry, RunHeader, frame_header_bytes, run_parts
from tiercache.tiers.s3.tier import Fetch, S3Tier


@dataclass(frozen=True)
class StoredBlock:
    """Where put_block left a block: its run, and where the run's frames lie."""

    key: str
    rank_digest: str
    run_hex: str
    geometry: RunGeometry


def put_block(tier: S3Tier, header: ObjectHeader, data: bytes | memoryview) -> StoredBlock | None:
    """Upload one block as a run of one (one PUT); None when the tier could not."""
    rank, block_hex = split_key(header.key)
    run_hex = os.urandom(RUN_ID_BYTES).hex()
    pages = memoryview(data).cast("B")
    provisional = RunGeometry(0, frame_header_bytes([header]), len(pages))
    block = bytes.fromhex(block_hex)
    toc = RunHeader(run_hex, rank, (block,), provisional, header.layout, header.dtype, header.shapes)
    parts = run_parts(toc, [(header, pages)])
    if not tier.put_run(rank, run_hex, parts):
        return None
    geometry = RunGeometry(len(parts[0]), provisional.frame_header, len(pages))
    return StoredBlock(header.key, rank, run_hex, geometry)


def fetch_block(tier: S3Tier, stored: StoredBlock, out: memoryview, expect: PageShape | None = None) -> Fetch:
    """One ranged GET of the block's frame into `out`, verified: what was found."""
    want = FrameWant(0, stored.key, out)
    (found,) = tier.fetch_run(stored.rank_digest, stored.run_hex, stored.geometry, [want], expect)
    return found

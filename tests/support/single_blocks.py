"""One block at a time through the index and the leases, for tests: each helper is
the whole-run or many-block call the product makes, given one block."""

from __future__ import annotations

from tiercache.index.leases import Claim, Leases
from tiercache.index.redis_index import RUN_ID_BYTES, RedisIndex, RunRecord, blocks_key, parse_location


def add_block(index: RedisIndex, model: str, rank: str, block: bytes) -> None:
    """Index one block as a run of its own (run id: its hash's first 8 bytes)."""
    index.add_run(model, rank, block[:RUN_ID_BYTES], RunRecord(0, 0, 0, (block,)))


def claim_write(leases: Leases, model: str, rank: str, block: bytes, token: str) -> Claim:
    return leases.claim_blocks(model, rank, [block], token)[0]


def publish(leases: Leases, model: str, rank: str, block: bytes, token: str) -> None:
    """Index one block as a run of its own and release the writer's lease on it."""
    leases.publish_run(model, rank, block[:RUN_ID_BYTES], RunRecord(0, 0, 0, (block,)), token)


def release_write(leases: Leases, model: str, rank: str, block: bytes, token: str) -> bool:
    return bool(leases.release_writes(model, rank, [block], token))


def acquire_read(leases: Leases, model: str, rank: str, block: bytes, token: str) -> bool:
    """True while the block is indexed (and its run now protected from GC)."""
    found, _ = leases.acquire_read_blocks(model, rank, [block], token)
    return bool(found)


def _run_of(leases: Leases, model: str, rank: str, block: bytes) -> bytes | None:
    redis = leases.redis
    raw = redis.call("locate", lambda: redis.client.hget(blocks_key(model, rank), block))
    return parse_location(raw)[0] if raw else None


def release_read(leases: Leases, model: str, rank: str, block: bytes, token: str) -> None:
    """Release the lease acquire_read took on the block's run (if it was unindexed
    meanwhile, the lease simply expires)."""
    run = _run_of(leases, model, rank, block)
    if run is not None:
        leases.release_runs(model, rank, [run], token)


def gc_unindex(leases: Leases, model: str, rank: str, block: bytes) -> int:
    """Unindex the run holding `block`: 1 removed, 0 leased, -1 absent."""
    run = _run_of(leases, model, rank, block)
    if run is None:
        return -1
    outcome = leases.gc_unindex_run(model, rank, run)
    return {-1: 0, -2: -1}.get(outcome, 1)

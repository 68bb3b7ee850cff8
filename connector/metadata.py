"""What the scheduler tells the workers each step, and what the workers tell back."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class BlockOp:
    block_hash: bytes
    gpu_block: int
    slot: int
    tier: str  # where the bytes are now: "cpu", "disk", "s3"; "" = lost, fail the block


@dataclass
class LoadJob:
    req_id: str
    ops: list[BlockOp]
    is_async: bool


@dataclass
class TierCacheMetadata(KVConnectorMetadata):
    # Write-back victims: copy their slot out before anything this step reuses it.
    write_backs: list[tuple[bytes, int]] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[BlockOp] = field(default_factory=list)
    # No request computes this step: vLLM is only polling for loads in flight.
    idle: bool = False


# Event kinds a worker reports. Each is keyed by (kind, value); the scheduler acts
# on a success once every TP rank has reported it, on a failure at the first report.
FILLED = "filled"  # block hash now in its CPU slot on this rank
FILL_FAILED = "fill_failed"
RELEASED = "released"  # this rank no longer reads or writes the slot
ON_DISK = "on_disk"  # block hash written to this rank's disk tier
OFF_DISK = "off_disk"  # block hash evicted or lost from this rank's disk tier
FAILURES = frozenset({FILL_FAILED, OFF_DISK})


@dataclass
class TierCacheWorkerMetadata(KVConnectorWorkerMetadata):
    events: Counter = field(default_factory=Counter)
    hits: Counter = field(default_factory=Counter)  # tier -> blocks loaded, for stats

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierCacheWorkerMetadata)
        return TierCacheWorkerMetadata(self.events + other.events, self.hits + other.hits)

"""What the scheduler tells the workers each step, and what the workers tell back."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .vllm_compat import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class BlockOp:
    block_hash: bytes
    gpu_block: int
    slot: int
    tier: str  # where the bytes are now: "cpu", "disk", "s3", "peer"; "" = lost, fail the block
    req_id: str = ""  # a store's request: its blocks share S3 runs (tiers/s3/run_packer.py)
    # A load's block whose slot another transfer is filling (a staging from disk or
    # S3, or a store): tier is CPU, and the worker copies it once that fill is done.
    after_fill: bool = False


@dataclass
class LoadJob:
    req_id: str
    ops: list[BlockOp]
    is_async: bool
    # The instance whose CPU tier holds the load's peer blocks (tiers/peer), if any.
    peer: str = ""


@dataclass
class TierCacheMetadata(KVConnectorMetadata):
    # Write-back victims: copy their slot out before anything this step reuses it.
    write_backs: list[tuple[bytes, int]] = field(default_factory=list)
    # The write-back victims that go to some lower tiers only, and which (the
    # `selective` policy's admission, tiercache/admission.py); absent: every tier.
    write_back_tiers: dict[bytes, tuple[str, ...]] = field(default_factory=dict)
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[BlockOp] = field(default_factory=list)
    # Requests whose last block to store is in this step's stores: their partial S3
    # runs ship once those blocks are written (tiers/s3/run_packer.py).
    stores_done: list[str] = field(default_factory=list)
    # Per request with stores this step: the paged-KV blocks its forward reads that
    # this step loads synchronously, its own or (through vLLM's prefix cache) another
    # request's. Should one fail, the blocks that request computes are computed over
    # garbage, and its stores are void.
    store_reads: dict[str, list[int]] = field(default_factory=dict)
    # No request computes this step: vLLM is only polling for loads in flight.
    idle: bool = False
    # Tokens this step computes, set only when some of them are prompt tokens: the
    # workers time its forward, which is what a skipped load costs (cost_model.py).
    timed_tokens: int = 0
    # The step's synchronous loads may start as soon as the worker is handed the step,
    # before vLLM prepares its inputs: vLLM neither zeroes nor copies any paged-KV block
    # while it does so this step (it would overwrite a hit copied in early).
    loads_early: bool = False
    # Requests vLLM finished whose GPU blocks it keeps (request_finished returned True)
    # until each worker reports them in finished_sending: once no store copy out of
    # their blocks is in flight on that worker.
    finished_storing: list[str] = field(default_factory=list)
    # The blocks of a request that stored may be freed and written again by this step's
    # forward (a preemption; a sliding window or Mamba group freeing blocks as its
    # request runs): the forward's stream waits for the store copies in flight first.
    fence_stores: bool = False
    # This step's forward may be one full CUDA graph replay, which calls no layer hook:
    # its hits are copied in whole before it (connector/graphs.py).
    full_graph: bool = False
    # This instance's name in Redis, set where the peer tier is on: each worker shares
    # its CPU tier under it (the scheduler's name, which a worker process cannot derive).
    instance: str = ""


# Event kinds a worker reports, each as (rank, kind, value) in the order the rank
# made them. The scheduler acts on a success once every TP rank has reported it, on a
# failure at the first report (see ledger.py).
FILLED = "filled"  # value (block hash, slot): the block is now in that CPU slot on this rank
FILL_FAILED = "fill_failed"  # value (block hash, slot)
# value (block hash, slot): a store not made, its block computed over a failed load
STORE_VOID = "store_void"
RELEASED = "released"  # value slot: this rank no longer reads or writes it (one pin)
ON_DISK = "on_disk"  # value block hash: written to this rank's disk tier
OFF_DISK = "off_disk"  # value block hash: evicted or lost from this rank's disk tier
READ_FAILED = "read_failed"  # value block hash: its read into the paged KV in the forward failed

Report = tuple[int, str, Any]
# A measurement for the scheduler's cost model: (tier, blocks, seconds) of one load's
# blocks from that tier, or (FORWARD, tokens, seconds) of one timed step.
FORWARD = "forward"
Timing = tuple[str, int, float]


@dataclass
class TierCacheWorkerMetadata(KVConnectorWorkerMetadata):
    reports: list[Report] = field(default_factory=list)
    hits: Counter = field(default_factory=Counter)  # tier -> blocks loaded, for stats
    timings: list[Timing] = field(default_factory=list)  # every rank's, each a sample

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierCacheWorkerMetadata)
        # Kept apart per report: summing would let one rank's report stand in for another's.
        return TierCacheWorkerMetadata(
            self.reports + other.reports, self.hits + other.hits, self.timings + other.timings
        )

    def counts(self) -> Counter:
        """How many reports of each (kind, value), whatever rank made them."""
        return Counter((kind, value) for _, kind, value in self.reports)

"""What the parts of the scheduler half (lookup.py, load_planning.py,
store_planning.py, scheduler.py) share: the state TierCacheScheduler sets up, and how
blocks are named and loaded."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from tiercache.config import TierCacheConfig
from tiercache.index.keys import block_key
from tiercache.index.redis_index import RedisIndex
from tiercache.policy import BlockPolicy
from tiercache.tiers import CPU, PEER, S3
from tiercache.tiers.cpu import SlotAllocator

from .cost_model import LoadCostModel
from .events import TierEvents
from .graphs import FullGraphs
from .group_lookup import GroupLookup
from .groups import GroupRule
from .load_failures import RecentLoadFailures
from .metadata import BlockOp, LoadJob
from .peer_lookup import PeerLookup
from .scheduler_state import Lookup, RequestState

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.request import Request


class SchedulerBase:
    # Set up by TierCacheScheduler.__init__, which says what each holds.
    config: TierCacheConfig
    block_size: int
    model_digest: str
    rank_digests: list[str]
    group_rules: list[GroupRule]
    hybrid: bool
    kv_in_host_memory: bool
    disk_in_forward: bool
    full_graphs: FullGraphs | None
    policy: BlockPolicy
    slots: SlotAllocator[bytes]
    s3_index: RedisIndex | None
    peers: PeerLookup | None
    load_failures: RecentLoadFailures
    cost: LoadCostModel | None
    groups: GroupLookup
    tier_events: TierEvents | None
    stats: Counter
    _requests: dict[str, RequestState]
    _lookups: dict[str, Lookup]
    _step: int
    _pending_loads: list[LoadJob]
    _load_slots: dict[str, list[BlockOp]]
    _hit_tiers: dict[str, Counter]
    _decisions: Counter
    _dropped_stores: int
    _storing: set[str]
    _finished_storing: list[str]
    _stored_last_step: bool
    _stores_held: bool
    _weights_epoch: bytes | None

    # -- block names ----------------------------------------------------------------
    def _name(self, key: bytes, vllm_hash: BlockHash, group: int = 0) -> None:
        """Events and presence name blocks by vLLM's hash (and KV cache group), which
        differs from `key` after a reset or in a group past the first: say which is
        which before the block can change tiers."""
        if self.tier_events is not None:
            self.tier_events.name(key, bytes(vllm_hash), group)

    def _block_key(self, block_hash: BlockHash) -> bytes:
        """The name a block is cached under: vLLM's hash, keyed by the weights epoch
        once vLLM has asked for a reset."""
        return block_key(bytes(block_hash), self._weights_epoch)

    def _block_keys(self, request: Request) -> list:
        if self._weights_epoch is None:
            return request.block_hashes
        return [self._block_key(h) for h in request.block_hashes]

    # -- loads ------------------------------------------------------------------------
    def _is_async(self, tiers: list[str], hashes) -> bool:
        """Whether a hit from these tiers is staged into CPU slots before its request
        is scheduled (an asynchronous load), rather than copied in during the forward.
        Always, with several KV cache groups: vLLM takes a failed load of such a model
        only for a request waiting on an asynchronous one (worker.py). A hit on a block
        whose slot is being filled (another request's staging, a store) waits for that
        fill and shares it: loading the block again would cost another read, and
        planning it as lost would recompute it."""
        if self.hybrid or any(self.policy.filling(bytes(h)) for h in hashes):
            return True
        if self.disk_in_forward:
            return S3 in tiers or PEER in tiers
        return any(tier != CPU for tier in tiers)

"""The scheduler half of the connector: it finds the longest cached prefix of each
request across the tiers, decides what each worker loads and stores, and owns the
CPU tier's slot map (every TP rank keeps its own shard in the same slot number).

It never waits on a worker: workers report what happened through worker metadata,
and a block counts as cached only once every rank has reported it."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiercache.config import TierCacheConfig, unbounded_warnings
from tiercache.index.block_hashing import BlockHashing
from tiercache.index.keys import KVSpec, block_key
from tiercache.index.presence import PresencePublisher
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import Deployment, RedisIndex
from tiercache.metrics import LOAD_DECISIONS, LOOKUP_BLOCKS, LOOKUP_HITS
from tiercache.object_shape import ObjectShape
from tiercache.policy import BlockPolicy, CpuTierFull, reads_disk_in_forward
from tiercache.tiers import CPU, DISK, S3
from tiercache.tiers.cpu import slots_for
from tiercache.tiers.disk.tier import DiskLayout

from .cost_model import LoadCostModel
from .events import TierEvents
from .graphs import FullGraphs
from .groups import FULL, NULL_BLOCK, STATE, WINDOW, best_end, group_key, group_rules
from .ledger import ReportLedger
from .load_failures import RecentLoadFailures
from .metadata import (
    FILL_FAILED,
    FILLED,
    FORWARD,
    OFF_DISK,
    ON_DISK,
    READ_FAILED,
    RELEASED,
    STORE_VOID,
    BlockOp,
    LoadJob,
    TierCacheMetadata,
    TierCacheWorkerMetadata,
)
from .weights_fingerprint import loaded_weights_epoch

if TYPE_CHECKING:
    # For annotations only: the scheduler half is handed these by the connector.
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("tiercache.connector")

# How long a waiting request's S3 lookup (one Redis round trip, which also touches
# the blocks' last-access scores) is reused while vLLM asks again each step. Its local
# tiers are looked up afresh every time; a block whose load failed since is left out
# at once; what this bounds is an S3 object removed by the service's GC meanwhile,
# which the touch made moments ago keeps at the far end of its order.
S3_LOOKUP_REUSE_SECONDS = 2.0


@dataclass
class _S3Answer:
    """What Redis said of a request's blocks from `start` on: the next `found` are
    in S3 (the one after, if any before `limit`, is not)."""

    start: int
    limit: int
    found: int
    asked_at: float

    def found_from(self, rest: int, limit: int, now: float) -> int | None:
        """Blocks in S3 from block `rest` on, by this answer; None where it does not
        say (it looked from elsewhere, up to another limit, or too long ago)."""
        if limit != self.limit or now - self.asked_at > S3_LOOKUP_REUSE_SECONDS:
            return None
        if not self.start <= rest <= self.start + self.found:
            return None
        return self.start + self.found - rest


@dataclass
class _Lookup:
    num_computed_tokens: int
    tiers: list[str]  # tier of each block past the local hit, in order
    step: int = 0  # the scheduler step it was made in: plans use only that step's
    # The hit as last answered: the tier of each block it could load (CPU room
    # allowing); the cost model loads a prefix of it.
    hit: list[str] = field(default_factory=list)
    # How many blocks of `hit` the CPU tier had slots to stage (None: all of it); the
    # blocks past it are counted as a "no_room" decision, not dropped silently.
    fits: int | None = None
    # Several KV cache groups: the tier of each (group, block index) looked at, and
    # the blocks of every group the answered hit loads, as (group, index, tier).
    group_tiers: dict[tuple[int, int], str | None] = field(default_factory=dict)
    plan: list[tuple[int, int, str]] = field(default_factory=list)
    load_async: bool = False  # what vLLM was told: the plan keeps to it
    s3: _S3Answer | None = None  # kept while the request waits (S3_LOOKUP_REUSE_SECONDS)


@dataclass
class _Request:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    next_block: int = 0  # blocks before this one are cached or planned
    # Every KV cache group's block table (the first is `block_ids`).
    group_block_ids: list[list[int]] = field(default_factory=list)


def _touches_blocks_before_forward(scheduler_output: SchedulerOutput) -> bool:
    """Whether vLLM writes paged-KV blocks while it prepares this step's inputs: it
    zeroes new blocks for models with Mamba layers or a mixed-precision KV cache, and
    copies shared blocks' tails for partial prefix-cache hits (copy-on-write). Either
    would land over a hit copied in before it."""
    zeroed = getattr(scheduler_output, "new_block_ids_to_zero", None)
    copied = getattr(scheduler_output, "kv_cache_block_copies", None)
    return bool(zeroed or copied)


def slot_bytes_for(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one slot: every layer's page, each padded to 64 bytes (as the worker's
    copier lays them out). With several KV cache groups (vLLM's hybrid manager) a slot
    holds one block of one group, whose layers overlay the other groups' (copier.py):
    the largest group's pages."""
    sizes = [
        (-(-group.kv_cache_spec.page_size_bytes // 64) * 64) * len(group.layer_names)
        for group in kv_cache_config.kv_cache_groups
    ]
    return max(sizes) if len(sizes) > 1 else sum(sizes)


class TierCacheScheduler:
    def __init__(
        self,
        config: TierCacheConfig,
        specs: list[KVSpec],
        kv_cache_config: KVCacheConfig,
        worker_count: int,
        *,
        hashing: BlockHashing | None = None,
        kv_events: bool = False,
        kv_in_host_memory: bool = False,
        full_graphs: FullGraphs | None = None,
    ):
        """`hashing`: how vLLM names this deployment's blocks, registered for the
        service's token lookups; `kv_events`: vLLM publishes KV events, so tier
        changes are kept for `take_events`; `kv_in_host_memory`: the paged KV is in
        host memory (vLLM's CPU backend), where disk hits may be read into it during
        the forward, and a store's copy is over when its hook returns; `full_graphs`:
        which steps vLLM may run as full CUDA graph replays (graphs.py)."""
        self.config = config
        self.kv_in_host_memory = kv_in_host_memory
        self.full_graphs = full_graphs
        # Requests with store copies planned since they last started (CUDA: a copy may
        # still read their blocks after their step), and those of them vLLM finished,
        # keeping their blocks until the workers report them (request_finished).
        self._storing: set[str] = set()
        self._finished_storing: list[str] = []
        self._stored_last_step = False
        # A hit with no S3 block then loads synchronously, its disk blocks through no
        # CPU slot (connector/disk_reads.py).
        self.disk_in_forward = reads_disk_in_forward(config, kv_in_host_memory, tp_size=specs[0].tp_size)
        self.specs = specs
        self.block_size = specs[0].block_size
        self.model_digest = specs[0].model_digest()
        self.rank_digests = [spec.digest() for spec in specs]
        self.slot_bytes = slot_bytes_for(kv_cache_config)
        # What each KV cache group needs for a hit (groups.py); one rule for a plain model.
        self.group_rules = group_rules(kv_cache_config, self.block_size)
        # A lone sliding-window or Mamba group has null blocks in its table too.
        self.hybrid = len(self.group_rules) > 1 or self.group_rules[0].kind in (WINDOW, STATE)
        # Filled, ready and on disk mean: on every rank (see ledger.py).
        self.policy = BlockPolicy(
            slots_for(config.cpu.capacity, self.slot_bytes),
            self.slot_bytes,
            write_back=config.movers.policy == "write_back",
        )
        self.slots = self.policy.slots
        self.worker_count = worker_count
        # MLA: one shared object, written by rank 0 alone.
        self.disk_reporters = 1 if len(specs) == 1 and worker_count > 1 else worker_count
        self.redis: GuardedRedis | None = None
        # The deployment registry always (the service's token lookups use it); the
        # index of S3 blocks only where there is an S3 tier to look them up in.
        self.index: RedisIndex | None = None
        if config.redis_url:
            self.redis = GuardedRedis(config.redis_url, config.redis)
            self.index = RedisIndex(self.redis)
        self.s3_index = self.index if config.s3 is not None else None
        # Once per vLLM instance, not once per TP rank's tier engine.
        for warning in unbounded_warnings(config):
            log.warning("tiercache: %s", warning)
        self.hashing = hashing
        # Set by reset_cache (new weights): every block is named anew under it.
        self._weights_epoch: bytes | None = None
        # Watching before the disk scan: what the disk holds from earlier runs is
        # published too.
        self.tier_events = self._watch_tiers(kv_events)
        if config.disk is not None:
            self._scan_disk()
        if self.index is not None:
            self._register(self.index)
        if self.tier_events is not None and self.tier_events.presence is not None:
            self.tier_events.presence.start()
        self._requests: dict[str, _Request] = {}
        # Per waiting request, its last lookup: planned from in the step it was made,
        # its S3 answer reused while the request waits (vLLM asks every step).
        self._lookups: dict[str, _Lookup] = {}
        self._step = 0  # steps planned so far (build_connector_meta)
        self._pending_loads: list[LoadJob] = []
        self._building: TierCacheMetadata | None = None  # the step build_connector_meta is planning
        self._load_slots: dict[str, list[BlockOp]] = {}  # async loads in flight, by request
        self._hit_tiers: dict[str, Counter] = {}  # this step's planned hits: tier -> blocks
        self.ledger = ReportLedger(worker_count, self.disk_reporters)
        self.load_failures = RecentLoadFailures()
        # Set by a reset vLLM's own prefix cache refused: see reset_cache.
        self._stores_held = False
        self.stats: Counter = Counter()
        self.cost = LoadCostModel(time.monotonic) if config.movers.cost_model == "on" else None
        self._decisions: Counter = Counter()  # (tier, decision) -> requests, not yet in vLLM's stats
        self._dropped_stores = 0  # stores no CPU slot was free for, not yet in vLLM's stats

    # -- startup ------------------------------------------------------------------
    def _scan_disk(self) -> None:
        """Blocks whose object exists on disk for every rank: the node's disk tier
        survives restarts, and this is how the scheduler learns what it holds."""
        assert self.config.disk is not None  # scanned only with a disk tier
        layout = DiskLayout(self.config.disk.path)
        per_rank = [{block for block, _ in layout.objects(digest)} for digest in self.rank_digests]
        common = set.intersection(*per_rank) if per_rank else set()
        for name in common:
            try:
                self.policy.stored_on_disk(bytes.fromhex(name))
            except ValueError:
                continue
        if common:
            log.info("tiercache: %d blocks found on disk from earlier runs", len(common))

    def _register(self, index: RedisIndex) -> None:
        shape = ObjectShape(self.model_digest, self.rank_digests[0], self.slot_bytes)
        deployment = Deployment(
            model_digest=self.model_digest,
            namespace=self.config.namespace,
            model=self.specs[0].model,
            tp_size=len(self.specs),
            rank_digests=tuple(self.rank_digests),
            object_bytes=shape.object_bytes,
            block_size=self.hashing.block_size if self.hashing else 0,
            hash_algo=self.hashing.algorithm if self.hashing else "",
            hash_seed=self.hashing.seed if self.hashing else None,
            groups=tuple(rule.encode() for rule in self.group_rules) if self.hybrid else (),
            weights_epoch=self._weights_epoch.hex() if self._weights_epoch is not None else "",
        )
        try:
            index.register(deployment)
        except RedisUnavailable:
            log.warning("tiercache: redis unreachable at startup; S3 lookups are misses until it answers")

    def _watch_tiers(self, kv_events: bool) -> TierEvents | None:
        """Tier changes feed vLLM's KV events and this instance's presence in Redis;
        with neither, nothing watches them."""
        presence = None
        if self.redis is not None and self.config.presence.enabled:
            presence = PresencePublisher(
                self.redis,
                self.model_digest,
                self.config.instance_id or f"{socket.gethostname()}-{os.getpid()}",
                ttl=self.config.presence.ttl,
                interval=self.config.presence.interval,
            )
        if not kv_events and presence is None:
            return None
        full = [group for group, rule in enumerate(self.group_rules) if rule.kind == FULL]
        events = TierEvents(
            self.policy,
            self.block_size,
            publish=kv_events,
            presence=presence,
            hybrid=self.hybrid,
            presence_group=full[0] if full and self.hybrid else 0,
        )
        self.policy.watcher = events
        return events

    def take_events(self) -> list:
        """vLLM KV events for this step's tier changes (connector.take_events)."""
        return self.tier_events.take() if self.tier_events is not None else []

    def _name(self, key: bytes, vllm_hash: BlockHash, group: int = 0) -> None:
        """Events and presence name blocks by vLLM's hash (and KV cache group), which
        differs from `key` after a reset or in a group past the first: say which is
        which before the block can change tiers."""
        if self.tier_events is not None:
            self.tier_events.name(key, bytes(vllm_hash), group)

    def close(self) -> None:
        """The engine shuts down: this instance's presence leaves Redis now."""
        if self.tier_events is not None and self.tier_events.presence is not None:
            self.tier_events.presence.close()

    # -- block names ----------------------------------------------------------------
    def _block_key(self, block_hash: BlockHash) -> bytes:
        """The name a block is cached under: vLLM's hash, keyed by the weights epoch
        once vLLM has asked for a reset."""
        return block_key(bytes(block_hash), self._weights_epoch)

    def _block_keys(self, request: Request) -> list:
        if self._weights_epoch is None:
            return request.block_hashes
        return [self._block_key(h) for h in request.block_hashes]

    def reset_cache(self, *, vllm_cache_cleared: bool = True) -> bool:
        """vLLM's /reset_prefix_cache, which weight-update and RL flows call after
        loading new weights: from now on no tier may serve a block computed before.
        The weights may have changed in memory only, so no digest of the files would
        notice; instead every block is named anew under a weights epoch, a fingerprint
        of the weights the workers hold now (connector/weights_fingerprint.py), here,
        in every object written from now on and in the deployment the lookup API
        reads. What this node held is forgotten at once; the objects of other engines
        holding the same weights are found again (the disk scanned, S3 looked up); the
        old objects are never looked up again, the disk tier's LRU and S3's GC reclaim
        them. Transfers planned before finish under the keys they were planned
        with, over KV computed before (a step's forward ends before vLLM runs a call
        between steps), and their slots are freed when they end.

        A request tracked now has KV from before: what it computes next extends that
        KV, so none of it is stored (vLLM tracks a request it preempts and schedules
        again anew, through update_state_after_alloc). `vllm_cache_cleared` False: vLLM
        refused to clear its own prefix cache (requests held blocks), so a new request
        may start from its blocks from before: nothing is stored until a reset vLLM
        does perform."""
        self._weights_epoch = loaded_weights_epoch() or secrets.token_bytes(16)
        self.policy.clear()
        if self.tier_events is not None:
            self.tier_events.reset()
        self.ledger.forget_disk()
        self._lookups.clear()
        self._requests.clear()
        self._stores_held = not vllm_cache_cleared
        # Other engines given the same weights stored under this epoch too: what the
        # disk holds of it, and the lookups for it, count from now on.
        if self.config.disk is not None:
            self._scan_disk()
        if self.index is not None:
            self._register(self.index)
        if self._stores_held:
            log.warning(
                "tiercache: cache reset (new weights epoch), but vLLM kept its prefix cache "
                "(requests held blocks): nothing is stored until reset_prefix_cache() succeeds"
            )
        else:
            log.info("tiercache: cache reset (new weights epoch): earlier blocks are no longer served")
        return True

    # -- lookup -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        hashes = self._block_keys(request)
        limit = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        first = num_computed_tokens // self.block_size
        if first >= limit:
            return 0, False
        if self.hybrid:
            return self._lookup_groups(request, hashes, first, limit, num_computed_tokens)
        # The local tiers afresh every time (a block evicted, failed or filled since
        # the last ask is seen); the S3 part from the request's last answer while
        # that still says (a waiting request is asked about every step).
        earlier = self._lookups.get(request.request_id)
        tiers = []
        for i in range(first, limit):
            block = bytes(hashes[i])
            tier = self.policy.local_tier(block)
            if tier is None or block in self.load_failures:
                break
            tiers.append(tier)
        rest = first + len(tiers)
        s3 = earlier.s3 if earlier is not None else None
        if rest < limit and self.s3_index is not None:
            wanted = [bytes(h) for h in hashes[rest:limit]]
            found = s3.found_from(rest, limit, time.monotonic()) if s3 is not None else None
            if found is None:
                s3 = None
                try:
                    found = self.s3_index.longest_prefix(self.model_digest, self.rank_digests, wanted)
                    s3 = _S3Answer(rest, limit, found, time.monotonic())
                except RedisUnavailable:
                    found = 0
            else:
                LOOKUP_BLOCKS.inc(limit - first)
            tiers.extend([S3] * self.load_failures.leading_clear(wanted[:found]))
        else:
            LOOKUP_BLOCKS.inc(limit - first)
        lookup = self._lookups[request.request_id] = _Lookup(num_computed_tokens, tiers, self._step, s3=s3)
        held = hashes[first : first + len(tiers)]
        # Counted once vLLM acts on it (update_state_after_alloc): it may ask again.
        lookup.hit = tiers
        if self._is_async(tiers, held):
            tiers = self._fit_to_cpu_tier(tiers, held)
            lookup.fits = len(tiers)
        load = len(tiers) if self.cost is None else self.cost.blocks_to_load(tiers, self.block_size)
        if not load:
            return 0, False
        lookup.load_async = self._is_async(tiers[:load], held[:load])
        return load * self.block_size, lookup.load_async

    def _lookup_groups(
        self, request: Request, hashes, first: int, limit: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """get_num_new_matched_tokens with several KV cache groups: the longest hit
        every group can serve (groups.py), cut by the cost model and the CPU slots
        staging needs, each cut rounded down to an end every group can still serve."""
        # Every tier afresh at each ask, like a plain model's local tiers: the plan
        # is made from this step's answer only.
        cached = self._lookups[request.request_id] = _Lookup(num_computed_tokens, [], self._step)
        group_tiers = cached.group_tiers

        def holds(group: int, index: int) -> bool:
            if (group, index) not in group_tiers:
                key = group_key(bytes(hashes[index]), group)
                tier = self.policy.local_tier(key)
                if tier is None and key not in self.load_failures and self.s3_index is not None:
                    try:
                        found = self.s3_index.longest_prefix(self.model_digest, self.rank_digests, [key])
                    except RedisUnavailable:
                        found = 0
                    tier = S3 if found else None
                group_tiers[(group, index)] = None if key in self.load_failures else tier
            return group_tiers[(group, index)] is not None

        for group, rule in enumerate(self.group_rules):
            if rule.kind == FULL and (group, first) not in group_tiers:
                self._look_up_run(group, hashes, first, limit, group_tiers)
        end = best_end(self.group_rules, first, limit, self.block_size, holds)
        primary = next((g for g, rule in enumerate(self.group_rules) if rule.kind != STATE), 0)
        while end > first:
            plan = self._group_plan(group_tiers, first, end)
            tiers = [group_tiers.get((primary, i)) or S3 for i in range(first, end)]
            load = len(tiers) if self.cost is None else self.cost.blocks_to_load(tiers, self.block_size)
            if self._is_async([tier for _, _, tier in plan], ()) and not self._fits_cpu_tier(plan, hashes):
                load = min(load, end - first - 1)
            if load == end - first:
                cached.tiers = cached.hit = tiers
                cached.plan = plan
                cached.load_async = True
                return load * self.block_size, self._is_async([tier for _, _, tier in plan], ())
            end = best_end(self.group_rules, first, first + load, self.block_size, holds)
        cached.tiers, cached.hit, cached.plan = [], [], []
        return 0, False

    def _look_up_run(self, group: int, hashes, first: int, limit: int, group_tiers) -> None:
        """A full-attention group's blocks from `first` on, as far as they are cached:
        the local tiers, then S3 for the rest in one round trip."""
        index = first
        while index < limit:
            key = group_key(bytes(hashes[index]), group)
            tier = self.policy.local_tier(key)
            if tier is None or key in self.load_failures:
                break
            group_tiers[(group, index)] = tier
            index += 1
        found = 0
        if index < limit and self.s3_index is not None:
            wanted = [group_key(bytes(h), group) for h in hashes[index:limit]]
            try:
                found = self.s3_index.longest_prefix(self.model_digest, self.rank_digests, wanted)
                found = self.load_failures.leading_clear(wanted[:found])
            except RedisUnavailable:
                found = 0
        for offset in range(found):
            group_tiers[(group, index + offset)] = S3
        if index + found < limit:
            group_tiers[(group, index + found)] = None

    def _group_plan(self, group_tiers, first: int, end: int) -> list[tuple[int, int, str]]:
        """(group, index, tier) of every block a hit ending at `end` loads, by index
        then group: a lost block fails every group's blocks after it (worker.py)."""
        plan = [
            (group, index, group_tiers[(group, index)])
            for group, rule in enumerate(self.group_rules)
            for index in rule.needs(first, end, self.block_size)
        ]
        return sorted(plan, key=lambda entry: (entry[1], entry[0]))

    def _fits_cpu_tier(self, plan: list[tuple[int, int, str]], hashes) -> bool:
        """Whether the CPU tier has a slot free for each disk or S3 block `plan` stages."""
        cpu_blocks = [group_key(bytes(hashes[i]), g) for g, i, tier in plan if tier == CPU]
        return sum(tier != CPU for _, _, tier in plan) <= self.policy.room_for_staging(cpu_blocks)

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
            return S3 in tiers
        return any(tier != CPU for tier in tiers)

    def _fit_to_cpu_tier(self, tiers: list[str], hashes) -> list[str]:
        """Each disk or S3 block is staged through a CPU slot of its own. A hit that
        needs more slots than transfers leave free is cut where they run out: the
        rest is computed, rather than planned, failed and recovered by vLLM."""
        # A staging evicts an unpinned slot, and the hit pins its own CPU blocks first
        # so that none of them is the one evicted: up to the cut, each staged block and
        # each CPU block no transfer holds yet take one of the unpinned slots. CPU
        # blocks past the cut take none (one may be evicted by the staging).
        free = self.slots.unpinned()
        taken = 0
        for i, tier in enumerate(tiers):
            block = bytes(hashes[i])
            if tier == CPU:
                taken += self.slots.unpinned_among((block,))
            elif not self.policy.filling(block):  # a fill shared needs no slot
                taken += 1
            if taken > free:
                return tiers[:i]
        return tiers

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _Request(request)
        state.request = request
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None and lookup.step != self._step:
            lookup = None  # vLLM asked in an earlier step and did not act on it then
        if lookup is not None:
            self._count_decisions(lookup, num_external_tokens // self.block_size)
        if num_external_tokens == 0 or lookup is None:
            return
        if self.hybrid:
            self._plan_group_loads(state, lookup, blocks.get_block_ids(), num_external_tokens)
            return
        block_ids = blocks.get_block_ids()[0]
        first = lookup.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        # vLLM waits for the kind of load the lookup announced (an async one until the
        # worker reports the request finished receiving): a block lost since the
        # lookup fails and is recomputed, but never changes that kind.
        is_async = lookup.load_async
        self._hit_tiers[req_id] = Counter(lookup.tiers[:count])
        hit: list[tuple[bytes, int, str]] = []
        for i, tier in enumerate(lookup.tiers[:count]):
            block_hash = self._block_key(request.block_hashes[first + i])
            self._name(block_hash, request.block_hashes[first + i])
            hit.append((block_hash, block_ids[first + i], tier))
        ops = self._plan_hit(hit, may_stage=is_async)
        job = LoadJob(req_id, ops, is_async)
        self._pending_loads.append(job)
        if is_async:
            self._load_slots[req_id] = ops
        state.next_block = max(state.next_block, first + count)
        for op in ops:
            if op.tier:
                self.stats[f"hit_{op.tier}"] += 1
                LOOKUP_HITS.labels(op.tier).inc()

    def _plan_group_loads(
        self, state: _Request, lookup: _Lookup, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """update_state_after_alloc with several KV cache groups: each group's blocks
        of the hit go into that group's blocks, as planned at the lookup."""
        request = state.request
        req_id = request.request_id
        first = lookup.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        plan = lookup.plan
        if count != len(lookup.tiers):
            # vLLM loads what the lookup answered; anything else is planned anew.
            plan = self._group_plan(lookup.group_tiers, first, first + count)
        tiers = [tier for _, _, tier in plan]
        is_async = self._is_async(tiers, ())
        self._hit_tiers[req_id] = Counter(lookup.tiers[:count])
        hit: list[tuple[bytes, int, str]] = []
        lost = False
        for group, index, tier in plan:
            gpu_block = block_ids[group][index] if index < len(block_ids[group]) else NULL_BLOCK
            if gpu_block == NULL_BLOCK:
                # vLLM gave this group no block where the plan loads one: the hit
                # cannot be whole, so every block of it is recomputed.
                lost = True
                continue
            block_hash = group_key(self._block_key(request.block_hashes[index]), group)
            self._name(block_hash, request.block_hashes[index], group)
            hit.append((block_hash, gpu_block, tier or ""))
        ops = self._plan_hit(hit, may_stage=is_async)
        if lost:
            log.warning("tiercache: request %s: a KV cache group lacks a block of its hit", req_id)
            for op in ops:
                self._unplan(op)
        job = LoadJob(req_id, ops, is_async)
        self._pending_loads.append(job)
        if is_async:
            self._load_slots[req_id] = ops
        state.next_block = max(state.next_block, first + count)
        for op in ops:
            if op.tier:
                self.stats[f"hit_{op.tier}"] += 1
                LOOKUP_HITS.labels(op.tier).inc()

    def _plan_hit(self, hit: list[tuple[bytes, int, str]], may_stage: bool) -> list[BlockOp]:
        """`_plan_load` for each (name, paged-KV block, tier) of a hit, in its order.
        The hit's ready CPU blocks are pinned before any slot is claimed to stage a
        lower-tier block into: a claim evicts the least recently used unpinned block,
        and the hit's own CPU blocks, pinned only later, were often those (the oldest
        blocks of a long prompt whose front had already gone to disk). The slots
        checked for staging (`_fit_to_cpu_tier`) already leave them out."""
        ops: list[BlockOp | None] = [None] * len(hit)
        pinned_first = [tier == CPU and block_hash in self.policy.ready for block_hash, _, tier in hit]
        for first_pass in (True, False):
            for i, (block_hash, gpu_block, tier) in enumerate(hit):
                if pinned_first[i] == first_pass:
                    ops[i] = self._plan_load(block_hash, gpu_block, tier, may_stage)
        return [op for op in ops if op is not None]

    def _unplan(self, op: BlockOp) -> None:
        """Undo `_plan_load` for `op` and leave it lost: the worker reports it failed."""
        if op.slot >= 0:
            if op.tier in (DISK, S3):
                self.policy.fill_failed(op.block_hash, op.slot)  # the slot claimed to stage it
            self.policy.release(op.slot)
        op.slot, op.tier = -1, ""

    def _count_decisions(self, lookup: _Lookup, loaded: int) -> None:
        """One decision per tier holding part of this request's hit: loaded, skipped
        (the cost model cut the hit before that tier's blocks), or no_room (every CPU
        slot it could have been staged through was held by a transfer)."""
        fits = len(lookup.hit) if lookup.fits is None else lookup.fits
        for tier in dict.fromkeys(lookup.hit):
            if tier in lookup.hit[:loaded]:
                decision = "load"
            elif tier in lookup.hit[:fits]:
                decision = "skip"
            else:
                decision = "no_room"
            if decision == "load" and self.cost is not None:
                self.cost.loading(tier)
            LOAD_DECISIONS.labels(tier, decision).inc()
            self.stats[f"decision_{decision}_{tier}"] += 1
            self._decisions[(tier, decision)] += 1

    def take_decisions(self) -> Counter:
        """(tier, decision) -> requests since the last call, for vLLM's connector stats."""
        decisions, self._decisions = self._decisions, Counter()
        return decisions

    def take_dropped_stores(self) -> int:
        """Blocks not stored since the last call because every CPU slot was held by a
        transfer, for vLLM's connector stats."""
        dropped, self._dropped_stores = self._dropped_stores, 0
        return dropped

    def hit_tiers(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """Tokens of this request's planned hit, by the tier each block was found in
        (a block lost since is still counted where it was found: vLLM recomputes it
        and counts the recompute apart). Asked once, right after the plan is made."""
        blocks = self._hit_tiers.pop(req_id, None)
        if not blocks or sum(blocks.values()) * self.block_size != num_external_tokens:
            return {}
        return {tier: count * self.block_size for tier, count in blocks.items()}

    def _plan_load(self, block_hash: bytes, gpu_block: int, tier: str, may_stage: bool) -> BlockOp:
        """Pin the block's CPU slot (or a new one to stage it into). A block lost since
        the lookup gets tier "" and the worker reports it as failed: vLLM recomputes it.
        A disk block of a synchronous load is read in the forward, through no slot.
        A block gone from the CPU tier falls back to disk where its load can read it.
        A block whose slot another transfer is filling (a staging planned for another
        request, a store) is copied from that slot once the fill is done: an
        asynchronous load waits for it, pinning the slot meanwhile."""
        if may_stage and self.policy.filling(block_hash):
            slot = self.slots.pin(block_hash)
            assert slot is not None  # filling: it holds a slot
            return BlockOp(block_hash, gpu_block, slot, CPU, after_fill=True)
        if tier == CPU:
            slot = self.policy.pin_ready(block_hash)
            if slot is not None:
                return BlockOp(block_hash, gpu_block, slot, CPU)
            reads_disk = may_stage or self.disk_in_forward
            tier = DISK if reads_disk and block_hash in self.policy.on_disk else ""
        if not tier:
            return BlockOp(block_hash, gpu_block, -1, "")
        if tier == DISK and not may_stage:
            return BlockOp(block_hash, gpu_block, -1, DISK)
        if block_hash in self.slots:  # a store or another load is filling it right now
            return BlockOp(block_hash, gpu_block, -1, "")
        try:
            slot = self.policy.claim(block_hash)
        except CpuTierFull:
            return BlockOp(block_hash, gpu_block, -1, "")
        return BlockOp(block_hash, gpu_block, slot, tier)

    # -- each step ------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TierCacheMetadata:
        meta = TierCacheMetadata(
            write_backs=self.policy.take_write_backs(),
            loads=self._pending_loads,
            stores=[],
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            loads_early=not _touches_blocks_before_forward(scheduler_output),
        )
        self._building = meta  # what fail_step undoes, should this raise
        if self.cost is not None and self._computes_prompt(scheduler_output):
            meta.timed_tokens = scheduler_output.total_num_scheduled_tokens
        self._pending_loads = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.group_block_ids = [list(ids) for ids in new.block_ids]
            state.block_ids = state.group_block_ids[0]
            self._plan_stores(state, new.req_id, new.num_computed_tokens, scheduler_output, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.group_block_ids = [list(ids) for ids in new_ids] if new_ids else []
                state.block_ids = state.group_block_ids[0] if state.group_block_ids else []
            elif new_ids:
                if len(state.group_block_ids) != len(new_ids):
                    state.group_block_ids = [state.block_ids] + [[] for _ in new_ids[1:]]
                for ids, added in zip(state.group_block_ids, new_ids, strict=True):
                    ids.extend(added)
                state.block_ids = state.group_block_ids[0]
            self._plan_stores(state, req_id, cached.num_computed_tokens[i], scheduler_output, meta)
        self._note_store_reads(meta)
        self._order_copies(scheduler_output, meta)
        # Write-backs found while planning stores this step still precede them.
        meta.write_backs.extend(self.policy.take_write_backs())
        # A lookup is planned from only in the step it was made in (update_state_after_alloc).
        self._step += 1
        self._hit_tiers.clear()
        self._building = None
        return meta

    def _order_copies(self, output: SchedulerOutput, meta: TierCacheMetadata) -> None:
        """What the workers need to order this step's copies on the GPU without
        waiting for them (connector/sync.py)."""
        meta.full_graph = self.full_graphs is not None and self.full_graphs.may_replay(
            output.num_scheduled_tokens
        )
        if self.kv_in_host_memory:
            return  # every copy is over when its hook returns
        # vLLM frees a preempted request's blocks at once, with no say for the
        # connector (Scheduler._preempt_request calls no connector hook that could
        # delay it): this step's forward may write them, so it waits on the GPU for
        # the store copies still reading them. The same holds when a sliding window
        # or Mamba group frees blocks of a running request.
        preempted = self._storing.intersection(getattr(output, "preempted_req_ids", None) or ())
        meta.fence_stores = bool(preempted) or (self.hybrid and self._stored_last_step)
        self._storing -= preempted  # their copies are fenced: nothing left to delay
        self._storing.update(op.req_id for op in meta.stores)
        self._stored_last_step = bool(meta.stores)
        meta.finished_storing, self._finished_storing = self._finished_storing, []

    def take_finished_storing(self) -> list[str]:
        """The requests whose blocks vLLM keeps for the workers and not yet told them
        of (a step whose plan failed carries them instead)."""
        finished, self._finished_storing = self._finished_storing, []
        return finished

    def _note_store_reads(self, meta: TierCacheMetadata) -> None:
        """Which of this step's synchronous loads each storing request reads. vLLM's
        prefix cache shares a block being loaded with every request scheduled after
        its loader in the same step, so a request that loads nothing may still compute
        its blocks over a load that fails: vLLM recomputes them then, and the workers
        must not store what this step made of them."""
        loading = {op.gpu_block for job in meta.loads if not job.is_async for op in job.ops}
        if not loading:
            return
        for req_id in {op.req_id for op in meta.stores}:
            state = self._requests.get(req_id)
            tables = (state.group_block_ids or [state.block_ids]) if state is not None else []
            reads = sorted(loading.intersection(block for ids in tables for block in ids))
            if reads:
                meta.store_reads[req_id] = reads

    def _computes_prompt(self, output: SchedulerOutput) -> bool:
        """Whether this step computes prompt tokens (a prefill, or a chunk of one):
        its forward then says what recomputing a prompt costs. Decode-only steps
        would say little about that and, being most steps, crowd out what does."""
        if output.scheduled_new_reqs:
            return True
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is not None and cached.num_computed_tokens[i] < state.request.num_prompt_tokens:
                return True
        return False

    def _plan_stores(
        self, state: _Request, req_id: str, computed: int, output: SchedulerOutput, meta: TierCacheMetadata
    ) -> None:
        if self._stores_held:
            return  # see reset_cache
        request = state.request
        done_tokens = computed + output.num_scheduled_tokens.get(req_id, 0)
        limit = min(done_tokens // self.block_size, len(request.block_hashes))
        if not self.hybrid:
            limit = min(limit, len(state.block_ids))
        if not self.config.store_decode:
            limit = min(limit, request.num_prompt_tokens // self.block_size)
        # vLLM computes blocks again that it had counted as computed after a load
        # failed (from the lost block on) or a preemption: they are stored as they come,
        # unless a tier holds them.
        state.next_block = min(state.next_block, computed // self.block_size)
        tier_full = False
        for block_hash, gpu_block, vllm_hash, group in self._store_candidates(state, limit, done_tokens):
            if block_hash in self.slots or block_hash in self.policy.on_disk:
                continue
            if not tier_full:
                try:
                    slot = self.policy.claim(block_hash)
                except CpuTierFull:
                    tier_full = True
            if tier_full:
                # Every slot is held by a transfer (none frees during this loop): the
                # rest of the range is not stored (a later request for it recomputes),
                # and the operator sees it counted.
                self._dropped_stores += 1
                continue
            self._name(block_hash, vllm_hash, group)
            meta.stores.append(BlockOp(block_hash, gpu_block, slot, CPU, req_id))
        planned = limit > state.next_block
        state.next_block = max(state.next_block, limit)
        if planned and not self.config.store_decode and limit >= request.num_prompt_tokens // self.block_size:
            # The prompt's last full block is stored now: nothing more of this request
            # will come, so its S3 run need not wait for the request to finish.
            meta.stores_done.append(req_id)

    def _store_candidates(self, state: _Request, limit: int, done_tokens: int):
        """(name, paged-KV block, vLLM's hash, group) of each block computed up to
        `limit` that a later hit may need: one per block, or with several KV cache
        groups, each group's that its rule keeps (groups.py), under its group's name."""
        request = state.request
        for i in range(state.next_block, limit):
            vllm_hash = request.block_hashes[i]
            if not self.hybrid:
                yield self._block_key(vllm_hash), state.block_ids[i], vllm_hash, 0
                continue
            for group, rule in enumerate(self.group_rules):
                ids = state.group_block_ids[group] if group < len(state.group_block_ids) else []
                if i >= len(ids) or ids[i] == NULL_BLOCK or not rule.stores(i, done_tokens, self.block_size):
                    continue
                yield group_key(self._block_key(vllm_hash), group), ids[i], vllm_hash, group

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, TierCacheWorkerMetadata):
            self.stats.update(worker_meta.hits)
            for rank, kind, value in worker_meta.reports:
                self._on_report(rank, kind, value)
            if self.cost is not None:
                for what, units, seconds in worker_meta.timings:
                    if what == FORWARD:
                        self.cost.observe_forward(units, seconds)
                    else:
                        self.cost.observe_load(what, units, seconds)
        for req_id in connector_output.finished_recving or ():
            self._load_slots.pop(req_id, None)

    def _on_report(self, rank: int, kind: str, value) -> None:
        if kind == RELEASED:
            for _ in range(self.ledger.release(rank, value)):
                self.policy.release(value)
        elif kind == FILLED:
            block_hash, slot = value
            if not self.policy.holds(block_hash, slot):
                self.ledger.end_fill(block_hash, slot)  # that fill ended: the report is stale
            elif self.ledger.fill(rank, block_hash, slot) and self.policy.filled(block_hash, slot):
                self.load_failures.discard(block_hash)
        elif kind in (FILL_FAILED, STORE_VOID):
            block_hash, slot = value
            self.ledger.end_fill(block_hash, slot)
            self.policy.fill_failed(block_hash, slot)
            if kind == FILL_FAILED:  # a void store says nothing of the block's other copies
                self.load_failures.add(block_hash)
        elif kind == ON_DISK:
            if self.ledger.stored_on_disk(rank, value):
                self.policy.stored_on_disk(value)
                self.load_failures.discard(value)
        elif kind == OFF_DISK:
            self.ledger.gone_from_disk(rank, value)
            self.policy.gone_from_disk(value)
        elif kind == READ_FAILED:
            self.load_failures.add(value)

    def request_finished(self, request: Request) -> tuple[bool, None]:
        """vLLM keeps the request's blocks (True) while a store copy may still read
        them: on CUDA, where a step's copies end after its hooks returned, for a request
        that stored since it last started. The workers report it in finished_sending
        once those copies are over (TierCacheWorker.take_finished_sending)."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._lookups.pop(req_id, None)
        if req_id not in self._storing:
            return False, None
        self._storing.discard(req_id)
        self._finished_storing.append(req_id)
        return True, None

    def gauges(self) -> dict[str, int]:
        """What must come back to zero once traffic stops, for vLLM's /metrics: CPU
        slots pinned by transfers, and requests waiting on a disk or S3 load."""
        return {"pinned_slots": self.slots.pinned(), "loads_in_flight": len(self._load_slots)}

    # -- after a failure (connector/guard.py) -------------------------------------------
    def fail_step(self) -> TierCacheMetadata:
        """`build_connector_meta` raised: the plan that goes out instead. vLLM has
        scheduled the loads planned for this step all the same, so they go out as
        loads whose every block fails (vLLM recomputes them, and hears each async one
        finished); the slots they and the step's stores pinned are freed here, and no
        store is made."""
        building, self._building = self._building, None
        jobs = building.loads if building is not None else self._pending_loads
        stores = building.stores if building is not None else []
        self._pending_loads = []
        failed: list[LoadJob] = []
        for job in jobs:
            for op in job.ops:
                if op.slot >= 0:
                    if op.tier != CPU:  # a slot claimed to stage into: never filled
                        self.policy.fill_failed(op.block_hash, op.slot)
                    self.policy.release(op.slot)
            ops = [BlockOp(op.block_hash, op.gpu_block, -1, "") for op in job.ops]
            failed.append(LoadJob(job.req_id, ops, job.is_async))
        self.drop_stores(stores)
        return TierCacheMetadata(loads=failed, finished_storing=self.take_finished_storing())

    def plan_failed_load(self, req_id: str, gpu_blocks: list[int], is_async: bool) -> None:
        """`update_state_after_alloc` raised for a request vLLM now expects `gpu_blocks`
        loaded into: a load whose every block fails, so vLLM recomputes them."""
        ops = [BlockOp(b"", block, -1, "") for block in gpu_blocks]
        self._pending_loads.append(LoadJob(req_id, ops, is_async))

    def drop_stores(self, stores: list[BlockOp]) -> None:
        """These planned stores will not be made: forget their blocks, free their slots."""
        for op in stores:
            self.policy.fill_failed(op.block_hash, op.slot)
            self.policy.release(op.slot)

"""The scheduler half of the connector: it finds the longest cached prefix of each
request across the tiers, decides what each worker loads and stores, and owns the
CPU tier's slot map (every TP rank keeps its own shard in the same slot number).
Its parts: lookups (lookup.py, group_lookup.py), load plans (load_planning.py), store
plans (store_planning.py); this module sets it up, plans each step and takes the
workers' reports.

It never waits on a worker: workers report what happened through worker metadata,
and a block counts as cached only once every rank has reported it."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections import Counter
from typing import TYPE_CHECKING

from tiercache.admission import admission_for
from tiercache.config import TierCacheConfig, unbounded_warnings
from tiercache.index.block_hashing import BlockHashing
from tiercache.index.keys import KVSpec
from tiercache.index.presence import PresencePublisher
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import Deployment, RedisIndex
from tiercache.index.request_counts import FLEET_COUNTS_REMEMBERED, FleetRequestCounts
from tiercache.object_shape import ObjectShape
from tiercache.policy import BlockPolicy, reads_disk_in_forward
from tiercache.tiers import CPU
from tiercache.tiers.cpu import slots_for
from tiercache.tiers.disk.layout import DiskLayout
from tiercache.tiers.peer.agent import load_nixl

from .cost_model import LoadCostModel
from .events import TierEvents
from .graphs import FullGraphs
from .group_lookup import GroupLookup
from .groups import FULL, STATE, WINDOW, group_rules
from .ledger import ReportLedger
from .load_failures import RecentLoadFailures
from .load_planning import LoadPlanning
from .lookup import Lookups
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
from .peer_lookup import PeerLookup
from .scheduler_state import S3_LOOKUP_REUSE_SECONDS, Lookup, RequestState
from .store_planning import StorePlanning
from .weights_fingerprint import loaded_weights_epoch

if TYPE_CHECKING:
    # For annotations only: the scheduler half is handed these by the connector.
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("tiercache.connector")


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


class TierCacheScheduler(Lookups, LoadPlanning, StorePlanning):
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
        # The group whose blocks presence lists: a hybrid model's first full-attention
        # one, a router's upper bound of the hit (the service's lookup API).
        full = [group for group, rule in enumerate(self.group_rules) if rule.kind == FULL]
        self.presence_group = full[0] if full and self.hybrid else 0
        # Filled, ready and on disk mean: on every rank (see ledger.py).
        self.policy = BlockPolicy(
            slots_for(config.cpu.capacity, self.slot_bytes),
            self.slot_bytes,
            write_back=config.movers.policy == "write_back",
            admission=admission_for(config, slots_for(config.cpu.capacity, self.slot_bytes), self.slot_bytes),
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
        # How this instance is named in Redis (its presence, its workers' peer records).
        self.instance = config.instance_id or f"{socket.gethostname()}-{os.getpid()}"
        self._count_fleet_requests()
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
        self.peers = self._peer_lookup()
        self._requests: dict[str, RequestState] = {}
        # Per waiting request, its last lookup: planned from in the step it was made,
        # its S3 answer reused while the request waits (vLLM asks every step).
        self._lookups: dict[str, Lookup] = {}
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
        # Lookups of several KV cache groups (group_lookup.py).
        self.groups = GroupLookup(
            self.group_rules,
            self.block_size,
            self.policy,
            self.load_failures,
            self.s3_index,
            self.model_digest,
            self.rank_digests,
            self.cost,
            S3_LOOKUP_REUSE_SECONDS,
            presence_group=self.presence_group,
            peer_ask_from=self._peer_ask_from if self.peers is not None else None,
            ask_peers=self._ask_peers if self.peers is not None else None,
        )

    # -- startup ------------------------------------------------------------------
    def _count_fleet_requests(self) -> None:
        """The selective policy's S3 admission counts requests across the fleet, in
        Redis (tiercache/index/request_counts.py), where there is an S3 to admit to."""
        admission, ttl = self.policy.admission, self.config.movers.selective_fleet_ttl_seconds
        if admission is None or self.redis is None or self.s3_index is None or ttl <= 0:
            return
        admission.fleet = FleetRequestCounts(
            self.redis,
            self.model_digest,
            ttl=ttl,
            remembered=min(4 * self.slots.num_slots, FLEET_COUNTS_REMEMBERED),
            popular_at=admission.everywhere_min_requests,
        )

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
                self.instance,
                ttl=self.config.presence.ttl,
                interval=self.config.presence.interval,
            )
        if not kv_events and presence is None:
            return None
        events = TierEvents(
            self.policy,
            self.block_size,
            publish=kv_events,
            presence=presence,
            hybrid=self.hybrid,
            presence_group=self.presence_group,
        )
        self.policy.watcher = events
        return events

    def _peer_lookup(self) -> PeerLookup | None:
        """Other instances' CPU tiers, where `peer.enabled` asks for them. Holders are
        found through presence, which a model of several KV cache groups publishes for
        one group only: the others' blocks are planned from the same holder
        (group_lookup.py)."""
        if not self.config.peer.enabled or self.redis is None:
            return None
        if self.tier_events is None or self.tier_events.presence is None:
            log.warning("tiercache: the peer tier needs presence.enabled: it is off")
            return None
        if load_nixl() is None:  # the workers cannot read (warned): plan no peer loads
            return None
        return PeerLookup(self.redis, self.model_digest, self.instance)

    def take_events(self) -> list:
        """vLLM KV events for this step's tier changes (connector.take_events)."""
        return self.tier_events.take() if self.tier_events is not None else []

    def close(self) -> None:
        """The engine shuts down: this instance's presence leaves Redis now."""
        if self.tier_events is not None and self.tier_events.presence is not None:
            self.tier_events.presence.close()
        if self.policy.admission is not None and self.policy.admission.fleet is not None:
            self.policy.admission.fleet.close()

    # -- new weights ------------------------------------------------------------------
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

    # -- each step ------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TierCacheMetadata:
        meta = TierCacheMetadata(
            write_backs=self.policy.take_write_backs(),
            loads=self._pending_loads,
            stores=[],
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            loads_early=not _touches_blocks_before_forward(scheduler_output),
            # The workers share their CPU tiers under this instance's name.
            instance=self.instance if self.peers is not None else "",
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
        self.policy.queue_popular()
        # Write-backs found while planning stores this step still precede them.
        meta.write_backs.extend(self.policy.take_write_backs())
        meta.write_back_tiers = self.policy.take_write_back_tiers()
        # A lookup is planned from only in the step it was made in (update_state_after_alloc).
        self._step += 1
        self._hit_tiers.clear()
        self._building = None
        return meta

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

    # -- reports ----------------------------------------------------------------------
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

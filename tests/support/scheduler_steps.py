"""Stand-ins for what vLLM hands the connector's scheduler half each step, shared by
the tests that drive it without an engine: a scheduler output, the blocks vLLM
allocated for a request, and one rank's worker reports arriving."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from tiercache.connector.metadata import TierCacheWorkerMetadata


def no_cached_requests() -> SimpleNamespace:
    return SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])


def scheduler_output(new=(), cached=None, scheduled=None) -> SimpleNamespace:
    """A step's SchedulerOutput: `new` requests, `cached` (running or resumed) ones,
    and `scheduled` tokens by request."""
    scheduled = scheduled or {}
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or no_cached_requests(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
    )


def new_request(req, block_ids, num_computed_tokens: int = 0) -> SimpleNamespace:
    """A request scheduled for the first time, with its block table."""
    return SimpleNamespace(
        req_id=req.request_id, block_ids=(list(block_ids),), num_computed_tokens=num_computed_tokens
    )


def blocks_of(ids) -> SimpleNamespace:
    """The KVCacheBlocks vLLM passes to update_state_after_alloc."""
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def report(sched, *events, rank: int = 0, hits=()) -> None:
    """One step's reports from one rank, as the workers' metadata brings them."""
    meta = TierCacheWorkerMetadata([(rank, kind, value) for kind, value in events], Counter(hits))
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta, finished_recving=set()))

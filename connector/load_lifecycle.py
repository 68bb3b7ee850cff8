"""One lifecycle for a load, from the scheduler's plan to the one report of its end.

On the worker a load (one request's `LoadJob`) goes through these states:

    planned -> staging -> staged -> copying -> ended
    (a synchronous CPU-tier hit goes from planned to copying; every failure, from
    any state, is a transition into ended)

- staging: an asynchronous load's disk and S3 blocks are read into their CPU slots,
  and its blocks whose slot another transfer is filling (`BlockOp.after_fill`) wait
  for that fill;
- staged: what staging brought is known block by block;
- copying: the longest good prefix is copied into the paged KV;
- ended: `LoadEnds.end`, exactly once, the one place that tells vLLM.

What vLLM is told depends on the model. With one KV cache group a failed block is
reported by its id and vLLM recomputes from there. With several, block ids repeat
across groups and vLLM refuses such reports (its engine core dies): the whole request
fails instead (`failed_recving`), which vLLM honours only for a request still waiting
for remote KV, so the scheduler plans every hit of such a model as an asynchronous
load. An asynchronous load is reported only once its copy into the paged KV is done
or queued ahead of every later forward (CUDA): once told, vLLM may schedule the
request, or abort it and hand its blocks to another, and a failure found after that
could not be reported at all (vLLM looks for failed blocks only among requests that
wait for remote KV or run)."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tiercache.tiers import CPU, DISK

from .metadata import BlockOp, LoadJob


class LoadState(enum.Enum):
    PLANNED = "planned"
    STAGING = "staging"
    STAGED = "staged"
    COPYING = "copying"
    ENDED = "ended"


def settled(filled: bool) -> Future:
    future: Future = Future()
    future.set_result([filled])
    return future


# The fill of a slot that will never hold its block: a store made void (its block was
# computed over a failed load), or a staging given up.
VOID = settled(False)


@dataclass
class Fill:
    """The last fill of a CPU slot on this rank: its block, and the future whose
    result list says at `index` whether the copy in succeeded."""

    block_hash: bytes
    future: Future
    index: int = 0

    def done(self) -> bool:
        return self.future.done()

    def ok(self) -> bool:
        # A staging given up before it started is cancelled: the slot never filled.
        if not self.future.done() or self.future.cancelled() or self.future.exception() is not None:
            return False
        return bool(self.future.result()[self.index])


def reads_in_forward(op: BlockOp) -> bool:
    """A disk block of a synchronous load: read from its object into the paged KV
    during the forward, through no CPU slot (disk_reads.py)."""
    return op.tier == DISK and op.slot < 0


def stages_into_slot(op: BlockOp) -> bool:
    """A block read from disk or S3 into a CPU slot claimed for it."""
    return op.tier != CPU and op.slot >= 0


@dataclass
class Load:
    job: LoadJob
    started: float = field(default_factory=time.perf_counter)
    state: LoadState = LoadState.PLANNED
    # Per lower tier: its blocks, and the staging of them (results in that order).
    staged: list[tuple[str, list[BlockOp], Future]] = field(default_factory=list)
    staged_at: dict[str, float] = field(default_factory=dict)  # tier -> when its last block was in
    # Blocks another transfer is filling the slot of, and that fill (None: this rank
    # knows of no such fill, and the block fails).
    after_fills: list[tuple[BlockOp, Fill | None]] = field(default_factory=list)
    # Ops whose slot is still this load's to give back (released, or handed to the
    # movers): each is given back exactly once.
    slots_owed: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.slots_owed = {id(op) for op in self.job.ops if op.slot >= 0}

    @property
    def ended(self) -> bool:
        return self.state is LoadState.ENDED

    def waits_on(self) -> list[Future]:
        fills = [fill.future for _, fill in self.after_fills if fill is not None]
        return [future for _, _, future in self.staged] + fills

    def staging_over(self) -> bool:
        return all(future.done() for future in self.waits_on())

    def staged_ok(self) -> dict[int, bool]:
        """Per op id, whether its bytes are in its slot (only for ops that had to be
        brought there; a CPU-tier block is there already)."""
        ok = {id(op): fill is not None and fill.ok() for op, fill in self.after_fills}
        for _, ops, future in self.staged:
            results = future.result() if future.done() and not future.cancelled() else [False] * len(ops)
            ok.update({id(op): bool(good) for op, good in zip(ops, results, strict=True)})
        return ok


def good_prefix(ops: list[BlockOp], staged_ok: dict[int, bool]) -> tuple[list[BlockOp], list[BlockOp]]:
    """The blocks to load and those that fail: a prefix must be whole, so every block
    after a failed one fails too."""
    for index, op in enumerate(ops):
        ok = staged_ok.get(id(op), False) or (op.tier == CPU and not op.after_fill)
        if not ok:
            return ops[:index], ops[index:]
    return list(ops), []


class LoadEnds:
    """What vLLM is told of loads, collected until it asks: the one place a load ends."""

    def __init__(self, fails_whole_requests: bool):
        # With several KV cache groups vLLM takes no block-level failures.
        self.fails_whole_requests = fails_whole_requests
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.failed_blocks: set[int] = set()

    def end(self, load: Load, failed: list[BlockOp]) -> bool:
        """End `load`, its `failed` blocks not loaded (vLLM recomputes them). False,
        and nothing reported, for a load that ended already."""
        if load.ended:
            return False
        load.state = LoadState.ENDED
        if failed:
            if self.fails_whole_requests:
                self.failed_recving.add(load.job.req_id)
            else:
                self.failed_blocks.update(op.gpu_block for op in failed)
        if load.job.is_async:
            self.finished_recving.add(load.job.req_id)
        return True

    def take_finished(self) -> set[str]:
        done, self.finished_recving = self.finished_recving, set()
        return done

    def take_failed_requests(self) -> set[str]:
        failed, self.failed_recving = self.failed_recving, set()
        return failed

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

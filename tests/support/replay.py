"""Replay an engine's recorded connector calls (scripts/record_connector_calls.py)
against the worker half, without vLLM, on KV tensors in vLLM's GPU layouts.

The worker sees the calls in the order vLLM's GPU model runner made them:
`start_load_kv` before the forward only in steps with synchronous loads, else after
it; a forward that per layer calls `wait_for_layer_load`, then reads and writes the
layer's KV, then `save_kv_layer`; then `wait_for_save`, `get_finished`,
`get_block_ids_with_load_errors`, the stats and `build_connector_worker_meta`. (vLLM's
CPU model runner is the GPU model runner; the recording is its order.)

The KV is a deterministic function of (block hash, layer, rank): the forward writes
`content(...)` into every full block it computes, so every block it reads, loaded
or computed, must hold exactly that. At each layer, right after the worker's
`wait_for_layer_load` returned, the replay checks every block the step's forward
reads: a load that lands after the forward read it, in the wrong block, from the
wrong slot or with a layer mixed up fails there, naming step, layer and block.

The worker's tiers are real (CPU slots, a disk folder, S3 and Redis as the caller
gives them). Two things are pinned to the recording so that timing cannot make the
replay differ from it: a disk or S3 staging completes no earlier than the step whose
`get_finished` reported it in the recording (and the replay waits for it there), and
each step's write-downs are flushed at its end (so a later hit finds its object).

On a CUDA device (`device="cuda"`) the KV lives on the GPU and the worker takes its
CUDA path: pinned CPU slots, loads and stores queued on the copier's stream, events
the forward's stream waits on. The forward's reads and writes are then kernels on the
forward's stream too, and the check of each layer's reads is queued there, read back
only when the step's forward is over: the host never waits in between, so a copy not
ordered against the forward shows up as wrong KV, as it would in vLLM, instead of
being hidden by a host synchronisation. The stand-in forward runs under torch's sync
debug mode set to fail, so that it cannot synchronise by accident (an upload from
pageable memory would); the worker's per-layer hooks run under it set to warn, and
`ReplayResult.hook_syncs` counts what they synchronised. Explicit waits
(`connector/sync.host_wait`, the one place the worker holds the host for the GPU)
fail the replay in any hook of a step: stores and loads must be ordered by events
and polled, never waited for. (`host_waits_for_copies` brings back the old way, each
copy waited for in the hook that queued it, for benchmarks/gpu_step.py to compare:
its waits are counted, not failed.) `attention_cycles` adds that
much GPU sleep to each layer's attention, between its reads and its writes, as a
longer forward would: a store copied before the forward wrote its layer then copies
stale KV."""

from __future__ import annotations

import copy
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiercache.config import build_config
from tiercache.connector import sync
from tiercache.connector.metadata import BlockOp, LoadJob, TierCacheMetadata
from tiercache.connector.worker import TierCacheWorker
from tiercache.index.keys import KVSpec

# The replay's own block interior: its content is synthetic, so any shape will do.
BLOCK_SIZE, HEADS, HEAD_SIZE = 16, 2, 8
LAYOUTS = {
    # FlashAttention: K and V apart, the block dimension second.
    "flash_attn": lambda n: (2, n, BLOCK_SIZE, HEADS, HEAD_SIZE),
    # FlashInfer: the block dimension first, K and V inside each block.
    "flashinfer": lambda n: (n, 2, BLOCK_SIZE, HEADS, HEAD_SIZE),
}
BLOCK_DIM = {"flash_attn": 1, "flashinfer": 0}
PARTIAL = -1.0  # what a block not yet full holds: never read back, never stored
BOUND = "a recording registers the KV caches, and binds a step's metadata before its other calls"


def content(hash_number: int, layer: int, rank: int) -> torch.Tensor:
    """What the forward writes into a full block of this hash, layer and rank."""
    generator = torch.Generator().manual_seed(hash_number * 1_000_003 + layer * 1009 + rank * 7 + 1)
    return torch.rand((2, BLOCK_SIZE, HEADS, HEAD_SIZE), generator=generator) + 1.0


def decode_meta(meta: dict[str, Any]) -> TierCacheMetadata:
    def op(entry: list) -> BlockOp:
        number, gpu_block, slot, tier = entry
        return BlockOp(number.to_bytes(32, "big"), gpu_block, slot, tier)

    return TierCacheMetadata(
        write_backs=[(number.to_bytes(32, "big"), slot) for number, slot in meta["write_backs"]],
        loads=[LoadJob(job["req"], [op(e) for e in job["ops"]], job["async"]) for job in meta["loads"]],
        stores=[op(e) for e in meta["stores"]],
        idle=meta["idle"],
        timed_tokens=meta.get("timed_tokens", 0),
    )


def _number(value: Any) -> Any:
    """A report value with block hashes as the recording's numbers."""
    if isinstance(value, tuple):
        return (int.from_bytes(value[0], "big"), value[1])
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    return value


@dataclass
class ReplayResult:
    steps: int = 0
    calls: Counter = field(default_factory=Counter)
    reads_checked: int = 0
    loaded_reads_checked: Counter = field(default_factory=Counter)  # tier -> block reads from a load
    hits: Counter = field(default_factory=Counter)  # tier -> blocks the worker loaded
    reports: Counter = field(default_factory=Counter)  # (kind, value) -> count
    hook_syncs: Counter = field(default_factory=Counter)  # per-layer hook -> host synchronisations (CUDA)
    sync_sites: Counter = field(default_factory=Counter)  # the call stack of each, innermost last
    hook_waits: Counter = field(default_factory=Counter)  # hook -> explicit host waits (sync.host_wait)
    hook_seconds: dict[str, float] = field(default_factory=dict)  # hook -> host time spent in it
    step_seconds: list[float] = field(default_factory=list)  # each step, bind to its worker metadata


class _GatedStaging:
    """Stands in for the tier engine's `stage_many`: the real reads run at once, but the
    futures the worker polls complete only when the replay reaches the step in which
    the recording saw the request's load finish."""

    def __init__(self, real_stage_many):
        self._real = real_stage_many
        self.owners: dict[tuple[bytes, int], str] = {}  # (block hash, slot) -> req id
        self._gates: dict[str, list[tuple[Future, Future]]] = {}
        self._lock = threading.Lock()

    def __call__(self, items) -> Future:
        block_hash, slot, _ = items[0]
        gate: Future = Future()
        with self._lock:
            self._gates.setdefault(self.owners[(block_hash, slot)], []).append((self._real(items), gate))
        return gate

    def release(self, req_ids, timeout: float = 60.0) -> None:
        for req_id in req_ids:
            with self._lock:
                pairs = self._gates.pop(req_id, [])
            for real, gate in pairs:
                gate.set_result(real.result(timeout=timeout))


class Replay:
    """One rank's recorded calls, replayed on a fresh worker. `tiers` is the
    kv_connector_extra_config for the disk, S3 and Redis tiers (the CPU tier is sized
    here from the recording). `loads_after_forward` breaks vLLM's order on purpose:
    every `start_load_kv` runs after the forward, as if no step had synchronous loads."""

    def __init__(
        self,
        recording: dict[str, Any],
        layout: str,
        tiers: dict[str, Any],
        rank: str = "0",
        loads_after_forward: bool = False,
        device: str = "cpu",
        attention_cycles: int = 0,
        host_waits_for_copies: bool = False,
        check_reads: bool = True,
    ):
        """`check_reads`: False leaves out the read checks, whose
        read-back holds the host at each step's end (benchmarks time the hooks alone)."""
        self.recording = recording
        self.calls = recording["workers"][rank]
        self.schedule = {step["step"]: step for step in recording["schedule"]}
        self.rank = int(rank)
        self.layout = layout
        self.loads_after_forward = loads_after_forward
        self.device = torch.device(device)
        self.attention_cycles = attention_cycles if self.device.type == "cuda" else 0
        header = recording["kv"]
        self.num_blocks = header["num_blocks"]
        if self.num_blocks in LAYOUTS[layout](0)[1:] + (2,):
            raise ValueError(f"{self.num_blocks} blocks: a block interior dimension has that size too")
        # The forward's order, as the recording's first full step shows it.
        self.layers = list(dict.fromkeys(c[1] for c in self.calls if c[0] == "wait_for_layer_load"))
        self.layer_number = {name: i for i, name in enumerate(self.layers)}
        self.kv = {
            name: torch.zeros(LAYOUTS[layout](self.num_blocks), device=self.device)
            for name in sorted(header["layers"])
        }
        self.blocks = {name: t.movedim(BLOCK_DIM[layout], 0) for name, t in self.kv.items()}
        slot_bytes = sum(t.numel() * t.element_size() for t in self.kv.values()) // self.num_blocks
        config = build_config(
            {
                **tiers,
                "namespace": "replay",
                "cpu": {"capacity": header["cpu_slots"] * slot_bytes},
            }
        )
        spec = KVSpec(
            "replay",
            "",
            "float32",
            "auto",
            BLOCK_SIZE,
            layout,
            len(self.kv),
            HEADS,
            HEAD_SIZE,
            1,
            self.rank,
            "replay",
            slot_bytes,
        )
        self.slot_bytes = slot_bytes
        self.worker = TierCacheWorker(
            config,
            spec,
            "replay",
            self.num_blocks,
            tp_rank=self.rank,
            writes_lower_tiers=True,
            disk_share=config.disk.capacity if config.disk else 0,
        )
        self.worker.copies.host_waits = host_waits_for_copies
        self.host_waits_for_copies = host_waits_for_copies
        self.check_reads = check_reads
        self._hook: str | None = None  # the worker hook running now, if any
        self._step_number = 0
        self._contents: dict[tuple[int, int], torch.Tensor] = {}
        # Per layer of the step's forward: what it read, and a device tensor saying
        # which of those reads found the wrong KV (read back when the forward is over).
        self._checks: list[tuple[int, str, list[tuple[int, int, str | None]], torch.Tensor]] = []
        self.result = ReplayResult()

    def _content(self, number: int, layer: int) -> torch.Tensor:
        key = (number, layer)
        if key not in self._contents:
            self._contents[key] = self._upload(content(number, layer, self.rank))
        return self._contents[key]

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the replay's device without holding the host: from pageable
        memory, torch waits for the stream to drain."""
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    @contextmanager
    def _syncs(self, mode: str, hook: str | None = None) -> Iterator[None]:
        """On CUDA, torch's sync debug mode inside: "error" fails on a host
        synchronisation; "warn" counts them against `hook`."""
        if self.device.type != "cuda":
            yield
            return
        previous = torch.cuda.get_sync_debug_mode()
        stacks: list[str] = []

        def note(message, *_args, **_kwargs) -> None:
            if "called a synchronizing" in str(message):  # not torch's notice on entering the mode
                frames = reversed(traceback.extract_stack()[-10:-1])
                stacks.append(" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            torch.cuda.set_sync_debug_mode(mode)
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        if hook is not None:
            self.result.hook_syncs[hook] += len(stacks)
            self.result.sync_sites.update(stacks)

    @contextmanager
    def _in_hook(self, hook: str) -> Iterator[None]:
        """A worker hook of vLLM's step path: timed, and its explicit waits counted."""
        self._hook = hook
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = self.result.hook_seconds
            seconds[hook] = seconds.get(hook, 0.0) + time.perf_counter() - started
            self._hook = None

    def _host_wait(self, target: Any) -> None:
        """Stands in for `sync.host_wait` while the replay runs."""
        hook = self._hook
        if hook is not None:
            self.result.hook_waits[hook] += 1
            if not self.host_waits_for_copies:
                raise AssertionError(
                    f"step {self._step_number}: {hook} waited for the GPU (sync.host_wait): a hook of "
                    "the step path must order its copies by events, never hold the host"
                )
        self._real_host_wait(target)

    # -- the forward ----------------------------------------------------------------
    def _attention(self, step: dict[str, Any], name: str) -> None:
        """What an attention layer does with the paged KV: read what the step's requests
        computed or loaded before, then write this step's new KV. On CUDA, all of it
        kernels on the forward's stream, the host going straight on."""
        layer = self.layer_number[name]
        blocks = self.blocks[name]
        reads = step["reads"]
        if reads:
            index = self._upload(torch.tensor([gpu_block for gpu_block, _, _ in reads]))
            expected = torch.stack([self._content(number, layer) for _, number, _ in reads])
            wrong = (blocks.index_select(0, index) != expected).flatten(1).any(1)
            self._checks.append((step["step"], name, reads, wrong))
        if self.attention_cycles:
            torch.cuda._sleep(self.attention_cycles)
        for gpu_block, number in step["writes"]:
            if number < 0:
                blocks[gpu_block].fill_(PARTIAL)
            else:
                blocks[gpu_block].copy_(self._content(number, layer))

    def _check_reads(self) -> None:
        """Read back the checks the forward queued, and fail on the first wrong read."""
        checks, self._checks = self._checks, []
        if not checks:
            return
        wrong_by_layer = torch.cat([wrong for *_, wrong in checks]).tolist()
        at = 0
        for step_number, name, reads, _ in checks:
            found = wrong_by_layer[at : at + len(reads)]
            for (gpu_block, number, tier), wrong in zip(reads, found, strict=True):
                if wrong:
                    source = f"loaded from {tier}" if tier else "computed earlier"
                    raise AssertionError(
                        f"step {step_number}, layer {name}: GPU block {gpu_block} ({source}, hash "
                        f"#{number}) does not hold its KV when the forward reads it"
                    )
                self.result.reads_checked += 1
                if tier:
                    self.result.loaded_reads_checked[tier] += 1
            at += len(reads)

    # -- the calls --------------------------------------------------------------------
    def run(self) -> ReplayResult:
        worker = self.worker
        meta: TierCacheMetadata | None = None
        step: dict[str, Any] = {}  # the bound step's schedule
        staging: _GatedStaging | None = None
        deferred_start = False
        in_forward = False
        step_started = time.perf_counter()
        self._real_host_wait = sync.host_wait
        sync.host_wait = self._host_wait  # counted, see _host_wait
        try:
            for call in self.calls:
                name = call[0]
                self.result.calls[name] += 1
                if name == "register_kv_caches":
                    worker.register_kv_caches(self.kv, self.slot_bytes)
                    assert worker.engine is not None, worker.disabled_reason
                    staging = _GatedStaging(worker.engine.stage_many)
                    worker.engine.stage_many = staging  # type: ignore[method-assign]  # gated by the replay
                elif name == "bind":
                    meta = decode_meta(call[1])
                    step = self.schedule[call[1]["step"]]
                    self._step_number = step["step"]
                    step_started = time.perf_counter()
                    with self._in_hook("bind_connector_metadata"):
                        worker.forward_begins(meta)  # as the connector does when vLLM binds
                    in_forward = False
                    self.result.steps += 1
                elif name == "start_load_kv":
                    if self.loads_after_forward and not in_forward:
                        deferred_start = True
                        continue
                    assert meta is not None and staging is not None, BOUND
                    self._start(meta, staging)
                elif name == "wait_for_layer_load":
                    in_forward = True
                    with self._syncs("warn", name), self._in_hook(name):
                        worker.wait_for_layer(call[1])
                    with self._syncs("error"):
                        self._attention(step, call[1])
                elif name == "save_kv_layer":
                    assert meta is not None, BOUND
                    with self._syncs("warn", name), self._in_hook(name):
                        worker.save_layer(call[1], meta)
                elif name == "wait_for_save":
                    assert meta is not None and staging is not None, BOUND
                    if deferred_start:
                        deferred_start = False
                        self._start(meta, staging)
                    with self._in_hook(name):
                        worker.wait_for_save(meta)
                    if self.check_reads:
                        self._check_reads()
                elif name == "get_finished":
                    recorded = set(call[2] or ())
                    assert staging is not None, BOUND
                    staging.release(recorded)
                    with self._in_hook(name):
                        got = worker.get_finished()
                    assert got == recorded, (step["step"], "finished receiving", got, recorded)
                elif name == "get_block_ids_with_load_errors":
                    with self._in_hook(name):
                        failed = worker.take_failed_blocks()
                    assert failed == set(call[1]), (step["step"], "failed blocks", failed, call[1])
                elif name == "get_kv_connector_stats":
                    with self._in_hook(name):
                        stats = worker.take_stats()
                    counts = {} if stats is None else stats.data
                    for key, value in call[1].items():
                        if key.startswith(("loaded_blocks_", "failed_blocks_")) or key == "stored_blocks":
                            assert counts.get(key) == value, (step["step"], key, counts.get(key), value)
                elif name == "build_connector_worker_meta":
                    with self._in_hook(name):
                        worker_meta = worker.take_worker_meta()
                    self.result.step_seconds.append(time.perf_counter() - step_started)
                    hits = dict(worker_meta.hits) if worker_meta is not None else {}
                    recorded_hits = {k: v for k, v in (call[2] or {}).items() if v}
                    assert {k: v for k, v in hits.items() if v} == recorded_hits, (step["step"], hits)
                    self.result.hits.update(hits)
                    if worker_meta is not None:
                        self.result.reports.update(
                            (kind, _number(value)) for _, kind, value in worker_meta.reports
                        )
                elif name == "clear_connector_metadata":
                    # A later step's disk or S3 hit reads what this step wrote down.
                    assert worker.engine is not None and worker.engine.flush(60), "write-downs did not finish"
                elif name == "shutdown":
                    worker.shutdown()
                # handle_preemptions: recorded without its metadata, so the replay does not
                # call step_arrives; forward_begins at "bind" decides on the write-down hold.
            if self.check_reads:
                self._check_reads()
        finally:
            if self.result.calls["shutdown"] == 0:
                worker.shutdown()
            sync.host_wait = self._real_host_wait
        # Copies still in flight at the end were settled at shutdown: their reports too.
        last = worker.take_worker_meta()
        if last is not None:
            self.result.reports.update((kind, _number(value)) for _, kind, value in last.reports)
        return self.result

    def _start(self, meta: TierCacheMetadata, staging: _GatedStaging) -> None:
        for job in meta.loads:
            if job.is_async:
                staging.owners.update(((op.block_hash, op.slot), job.req_id) for op in job.ops)
        with self._in_hook("start_load_kv"):
            self.worker.start_load_kv(meta)


def expected_result(recording: dict[str, Any]) -> dict[str, Any]:
    """What a right replay of `recording` adds up to, in `ReplayResult`'s fields: every
    step; every block a forward reads, checked at every layer; every loaded block so
    checked, by tier; the blocks the worker loaded, by tier."""
    summary = recording["summary"]
    layers = len(recording["kv"]["layers"])
    return {
        "steps": summary["steps"],
        "reads_checked": layers * sum(len(step["reads"]) for step in recording["schedule"]),
        "loaded_reads_checked": {tier: n * layers for tier, n in summary["loaded_reads_checked"].items()},
        "hits": {t: n for t, n in summary["loaded_blocks_by_tier"].items() if t in ("cpu", "disk", "s3")},
    }


def with_swapped_slots(recording: dict[str, Any]) -> dict[str, Any]:
    """A copy of `recording` broken on purpose: two blocks of its first synchronous
    load of several blocks (a CPU hit) swap slots, so each gets the other's KV."""
    broken = copy.deepcopy(recording)
    for call in broken["workers"]["0"]:
        if call[0] == "bind":
            jobs = [job for job in call[1]["loads"] if not job["async"] and len(job["ops"]) > 1]
            if jobs:
                ops = jobs[0]["ops"]
                ops[0][2], ops[1][2] = ops[1][2], ops[0][2]
                return broken
    raise ValueError("the recording has no synchronous load of two blocks or more")


def recorded_reports(recording: dict[str, Any], rank: str = "0") -> Counter:
    """Every report the recorded worker made, as (kind, value) with hash numbers."""
    out: Counter = Counter()
    for call in recording["workers"][rank]:
        if call[0] == "build_connector_worker_meta" and call[1]:
            for _, kind, value in call[1]:
                out[(kind, tuple(value) if isinstance(value, list) else value)] += 1
    return out

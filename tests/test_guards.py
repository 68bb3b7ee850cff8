"""No exception of tiercache's reaches vLLM (issue 39, item 3): an error in any hook
costs that step's loads a recompute, counted, and repeated errors turn the connector
off for a while; a disk.path that cannot be used turns the disk tier off, not the
engine.

Both halves of the real connector class run in this process on stand-ins for vLLM's
configs, requests and scheduler outputs, with a real CPU tier and KV tensors, passing
each step's metadata and worker reports between them as vLLM does. An exception is
injected into each hook (at its entry, or deep inside it); the scenario then checks
what vLLM relies on: no exception, every block a load did not make reported failed
(each block not reported holds the KV of its hash), every CPU slot unpinned once the
step is over, the failure counted in the connector's stats."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiercache.connector import guard as guard_module
from tiercache.connector.load_failures import BACKOFF_SECONDS
from tiercache.connector.metadata import TierCacheMetadata
from tiercache.connector.worker import TierCacheWorker

from support.scheduler_steps import blocks_of, new_request, scheduler_output

pytest.importorskip("vllm")
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from tiercache.connector.connector import TierCacheConnector  # noqa: E402

BLOCK = 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_BLOCKS = 16
PAGE = 2 * BLOCK * 32 * 2  # LBHNC, 2 KV heads, head size 16, float16


def vllm_config(model: Path, extra: dict) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=str(model),
            revision=None,
            dtype="float16",
            quantization=None,
            quantization_config=None,
            hf_overrides={},
            use_mla=False,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(
            cache_dtype="auto",
            block_size=BLOCK,
            kv_cache_dtype_skip_layers=[],
            prefix_caching_hash_algo="sha256",
        ),
        load_config=SimpleNamespace(download_dir=None),
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=extra, kv_load_failure_policy="recompute"
        ),
        kv_events_config=None,
    )


def kv_cache_config() -> SimpleNamespace:
    spec = SimpleNamespace(page_size_bytes=PAGE, num_kv_heads=2, head_size=16)
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(LAYERS))],
        num_blocks=NUM_BLOCKS,
        kv_cache_layout="LBHNC",
    )


@pytest.fixture(autouse=True)
def tiercache_logging():
    """The connector sends tiercache's records through vLLM's logger when it is built;
    later tests capture them at the root logger, as they were."""
    ours = logging.getLogger("tiercache")
    saved = ours.handlers[:], ours.propagate, ours.level
    yield
    ours.handlers[:], ours.propagate = saved[0], saved[1]
    ours.setLevel(saved[2])


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text('{"num_hidden_layers": 2}')
    (path / "model.safetensors").write_bytes(b"\0" * 1000)
    return path


def request(req_id: str, n_blocks: int, seed: int = 0) -> SimpleNamespace:
    tokens = n_blocks * BLOCK + 1
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=[bytes([seed, i]) * 16 for i in range(n_blocks)],
        num_tokens=tokens,
        num_prompt_tokens=tokens,
    )


class Engine:
    """Drives both halves as vLLM's scheduler and model runner do, one step at a time."""

    def __init__(self, model: Path, extra: dict | None = None):
        extra = {"cpu": {"capacity": 8 * 2 * PAGE}, **(extra or {})}
        config = vllm_config(model, extra)
        self.scheduler = TierCacheConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
        self.worker = TierCacheConnector(config, KVConnectorRole.WORKER, kv_cache_config())
        self.kv = {name: torch.randn(NUM_BLOCKS, 2, BLOCK, 32).to(torch.float16) for name in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.invalid: set[int] = set()
        self.stats: dict = {}

    def block(self, gpu_block: int) -> list[torch.Tensor]:
        return [self.kv[name][gpu_block].clone() for name in LAYERS]

    def step(self, new=(), scheduled=None, finished=()) -> set[str]:
        """One step: plan, run the worker's hooks around a forward, report back.
        Returns the requests the worker reported finished receiving."""
        meta = self.scheduler.build_connector_meta(scheduler_output(new, scheduled=scheduled or {}))
        worker = self.worker
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type]  # the forward context is not read
        for name in LAYERS:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, self.kv[name], None)  # type: ignore[arg-type]
        worker.wait_for_save()
        _, recving = worker.get_finished(set(finished))
        self.invalid |= worker.get_block_ids_with_load_errors()
        for half in (worker, self.scheduler):
            stats = half.get_kv_connector_stats()
            for key, value in (stats.data if stats is not None else {}).items():
                if isinstance(value, int):
                    self.stats[key] = self.stats.get(key, 0) + value
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        output = SimpleNamespace(kv_connector_worker_meta=worker_meta, finished_recving=recving or set())
        self.scheduler.update_connector_output(output)
        list(self.scheduler.take_events())
        return recving or set()

    def prompt(self, req, gpu_blocks: list[int]) -> int:
        """Schedule `req` into `gpu_blocks` for one whole-prompt step; the tokens it
        was told were cached (after an async load, once it is reported received)."""
        hit, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        hit = hit or 0
        self.scheduler.update_state_after_alloc(req, blocks_of(gpu_blocks), hit)
        self.scheduler.get_external_cache_hit_sources(req, hit)
        if is_async:
            for _ in range(200):  # the load's steps: vLLM polls until the worker reports it
                if req.request_id in self.step():
                    break
            self.scheduler.update_state_after_alloc(req, blocks_of(gpu_blocks), 0)
        self.step([new_request(req, gpu_blocks, hit)], scheduled={req.request_id: req.num_tokens - hit})
        self.scheduler.request_finished(req, gpu_blocks)
        return hit

    def settle(self) -> None:
        """Steps until no CPU slot is pinned (the write-downs to disk ended), or a while."""
        deadline = time.monotonic() + 10
        while True:
            self.step()
            if not self.pinned() or time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def pinned(self) -> int:
        scheduler = self.scheduler.scheduler
        assert scheduler is not None
        return scheduler.slots.pinned()

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def boom(*args, **kwargs):
    raise RuntimeError("injected")


# hook vLLM calls -> (half, where the exception is raised)
HOOKS = {
    "handle_preemptions": ("worker", "step_arrives"),
    "bind_connector_metadata": ("worker", "forward_begins"),
    "start_load_kv": ("worker", "start_load_kv"),
    "wait_for_layer_load, a hit copied in beside the forward": ("worker", "copier.copy_region"),
    "wait_for_layer_load": ("worker", "wait_for_layer"),
    "save_kv_layer": ("worker", "save_layer"),
    "wait_for_save": ("worker", "wait_for_save"),
    "wait_for_save, copying stores out": ("worker", "copier.queue_to_slots"),
    "get_finished": ("worker", "get_finished"),
    "get_block_ids_with_load_errors": ("worker", "take_failed_blocks"),
    "build_connector_worker_meta": ("worker", "take_worker_meta"),
    "get_kv_connector_stats (worker)": ("worker", "take_stats"),
    "get_num_new_matched_tokens": ("scheduler", "get_num_new_matched_tokens"),
    "update_state_after_alloc": ("scheduler", "update_state_after_alloc"),
    "update_state_after_alloc, planning a load": ("scheduler", "_plan_load"),
    "get_external_cache_hit_sources": ("scheduler", "hit_tiers"),
    "build_connector_meta": ("scheduler", "build_connector_meta"),
    "build_connector_meta, planning stores": ("scheduler", "_plan_stores"),
    "request_finished": ("scheduler", "request_finished"),
    "take_events": ("scheduler", "take_events"),
    "get_kv_connector_stats (scheduler)": ("scheduler", "take_decisions"),
}


def inject(engine: Engine, monkeypatch, half: str, where: str) -> None:
    target = getattr(engine, half)
    target = target.scheduler if half == "scheduler" else target.worker
    *path, name = where.split(".")
    for part in path:
        target = getattr(target, part)
    monkeypatch.setattr(target, name, boom)


def evict_to_disk(engine: Engine, req) -> None:
    """Wait until the disk holds `req`'s blocks, then drop them from the CPU tier: the
    next hit on them is staged from disk, an async load."""
    scheduler = engine.scheduler.scheduler
    assert scheduler is not None
    deadline = time.monotonic() + 30
    while not all(bytes(h) in scheduler.policy.on_disk for h in req.block_hashes):
        assert time.monotonic() < deadline, "the write-through to disk did not end"
        time.sleep(0.01)
        engine.step()
    for block_hash in req.block_hashes:
        scheduler.policy.fill_failed(bytes(block_hash), scheduler.slots.slot_of(bytes(block_hash)))


@pytest.mark.parametrize("hit", ["cpu hit", "disk hit, staged"])
@pytest.mark.parametrize("hook", list(HOOKS))
def test_an_exception_in_any_hook_costs_a_recompute_never_an_error(
    hook, hit, model_dir, tmp_path, monkeypatch, caplog
):
    staged = hit == "disk hit, staged"
    # The cost model off: a stand-in forward costs nothing, so it would skip every disk hit.
    disk = {
        "disk": {"path": str(tmp_path / "disk"), "load_in_forward": False},
        "movers": {"cost_model": "off"},
    }
    extra = disk if staged else {}
    engine = Engine(model_dir, extra)
    try:
        stored = request("r1", 3)
        assert engine.prompt(stored, [1, 2, 3, 4]) == 0
        engine.step()  # the stores' reports arrive
        if staged:
            evict_to_disk(engine, stored)
        want = {block: engine.block(block) for block in (1, 2, 3)}
        assert engine.pinned() == 0

        with monkeypatch.context() as patch:
            inject(engine, patch, *HOOKS[hook])
            with caplog.at_level(logging.ERROR, logger="tiercache"):
                # Three blocks hit, a fourth stored.
                hit_tokens = engine.prompt(request("r2", 4), [5, 6, 7, 8, 15])
                engine.step()
        assert "injected" in caplog.text  # logged with its traceback
        assert engine.stats.get("hook_failures", 0) >= 1, engine.stats
        # Every block vLLM was told is cached either holds its KV or is reported failed.
        for source, target in list(zip((1, 2, 3), (5, 6, 7), strict=True))[: hit_tokens // BLOCK]:
            if target not in engine.invalid:
                got = engine.block(target)
                assert all(torch.equal(a, b) for a, b in zip(got, want[source], strict=True)), target

        # The step is over: nothing stays pinned (once the write-down to disk ended),
        # and once the failed blocks' backoff is over the cache serves them whole again.
        engine.settle()
        assert engine.pinned() == 0
        scheduler = engine.scheduler.scheduler
        assert scheduler is not None
        later = BACKOFF_SECONDS + guard_module.OFF_SECONDS  # a failure in every step turns it off
        scheduler.load_failures.clock = lambda: time.monotonic() + later
        engine.worker.guard.clock = engine.scheduler.guard.clock = lambda: time.monotonic() + later
        engine.invalid.clear()
        assert engine.prompt(request("r3", 3), [9, 10, 11, 12]) == 3 * BLOCK
        assert not engine.invalid
        for source, target in zip((1, 2, 3), (9, 10, 11), strict=True):
            assert all(torch.equal(a, b) for a, b in zip(engine.block(target), want[source], strict=True))
    finally:
        engine.close()


def test_the_hooks_outside_a_step_never_raise_either(model_dir, monkeypatch):
    """register_kv_caches (the worker serves without the cache from then on),
    update_connector_output, reset_cache and shutdown: no exception reaches vLLM."""
    with monkeypatch.context() as patch:
        patch.setattr(TierCacheWorker, "register_kv_caches", boom)
        engine = Engine(model_dir)
    try:
        assert engine.worker.worker is not None and engine.worker.worker.engine is None
        assert engine.prompt(request("r1", 3), [1, 2, 3, 4]) == 0
        engine.step()
        assert engine.pinned() == 0  # every store reported failed and released
        assert engine.prompt(request("r2", 3), [5, 6, 7, 8]) == 0  # nothing was stored

        scheduler = engine.scheduler.scheduler
        assert scheduler is not None
        with monkeypatch.context() as patch:
            for name in ("update_connector_output", "reset_cache", "close"):
                patch.setattr(scheduler, name, boom)
            patch.setattr(engine.worker.worker, "shutdown", boom)
            engine.step()  # update_connector_output
            assert engine.scheduler.reset_cache() is False  # vLLM hears the reset failed
            engine.close()
        assert engine.stats.get("hook_failures", 0) >= 1
    finally:
        engine.close()


@pytest.mark.parametrize("hook", ["unregister_kv_caches", "restore_kv_caches"])
def test_sleep_mode_hooks_that_fail_turn_the_worker_off_never_raise(hook, model_dir, monkeypatch):
    engine = Engine(model_dir)
    try:
        assert engine.prompt(request("r1", 3), [1, 2, 3, 4]) == 0
        engine.step()
        with monkeypatch.context() as patch:
            patch.setattr(engine.worker.worker, hook, boom)
            getattr(engine.worker, hook)()
        assert engine.worker.worker is not None and engine.worker.worker.engine is None
        # The scheduler still plans the hit; the worker fails it, and vLLM recomputes.
        engine.invalid.clear()
        assert engine.prompt(request("r2", 3), [5, 6, 7, 8]) == 3 * BLOCK
        assert {5, 6, 7} <= engine.invalid
        engine.settle()
        assert engine.pinned() == 0
    finally:
        engine.close()


def test_repeated_failures_turn_the_connector_off_until_it_comes_back_by_itself(model_dir, monkeypatch):
    now = [1000.0]
    engine = Engine(model_dir)
    engine.worker.guard.clock = engine.scheduler.guard.clock = lambda: now[0]
    try:
        assert engine.prompt(request("r1", 3), [1, 2, 3, 4]) == 0
        engine.step()
        with monkeypatch.context() as patch:
            inject(engine, patch, "worker", "start_load_kv")
            for i in range(guard_module.TRIP_AFTER):
                engine.prompt(request(f"fail{i}", 3), [5, 6, 7, 8])
        assert engine.stats.get("connector_off_trips") == 1
        assert engine.worker.guard.off
        # Off: the worker fails every load it is handed and makes no store.
        stored_before = engine.stats.get("stored_blocks", 0)
        engine.invalid.clear()
        engine.prompt(request("again", 3), [5, 6, 7, 8])
        assert {5, 6, 7} <= engine.invalid
        engine.prompt(request("fresh", 2, seed=9), [13, 14, 15])
        assert engine.stats.get("stored_blocks", 0) == stored_before
        engine.step()
        assert engine.pinned() == 0
        # The scheduler half off too: every lookup misses, nothing is planned.
        engine.scheduler.guard._off_until = now[0] + guard_module.OFF_SECONDS
        assert engine.scheduler.get_num_new_matched_tokens(request("r9", 3), 0) == (0, False)
        meta = engine.scheduler.build_connector_meta(
            scheduler_output([new_request(request("s", 2, seed=7), [13, 14, 15])], scheduled={"s": 65})
        )
        assert isinstance(meta, TierCacheMetadata) and not meta.stores
        # Back by itself after the pause.
        now[0] += guard_module.OFF_SECONDS + 1
        assert not engine.worker.guard.off and not engine.scheduler.guard.off
        engine.invalid.clear()
        assert engine.prompt(request("r2", 3), [9, 10, 11, 12]) == 3 * BLOCK
        assert not engine.invalid
        assert engine.pinned() == 0
    finally:
        engine.close()


@pytest.mark.parametrize("problem", ["a regular file", "under a regular file"])
def test_a_disk_path_that_cannot_be_used_turns_the_disk_tier_off_not_the_engine(
    problem, model_dir, tmp_path, caplog
):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    path = blocker if problem == "a regular file" else blocker / "disk"
    with caplog.at_level(logging.ERROR, logger="tiercache"):
        engine = Engine(model_dir, {"disk": {"path": str(path), "capacity": "64MiB"}})
    try:
        assert f"disk.path {str(path)!r} cannot be used" in caplog.text
        assert engine.worker.worker is not None and engine.worker.worker.engine is not None
        assert engine.worker.worker.engine.disk is None
        # The CPU tier still serves.
        assert engine.prompt(request("r1", 3), [1, 2, 3, 4]) == 0
        engine.step()
        assert engine.prompt(request("r2", 3), [5, 6, 7, 8]) == 3 * BLOCK
        assert not engine.invalid
    finally:
        engine.close()


def test_request_finished_all_groups_is_guarded_and_forgets_the_announced_hit(model_dir, monkeypatch):
    """vLLM's hybrid KV cache manager calls request_finished_all_groups instead of
    request_finished: it must neither raise into vLLM nor keep the request's
    announced hit (one entry leaked per aborted hit)."""
    engine = Engine(model_dir)
    try:
        assert engine.prompt(request("r1", 3), [1, 2, 3, 4]) == 0
        engine.step()
        again = request("r2", 3)
        hit, _ = engine.scheduler.get_num_new_matched_tokens(again, 0)
        assert hit == 3 * BLOCK and "r2" in engine.scheduler._announced
        assert engine.scheduler.request_finished_all_groups(again, ([],)) == (False, None)
        assert "r2" not in engine.scheduler._announced  # aborted before its allocation
        scheduler = engine.scheduler.scheduler
        assert scheduler is not None
        with monkeypatch.context() as patch:
            patch.setattr(scheduler, "request_finished", boom)
            assert engine.scheduler.request_finished_all_groups(again, ([5, 6, 7, 8],)) == (False, None)
        assert engine.scheduler.get_kv_connector_stats().data.get("hook_failures") == 1
    finally:
        engine.close()

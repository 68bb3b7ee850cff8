"""Checks TierCacheConnector against one vLLM's connector contract and prints what it
found as one JSON line; tests/test_vllm_versions.py asserts on it.

Run as `python tests/support/vllm_contract.py [FOLDER]`: with FOLDER (a `pip install
--no-deps --target` of another vLLM) that vLLM is first on sys.path, so this process
sees it alone, never mixed with the one installed in the environment. Its compiled
CUDA kernels do not load beside the CPU torch; the connector base, the config logic,
the factory and the worker's sleep and wake-up code are plain Python and do."""

from __future__ import annotations

import inspect
import json
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any

if len(sys.argv) > 1:
    sys.path.insert(0, os.path.abspath(sys.argv[1]))
# vLLM's config checks read it; the contract must not depend on the caller's.
os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
# The GPU wheel finds no platform on this machine; its config code runs on the CPU one.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import base  # noqa: E402

# Where vLLM calls the connector's hooks: each must import beside tiercache.
CALLERS = [
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.kv_connector_model_runner_mixin",
    "vllm.distributed.kv_transfer.kv_transfer_state",
]


def imports() -> dict[str, str]:
    """Module -> error, for each of vLLM's callers that fails to import."""
    import importlib

    failed = {}
    for name in CALLERS:
        try:
            importlib.import_module(name)
        except Exception as error:  # reported, asserted on by the test
            failed[name] = f"{type(error).__name__}: {error}"
    return failed


def kind(owner: type, name: str) -> str:
    attr = inspect.getattr_static(owner, name)
    if isinstance(attr, classmethod):
        return "classmethod"
    if isinstance(attr, staticmethod):
        return "staticmethod"
    if isinstance(attr, property):
        return "property"
    return "method" if callable(attr) else "attribute"


def parameters(owner: type, name: str) -> list[inspect.Parameter]:
    """The parameters a caller passes (without self or cls)."""
    attr = inspect.getattr_static(owner, name)
    function = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
    params = list(inspect.signature(function).parameters.values())
    return params if isinstance(attr, staticmethod) else params[1:]


def incompatible(base_params: list[inspect.Parameter], ours: list[inspect.Parameter]) -> list[str]:
    """Ways a call that fits vLLM's signature would not fit ours."""
    problems = []
    by_name = {p.name: p for p in ours}
    positional = [p for p in ours if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_args = any(p.kind == p.VAR_POSITIONAL for p in ours)
    var_kwargs = any(p.kind == p.VAR_KEYWORD for p in ours)
    index = 0
    for p in base_params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if index >= len(positional) and not var_args:
                problems.append(f"takes no positional argument {index} ({p.name})")
            if p.kind == p.POSITIONAL_OR_KEYWORD and p.name not in by_name and not var_kwargs:
                problems.append(f"takes no keyword {p.name}")
            index += 1
        elif p.kind == p.KEYWORD_ONLY:
            if p.name not in by_name and not var_kwargs:
                problems.append(f"takes no keyword {p.name}")
        elif p.kind == p.VAR_POSITIONAL and not var_args:
            problems.append("takes no *args")
        elif p.kind == p.VAR_KEYWORD and not var_kwargs:
            problems.append("takes no **kwargs")
    known = {p.name for p in base_params}
    for p in ours:
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if required and p.name not in known:
            problems.append(f"requires {p.name}, which vLLM does not pass")
    return problems


def hooks(connector_cls: type) -> dict[str, Any]:
    """Every public hook of vLLM's connector base: which tiercache overrides, and
    whether each override takes every call vLLM's signature allows."""
    names = sorted(
        name
        for klass in base.KVConnectorBase_V1.__mro__
        if klass is not object
        for name in vars(klass)
        if not name.startswith("_") or name == "__init__"
    )
    overridden, inherited, problems = [], [], {}
    for name in dict.fromkeys(names):
        owner = next(k for k in connector_cls.__mro__ if name in vars(k))
        if owner is not connector_cls:
            inherited.append(name)
            continue
        overridden.append(name)
        base_kind, our_kind = kind(base.KVConnectorBase_V1, name), kind(connector_cls, name)
        if base_kind != our_kind:
            problems[name] = [f"is a {our_kind}, vLLM's is a {base_kind}"]
        elif base_kind in ("method", "classmethod", "staticmethod"):
            found = incompatible(parameters(base.KVConnectorBase_V1, name), parameters(connector_cls, name))
            if found:
                problems[name] = found
    return {"overridden": overridden, "inherited": inherited, "problems": problems}


def engine_config(config: KVTransferConfig | None) -> VllmConfig:
    """vLLM's whole config logic for an engine asking for full CUDA graphs, on a
    platform that stands in for a GPU's answers: static graphs and the hybrid KV cache
    manager supported (the CPU platform supports neither, so would decide nothing)."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    platform.support_static_graph_mode = classmethod(lambda cls: True)  # type: ignore[method-assign]
    platform.support_hybrid_kv_cache = classmethod(lambda cls: True)  # type: ignore[method-assign]
    return VllmConfig(
        kv_transfer_config=config,
        compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
    )


def decisions(config: KVTransferConfig) -> dict[str, Any]:
    """What vLLM decides from the connector class, through vLLM's own code."""
    connector_cls = KVConnectorFactory.get_connector_class(config)
    plain, ours = engine_config(None), engine_config(config)
    post_init = inspect.getsource(VllmConfig.__post_init__)
    out: dict[str, Any] = {
        "class": f"{connector_cls.__module__}.{connector_cls.__qualname__}",
        # VllmConfig turns HMA off unless the factory says the connector supports it.
        "hma_checked_by_config": "supports_hma_config(" in inspect.getsource(VllmConfig),
        "hma": KVConnectorFactory.supports_hma_config(config),
        "class_is_supports_hma": issubclass(connector_cls, base.SupportsHMA),
        # VllmConfig.__post_init__ asks the class, with the extra config, whether full
        # CUDA graphs must become piecewise.
        "piecewise_asked_by_config": "connector_cls.requires_piecewise_for_cudagraph(" in post_init,
        "piecewise": connector_cls.requires_piecewise_for_cudagraph(config.kv_connector_extra_config),
        "sleep_hooks_in_base": hasattr(base.KVConnectorBase_V1, "supports_sleep_mode"),
        # The same decisions as a whole VllmConfig makes them.
        "engine_full_graphs_without_connector": plain.compilation_config.cudagraph_mode.has_full_cudagraphs(),
        "engine_full_graphs": ours.compilation_config.cudagraph_mode.has_full_cudagraphs(),
        "engine_hma_off_without_connector": plain.scheduler_config.disable_hybrid_kv_cache_manager,
        "engine_hma_off": ours.scheduler_config.disable_hybrid_kv_cache_manager,
    }
    if out["sleep_hooks_in_base"]:
        # vLLM's own check, as an engine with sleep mode (and its cumem allocator) runs it.
        engine = SimpleNamespace(
            kv_transfer_config=config,
            model_config=SimpleNamespace(enable_sleep_mode=True, enable_cumem_allocator=True),
        )
        try:
            VllmConfig._verify_kv_transfer_compat(engine)  # type: ignore[arg-type]
            out["sleep_mode"] = "accepted"
        except ValueError as error:
            out["sleep_mode"] = f"refused: {error}"
    return out


def sleep_call_order(connector_cls: type) -> dict[str, Any]:
    """Drive vLLM's own GPU `Worker.sleep`, `wake_up` and `discard` against a
    TierCacheConnector's worker half on CPU tensors. The sleep-mode backend stands in
    for the cumem allocator: it records when it runs, and its wake-up points vLLM's KV
    tensor objects at new memory, which a copier that kept views of the old would miss."""
    from vllm.v1.worker import gpu_worker

    from tiercache.config import build_config
    from tiercache.connector.metadata import BlockOp, LoadJob, TierCacheMetadata
    from tiercache.connector.worker import TierCacheWorker
    from tiercache.index.keys import KVSpec

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    kv = {name: torch.randn(10, 2, 16, 8) for name in layers}
    slot_bytes = 3 * 2 * 16 * 8 * 4
    spec = KVSpec("m", "", "float32", "auto", 16, "cpu", 3, 2, 8, 1, 0, "t", slot_bytes)
    worker = TierCacheWorker(
        build_config({"cpu": {"capacity": 4 * slot_bytes}}),
        spec,
        "digest",
        10,
        tp_rank=0,
        writes_lower_tiers=True,
        disk_share=0,
    )
    worker.register_kv_caches(kv, slot_bytes)
    connector = object.__new__(connector_cls)  # the worker half alone: no engine here
    connector.worker, connector.scheduler = worker, None
    events: list[str] = []
    old_memory: list[dict[str, torch.Tensor]] = []

    class Recorded:
        """What vLLM's get_kv_transfer_group() returns: the connector, calls noted."""

        def __getattr__(self, name: str):
            method = getattr(connector, name)

            def call(*args, **kwargs):
                events.append(name)
                return method(*args, **kwargs)

            return call

    class Backend:
        def suspend(self, level: int = 1) -> None:
            events.append("suspend" + (" (copier dropped)" if worker.copier is None else " (copier held)"))

        def resume(self, tags: list[str] | None = None) -> None:
            events.append(f"resume {tags}")
            if tags is None or "kv_cache" in tags:
                old_memory.append({name: t.view_as(t) for name, t in kv.items()})
                for tensor in kv.values():
                    tensor.set_(torch.randn_like(tensor))

        def discard(self, tags: tuple[str, ...]) -> None:
            events.append(f"discard {list(tags)}")

    class AnyFalse:
        def __getattr__(self, name: str) -> bool:
            return False

    gpu_worker.has_kv_transfer_group = lambda: True
    gpu_worker.get_kv_transfer_group = lambda: Recorded()
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    torch.accelerator.get_memory_info = lambda *args, **kwargs: (1 << 30, 2 << 30)
    vllm_worker = SimpleNamespace(
        sleep_mode_backend=Backend(),
        vllm_config=SimpleNamespace(model_config=AnyFalse()),
        model_config=AnyFalse(),
        _sleep_saved_parameters={},
        _sleep_saved_buffers={},
        _sleep_saved_draft_buffers={},
        synchronize_device=lambda: None,
    )

    def step(meta: TierCacheMetadata) -> None:
        worker.start_load_kv(meta)
        for name in layers:
            worker.wait_for_layer(name)
            worker.save_layer(name, meta)
        worker.wait_for_save(meta)

    def hit_lands_in_new_memory(slot: int, block: int, want: dict[str, torch.Tensor]) -> bool:
        step(TierCacheMetadata(loads=[LoadJob("r", [BlockOp(b"h" * 32, block, slot, "cpu")], False)]))
        loaded = all(torch.equal(kv[name][block], want[name]) for name in layers)
        return worker.take_failed_blocks() == set() and loaded

    def untouched(before: list[dict[str, torch.Tensor]]) -> bool:
        pairs = zip(old_memory, before, strict=True)
        return all(torch.equal(old[name], kept[name]) for old, kept in pairs for name in layers)

    Worker = gpu_worker.Worker
    out: dict[str, Any] = {}
    step(TierCacheMetadata(stores=[BlockOp(b"h" * 32, 3, 1, "cpu")]))
    cached = {name: kv[name][3].clone() for name in layers}

    Worker.sleep(vllm_worker, level=1)
    Worker.wake_up(vllm_worker, None)
    out["sleep_then_wake"] = list(events)
    kept = [{n: t.clone() for n, t in old.items()} for old in old_memory]
    out["load_after_wake_in_new_memory"] = hit_lands_in_new_memory(1, 7, cached)
    computed = {name: kv[name][5].clone() for name in layers}
    step(TierCacheMetadata(stores=[BlockOp(b"h" * 32, 5, 2, "cpu")]))
    out["store_after_wake_from_new_memory"] = hit_lands_in_new_memory(2, 8, computed)
    out["old_memory_untouched"] = untouched(kept)

    events.clear()
    Worker.sleep(vllm_worker, level=1)
    Worker.wake_up(vllm_worker, ["weights"])
    step(TierCacheMetadata(loads=[LoadJob("r", [BlockOp(b"h" * 32, 9, 1, "cpu")], False)]))
    out["load_with_kv_asleep_failed"] = worker.take_failed_blocks() == {9}
    Worker.wake_up(vllm_worker, ["kv_cache"])
    out["sleep_then_wake_weights_then_kv"] = list(events)
    out["load_after_partial_wakes_in_new_memory"] = hit_lands_in_new_memory(1, 9, cached)

    events.clear()
    if hasattr(Worker, "discard"):
        Worker.discard(vllm_worker, ("kv_cache",))
        Worker.wake_up(vllm_worker, ["kv_cache"])
        out["discard_then_wake_kv"] = list(events)
        kept = [{n: t.clone() for n, t in old.items()} for old in old_memory]
        out["load_after_discard_in_new_memory"] = hit_lands_in_new_memory(1, 6, cached)
        out["old_memory_untouched_after_discard"] = untouched(kept)
    worker.shutdown()
    return out


def main() -> None:
    result: dict[str, Any] = {"version": vllm.__version__, "vllm_path": os.path.dirname(vllm.__file__)}
    try:
        import tiercache.connector

        connector_cls = tiercache.connector.TierCacheConnector
        config = KVTransferConfig(
            kv_connector="TierCacheConnector",
            kv_connector_module_path="tiercache.connector",
            kv_role="kv_both",
        )
        result["caller_import_errors"] = imports()
        result["abstract"] = sorted(connector_cls.__abstractmethods__)
        result["hooks"] = hooks(connector_cls)
        result["decisions"] = decisions(config)
        if result["decisions"]["sleep_hooks_in_base"]:
            result["sleep"] = sleep_call_order(connector_cls)
    except Exception:
        result["error"] = traceback.format_exc()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

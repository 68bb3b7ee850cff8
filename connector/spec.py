"""The KVSpec of a vLLM deployment, computed the same way in the scheduler and in
every worker, so both name objects alike."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tiercache.config import TierCacheConfig
from tiercache.index.keys import KVSpec, layers_digest, weights_fingerprint

log = logging.getLogger("tiercache.connector")
_warned_unreadable: set[str] = set()  # models whose fallback was logged in this process


def refuse_unsupported(vllm_config) -> None:
    """Refuse, at engine start, deployments whose KV this connector cannot name right.

    Pipeline parallelism: each stage holds other layers, so each (stage, TP rank)
    needs its own objects, and the scheduler, which sees only the first stage's KV
    cache config, would have to know every stage's layers and slot size to tell when
    a block is whole. Until that is built, serving PP with one stage's view would
    mix or lose layers; refusing is the only right answer."""
    parallel = vllm_config.parallel_config
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp_size > 1:
        raise ValueError(
            f"tiercache does not support pipeline parallelism (pipeline_parallel_size={pp_size}): "
            "run with pipeline_parallel_size=1 (tensor parallelism is supported), or without "
            "the tiercache connector"
        )
    # Context parallelism: vLLM hashes blocks of block_size x the context-parallel size
    # tokens and each rank holds its own shard of a block's tokens (an MLA latent cache
    # too), while tiercache plans stores per rank-local block and writes MLA's cache once
    # for all ranks: it would store blocks not yet computed under valid keys.
    for setting in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        cp_size = int(getattr(parallel, setting, 1) or 1)
        if cp_size > 1:
            raise ValueError(
                f"tiercache does not support context parallelism ({setting}={cp_size}): "
                f"run with {setting}=1 (tensor parallelism is supported), or without the "
                "tiercache connector"
            )


def _layout_name(vllm_config, kv_cache_config) -> str:
    """The KV cache layout the engine core resolved (vLLM 0.32 records it in the KV
    cache config it hands both halves of the connector, and in the cache config); the
    process-wide getter of earlier vLLM versions otherwise. Without it, two layouts
    whose tensors have the same shape (block size equal to the head count) would
    share keys and read each other's bytes transposed."""
    for holder in (kv_cache_config, getattr(vllm_config, "cache_config", None)):
        layout = getattr(holder, "kv_cache_layout", None)
        if layout:
            return str(layout)
    try:
        # vLLM before 0.32 only: mypy reads 0.32, which has no such function.
        from vllm.v1.attention.backends.utils import get_kv_cache_layout  # type: ignore[attr-defined]

        return str(get_kv_cache_layout())
    except Exception:  # no such getter: the platform name still separates backends
        return ""


def _canonical(value) -> object:
    """A JSON-able form of a config value that is the same in every process: a
    function (hf_overrides may be one) by its name, never by a repr with an address."""
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def _quantization(model, cache) -> str:
    """Everything beyond dtype and KV dtype that changes the KV bytes one model
    writes: the weights' quantization (fp8 weights give other activations, so other
    KV, than bf16 ones of the same checkpoint), which layers skip KV quantization,
    and config overrides (rope scaling changes every K)."""
    fields = {
        "method": model.quantization,
        "config": _canonical(getattr(model, "quantization_config", None)),
        "kv_skip_layers": sorted(getattr(cache, "kv_cache_dtype_skip_layers", None) or []),
        "hf_overrides": _canonical(getattr(model, "hf_overrides", None) or {}),
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)


def _weights_identity(model: str, revision: str | None, download_dir: str | None) -> str:
    """The weights' fingerprint (see keys.weights_fingerprint) for a model directory,
    or for a hub id, over the snapshot it resolves to in the local cache (the files
    vLLM loaded). The scheduler and every worker read the same files, so they agree.
    When nothing can be read (a remote loader, an unusual cache), the model id alone:
    logged once, since new weights under that id would then get the old KV."""
    directory: Path | None = Path(model) if Path(model).is_dir() else None
    if directory is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json", cache_dir=download_dir, revision=revision)
            if isinstance(found, str):
                directory = Path(found).parent
        except Exception as error:  # a malformed id, an unreadable cache: same fallback
            log.debug("tiercache: no cached snapshot for %s: %s", model, error)
    fingerprint = weights_fingerprint(directory) if directory is not None else None
    if fingerprint is None:
        if model in _warned_unreadable:
            return ""
        _warned_unreadable.add(model)
        log.warning(
            "tiercache: cannot read the weight files of %s, so its keys name the model id only; "
            "set model_revision in the connector config so new weights under this id get new keys",
            model,
        )
        return ""
    return fingerprint


def _group_signature(group) -> str:
    """A KV cache group's kind, layer count and what decides which of its blocks a hit
    needs (a sliding window, Mamba's cache mode)."""
    spec = group.kv_cache_spec
    details = [type(spec).__name__, str(len(group.layer_names)), f"b{spec.block_size}"]
    if getattr(spec, "sliding_window", None):
        details.append(f"w{spec.sliding_window}")
    if getattr(spec, "mamba_cache_mode", None):
        details.append(str(spec.mamba_cache_mode))
    return "/".join(details)


def kv_specs(vllm_config, kv_cache_config, config: TierCacheConfig) -> list[KVSpec]:
    """One KVSpec per TP rank (pipeline parallelism is refused by refuse_unsupported)."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    tp_size = parallel.tensor_parallel_size
    groups = kv_cache_config.kv_cache_groups
    layer_names = [name for group in groups for name in group.layer_names]
    page_bytes = sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names) for group in groups)
    spec = groups[0].kv_cache_spec
    layout_name = _layout_name(vllm_config, kv_cache_config)
    layout = f"{current_platform.device_type}:{layout_name}:{type(spec).__name__}"
    if len(groups) > 1:
        # vLLM's hybrid KV cache manager on: an object holds one block of one group
        # (the group is in the block's name, scheduler.py), not every layer as one
        # group of the same layers would.
        layout += ":groups=" + ",".join(_group_signature(group) for group in groups)
    # MLA keeps one latent cache that every rank holds whole: store it once.
    is_mla = bool(getattr(model, "use_mla", False))
    ranks = 1 if is_mla else tp_size
    # A pinned revision names the weights; without one, their files do. Dummy weights
    # (vLLM's load_format=dummy: seeded random values) are neither: they are named
    # as such, so they never share a block with the real weights of the folder.
    load_config = getattr(vllm_config, "load_config", None)
    weights = ""
    if str(getattr(load_config, "load_format", "auto")).lower().endswith("dummy"):
        weights = "load_format=dummy"
    elif not config.model_revision:
        download_dir = getattr(load_config, "download_dir", None)
        weights = _weights_identity(str(model.model), model.revision, download_dir)
    return [
        KVSpec(
            model=str(model.model),
            revision=str(config.model_revision or model.revision or ""),
            dtype=str(model.dtype).removeprefix("torch."),
            kv_dtype=str(cache.cache_dtype),
            block_size=int(cache.block_size),
            layout=layout,
            num_layers=len(layer_names),
            num_kv_heads=int(getattr(spec, "num_kv_heads", 1)),
            head_size=int(getattr(spec, "head_size", 0)),
            tp_size=ranks,
            tp_rank=rank,
            namespace=config.namespace,
            page_bytes=int(page_bytes),
            pp_size=int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
            pp_rank=0,
            layers=layers_digest(layer_names),
            quantization=_quantization(model, cache),
            weights=weights,
        )
        for rank in range(ranks)
    ]

"""The KVSpec of a vLLM deployment, computed the same way in the scheduler and in
every worker, so both name objects alike."""

from __future__ import annotations

from tiercache.config import TierCacheConfig
from tiercache.keys import KVSpec


def _layout_name() -> str:
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return str(get_kv_cache_layout())
    except Exception:  # older/newer vLLM: the platform name still separates layouts
        return ""


def kv_specs(vllm_config, kv_cache_config, config: TierCacheConfig) -> list[KVSpec]:
    """One KVSpec per TP rank."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    tp_size = parallel.tensor_parallel_size
    groups = kv_cache_config.kv_cache_groups
    layer_names = [name for group in groups for name in group.layer_names]
    page_bytes = sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names) for group in groups)
    spec = groups[0].kv_cache_spec
    layout = f"{current_platform.device_type}:{_layout_name()}:{type(spec).__name__}"
    # MLA keeps one latent cache that every rank holds whole: store it once.
    is_mla = bool(getattr(model, "use_mla", False))
    ranks = 1 if is_mla else tp_size
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
        )
        for rank in range(ranks)
    ]

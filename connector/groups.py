"""The rule of each of a vLLM deployment's KV cache groups (tiercache/index/kv_groups.py),
read off vLLM's KV cache specs."""

from __future__ import annotations

from tiercache.index.kv_groups import (
    FULL,
    NONE,
    NULL_BLOCK,
    STATE,
    WINDOW,
    GroupRule,
    best_end,
    group_key,
)

__all__ = ["FULL", "NONE", "NULL_BLOCK", "STATE", "WINDOW"]
__all__ += ["GroupRule", "best_end", "group_key", "group_rules"]


def rule_for(kv_cache_spec, block_size: int) -> GroupRule:
    """The rule of a group from its vLLM KV cache spec. A group whose blocks are not
    `block_size` tokens (vLLM's hash granularity) is not matched block for block."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if getattr(kv_cache_spec, "block_size", None) != block_size:
        return GroupRule(NONE)
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return GroupRule(
            WINDOW,
            sliding_window=int(kv_cache_spec.sliding_window),
            extra_retained_tokens=int(getattr(kv_cache_spec, "extra_retained_tokens", 0) or 0),
        )
    if isinstance(kv_cache_spec, MambaSpec):
        return GroupRule(STATE if getattr(kv_cache_spec, "mamba_cache_mode", "none") == "align" else NONE)
    if isinstance(kv_cache_spec, FullAttentionSpec):
        return GroupRule(FULL)
    return GroupRule(NONE)


def group_rules(kv_cache_config, block_size: int) -> list[GroupRule]:
    return [rule_for(group.kv_cache_spec, block_size) for group in kv_cache_config.kv_cache_groups]

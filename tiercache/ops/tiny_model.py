"""A tiny random Llama written to disk at run time: no model can be downloaded here,
and a random model is enough to check that a cache hit gives the same output as a
cold run. initializer_range is large so outputs really depend on the KV."""

from __future__ import annotations

import json
from pathlib import Path


def write_tiny_llama(
    path: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 2048,
    max_positions: int = 8192,
    intermediate_size: int | None = None,
    head_dim: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write config.json and random safetensors weights; reuse them if already there.
    `head_dim`: None for hidden_size / num_heads."""
    spec = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_positions": max_positions,
        "intermediate_size": intermediate_size,
        "seed": seed,
        "dtype": dtype,
    }
    if head_dim is not None:  # named only when set: the models written before keep their marker
        spec["head_dim"] = head_dim

    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size or hidden_size * 2,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_positions,
            initializer_range=0.2,
            torch_dtype=dtype,
            tie_word_embeddings=False,
            **({"head_dim": head_dim} if head_dim is not None else {}),
        )
        return LlamaForCausalLM(config)

    return _write_once(path, spec, build)


def _write_once(path: str | Path, spec: dict, build) -> Path:
    """Write the model `build()` returns unless `path` already holds the one `spec` names."""
    path = Path(path)
    marker = path / "tiercache-model.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    import torch

    torch.manual_seed(spec["seed"])
    model = build().to(getattr(torch, spec["dtype"]))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return path


def _hybrid_attention(spec: dict) -> dict:
    """The config settings the hybrid writers share, from their spec."""
    return {
        "vocab_size": spec["vocab_size"],
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["hidden_size"] * 2,
        "num_hidden_layers": len(spec["layer_types"]),
        "num_attention_heads": spec["num_heads"],
        "num_key_value_heads": spec["num_kv_heads"],
        "head_dim": spec["head_dim"],
        "layer_types": list(spec["layer_types"]),
        "max_position_embeddings": spec["max_positions"],
        "initializer_range": 0.2,
        "torch_dtype": spec["dtype"],
    }


def write_tiny_gemma3(
    path: str | Path,
    *,
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention") * 2,
    sliding_window: int = 128,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    vocab_size: int = 2048,
    max_positions: int = 8192,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A tiny random Gemma 3 text model: sliding-window and full-attention layers, so
    vLLM's hybrid KV cache manager gives it two KV cache groups."""
    spec = {
        "arch": "Gemma3ForCausalLM",
        "layer_types": list(layer_types),
        "sliding_window": sliding_window,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_positions": max_positions,
        "seed": seed,
        "dtype": dtype,
    }

    def build():
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            **_hybrid_attention(spec),
            sliding_window=sliding_window,
        )
        return Gemma3ForCausalLM(config)

    return _write_once(path, spec, build)


def write_tiny_qwen3_next(
    path: str | Path,
    *,
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention") * 2,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    head_dim: int = 256,
    vocab_size: int = 2048,
    max_positions: int = 8192,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A tiny random Qwen3-Next: gated delta-net (linear attention) and full-attention
    layers, with a small mixture of experts (vLLM's Qwen3-Next wants one); vLLM's
    hybrid KV cache manager gives the linear layers a Mamba-state group of their own."""
    spec = {
        "arch": "Qwen3NextForCausalLM",
        "linear_heads": [1, 1, 128, 128],  # key heads, value heads, key dim, value dim
        "layer_types": list(layer_types),
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_positions": max_positions,
        "seed": seed,
        "dtype": dtype,
    }

    def build():
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            **_hybrid_attention(spec),
            # Head dims vLLM's CPU gated delta-net kernel takes (Qwen3-Next's own),
            # one head each: a state (66 KiB) that a 32-token attention page of 4 KV
            # heads of 256 holds in bf16 (vLLM otherwise raises the block size).
            linear_num_key_heads=1,
            linear_num_value_heads=1,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
            mlp_only_layers=[],
            decoder_sparse_step=1,
        )
        return Qwen3NextForCausalLM(config)

    return _write_once(path, spec, build)

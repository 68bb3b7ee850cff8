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
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write config.json and random safetensors weights; reuse them if already there."""
    path = Path(path)
    marker = path / "tiercache-model.json"
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
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
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
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return path

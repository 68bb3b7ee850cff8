"""vLLM's prefix block hashes, computed from token ids without vLLM.

A router knows a prompt's token ids, not vLLM's block hashes; the service's lookup
turns one into the other the way vLLM's engine does for a plain text prompt
(`vllm/v1/core/kv_cache_utils.py`: `hash_block_tokens` chained over full blocks from
`NONE_HASH`, the hash of the seed). The service must run without vLLM, and importing
even `vllm.utils.hashing` loads torch and some 2,700 modules (about 6 s), so this is a
re-implementation; tests/test_block_hashing.py checks it byte for byte against vLLM's
own functions for every algorithm, and the engine test against a running engine.

Only prompts without extra keys hash this way: LoRA adapters, multimodal inputs,
a `cache_salt` and prompt embeddings add per-block extra keys that a token list does
not carry. Routers with such prompts pass the block hashes themselves."""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM derives NONE_HASH from this fixed seed for the cryptographic algorithms (so
# every process agrees), unless PYTHONHASHSEED is set; the xxhash ones get a random
# seed per process unless PYTHONHASHSEED is set, and then no one else can compute them.
DEFAULT_SEED = "vllm-none-hash"
CRYPTOGRAPHIC = frozenset({"sha256", "sha256_cbor"})
# vLLM pickles with pickle.HIGHEST_PROTOCOL, which is 5 on every Python it supports;
# pinned here so that a newer Python in the service cannot silently disagree.
PICKLE_PROTOCOL = 5


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=PICKLE_PROTOCOL)


def _cbor(value: Any) -> bytes:
    try:
        import cbor2
    except ImportError:  # installed with vLLM, not with tiercache
        raise ValueError("the *_cbor block hash algorithms need the cbor2 package") from None
    return cbor2.dumps(value, canonical=True)


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """The function vLLM's `prefix_caching_hash_algo` names, as bytes -> digest."""
    serialize = _cbor if algorithm.endswith("_cbor") else _pickled
    if algorithm in ("sha256", "sha256_cbor"):
        return lambda value: hashlib.sha256(serialize(value)).digest()
    if algorithm in ("xxhash", "xxhash_cbor"):
        return lambda value: xxhash.xxh3_128_digest(serialize(value))
    raise ValueError(f"unknown block hash algorithm {algorithm!r} (one of {', '.join(ALGORITHMS)})")


def shareable_seed(algorithm: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The seed an engine derives NONE_HASH from, when another process can know it:
    PYTHONHASHSEED if set, the fixed default for a cryptographic algorithm, and None
    for xxhash without PYTHONHASHSEED (a random seed that never leaves the engine)."""
    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    return DEFAULT_SEED if algorithm in CRYPTOGRAPHIC else None


@dataclass(frozen=True)
class BlockHashing:
    """How one deployment names its blocks: what the scheduler registers in Redis."""

    algorithm: str
    block_size: int
    seed: str

    def __post_init__(self) -> None:
        hash_function(self.algorithm)  # refuse an unknown algorithm at once
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """vLLM's hash of each full block of `token_ids`, chained from the seed."""
        fn = hash_function(self.algorithm)
        parent = fn(self.seed)  # NONE_HASH
        hashes = []
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            # (parent, the block's tokens as a tuple, no extra keys): vLLM's tuple.
            parent = fn((parent, tuple(token_ids[start : start + size]), None))
            hashes.append(parent)
        return hashes

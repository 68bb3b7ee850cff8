"""tiercache/index/block_hashing.py against vLLM's own block hashing, for every algorithm
vLLM offers: the service computes the hashes a router's token ids have in an engine."""

from __future__ import annotations

import random

import pytest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from tiercache.index.block_hashing import ALGORITHMS, DEFAULT_SEED, BlockHashing, shareable_seed


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hashes_match_vllms_chained_block_hashes(algorithm, block_size, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")  # a seed both sides can know, for xxhash too
    fn = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(fn)
    seed = kv_cache_utils.get_none_hash_seed()
    tokens = [random.Random(block_size).randrange(2**17) for _ in range(5 * block_size + 3)]
    want, parent = [], None
    for start in range(0, 5 * block_size, block_size):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[start : start + block_size], None)
        want.append(bytes(parent))
    assert BlockHashing(algorithm, block_size, seed).block_hashes(tokens) == want
    # Another seed is another chain.
    assert BlockHashing(algorithm, block_size, seed + "x").block_hashes(tokens)[0] != want[0]


def test_default_seed_is_vllms_and_random_seeds_are_not_shared():
    assert DEFAULT_SEED == kv_cache_utils.DEFAULT_NONE_HASH_SEED
    assert shareable_seed("sha256", {}) == DEFAULT_SEED
    assert shareable_seed("sha256_cbor", {"PYTHONHASHSEED": "9"}) == "9"
    assert shareable_seed("xxhash", {}) is None
    assert shareable_seed("xxhash", {"PYTHONHASHSEED": "0"}) == "0"


def test_short_prompts_and_bad_settings():
    hashing = BlockHashing("sha256", 4, DEFAULT_SEED)
    assert hashing.block_hashes([1, 2, 3]) == []
    assert len(hashing.block_hashes(list(range(9)))) == 2
    with pytest.raises(ValueError, match="unknown block hash algorithm"):
        BlockHashing("md5", 4, DEFAULT_SEED)
    with pytest.raises(ValueError, match="block_size"):
        BlockHashing("sha256", 0, DEFAULT_SEED)

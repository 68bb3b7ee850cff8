"""The peer tier end to end on vLLM's CPU build: two engines (each a process of its
own, tiercache.ops.vllm_runner), each with a CPU tier only, one Redis. The first
computes a prompt; the second, which never saw it, loads its KV from the first one's
CPU tier over NIXL and answers as the first did (which computed it from scratch), and
vLLM's loaded_blocks{tier="peer"} counts the blocks."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tiercache.ops.tiny_model import write_tiny_llama
from tiercache.ops.vllm_runner import assert_same_output, connector_config, loading_every_hit, run_engine

from support.nixl import needs_nixl

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs_nixl,
]

BLOCK = 32
rng = random.Random(4747)
PROMPT = [rng.randrange(1, 2000) for _ in range(6 * BLOCK + 7)]  # 6 full blocks to load


def spec(model: str, redis_url: str, name: str, prompts: list[dict], tp: int) -> dict:
    extra = {
        "cpu": {"capacity": 64 * 1024 * 1024},
        "redis_url": redis_url,
        "instance_id": name,
        "presence": {"interval": 0.2, "ttl": 5},
        "peer": {"enabled": True},
    }
    return {
        "model": model,
        "kv_transfer_config": connector_config(loading_every_hit(extra)),
        "prompts": prompts,
        "log_stats": True,
        "counters": "vllm:tiercache_loaded_blocks",
        # Two engines at once: each takes a small share of host memory for its KV.
        "gpu_memory_utilization": 0.05,
        "tensor_parallel_size": tp,
    }


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_an_engine_answers_from_another_engines_cpu_tier(tmp_path: Path, redis_url, tp: int):
    """With TP=2 on both, each rank reads its own shard from the holder's same rank."""
    model = str(write_tiny_llama(tmp_path / "llama", seed=0))
    stored, read = tmp_path / "stored", tmp_path / "read"
    holder = spec(
        model,
        redis_url,
        "e2e-holder",
        [
            {"name": "computed", "ids": PROMPT},
            {"sleep": 1},  # presence publishes what the CPU tier holds (every 0.2 s)
            {"touch": str(stored)},
            {"wait_for": str(read), "timeout": 400},  # alive while the other reads
        ],
        tp,
    )
    reader = spec(
        model,
        redis_url,
        "e2e-reader",
        [
            {"wait_for": str(stored), "timeout": 400},
            {"name": "from_peer", "ids": PROMPT},
            {"touch": str(read)},
        ],
        tp,
    )
    # Both start at once: their engine start-ups overlap.
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_engine, s, tmp_path / "runs", timeout=600) for s in (holder, reader)]
        try:
            held, loaded = (run.result() for run in runs)
        finally:
            read.touch()  # a reader that failed must not leave the holder waiting
    computed = held["results"][0]
    from_peer = loaded["results"][0]
    assert from_peer["num_cached_tokens"] == 6 * BLOCK, loaded["log"]
    # vLLM sums the workers' counts: each rank loaded its shard of the 6 blocks.
    assert from_peer["counters"].get("tier=peer") == 6 * tp, from_peer["counters"]
    assert computed["counters"].get("tier=peer", 0) == 0
    assert_same_output(from_peer, computed)

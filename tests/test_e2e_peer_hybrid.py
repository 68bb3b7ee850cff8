"""The peer tier end to end for hybrid models, on vLLM's CPU build with its hybrid KV
cache manager on: two engines (each a process of its own, tiercache.ops.vllm_runner)
each with a CPU tier only, one Redis. The first computes a prompt; the second, which
never saw it, loads every group's blocks of it from the first one's CPU tier over NIXL
(the full-attention blocks presence lists, and the other groups' blocks at the same
indexes) and answers as the first did, which computed it from scratch. The models: a
tiny Gemma 3 (sliding-window and full-attention layers), and a tiny Qwen3-Next (gated
delta-net linear attention, whose state vLLM keeps as Mamba groups, and full
attention), both written at test time."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tiercache.ops.tiny_model import write_tiny_gemma3, write_tiny_qwen3_next
from tiercache.ops.vllm_runner import assert_same_output, connector_config, loading_every_hit, run_engine

from support.nixl import needs_nixl

pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_nixl]

BLOCK = 32
WINDOW = 64  # Gemma's sliding window: a hit needs its last 2 blocks in that group
rng = random.Random(4748)
PROMPT = [rng.randrange(1, 2000) for _ in range(6 * BLOCK + 7)]  # 6 full blocks to load
HMA_OFF = "Turning off hybrid kv cache manager"
# Qwen3-Next as tests/test_e2e_hybrid.py runs it: vLLM keeps linear-attention states
# at block boundaries only with its own prefix cache on, and its CPU kernels want bf16.
MODELS = {
    "gemma3": {"writer": lambda path: write_tiny_gemma3(path, sliding_window=WINDOW), "spec": {}},
    "qwen3_next": {
        "writer": write_tiny_qwen3_next,
        "spec": {"dtype": "bfloat16", "enable_prefix_caching": True},
    },
}


def spec(kind: str, model: str, redis_url: str, name: str, prompts: list[dict]) -> dict:
    extra = {
        "cpu": {"capacity": 64 * 1024 * 1024},
        "redis_url": redis_url,
        "namespace": "peer-hybrid",
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
        **MODELS[kind]["spec"],
    }


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_hybrid_engine_answers_from_another_engines_cpu_tier(tmp_path: Path, redis_url, kind: str):
    model = str(MODELS[kind]["writer"](tmp_path / kind))
    stored, read = tmp_path / "stored", tmp_path / "read"
    holder = spec(
        kind,
        model,
        redis_url,
        "e2e-hybrid-holder",
        [
            {"name": "computed", "ids": PROMPT},
            {"sleep": 1},  # presence publishes what the CPU tier holds (every 0.2 s)
            {"touch": str(stored)},
            {"wait_for": str(read), "timeout": 400},  # alive while the other reads
        ],
    )
    reader = spec(
        kind,
        model,
        redis_url,
        "e2e-hybrid-reader",
        [
            {"wait_for": str(stored), "timeout": 400},
            {"name": "from_peer", "ids": PROMPT},
            {"touch": str(read)},
        ],
    )
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_engine, s, tmp_path / "runs", timeout=600) for s in (holder, reader)]
        try:
            held, loaded = (run.result() for run in runs)
        finally:
            read.touch()  # a reader that failed must not leave the holder waiting
    for out in (held, loaded):
        assert HMA_OFF not in Path(out["log"]).read_text(), "vLLM turned its hybrid KV cache manager off"
    computed = held["results"][0]
    from_peer = loaded["results"][0]
    assert from_peer["num_cached_tokens"] == 6 * BLOCK, loaded["log"]
    # Every full-attention block of the hit, and Gemma's window's last two blocks, or
    # Qwen3-Next's linear-attention state at the hit's end (one state group).
    other_groups = 2 if kind == "gemma3" else 1
    assert from_peer["counters"].get("tier=peer") == 6 + other_groups, from_peer["counters"]
    assert computed["counters"].get("tier=peer", 0) == 0
    assert_same_output(from_peer, computed)

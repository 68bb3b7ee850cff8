"""Hybrid models end to end on vLLM's CPU build, with vLLM's hybrid KV cache manager
on: a tiny Gemma 3 (sliding-window and full-attention layers) and a tiny Qwen3-Next
(gated delta-net linear attention, whose state vLLM keeps as a Mamba group, and full
attention), both written at test time.

Each KV cache group's blocks are objects of their own in every tier; a hit loads
what every group needs (connector/groups.py): all of the full-attention blocks, the
sliding window's last blocks, the linear-attention state at the hit's end. Each hit
is compared with the cold run of its prompt."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tiercache.ops.tiny_model import write_tiny_gemma3, write_tiny_qwen3_next
from tiercache.ops.vllm_runner import assert_same_output, connector_config, loading_every_hit, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
WINDOW = 64  # Gemma's sliding window: a hit needs its last 2 blocks in that group
rng = random.Random(4321)
P1 = [rng.randrange(1, 2000) for _ in range(299)]  # 9 full blocks are loadable
P2 = P1[: 6 * BLOCK] + [rng.randrange(1, 2000) for _ in range(200)]  # shares 6 blocks with P1
P3 = P2[: 10 * BLOCK] + [rng.randrange(1, 2000) for _ in range(40)]  # shares 10 blocks with P2
HMA_OFF = "Turning off hybrid kv cache manager"


def prompts(*pairs):
    return [{"name": name, "ids": ids} for name, ids in pairs]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e-hybrid")


@pytest.fixture(scope="module")
def stack(redis_url, s3_endpoint):
    from tiercache.ops.local_stack import create_bucket

    create_bucket(s3_endpoint, "tc-hybrid")
    return {
        "redis_url": redis_url,
        "s3": {"bucket": "tc-hybrid", "endpoint_url": s3_endpoint, "region": "us-east-1", "prefix": "hy/"},
    }


# Gemma runs without vLLM's prefix cache; Qwen3-Next with it, since only then does
# vLLM keep linear-attention states at block boundaries (its `align` Mamba cache
# mode), and its CPU kernels want bf16.
MODELS = {
    "gemma3": {"writer": lambda path: write_tiny_gemma3(path, sliding_window=WINDOW), "spec": {}},
    "qwen3_next": {
        "writer": write_tiny_qwen3_next,
        "spec": {"dtype": "bfloat16", "enable_prefix_caching": True},
    },
}


def engine(kind: str, workdir: Path, extra, items, **spec):
    model = str(MODELS[kind]["writer"](workdir / kind))
    kv = connector_config(loading_every_hit({"namespace": "hybrid", **extra}))
    out = run_engine(
        {"model": model, "kv_transfer_config": kv, "prompts": items, **MODELS[kind]["spec"], **spec},
        workdir / "runs",
    )
    log = Path(out["log"]).read_text()
    assert HMA_OFF not in log, "vLLM turned its hybrid KV cache manager off"
    return out["results"]


def disk_objects(disk: Path) -> int:
    return len(list(disk.rglob("*.safetensors")))


@pytest.fixture(scope="module", params=sorted(MODELS))
def first_engine(request, workdir, stack):
    """Cold P1, a CPU hit of it (after vLLM's own prefix cache is reset, where it is
    on), then P2, which shares P1's first 6 blocks, and (after another reset) P3,
    which shares P2's first 10; every tier on."""
    kind = request.param
    disk = workdir / f"disk-{kind}"
    config = {**stack, "cpu": {"capacity": "64MiB"}, "disk": {"path": str(disk), "capacity": "256MiB"}}
    results = engine(
        kind,
        workdir,
        config,
        [
            *prompts(("p1", P1)),
            {"clear_vllm_prefix_cache": True},
            *prompts(("p1", P1), ("p2", P2)),
            {"clear_vllm_prefix_cache": True},
            *prompts(("p3", P3)),
        ],
        # Clearing vLLM's own prefix cache alone needs its engine core in this process.
        in_process=True,
    )
    return kind, {"cold": results[0], "cpu_hit": results[1], "p2": results[2], "p3": results[3]}, disk


def test_the_engine_runs_with_the_hybrid_manager_on_and_answers_right(first_engine):
    # (engine() checks that vLLM kept its hybrid KV cache manager on.)
    _, runs, _ = first_engine
    assert runs["cold"]["num_cached_tokens"] == 0
    assert_same_output(runs["cpu_hit"], runs["cold"])


def test_a_cpu_hit_with_the_hybrid_manager_on_matches_the_cold_run(first_engine):
    kind, runs, _ = first_engine
    assert runs["cold"]["num_cached_tokens"] == 0
    assert runs["cpu_hit"]["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(runs["cpu_hit"], runs["cold"])


def test_a_shared_prefix_hits_as_far_as_every_group_can_serve(first_engine):
    kind, runs, _ = first_engine
    if kind == "gemma3":
        # Full attention holds P1's first 6 blocks and the window their last 2.
        assert runs["p2"]["num_cached_tokens"] == 6 * BLOCK
    else:
        # The linear-attention state exists only where a step of P1 ended (after its
        # 9th block): P1 hits whole, P2 (6 blocks shared) not at all, as in vLLM's
        # own cache.
        assert runs["cpu_hit"]["num_cached_tokens"] == 9 * BLOCK
        assert runs["p2"]["num_cached_tokens"] == 0
    # P3: full attention (and the window) could serve 10 blocks of P2's; the
    # linear-attention state exists only after blocks 6 and 12 of P2 (where its
    # prefill stopped), so Qwen3-Next's hit ends at 6.
    assert runs["p3"]["num_cached_tokens"] == (10 if kind == "gemma3" else 6) * BLOCK


def test_each_group_stores_its_own_blocks(first_engine):
    kind, _, disk = first_engine
    full = 9 + 6 + 1  # P1's blocks, P2's own and P3's own
    # Every sliding-window block may end some later window; a linear-attention
    # state only where a prompt's prefill stopped on a block boundary, where vLLM's
    # align mode stops a chunk to keep the state: the end of a prompt's last full
    # block (P1: 9, P2: 12, P3: 11) and the end of the prefix it shares with a
    # prompt in vLLM's own prefix cache (P2: 6; P3 comes after that cache is
    # cleared, so it has no such stop).
    other = full if kind == "gemma3" else 4
    assert disk_objects(disk) == full + other


def test_disk_hit_in_a_fresh_engine(first_engine, workdir):
    kind, runs, disk = first_engine
    assert runs["cpu_hit"]["num_cached_tokens"], "no hit in the first engine: no engine to start for this"
    hit = engine(kind, workdir, {"disk": {"path": str(disk)}}, prompts(("p1", P1)))[0]
    assert hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(hit, runs["cold"])


def test_s3_hit_in_a_fresh_engine_with_an_empty_disk(first_engine, workdir, stack):
    kind, runs, _ = first_engine
    assert runs["cpu_hit"]["num_cached_tokens"], "no hit in the first engine: no engine to start for this"
    empty = workdir / f"disk-empty-{kind}"
    config = {**stack, "disk": {"path": str(empty), "capacity": "256MiB"}}
    hit = engine(kind, workdir, config, prompts(("p1", P1)))[0]
    assert hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(hit, runs["cold"])


def test_tensor_parallel_2_hybrid_hit(workdir):
    disk = workdir / "disk-gemma3-tp2"
    results = engine(
        "gemma3",
        workdir,
        {"disk": {"path": str(disk)}},
        prompts(("p1", P1), ("p1", P1)),
        tensor_parallel_size=2,
    )
    cold, hit = results
    assert cold["num_cached_tokens"] == 0 and hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(hit, cold)
    # Two ranks, each with both groups' blocks of its own shard.
    # (The root's .tiercache/ holds the shared budget's index, no objects.)
    ranks = [rank for rank in disk.iterdir() if rank.is_dir() and not rank.name.startswith(".")]
    assert sorted(disk_objects(rank) for rank in ranks) == [18, 18]

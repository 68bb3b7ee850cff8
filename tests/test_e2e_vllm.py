"""End to end on vLLM's CPU build with a tiny random Llama written by a fixture.

Each engine below is a fresh process (tiercache.ops.vllm_runner), so "a disk hit"
really is a hit after a restart. The S3 tier is a real S3-compatible server
(SeaweedFS, `real_s3_endpoint`) that checks every request's signature. Outputs are
compared to a run without the connector by the first step's top logprobs, within a
tolerance: greedy tokens of a random model flip between near-ties when kernels differ."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from tiercache.ops.tiny_model import write_tiny_llama
from tiercache.ops.vllm_runner import assert_same_output, connector_config, loading_every_hit, run_engine
from tiercache.tiers.disk.layout import DiskLayout

from support.faulty_connector import FAULTS_ENV

TESTS = Path(__file__).resolve().parent

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
rng = random.Random(1234)
P1 = [rng.randrange(1, 2000) for _ in range(299)]  # 9 full blocks are loadable
P2 = P1[: 4 * BLOCK] + [rng.randrange(1, 2000) for _ in range(200)]  # shares 4 blocks with P1
SHORT = P1[:20]  # shorter than one block
SHARER = P1[: 6 * BLOCK] + [rng.randrange(1, 2000) for _ in range(140)]  # P1's first 6 blocks, 4 of its own
DEAD_REDIS = "redis://127.0.0.1:1/0"
DEAD_S3 = "http://127.0.0.1:1"


def prompts(*pairs):
    return [{"name": name, "ids": ids} for name, ids in pairs]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def model(workdir) -> str:
    return str(write_tiny_llama(workdir / "llama-a", seed=0))


@pytest.fixture(scope="module")
def other_model(workdir) -> str:
    return str(write_tiny_llama(workdir / "llama-b", seed=1, num_layers=3))


def engine(model, workdir, extra=None, items=(), env=None, **spec):
    kv = connector_config(loading_every_hit(extra)) if extra is not None else None
    return run_engine(
        {"model": model, "kv_transfer_config": kv, "prompts": items, **spec}, workdir / "runs", env=env
    )


@pytest.fixture(scope="module")
def reference(model, workdir):
    out = engine(model, workdir, None, prompts(("p1", P1), ("p2", P2), ("short", SHORT), ("sharer", SHARER)))
    return {r["name"]: r for r in out["results"]}


@pytest.fixture(scope="module")
def stack(redis_url, real_s3_endpoint, workdir):
    from tiercache.ops.local_stack import create_bucket

    create_bucket(real_s3_endpoint, "tc-e2e")
    return {
        "redis_url": redis_url,
        "s3": {"bucket": "tc-e2e", "endpoint_url": real_s3_endpoint, "region": "us-east-1", "prefix": "e2e/"},
    }


def full_config(stack, disk: Path) -> dict:
    return {
        **stack,
        "namespace": "e2e",
        "cpu": {"capacity": "64MiB"},
        "disk": {"path": str(disk), "capacity": "256MiB"},
    }


@pytest.fixture(scope="module")
def first_engine(model, workdir, stack, reference):
    """Cold, then a CPU hit, a partial hit and a short prompt, all three tiers on. The
    hit comes while its prompt is still being written down. SHARER, last, leaves
    sound copies of its own blocks on disk-a for the corruption tests to compare."""
    out = engine(
        model,
        workdir,
        # A loaded machine may take longer than the default 10 s to finish the S3 uploads
        # at shutdown; the fresh-process S3 test needs every one of them.
        {
            **full_config(stack, workdir / "disk-a"),
            "movers": {"shutdown_flush_seconds": 120},
        },
        prompts(("p1", P1), ("p1", P1), ("p2", P2), ("short", SHORT), ("sharer", SHARER)),
    )
    return out["results"]


def test_cold_then_cpu_hit_matches_reference(first_engine, reference):
    cold, hit = first_engine[0], first_engine[1]
    assert cold["num_cached_tokens"] == 0
    assert hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(cold, reference["p1"])
    assert_same_output(hit, reference["p1"])


def test_shared_prefix_gets_partial_hit(first_engine, reference):
    partial = first_engine[2]
    assert partial["num_cached_tokens"] == 4 * BLOCK
    assert_same_output(partial, reference["p2"])


def test_prompt_shorter_than_a_block(first_engine, reference):
    short = first_engine[3]
    assert short["num_cached_tokens"] == 0
    assert_same_output(short, reference["short"])


def test_disk_hit_from_a_fresh_process(first_engine, model, workdir, reference):
    # Disk alone (no Redis, no S3): the hit can only come from the disk tier.
    out = engine(
        model, workdir, {"namespace": "e2e", "disk": {"path": str(workdir / "disk-a")}}, prompts(("p1", P1))
    )
    hit = out["results"][0]
    assert hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(hit, reference["p1"])


def test_s3_hit_from_a_fresh_process_with_empty_disk(first_engine, model, workdir, stack, reference):
    out = engine(model, workdir, full_config(stack, workdir / "disk-empty"), prompts(("p1", P1)))
    hit = out["results"][0]
    assert hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(hit, reference["p1"])
    # Promoted from S3 onto this node's disk on the way up.
    assert list((workdir / "disk-empty").rglob("*.safetensors"))


def test_a_wrong_s3_secret_is_refused_and_ends_as_a_miss(first_engine, model, workdir, stack, reference):
    """The real server checks each request's signature (moto takes any): an engine
    whose secret is wrong has every S3 read of P1's indexed blocks refused, recomputes
    them, right, and its writes to S3 are refused too. A refusal says nothing about the
    objects, so they stay indexed: a process with the right secret still gets the hit."""
    config = full_config(stack, workdir / "disk-wrong-secret")
    refused = engine(
        model,
        workdir,
        config,
        prompts(("p1", P1)),
        env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
        log_stats=True,
        counters="vllm:tiercache_failed_blocks",
    )["results"][0]
    assert_same_output(refused, reference["p1"])
    assert refused["counters"]["tier=s3"] > 0  # the hit was planned, read and refused
    assert "9 of 9" in where_p1_lives(workdir, config)["s3"]


def test_another_model_on_the_same_redis_and_s3_gets_no_hit(first_engine, other_model, workdir, stack):
    out = engine(
        other_model, workdir, full_config(stack, workdir / "disk-b"), prompts(("p1", P1), ("p1", P1))
    )
    first, second = out["results"]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == 9 * BLOCK  # its own blocks, from its own CPU tier


def test_redis_and_s3_unreachable_still_right_with_local_hits(model, workdir, reference):
    config = {
        "redis_url": DEAD_REDIS,
        "s3": {"bucket": "tc-e2e", "endpoint_url": DEAD_S3},
        "disk": {"path": str(workdir / "disk-dead")},
    }
    out = engine(model, workdir, config, prompts(("p1", P1), ("p1", P1)))
    cold, hit = out["results"]
    assert cold["num_cached_tokens"] == 0
    assert hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(cold, reference["p1"])
    assert_same_output(hit, reference["p1"])


def test_embedded_default_config(model, workdir, reference):
    out = engine(model, workdir, {}, prompts(("p1", P1), ("p1", P1)))
    cold, hit = out["results"]
    assert (cold["num_cached_tokens"], hit["num_cached_tokens"]) == (0, 9 * BLOCK)
    assert_same_output(hit, reference["p1"])


def corrupt(path: Path) -> None:
    """Same size, garbage pages: only the checksum can tell."""
    data = bytearray(path.read_bytes())
    data[-4096:] = bytes(4096)
    path.write_bytes(bytes(data))


def block_hashes(ids: list[int]) -> list[bytes]:
    """A prompt's block hashes as the engines name its objects (run_engine's PYTHONHASHSEED)."""
    from tiercache.index.block_hashing import BlockHashing, shareable_seed

    return BlockHashing("sha256", BLOCK, shareable_seed("sha256", {"PYTHONHASHSEED": "0"})).block_hashes(ids)


def p1_block_hashes() -> list[bytes]:
    hashes = block_hashes(P1)
    assert len(hashes) == 9
    return hashes


def object_of(disk: Path, block_hash: bytes) -> Path:
    (path,) = disk.rglob(f"{block_hash.hex()}.safetensors")
    return path


def zero_first_layer(path: Path) -> None:
    """Zero the object's first layer's page, all of it. Read in the forward, that page
    fails its check and the block's later layers are not read: every layer's page of
    the block holds bad bytes, so what the forward computes after it is wrong at every
    layer but the first. (A bad last layer alone, as `corrupt` makes, may be read
    before the first: the layers are read by several threads.)"""
    from tiercache.tiers.format import decode_header, header_length, parse_parts

    data = bytearray(path.read_bytes())
    header = decode_header(bytes(data[8 : 8 + header_length(data)]))
    parts = parse_parts(header)
    assert parts is not None  # written where disk hits are read in the forward
    start, first_page, _ = parts[0]
    start += header.data_offset
    data[start : start + first_page] = bytes(first_page)
    path.write_bytes(bytes(data))


def stored_kv(path: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    from tiercache.tiers.format import TENSOR_NAME

    return load_file(str(path))[TENSOR_NAME].view(np.float32)


def test_corrupt_disk_objects_are_recomputed_never_wrong(first_engine, model, workdir, reference):
    disk = workdir / "disk-corrupt"
    shutil.copytree(workdir / "disk-a", disk)
    objects = list(disk.rglob("*.safetensors"))
    assert objects
    for path in objects:
        corrupt(path)
    out = engine(
        model,
        workdir,
        {"namespace": "e2e", "disk": {"path": str(disk)}},  # the namespace the objects were written in
        prompts(("p1", P1), ("p1", P1)),
        log_stats=True,
        counters="vllm:tiercache_failed_blocks",
    )
    recomputed, hit_again = out["results"]
    assert_same_output(recomputed, reference["p1"])
    assert recomputed["counters"]["tier=disk"] > 0  # the objects were read, and refused
    # The corrupt objects were dropped and the recomputed blocks stored again.
    assert hit_again["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(hit_again, reference["p1"])


@pytest.mark.parametrize("in_forward", [True, False], ids=["read-in-forward", "staged-to-cpu"])
def test_a_corrupt_block_mid_prefix_is_recomputed_from_there_never_wrong(
    first_engine, model, workdir, reference, in_forward
):
    """Block 4 of P1's 9 is corrupt on disk, the rest sound: the hit's blocks 0-3 are
    good, and vLLM must recompute from block 4 on, whatever was loaded after it. Both
    ways a disk hit is loaded on the CPU backend: read into the paged KV inside the
    forward (checked before the step's output counts) and staged into the CPU tier
    first (checked before the load is reported done)."""
    disk = workdir / f"disk-mid-prefix-{'forward' if in_forward else 'staged'}"
    shutil.copytree(workdir / "disk-a", disk)
    corrupt(object_of(disk, p1_block_hashes()[4]))
    out = engine(
        model,
        workdir,
        {"namespace": "e2e", "disk": {"path": str(disk), "load_in_forward": in_forward}},
        prompts(("p1", P1), ("p1", P1)),
        log_stats=True,
        counters="vllm:tiercache_failed_blocks",
    )
    first, again = out["results"]
    assert_same_output(first, reference["p1"])
    # Read in the forward, block 4 alone fails its check (vLLM drops what came after
    # it); staged, the blocks after it are failed with it and never copied.
    failed = {"tier=disk": 1 if in_forward else 5}
    assert {k: v for k, v in first["counters"].items() if v} == failed
    # The corrupt object was dropped, and the recomputed blocks stored again.
    assert again["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(again, reference["p1"])
    assert {k: v for k, v in again["counters"].items() if v} == failed


def test_blocks_computed_over_a_corrupt_block_are_never_cached(first_engine, model, workdir, reference):
    """P1 and SHARER arrive together. The disk holds P1's blocks 0-5 only, block 2's
    first layer zeroed. P1's hit reads 0-5 inside the forward, and SHARER, scheduled in
    the same step, shares them through vLLM's prefix cache: that forward computes P1's
    blocks 6-8 and SHARER's 6-9 over block 2's bad pages. vLLM drops that output and
    recomputes both; what tiercache stores must be what the recompute made, so that a
    later process's hits are right."""
    clean, disk = workdir / "disk-a", workdir / "disk-poisoned-step"
    shutil.copytree(clean, disk)
    p1, sharer = p1_block_hashes(), block_hashes(SHARER)
    for gone in [*p1[6:], *sharer[6:]]:
        object_of(disk, gone).unlink()
    zero_first_layer(object_of(disk, p1[2]))
    config = {"namespace": "e2e", "disk": {"path": str(disk)}}
    both = prompts(("p1", P1), ("sharer", SHARER))
    out = engine(
        model,
        workdir,
        config,
        [{"batch": both}],
        enable_prefix_caching=True,
        in_process=True,  # both requests in the first step
        log_stats=True,
        counters="vllm:tiercache_failed_blocks",
    )
    for result in out["results"]:
        assert_same_output(result, reference[result["name"]])
    assert {k: v for k, v in out["results"][-1]["counters"].items() if v} == {"tier=disk": 1}
    # Stored again, each as a sound run computed it: the recomputed block 2 and the
    # blocks computed over it.
    for block in [p1[2], *p1[6:], *sharer[6:]]:
        stored, sound = stored_kv(object_of(disk, block)), stored_kv(object_of(clean, block))
        np.testing.assert_allclose(stored, sound, atol=1e-4)
    later = engine(model, workdir, config, both)
    for result in later["results"]:
        assert result["num_cached_tokens"] == result["prompt_tokens"] // BLOCK * BLOCK  # every full block
        assert_same_output(result, reference[result["name"]])


@pytest.fixture(scope="module")
def tp2_reference(model, workdir):
    out = engine(model, workdir, None, prompts(("p1", P1)), tensor_parallel_size=2)
    return out["results"][0]


def test_tensor_parallel_2_each_rank_stores_and_loads_its_own_shard(model, workdir, tp2_reference):
    disk = workdir / "disk-tp2"
    config = {"namespace": "tp2", "disk": {"path": str(disk)}}
    first = engine(model, workdir, config, prompts(("p1", P1), ("p1", P1)), tensor_parallel_size=2)
    cold, hit = first["results"]
    assert cold["num_cached_tokens"] == 0 and hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(hit, tp2_reference)
    # Two ranks, two namespace digests, each with its own copy of every block.
    rank_dirs = [DiskLayout(disk).digest_dir(digest) for digest in DiskLayout(disk).digests()]
    assert len(rank_dirs) == 2
    counts = {len(list(d.rglob("*.safetensors"))) for d in rank_dirs}
    assert counts == {9}
    fresh = engine(model, workdir, config, prompts(("p1", P1)), tensor_parallel_size=2)
    restart_hit = fresh["results"][0]
    assert restart_hit["num_cached_tokens"] == 9 * BLOCK
    assert_same_output(restart_hit, tp2_reference)


def test_inside_multiconnector_beside_another_connector(model, workdir, reference):
    ours = connector_config({"namespace": "multi"})
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(workdir / "example")},
    }
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [ours, example]},
    }
    out = run_engine(
        {"model": model, "kv_transfer_config": multi, "prompts": prompts(("p1", P1), ("p1", P1))},
        workdir / "runs",
    )
    cold, hit = out["results"]
    assert (cold["num_cached_tokens"], hit["num_cached_tokens"]) == (0, 9 * BLOCK)
    assert_same_output(hit, reference["p1"])


def where_p1_lives(workdir: Path, config: dict) -> dict[str, str]:
    """`tiercache inspect` of P1 under `config`: its "N of 9" line for each tier."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    config_file = workdir / "inspect.yaml"
    config_file.write_text(yaml.safe_dump(config))
    tokens = workdir / "p1.json"
    tokens.write_text(json.dumps(P1))
    command = ["inspect", "--prompt", f"@{tokens}", "--config", str(config_file)]
    result = subprocess.run(
        [sys.executable, "-m", "tiercache.ops.cli", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "0", "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "of 9" in line]
    return {tier: " ".join(line for line in lines if tier in line) for tier in ("s3", "disk")}


def test_inspect_shows_where_a_prompts_prefix_lives(first_engine, workdir, stack):
    found = where_p1_lives(workdir, full_config(stack, workdir / "disk-a"))
    assert "9 of 9" in found["s3"], found
    assert "9 of 9" in found["disk"], found


def test_connector_failures_never_reach_vllm_nor_change_its_outputs(model, workdir, reference):
    """Issue 39, item 3, inside a real engine: hooks of both halves raise every other
    call (tests/support/faulty_connector.py). The engine serves every prompt,
    each output agrees with the run without the connector, and the failures are
    counted on vLLM's metrics."""
    faults = (
        "scheduler.build_connector_meta,scheduler.update_state_after_alloc,"
        "worker.start_load_kv,worker.wait_for_layer,worker.wait_for_save,worker.get_finished"
    )
    kv = {
        **connector_config(loading_every_hit({"disk": {"path": str(workdir / "disk-faulty")}})),
        "kv_connector": "FaultyTierCacheConnector",
        "kv_connector_module_path": "support.faulty_connector",
    }
    items = prompts(("p1", P1), ("p1", P1), ("p2", P2), ("p1", P1), ("sharer", SHARER), ("p1", P1))
    spec = {"model": model, "kv_transfer_config": kv, "prompts": items}
    # The engine's processes import the faulty connector from tests/support/.
    python_path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    out = run_engine(
        {**spec, "log_stats": True, "counters": "vllm:tiercache_hook_failures"},
        workdir / "runs",
        env={FAULTS_ENV: faults, "PYTHONPATH": python_path},
    )
    for result in out["results"]:
        assert_same_output(result, reference[result["name"]])
    assert sum(out["results"][-1]["counters"].values()) >= 1

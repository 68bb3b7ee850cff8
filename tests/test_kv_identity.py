"""What names a stored block: every field that changes the KV bytes is in its key,
objects whose header says they hold other layers are never served, and the TP ranks
of one node keep to their own files on a shared disk root.

The vLLM configs here are stand-ins with the attributes the connector reads: no
engine is started."""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tiercache.config import build_config
from tiercache.engine import DISK, ObjectShape, TierEngine
from tiercache.index.keys import KVSpec
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.disk.tier import DiskTier

BLOCK = 32
PAGE = 4096
SLOT = 8192
STAGE_0 = ["model.layers.0.self_attn.attn"]
STAGE_1 = ["model.layers.1.self_attn.attn"]


def vllm_config(model: str, *, quantization=None, revision=None, tp=1, pp=1, load_format="auto"):
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model,
            revision=revision,
            dtype="float32",
            quantization=quantization,
            quantization_config=None,
            hf_overrides={},
            use_mla=False,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK, kv_cache_dtype_skip_layers=[]),
        load_config=SimpleNamespace(download_dir=None, load_format=load_format),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}, kv_load_failure_policy="recompute"),
    )


def kv_cache_config(layer_names=STAGE_0, layout=None):
    spec = SimpleNamespace(page_size_bytes=PAGE, num_kv_heads=2, head_size=16)
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(layer_names))],
        num_blocks=16,
        kv_cache_layout=layout,
    )


def digests(vllm, layers=STAGE_0, layout=None, **config) -> list[str]:
    pytest.importorskip("vllm")
    from tiercache.connector.spec import kv_specs

    kv = kv_cache_config(layers, layout)
    return [s.digest() for s in kv_specs(vllm, kv, build_config(config, environ={}))]


def test_the_kv_cache_layout_the_engine_resolved_is_in_the_key(model_dir):
    """vLLM 0.32 resolves the layout once and records it in the KV cache config; the
    key read it from a getter that vLLM no longer has, so every layout got one key."""
    config = vllm_config(str(model_dir))
    assert digests(config, layout="LBNHC") != digests(config, layout="LBHNC")
    assert digests(config, layout="LBNHC") == digests(config, layout="LBNHC")
    # Recorded only in the cache config (the worker's copy before its KV cache config).
    config.cache_config.kv_cache_layout = "LBHNC"
    assert digests(config) == digests(config, layout="LBHNC")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text('{"num_hidden_layers": 2}')
    (path / "model.safetensors").write_bytes(b"\0" * 1000)
    return path


# -- pipeline stages and layers (issue 16, defect 1) ----------------------------------


def test_pipeline_stage_and_layers_are_in_the_key_but_not_the_deployment():
    stage0 = KVSpec(
        "m", "", "float32", "auto", BLOCK, "cpu", 1, 2, 16, 1, 0, "t", PAGE, pp_size=2, layers="a"
    )
    stage1 = replace(stage0, pp_rank=1, layers="b")
    assert stage0.digest() != stage1.digest()
    assert replace(stage0, pp_rank=1).digest() != stage0.digest()
    assert replace(stage0, layers="b").digest() != stage0.digest()
    # One deployment in the shared index, whatever stage or rank wrote a block.
    assert stage0.model_digest() == stage1.model_digest()


def test_workers_holding_other_layers_name_their_blocks_apart(model_dir):
    """Two workers of one TP rank with the same layer count but other layers (the two
    stages of a PP=2 deployment) used to write one key each with different bytes."""
    config = vllm_config(str(model_dir))
    assert digests(config, STAGE_0) != digests(config, STAGE_1)
    assert digests(config, STAGE_0) == digests(config, list(reversed(STAGE_0)))


def test_pipeline_parallelism_is_refused_at_connector_start(model_dir):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tiercache.connector.connector import TierCacheConnector

    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=r"pipeline_parallel_size=2"):
            TierCacheConnector(vllm_config(str(model_dir), pp=2), role, kv_cache_config())


@pytest.mark.parametrize("setting", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_at_connector_start(setting):
    """With decode or prefill context parallelism vLLM hashes blocks of block_size x
    the CP size tokens, each rank holding a shard of them; tiercache planned stores
    per rank-local block, so it stored blocks not yet computed under valid keys."""
    pytest.importorskip("vllm")
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tiercache.connector.connector import TierCacheConnector

    if setting == "decode_context_parallel_size":
        parallel = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
        config = VllmConfig(parallel_config=parallel)
    else:
        # vLLM's V1 model runner (the only one without Triton) refuses PCP when it
        # validates the config; the connector must refuse it all the same where it runs.
        config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2))
        config.parallel_config.prefill_context_parallel_size = 2
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=rf"context parallelism \({setting}=2\)"):
            TierCacheConnector(config, role, kv_cache_config())


def engine_over(root: Path, shape: ObjectShape, capacity: int = 1 << 20) -> TierEngine:
    config = build_config(
        {"cpu": {"capacity": 2 * shape.slot_bytes}, "disk": {"path": str(root), "capacity": capacity}},
        environ={},
    )
    return TierEngine(config, shape, CpuBuffer(2, shape.slot_bytes, pin_memory=False), disk_capacity=capacity)


def test_an_object_holding_other_layers_is_a_miss_and_removed(tmp_path):
    """Same key, same size, a valid checksum: only the header tells that the pages
    are another stage's layers. They must never be served."""
    digest = uuid.uuid4().hex[:16]
    ours = ObjectShape("m" * 16, digest, SLOT, "block-major", "float32", "model.layers.0.attn:[2, 32, 32]")
    theirs = replace(ours, shapes="model.layers.1.attn:[2, 32, 32]")
    engine = engine_over(tmp_path / "disk", ours)
    try:
        block_hash = b"\7" * 32
        data = memoryview(np.random.default_rng(0).bytes(SLOT))
        assert engine.disk.put(ours.key(block_hash), data, theirs.header(block_hash, data))
        out = memoryview(bytearray(SLOT))
        assert not engine.read_into(block_hash, out, DISK)
        assert not engine.disk.path_of(ours.key(block_hash)).exists()
        # The reader's own objects still load.
        assert engine.disk.put(ours.key(block_hash), data, ours.header(block_hash, data))
        assert engine.read_into(block_hash, out, DISK) and bytes(out) == bytes(data)
    finally:
        engine.close()


# -- quantization and the weights' identity (issue 16, defect 2) ----------------------------


def test_quantization_changes_the_key(model_dir):
    model = str(model_dir)
    assert digests(vllm_config(model, quantization="fp8")) != digests(vllm_config(model))


@pytest.mark.parametrize("size", [1200, 1000], ids=["new size", "same size, rewritten in place"])
def test_rewritten_weights_change_the_key(model_dir, size):
    before = digests(vllm_config(str(model_dir)))
    weights = model_dir / "model.safetensors"
    weights.write_bytes(b"\1" * size)
    later = time.time() + 60
    os.utime(weights, (later, later))
    assert digests(vllm_config(str(model_dir))) != before


def test_dummy_weights_never_share_keys_with_the_real_weights_of_the_folder(model_dir):
    """vLLM's load_format=dummy fills the model with seeded random values: an engine
    so started on a real model folder named its blocks as the real weights' engines."""
    model = str(model_dir)
    for pinned in ({}, {"model_revision": "v7"}):
        real = digests(vllm_config(model), **pinned)
        dummy = digests(vllm_config(model, load_format="dummy"), **pinned)
        assert dummy != real
        assert digests(vllm_config(model, load_format="dummy"), **pinned) == dummy  # dummy engines agree


def test_a_pinned_revision_overrides_the_fingerprint(model_dir):
    pinned = digests(vllm_config(str(model_dir)), model_revision="v7")
    (model_dir / "model.safetensors").write_bytes(b"\1" * 1200)
    os.utime(model_dir / "model.safetensors", (time.time() + 60,) * 2)
    assert digests(vllm_config(str(model_dir)), model_revision="v7") == pinned
    assert digests(vllm_config(str(model_dir)), model_revision="v8") != pinned
    assert digests(vllm_config(str(model_dir))) != pinned


def hub_snapshot(cache: Path, repo: str, blob: str) -> None:
    """The Hugging Face cache's layout: a snapshot's files link to hash-named blobs."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("c0ffee")
    snapshot = folder / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    for name, content, blob_name in (("config.json", b"{}", "cfg0"), ("model.safetensors", b"w" * 64, blob)):
        (folder / "blobs" / blob_name).write_bytes(content)
        (snapshot / name).symlink_to(f"../../blobs/{blob_name}")


def test_a_hub_id_is_fingerprinted_by_its_cached_snapshot(tmp_path):
    """Two nodes that downloaded the same snapshot at different times agree; another
    blob behind the same id does not."""
    pytest.importorskip("huggingface_hub")
    node_a, node_b, changed = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    hub_snapshot(node_a, "org/tiny", "w1")
    time.sleep(0.01)
    hub_snapshot(node_b, "org/tiny", "w1")
    hub_snapshot(changed, "org/tiny", "w2")

    def digest_in(cache: Path) -> list[str]:
        config = vllm_config("org/tiny")
        config.load_config.download_dir = str(cache)
        return digests(config)

    assert digest_in(node_a) == digest_in(node_b)
    assert digest_in(node_a) != digest_in(changed)


def test_unreadable_weights_fall_back_to_the_model_id_and_log_once(tmp_path, caplog):
    config = vllm_config("no-such-org/no-such-model-" + uuid.uuid4().hex)
    config.load_config.download_dir = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tiercache.connector"):
        first, second = digests(config), digests(config)
    assert first == second
    assert sum("cannot read the weight files" in r.message for r in caplog.records) == 1


def test_weights_fingerprint_reads_config_and_weight_files(model_dir, tmp_path):
    from tiercache.index.keys import weights_fingerprint

    assert weights_fingerprint(tmp_path / "empty-or-missing") is None
    before = weights_fingerprint(model_dir)
    (model_dir / "config.json").write_text('{"num_hidden_layers": 3}')
    assert weights_fingerprint(model_dir) != before
    (model_dir / "tokenizer.json").write_text("{}")  # not the weights: no change
    after = weights_fingerprint(model_dir)
    assert weights_fingerprint(model_dir) == after


# -- TP ranks sharing one disk root (issue 16, defect 11) -------------------------------------


def fill(tier: DiskTier, digest: str, count: int, size: int = SLOT, first: int = 0) -> list[str]:
    keys = []
    for i in range(first, first + count):
        key = f"{digest}/{i:064x}"
        data = memoryview(bytes([i]) * size)
        shape = ObjectShape("m" * 16, digest, size)
        header = shape.header(bytes.fromhex(f"{i:064x}"), data)
        assert tier.put(key, data, header)
        keys.append(key)
    return keys


def test_ranks_on_one_root_share_its_budget_and_hear_of_their_objects_evicted(tmp_path):
    """Each rank's tier lists its own objects only, but the capacity is the root's:
    a rank that stores evicts the least recently used of every rank, and the rank
    whose objects went hears of it (its scheduler stops counting them on disk)."""
    root = tmp_path / "disk"
    rank0, rank1 = "0" * 15 + "a", "0" * 15 + "b"
    keys1 = fill(DiskTier(root, 1 << 30), rank1, 4)
    keys0 = fill(DiskTier(root, 1 << 30), rank0, 4)
    object_bytes = DiskTier(root, 1 << 30, digest=rank0).usage_bytes() // 4

    budget = 9 * object_bytes  # both ranks' 8 objects, and one more
    removed1: list[str] = []
    tier0 = DiskTier(root, budget, digest=rank0)
    tier1 = DiskTier(root, budget, digest=rank1, on_remove=removed1.append)
    assert sorted(tier0.keys()) == keys0 and sorted(tier1.keys()) == keys1

    # Rank 0 stores 4 more: the root keeps 9, and rank 1's 3 oldest (older than any
    # of rank 0's) make the room.
    fill(tier0, rank0, 8)
    assert DiskTier(root, 1 << 30).usage_bytes() <= budget
    assert tier1.keys() == keys1[3:]
    assert [tier1.path_of(k).exists() for k in keys1] == [False, False, False, True]
    assert not tier1.get_into(keys1[0], memoryview(bytearray(SLOT)))  # a miss
    # Rank 1 hears of the three at its next store, which evicts its own oldest.
    (new,) = fill(tier1, rank1, 1, first=4)
    assert set(removed1) == set(keys1)
    assert tier1.keys() == [new] and len(DiskTier(root, 1 << 30).keys()) == 9


def test_tier_engines_of_two_ranks_on_one_root_keep_one_budget(tmp_path):
    """What the connector's workers do: one TierEngine per rank on one disk root,
    each given the root's whole capacity."""
    root = tmp_path / "disk"
    shapes = [ObjectShape("m" * 16, uuid.uuid4().hex[:16], SLOT) for _ in range(2)]
    seeded = {shape.rank_digest: fill(DiskTier(root, 1 << 30), shape.rank_digest, 3) for shape in shapes}
    budget = 8 * shapes[0].object_bytes
    engines = [engine_over(root, shape, capacity=budget) for shape in shapes]
    try:
        for engine, shape in zip(engines, shapes, strict=True):
            assert sorted(engine.disk.keys()) == seeded[shape.rank_digest]
        fill(engines[0].disk, shapes[0].rank_digest, 6)
        assert DiskTier(root, 1 << 30).usage_bytes() <= budget
        left = engines[1].disk.keys()
        assert left == seeded[shapes[1].rank_digest][1:]  # its oldest made the room
        assert all(engines[1].disk.path_of(k).exists() for k in left)
    finally:
        for engine in engines:
            engine.close()

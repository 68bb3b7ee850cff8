"""An S3 hit kept on the node's disk, decided by the one cache policy (tiercache/policy.py):
under write-through the worker writes the promoted block to disk at once; under
write-back it does not (the disk gets the block when the CPU tier evicts it). Before
the rule was shared, the worker promoted to disk under either policy. Real redis-server
and moto's S3 server; the worker half of the connector on CPU tensors."""

from __future__ import annotations

import time

import pytest
import torch

from tiercache.config import build_config
from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.metadata import ON_DISK, BlockOp, LoadJob, TierCacheMetadata
from tiercache.connector.worker import TierCacheWorker
from tiercache.index.keys import KVSpec
from tiercache.tiers import S3

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
NUM_BLOCKS = 8
BLOCK_HASH = b"p" * 32


def worker_for(tmp_path, name: str, redis_url: str, endpoint: str, bucket: str, policy: str):
    kv = {layer: torch.randn(NUM_BLOCKS, 2, 16, 8) for layer in LAYERS}
    slot_bytes = PagedKVCopier(kv, NUM_BLOCKS).slot_bytes
    config = build_config(
        {
            "cpu": {"capacity": 4 * slot_bytes},
            "disk": {"path": str(tmp_path / name)},
            "redis_url": redis_url,
            "s3": {"bucket": bucket, "endpoint_url": endpoint, "region": "us-east-1"},
            "movers": {"policy": policy, "cost_model": "off"},
        }
    )
    spec = KVSpec("m", "", "float32", "auto", 16, "cpu", len(LAYERS), 2, 8, 1, 0, "t", slot_bytes)
    worker = TierCacheWorker(
        config,
        spec,
        "promotion-" + bucket,
        NUM_BLOCKS,
        tp_rank=0,
        writes_lower_tiers=True,
        disk_share=1 << 26,
    )
    worker.register_kv_caches(kv, slot_bytes)
    return worker, kv


@pytest.mark.parametrize("policy,kept_on_disk", [("write_through", True), ("write_back", False)])
def test_an_s3_hit_is_promoted_to_disk_only_where_the_policy_says(
    tmp_path, redis_url, s3_endpoint, bucket, policy, kept_on_disk
):
    writer, writer_kv = worker_for(tmp_path, "writer-disk", redis_url, s3_endpoint, bucket, "write_through")
    store = TierCacheMetadata(stores=[BlockOp(BLOCK_HASH, 2, 0, "cpu")])
    writer.start_load_kv(store)
    writer.wait_for_save(store)
    assert writer.engine.flush(30)
    writer.shutdown()

    reader, reader_kv = worker_for(tmp_path, "reader-disk", redis_url, s3_endpoint, bucket, policy)
    try:
        load = TierCacheMetadata(loads=[LoadJob("r", [BlockOp(BLOCK_HASH, 5, 1, S3)], True)])
        reader.start_load_kv(load)
        deadline = time.monotonic() + 30
        while "r" not in reader.get_finished():
            assert time.monotonic() < deadline, "the S3 load never finished"
            time.sleep(0.01)
        assert reader.take_failed_blocks() == set()
        for layer in LAYERS:  # the block did arrive, whatever the policy
            assert torch.equal(reader_kv[layer][5], writer_kv[layer][2])
        assert reader.engine.flush(30)
        kinds = [kind for _, kind, _ in reader.take_worker_meta().reports]
        assert (ON_DISK in kinds) is kept_on_disk
        on_disk = list((tmp_path / "reader-disk").rglob("*.safetensors"))
        assert bool(on_disk) is kept_on_disk
    finally:
        reader.shutdown()

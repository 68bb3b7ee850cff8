"""The worker half imports and copies blocks where vLLM cannot be imported (issue 20,
item 3): only the connector class itself needs vLLM (connector/vllm_compat.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class NoVllm(importlib.abc.MetaPathFinder):
        # As if vLLM were not installed, whatever this environment holds.
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoVllm())

    import torch
    import tiercache.connector  # the package itself imports nothing of vLLM
    from tiercache.config import build_config
    from tiercache.connector.metadata import BlockOp, LoadJob, TierCacheMetadata
    from tiercache.connector.vllm_compat import HAVE_VLLM
    from tiercache.connector.worker import TierCacheWorker
    from tiercache.index.keys import KVSpec

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    # FlashAttention's GPU layout: (2, num_blocks, block_size, kv_heads, head_size).
    kv = {name: torch.randn(2, 10, 16, 2, 8) for name in layers}
    slot_bytes = 3 * 2 * 16 * 2 * 8 * 4
    spec = KVSpec("m", "", "float32", "auto", 16, "cpu", 3, 2, 8, 1, 0, "t", slot_bytes)
    worker = TierCacheWorker(
        build_config({"cpu": {"capacity": 4 * slot_bytes}}), spec, "digest", 10,
        tp_rank=0, writes_lower_tiers=True, disk_share=0,
    )
    worker.register_kv_caches(kv, slot_bytes)
    want = {name: t[:, 3].clone() for name, t in kv.items()}
    store = TierCacheMetadata(stores=[BlockOp(b"h" * 32, 3, 1, "cpu")])
    worker.start_load_kv(store)
    worker.wait_for_save(store)
    load = TierCacheMetadata(loads=[LoadJob("r", [BlockOp(b"h" * 32, 7, 1, "cpu")], False)])
    worker.start_load_kv(load)
    worker.wait_for_save(load)
    reports = worker.take_worker_meta().reports
    worker.shutdown()
    print(json.dumps({
        "have_vllm": HAVE_VLLM,
        "vllm_modules": sorted(m for m in sys.modules if m.split(".")[0] == "vllm"),
        "loaded": all(torch.equal(kv[name][:, 7], want[name]) for name in layers),
        "reports": [[kind, str(value)] for _, kind, value in reports],
        "stats": worker.take_stats().data.get("stored_blocks"),
    }))
    """
)


def test_the_worker_imports_and_copies_with_vllm_unimportable():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["have_vllm"] is False
    assert out["vllm_modules"] == []
    assert out["loaded"] is True
    assert [kind for kind, _ in out["reports"]][:2] == ["filled", "released"]
    assert out["stats"] == 1


def test_with_vllm_installed_its_own_base_classes_are_used():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1 import base, metrics

    from tiercache.connector.metadata import TierCacheMetadata, TierCacheWorkerMetadata
    from tiercache.connector.stats import TierCacheStats

    assert issubclass(TierCacheMetadata, base.KVConnectorMetadata)
    assert issubclass(TierCacheWorkerMetadata, base.KVConnectorWorkerMetadata)
    assert issubclass(TierCacheStats, metrics.KVConnectorStats)

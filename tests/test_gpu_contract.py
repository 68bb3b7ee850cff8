"""What vLLM's GPU build asks of a connector, checked with vLLM's own config code.

`VllmConfig.__post_init__` (vllm/config/vllm.py) asks the connector class, whenever the
configured cudagraph mode has full graphs:

    if (self.kv_transfer_config is not None
            and self.kv_transfer_config.is_kv_transfer_instance
            and self.compilation_config.cudagraph_mode.has_full_cudagraphs()):
        connector_cls = KVConnectorFactory.get_connector_class(self.kv_transfer_config)
        if connector_cls.requires_piecewise_for_cudagraph(
                self.kv_transfer_config.kv_connector_extra_config):
            ...
            self.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE

tiercache answers False for every configuration: a step that may be a full graph
replay (which calls no layer hook) loads its hits whole before the forward and stores
whole after it (connector/graphs.py), so decode batches keep full graphs. The GPU
itself is the one thing faked here: the CPU platform has no graphs at all."""

from __future__ import annotations

import pytest
from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.platforms import current_platform

from tiercache.connector import TierCacheConnector
from tiercache.connector.graphs import FullGraphs, full_graphs

# tiercache's configurations, as kv_connector_extra_config (nothing is started).
CONFIGURATIONS = {
    "CPU tier only": {"cpu": {"capacity": "1GiB"}},
    "CPU and disk": {"cpu": {"capacity": "1GiB"}, "disk": {"path": "/tmp/tc-graphs", "capacity": "2GiB"}},
    "CPU, disk, S3 and Redis": {
        "cpu": {"capacity": "1GiB"},
        "disk": {"path": "/tmp/tc-graphs", "capacity": "2GiB"},
        "s3": {"bucket": "b", "endpoint_url": "http://127.0.0.1:9", "capacity": "10GiB"},
        "redis_url": "redis://127.0.0.1:9/0",
    },
    "decode tokens stored": {"cpu": {"capacity": "1GiB"}, "store_decode": True},
    "write-back": {"cpu": {"capacity": "1GiB"}, "movers": {"policy": "write_back"}},
}


@pytest.fixture
def graphs_supported(monkeypatch):
    """Stand in for a CUDA platform's answer: static graphs are supported."""
    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))


def vllm_config(kv_transfer_config, mode=CUDAGraphMode.FULL_AND_PIECEWISE) -> VllmConfig:
    return VllmConfig(
        kv_transfer_config=kv_transfer_config, compilation_config=CompilationConfig(cudagraph_mode=mode)
    )


def ours(extra: dict) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="TierCacheConnector",
        kv_connector_module_path="tiercache.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )


@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_every_configuration_keeps_vllms_full_cuda_graphs(graphs_supported, configuration):
    extra = CONFIGURATIONS[configuration]
    assert TierCacheConnector.requires_piecewise_for_cudagraph(extra) is False
    without = vllm_config(None).compilation_config.cudagraph_mode
    mode = vllm_config(ours(extra)).compilation_config.cudagraph_mode
    # (With no model to compile vLLM lowers FULL_AND_PIECEWISE to FULL_DECODE_ONLY,
    # with or without a connector: the connector changes nothing.)
    assert mode == without and mode.has_full_cudagraphs(), mode
    assert (
        vllm_config(ours(extra), CUDAGraphMode.FULL).compilation_config.cudagraph_mode == CUDAGraphMode.FULL
    )


def test_the_override_is_what_it_was_asked_for(graphs_supported, monkeypatch):
    """The same code path with a connector that does ask (tiercache's answer before
    issue 41): full graphs are gone, so the test above sees the override's absence."""
    monkeypatch.setattr(
        TierCacheConnector, "requires_piecewise_for_cudagraph", classmethod(lambda cls, e: True)
    )
    assert not vllm_config(ours({})).compilation_config.cudagraph_mode.has_full_cudagraphs()


def test_the_scheduler_marks_the_steps_a_full_graph_may_replay(graphs_supported):
    decode_only = full_graphs(vllm_config(ours({})))
    assert decode_only is not None and not decode_only.any_batch and decode_only.decode_query_len == 1
    assert decode_only.may_replay({"a": 1, "b": 1, "c": 1})  # a decode batch
    assert not decode_only.may_replay({"a": 1, "b": 37})  # a prefill beside it: piecewise
    assert not decode_only.may_replay({})  # nothing runs
    any_batch = full_graphs(vllm_config(ours({}), CUDAGraphMode.FULL))
    assert any_batch is not None and any_batch.may_replay({"a": 1, "b": 37})
    assert not FullGraphs(1, True, max_tokens=32).may_replay({"a": 1, "b": 37})  # beyond the captured sizes
    assert full_graphs(vllm_config(ours({}), CUDAGraphMode.PIECEWISE)) is None

"""What vLLM's GPU build asks of a connector, checked with vLLM's own config code:
full CUDA graph replays skip the layer hooks tiercache copies from, so the connector
must make vLLM capture piecewise graphs. The GPU itself is the one thing faked here:
the CPU platform has no graphs at all."""

from __future__ import annotations

import pytest
from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.platforms import current_platform

from tiercache.connector import TierCacheConnector


def test_the_connector_asks_for_piecewise_cuda_graphs():
    assert TierCacheConnector.requires_piecewise_for_cudagraph({}) is True
    assert TierCacheConnector.requires_piecewise_for_cudagraph({"cpu": {"capacity": "1GiB"}}) is True


@pytest.fixture
def graphs_supported(monkeypatch):
    """Stand in for a CUDA platform's answer: static graphs are supported."""
    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))


def graph_mode(kv_transfer_config) -> CUDAGraphMode:
    config = VllmConfig(
        kv_transfer_config=kv_transfer_config,
        compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
    )
    return config.compilation_config.cudagraph_mode


def test_vllm_turns_full_graphs_into_piecewise_for_the_connector(graphs_supported):
    assert graph_mode(None).has_full_cudagraphs()  # without a connector, full graphs stay
    ours = KVTransferConfig(
        kv_connector="TierCacheConnector", kv_connector_module_path="tiercache.connector", kv_role="kv_both"
    )
    # vLLM's override makes it PIECEWISE; with no model to compile, later checks
    # may lower that to NONE. Either way no full graph can skip a connector hook.
    assert not graph_mode(ours).has_full_cudagraphs()

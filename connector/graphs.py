"""Which steps vLLM may run as one full CUDA graph replay.

A full graph replays a whole forward captured once: the Python calls inside it (the
connector's `wait_for_layer_load` and `save_kv_layer`) are not made again. vLLM makes
`start_load_kv`, `bind_connector_metadata` and `wait_for_save` outside the graph, so
the connector needs no layer hook in such a step: the scheduler marks the steps that
may be replays (`TierCacheMetadata.full_graph`), and the worker copies their hits in
whole before the forward (the forward's stream waiting for the copy) and their
stores out whole after it. With that, tiercache never asks vLLM for piecewise graphs
(`TierCacheConnector.requires_piecewise_for_cudagraph`), and decode batches keep
vLLM's full graphs."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FullGraphs:
    decode_query_len: int  # tokens per request in a uniform decode batch (1 + speculative)
    any_batch: bool  # batches of any shape replay full graphs too (cudagraph_mode FULL)
    max_tokens: int  # the largest batch captured

    def may_replay(self, num_scheduled_tokens: Mapping[str, int]) -> bool:
        """Whether a step scheduling these tokens per request may be a full graph
        replay. Errs towards yes: a step marked so only loses the layer-by-layer
        overlap of its hits."""
        total = sum(num_scheduled_tokens.values())
        if not total or total > self.max_tokens:
            return False
        return self.any_batch or max(num_scheduled_tokens.values()) <= self.decode_query_len


def full_graphs(vllm_config: Any) -> FullGraphs | None:
    """What vLLM's configuration lets replay as full graphs (None: nothing). The worker
    may lower the mode later for its attention backend, never raise it."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = getattr(vllm_config, "compilation_config", None)  # absent from stand-ins
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is None or not mode.has_full_cudagraphs():
        return None
    return FullGraphs(
        decode_query_len=1 + int(getattr(vllm_config, "num_speculative_tokens", 0) or 0),
        any_batch=mode.mixed_mode() == CUDAGraphMode.FULL,
        max_tokens=getattr(compilation, "max_cudagraph_capture_size", None) or sys.maxsize,
    )

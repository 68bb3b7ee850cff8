"""vLLM's base classes for what the connector sends between its halves and reports as
stats, or minimal local stand-ins where vLLM cannot be imported.

The worker half (worker.py and everything it imports) runs without vLLM: in unit
tests, in the replay of an engine's recorded connector calls, and in tools that only
move blocks. Only these three classes are needed at run time, as bases. Where vLLM is
installed its own classes are always used, so vLLM's isinstance checks, its
aggregation of worker metadata and its pickling between processes see exactly the
types they expect. Only a missing vLLM falls back: any other error while importing it
is raised, never hidden."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )

    HAVE_VLLM = True
except ModuleNotFoundError as missing:
    if missing.name is None or missing.name.split(".")[0] != "vllm":
        raise  # vLLM is there but something it needs is not: that is not "no vLLM"
    HAVE_VLLM = False

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """What the scheduler half sends the workers each step."""

    class KVConnectorWorkerMetadata(ABC):  # type: ignore[no-redef]
        """What each worker sends back each step; vLLM merges ranks with `aggregate`."""

        @abstractmethod
        def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata: ...

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """A serializable bag of counts a worker reports each step."""

        data: dict[str, Any] = field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            return self.data

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        """Only vLLM builds Prometheus metrics for a connector, and only with vLLM there."""

        def __init__(self, *args: Any, **kwargs: Any):
            raise RuntimeError("a connector's Prometheus metrics are built by vLLM, which is not installed")


__all__ = [
    "HAVE_VLLM",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
]

"""One engine step through the connector's worker half, as vLLM's model runner calls
its hooks, for the tests that drive a worker without an engine."""

from __future__ import annotations

from collections.abc import Iterable

from tiercache.connector.metadata import TierCacheMetadata
from tiercache.connector.worker import TierCacheWorker


def vllm_step(
    worker: TierCacheWorker, meta: TierCacheMetadata, layers: Iterable[str], finished: Iterable[str] = ()
) -> None:
    """The step's hooks in vLLM's order, every attention layer's included; `finished`:
    the requests vLLM finished, handed to get_finished at the step's end."""
    worker.step_arrives(meta)
    worker.forward_begins(meta)
    worker.start_load_kv(meta)
    for name in layers:
        worker.wait_for_layer(name)
        worker.save_layer(name, meta)
    worker.wait_for_save(meta)
    worker.get_finished(set(finished))

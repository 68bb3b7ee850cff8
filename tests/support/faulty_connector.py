"""A TierCacheConnector that fails on purpose, for the end-to-end test of its guard
(connector/guard.py) inside a real vLLM engine.

`TC_TEST_FAULTS` lists methods of the connector's two halves to break, as
"worker.start_load_kv,scheduler.build_connector_meta"; each raises on every other call
(the first, the third, ...), so one run sees failed steps beside sound ones. The
variable reaches the engine core and the workers with the rest of the environment."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

from tiercache.connector.connector import TierCacheConnector

# Not TIERCACHE_*: those are read as settings (config.env_overrides).
FAULTS_ENV = "TC_TEST_FAULTS"


class InjectedFault(RuntimeError):
    pass


def _fails_every_other_call(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    calls = itertools.count()

    def call(*args: Any, **kwargs: Any) -> Any:
        if next(calls) % 2 == 0:
            raise InjectedFault(f"{name}: injected by {FAULTS_ENV}")
        return method(*args, **kwargs)

    return call


class FaultyTierCacheConnector(TierCacheConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        for fault in filter(None, os.environ.get(FAULTS_ENV, "").split(",")):
            half, method = fault.strip().split(".")
            target = self.worker if half == "worker" else self.scheduler
            if target is not None:
                setattr(target, method, _fails_every_other_call(getattr(target, method), fault))

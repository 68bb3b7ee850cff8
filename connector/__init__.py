"""The vLLM KV connector. Use it with:

--kv-transfer-config '{"kv_connector": "TierCacheConnector",
                       "kv_connector_module_path": "tiercache.connector",
                       "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

vLLM imports this package and then asks it for `TierCacheConnector`; the class (and
with it vLLM) is imported only then, so the worker half (`tiercache.connector.worker`)
imports where vLLM is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .connector import TierCacheConnector

__all__ = ["TierCacheConnector"]


def __getattr__(name: str):
    if name == "TierCacheConnector":
        from .connector import TierCacheConnector

        return TierCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

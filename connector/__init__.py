"""The vLLM KV connector. Use it with:

--kv-transfer-config '{"kv_connector": "TierCacheConnector",
                       "kv_connector_module_path": "tiercache.connector",
                       "kv_role": "kv_both", "kv_connector_extra_config": {...}}'
"""

from .connector import TierCacheConnector

__all__ = ["TierCacheConnector"]

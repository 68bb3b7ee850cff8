"""The tiercache service (`tiercache serve`): health and readiness probes, Prometheus
metrics, per-namespace stats, a prefix lookup API for request routers, admin
endpoints (namespace flush, a GC pass) and the S3 garbage collector on a timer.

It reads the same config file as the connector. It never imports vLLM or torch, and
it never touches the CPU tiers of the vLLM workers: what it knows comes from the
Redis registry and index, the S3 bucket and, when `disk.path` is set, this node's
disk tier directory.

Nothing here reads S3 credentials: boto3 takes them from the standard chain, and no
response or log line carries them. Redis URLs are shown with their password hidden.

The modules, each with one job:
- models.py: the API's request and response bodies;
- state.py: what one service process shares between requests (connections, the
  readiness probes, lookups, the GC loop);
- stats.py: objects and bytes per namespace, deployment and tier;
- collector.py: the Prometheus series computed on each scrape;
- http.py: the body limit, JSON errors and exception handlers;
- probes.py, cache.py, admin.py: the FastAPI routers, one per OpenAPI tag;
- app.py: the app built from them, and `serve`."""

from tiercache.ops.service.app import create_app, serve
from tiercache.ops.service.models import MAX_LOOKUP_HASHES
from tiercache.ops.service.stats import collect_stats

__all__ = ["MAX_LOOKUP_HASHES", "collect_stats", "create_app", "serve"]

"""The service as an ASGI app, built from the probes, cache and admin routers, and
`serve`, which runs it on uvicorn."""

from __future__ import annotations

import contextlib
import logging
import os

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from tiercache import __version__
from tiercache.config import TierCacheConfig, redact_url
from tiercache.ops.service import admin, cache, probes
from tiercache.ops.service.auth import (
    ADMIN_TOKEN_ENV,
    LOOKUP_TOKEN_ENV,
    LOOKUP_TOKENS_DIR_ENV,
    ServiceTokens,
    TokenError,
)
from tiercache.ops.service.collector import ServiceCollector
from tiercache.ops.service.http import MAX_BODY_BYTES, BodyLimit, add_error_handlers
from tiercache.ops.service.state import ServiceState

log = logging.getLogger(__name__)

DESCRIPTION = """
The tiercache service: health and readiness probes, Prometheus metrics, cache stats,
a prefix lookup for request routers, and admin operations (namespace flush, S3 GC).

`/v1/lookup` needs `Authorization: Bearer <token>` with a lookup token: the router
token (`TIERCACHE_LOOKUP_TOKEN`, every namespace), the namespace's own (a file named
after it in `TIERCACHE_LOOKUP_TOKENS_DIR`) or the admin token. A missing or wrong token
answers 401. While the service has no lookup token configured, lookups are open.

Admin endpoints need `Authorization: Bearer <TIERCACHE_ADMIN_TOKEN>`: without it or
with a wrong token they answer 401, and while the service has no admin token
configured, always 403.

Each token can also come from a file: `<VARIABLE>_FILE` names it.
"""

TAGS = [
    {"name": "probes", "description": "Liveness, readiness and Prometheus metrics."},
    {"name": "cache", "description": "What the cache holds, and lookups for request routers."},
    {"name": "admin", "description": "Operations that delete data. Bearer token required."},
]


def create_app(
    config: TierCacheConfig,
    admin_token: str | None = None,
    *,
    lookup_token: str | None = None,
    namespace_tokens: dict[str, str] | None = None,
    gc_interval: float = 0.0,
) -> FastAPI:
    """The service as an ASGI app. `admin_token` guards the admin endpoints (None:
    they are refused) and also allows lookups; `lookup_token` allows lookups in every
    namespace, `namespace_tokens` (namespace -> token) in one each (neither: lookups
    are open); `gc_interval` > 0 runs the S3 GC on that period while the app is up
    (between lifespan startup and shutdown), when S3 is configured."""
    tokens = ServiceTokens(admin_token or None, lookup_token or None, dict(namespace_tokens or {}))
    state = ServiceState(config, tokens, gc_interval)
    metrics_registry = CollectorRegistry(auto_describe=False)
    metrics_registry.register(ServiceCollector(state))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        try:
            yield
        finally:
            state.close()

    app = FastAPI(
        title="tiercache",
        version=__version__,
        description=DESCRIPTION,
        openapi_tags=TAGS,
        lifespan=lifespan,
    )
    app.state.tiercache = state
    app.state.metrics_registry = metrics_registry
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    add_error_handlers(app)
    for router in (probes.router, cache.router, admin.router):
        app.include_router(router)
    return app


def serve(
    config: TierCacheConfig,
    host: str = "127.0.0.1",
    port: int = 8080,
    gc_interval: float = 60.0,
) -> None:
    """Run the service on uvicorn until SIGINT/SIGTERM. The tokens come from the
    environment (see tiercache.ops.service.auth); log level from TIERCACHE_LOG_LEVEL
    (default INFO). Exits 2 on a token setting it cannot use."""
    import uvicorn

    level = os.environ.get("TIERCACHE_LOG_LEVEL", "INFO").upper()
    if level not in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"):
        level = "INFO"
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tokens = ServiceTokens.from_environment()
    except TokenError as error:
        log.error("%s", error)
        raise SystemExit(2) from None
    if tokens.admin is None:
        log.warning("%s is unset: the admin endpoints answer 403", ADMIN_TOKEN_ENV)
    if tokens.lookups_open:
        log.warning(
            "neither %s nor %s is set: /v1/lookup answers anyone who reaches %s:%d, for every namespace",
            LOOKUP_TOKEN_ENV,
            LOOKUP_TOKENS_DIR_ENV,
            host,
            port,
        )
    else:
        log.info(
            "lookups need a token: %s for every namespace, %d namespace tokens",
            "set" if tokens.lookup else "none",
            len(tokens.namespaces),
        )
    log.info(
        "tiercache service on %s:%d (namespace %r, redis %s, s3 %s)",
        host,
        port,
        config.namespace,
        redact_url(config.redis_url) if config.redis_url else "off",
        f"bucket {config.s3.bucket}" if config.s3 else "off",
    )
    app = create_app(
        config,
        admin_token=tokens.admin,
        lookup_token=tokens.lookup,
        namespace_tokens=dict(tokens.namespaces),
        gc_interval=gc_interval,
    )
    uvicorn.run(app, host=host, port=port, log_level=level.lower(), proxy_headers=False)

"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from tiercache.ops.service.http import AsciiJSON, service_state
from tiercache.ops.service.models import ReadinessResponse
from tiercache.ops.service.state import ServiceState

router = APIRouter(tags=["probes"])


@router.get("/healthz", summary="Liveness")
def healthz() -> dict[str, str]:
    """200 while the process runs, whatever its dependencies do: restart on failure
    of this probe only."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness",
    response_model=ReadinessResponse,
    responses={503: {"model": ReadinessResponse, "description": "A dependency is down."}},
)
def readyz(state: ServiceState = Depends(service_state)):
    """200 while Redis answers PING and, when S3 is configured, the bucket answers
    HEAD; 503 naming what is down otherwise. Each check is bounded by the
    configured connect/socket timeouts."""
    ready, checks = state.readiness()
    body = {"status": "ready" if ready else "unavailable", "checks": checks}
    return AsciiJSON(body, status_code=200 if ready else 503)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format."}},
)
def metrics(request: Request) -> Response:
    """Prometheus text: the process's `tiercache_` tier, lookup and GC series, plus
    index objects and bytes per namespace and tier, refreshed on each scrape."""
    body = generate_latest(REGISTRY) + generate_latest(request.app.state.metrics_registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)

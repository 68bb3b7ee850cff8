"""Operations that delete data (a namespace flush, an S3 GC pass), behind the admin
bearer token."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi import Path as PathParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tiercache.errors import GcBusy
from tiercache.ops.service.auth import ADMIN_TOKEN_ENV
from tiercache.ops.service.http import service_state
from tiercache.ops.service.models import NAMESPACE_PATTERN, ProblemResponse
from tiercache.ops.service.state import ServiceState
from tiercache.tiers.s3.gc import flush_namespace

bearer = HTTPBearer(
    auto_error=False,
    description=f"The admin token: {ADMIN_TOKEN_ENV} (or the file {ADMIN_TOKEN_ENV}_FILE names).",
)


def require_admin(
    credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
    state: ServiceState = Depends(service_state),
) -> None:
    if not state.tokens.admin_configured:
        raise HTTPException(403, f"admin endpoints are disabled: {ADMIN_TOKEN_ENV} is unset for this service")
    if not state.tokens.grant(credentials.credentials if credentials else None).admin:
        raise HTTPException(
            401,
            "admin endpoint: send 'Authorization: Bearer <the admin token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


router = APIRouter(
    tags=["admin"],
    dependencies=[Depends(require_admin)],
    responses={
        401: {"model": ProblemResponse, "description": "No bearer token, or not the admin token."},
        403: {"model": ProblemResponse, "description": "No admin token configured."},
        503: {"model": ProblemResponse, "description": "Redis or S3 did not answer."},
    },
)


@router.delete("/v1/namespaces/{namespace}", summary="Flush a namespace")
def flush(
    namespace: str = PathParam(
        min_length=1, max_length=128, pattern=NAMESPACE_PATTERN, description="The namespace to flush."
    ),
    state: ServiceState = Depends(service_state),
) -> dict[str, Any]:
    """Drop the index entries and registry entries of every deployment under the
    namespace, then delete their S3 objects (those under a live read lease are left
    to the orphan sweep) and their objects on this node's disk tier."""
    if state.redis is None:
        raise HTTPException(409, "redis_url is not configured: there is no registry of namespaces")
    report = flush_namespace(state.config, namespace, redis=state.gc_redis, s3=state.s3)
    state.forget_disk_scan()
    return report


@router.post(
    "/v1/gc",
    summary="Run one S3 GC pass now",
    responses={409: {"model": ProblemResponse, "description": "Busy or no S3."}},
)
def gc(
    sweep_orphans: bool = Query(True, description="Also delete old S3 objects that no index names."),
    grace_seconds: float | None = Query(
        None,
        ge=0,
        le=7 * 86400,
        description="Orphans younger than this are kept (in-flight uploads). Default 600.",
    ),
    state: ServiceState = Depends(service_state),
) -> dict[str, Any]:
    """Keep the namespace's S3 tier under `s3.capacity` (oldest last access first;
    the index entry goes before the object; objects under a live read lease are
    skipped), then sweep orphans. Answers the pass's report."""
    if state.s3 is None:
        raise HTTPException(409, "s3 is not configured: there is nothing to collect")
    try:
        return state.run_gc(sweep_orphans=sweep_orphans, grace_seconds=grace_seconds)
    except GcBusy:
        raise HTTPException(409, "a GC pass is already running") from None

"""What the cache holds, and the prefix lookup for request routers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tiercache.ops.service.auth import ADMIN_TOKEN_ENV, LOOKUP_TOKEN_ENV, LOOKUP_TOKENS_DIR_ENV, Grant
from tiercache.ops.service.http import service_state
from tiercache.ops.service.models import LookupRequest, LookupResponse, ProblemResponse
from tiercache.ops.service.state import ServiceState

router = APIRouter(tags=["cache"])

lookup_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="LookupToken",
    description=f"A lookup token: {LOOKUP_TOKEN_ENV} (every namespace), the namespace's file in "
    f"{LOOKUP_TOKENS_DIR_ENV} (that namespace only) or {ADMIN_TOKEN_ENV}. Not needed while the "
    "service has none of them configured.",
)

# One answer for a missing token, a wrong one and one for another namespace: it names
# nothing the cache holds, nor whether the namespace has a token of its own.
UNAUTHORIZED = "lookup: send 'Authorization: Bearer <token>' with a lookup token for this namespace"


def _unauthorized() -> HTTPException:
    return HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})


def lookup_grant(
    credentials: HTTPAuthorizationCredentials | None = Depends(lookup_bearer),
    state: ServiceState = Depends(service_state),
) -> Grant | None:
    """What the request's token allows; None while lookups are open. Checked before
    the body is validated, so a caller without a valid token learns nothing more."""
    if state.tokens.lookups_open:
        return None
    grant = state.tokens.grant(credentials.credentials if credentials else None)
    if not grant.allows_lookups:
        raise _unauthorized()
    return grant


@router.get("/v1/stats", summary="Objects, bytes and hit rates per namespace")
def stats(state: ServiceState = Depends(service_state)) -> dict[str, Any]:
    """Per namespace: objects and bytes per tier (S3 from the Redis index, ZCARD x
    object size; disk by scanning this node's `disk.path`), per deployment, and
    the hit rate of the lookups this service answered. `rows` flattens the same
    numbers. A Redis outage is reported under `errors`, not as a failure."""
    return state.stats(disk_max_age=1.0)


@router.post(
    "/v1/lookup",
    summary="Longest cached prefix, for request routers",
    response_model=LookupResponse,
    responses={
        401: {"model": ProblemResponse, "description": "No lookup token, or not one for this namespace."},
        413: {"model": ProblemResponse, "description": "Request body too large."},
        503: {"model": ProblemResponse, "description": "Redis did not answer."},
    },
)
def lookup(
    request: LookupRequest,
    grant: Grant | None = Depends(lookup_grant),
    state: ServiceState = Depends(service_state),
) -> LookupResponse:
    """For each deployment registered under `namespace`: how many leading blocks of
    `block_hashes` it can load from the shared S3 tier (one Redis round trip per
    deployment, all TP ranks at once) and, when this service has the disk path,
    from this node's disk tier. Asking does not count as an access for the GC.

    Needs `Authorization: Bearer <token>` with a token for the namespace (or for
    every namespace) once the service has any lookup token configured."""
    if grant is not None and not grant.may_look_up(request.namespace):
        raise _unauthorized()
    return state.lookup(request)

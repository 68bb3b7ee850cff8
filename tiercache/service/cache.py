"""What the cache holds, and the prefix lookup for request routers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from tiercache.service.http import service_state
from tiercache.service.models import LookupRequest, LookupResponse, ProblemResponse
from tiercache.service.state import ServiceState

router = APIRouter(tags=["cache"])


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
        413: {"model": ProblemResponse, "description": "Request body too large."},
        503: {"model": ProblemResponse, "description": "Redis did not answer."},
    },
)
def lookup(request: LookupRequest, state: ServiceState = Depends(service_state)) -> LookupResponse:
    """For each deployment registered under `namespace`: how many leading blocks of
    `block_hashes` it can load from the shared S3 tier (one Redis round trip per
    deployment, all TP ranks at once) and, when this service has the disk path,
    from this node's disk tier. Asking does not count as an access for the GC."""
    return state.lookup(request)

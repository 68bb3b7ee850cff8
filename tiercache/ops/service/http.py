"""HTTP plumbing shared by every route: JSON that always renders, the request body
limit, and the answers for invalid requests and for Redis or S3 not answering."""

from __future__ import annotations

import json
import logging
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tiercache.index.redis_conn import RedisUnavailable
from tiercache.ops.service.state import ServiceState

log = logging.getLogger(__name__)

# The largest valid lookup is MAX_LOOKUP_TOKENS token ids of 19 digits each, about
# 2.8 MB of JSON (MAX_LOOKUP_HASHES 64-byte hashes are about 1.1 MB).
MAX_BODY_BYTES = 4 * 2**20


class AsciiJSON(JSONResponse):
    """JSON with every non-ASCII character escaped, so anything echoed from a request
    (even a lone surrogate) renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class BodyLimit:
    """Refuses a request body over `limit` bytes with 413.

    A declared Content-Length over the limit is refused before anything is read. A
    chunked body declares nothing, so the bytes are counted as they arrive: the body
    is read here, at most `limit` bytes of it, and handed on to the app unchanged. (The
    endpoints read their whole body anyway, so buffering it costs nothing more.)"""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._check_length(scope)
        if refusal is None:
            messages, refusal = await self._read_body(receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        pending = iter(messages)

        async def replay():
            message = next(pending, None)
            return message if message is not None else await receive()

        await self.app(scope, replay, send)

    def _check_length(self, scope) -> JSONResponse | None:
        length = dict(scope["headers"]).get(b"content-length")
        if length is None:
            return None
        if not length.isdigit():
            return AsciiJSON({"detail": "Content-Length is not a number"}, status_code=400)
        if int(length) > self.limit:
            return self._too_large()
        return None

    async def _read_body(self, receive) -> tuple[list[dict], JSONResponse | None]:
        """The body's messages, or a 413 as soon as more than `limit` bytes came."""
        messages: list[dict] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away
                return messages, None
            received += len(message.get("body", b""))
            if received > self.limit:
                return messages, self._too_large()
            if not message.get("more_body", False):
                return messages, None

    def _too_large(self) -> JSONResponse:
        return AsciiJSON({"detail": f"request body over {self.limit} bytes"}, status_code=413)


def _field_name(loc: tuple) -> str:
    parts = [str(part)[:64] for part in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:] or parts
    return ".".join(parts) or "(body)"


def add_error_handlers(app: FastAPI) -> None:
    """Invalid requests answer 422 with each problem named (never the echoed input
    unescaped); Redis or S3 not answering is a 503, never a 500."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        problems = [
            {
                "loc": [str(part)[:64] if isinstance(part, str) else part for part in item.get("loc", ())],
                "msg": str(item.get("msg", "invalid")).removeprefix("Value error, "),
                "type": str(item.get("type", "value_error")),
            }
            for item in error.errors()[:20]
        ]
        message = "; ".join(f"{_field_name(tuple(p['loc']))}: {p['msg']}" for p in problems[:5])
        return AsciiJSON({"detail": problems, "message": f"invalid request: {message}"}, status_code=422)

    @app.exception_handler(RedisUnavailable)
    async def _redis_down(request: Request, error: RedisUnavailable):
        return AsciiJSON(
            {"detail": "redis is unavailable: the shared index cannot be read now; retry later"},
            status_code=503,
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(BotoCoreError)
    @app.exception_handler(ClientError)
    async def _s3_down(request: Request, error: Exception):
        log.warning("s3 call failed: %s", type(error).__name__)
        return AsciiJSON({"detail": "the S3 store did not answer; retry later"}, status_code=503)


def service_state(request: Request) -> ServiceState:
    """The app's ServiceState, for the routes (a FastAPI dependency)."""
    return request.app.state.tiercache

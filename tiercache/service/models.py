"""The service API's request and response bodies, with the limits they enforce."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# One lookup names at most this many blocks: 65536 blocks of 16 tokens is a 1M-token prompt.
MAX_LOOKUP_HASHES = 65536
NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
_HEX = re.compile(r"^[0-9a-f]*$")


def _block_hash(value: str) -> str:
    value = value.lower()
    if not 16 <= len(value) <= 128 or len(value) % 2 or not _HEX.match(value):
        raise ValueError("a block hash must be an even number (16 to 128) of hex digits")
    return value


BlockHashHex = Annotated[str, AfterValidator(_block_hash)]


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(
        min_length=1,
        max_length=128,
        pattern=NAMESPACE_PATTERN,
        description="The tiercache namespace the deployments were configured with "
        "(`namespace` in the connector config).",
        examples=["default"],
    )
    block_hashes: list[BlockHashHex] = Field(
        min_length=1,
        max_length=MAX_LOOKUP_HASHES,
        description="vLLM's chained block hashes of the prompt, in order, hex-encoded "
        f"(the same bytes as `request.block_hashes`). 1 to {MAX_LOOKUP_HASHES} of them.",
        examples=[["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]],
    )


class TierBlocks(BaseModel):
    s3: int = Field(description="Leading blocks every TP rank holds in the shared S3 tier.")
    disk: int | None = Field(
        None,
        description="Leading blocks every TP rank holds on this node's disk tier "
        "(null when the service has no `disk.path`).",
    )


class DeploymentHit(BaseModel):
    model_digest: str = Field(description="Digest of everything that makes the KV bytes compatible.")
    model: str
    tp_size: int
    prefix_blocks: int = Field(description="The longest prefix this deployment can load (any tier).")
    tiers: TierBlocks


class LookupResponse(BaseModel):
    namespace: str
    requested_blocks: int
    prefix_blocks: int = Field(description="The longest cached prefix over every deployment, in blocks.")
    deployments: list[DeploymentHit] = Field(
        description="Each deployment registered under the namespace, longest prefix first."
    )


class ProblemResponse(BaseModel):
    detail: Any


class ReadinessResponse(BaseModel):
    status: str = Field(description="`ready` or `unavailable`.")
    checks: dict[str, dict[str, Any]] = Field(
        description="Per dependency: `ok`, and when down, an `error` saying why."
    )

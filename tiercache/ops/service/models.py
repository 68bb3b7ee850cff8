"""The service API's request and response bodies, with the limits they enforce."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_validator

# One lookup names at most this many blocks (8192 blocks of 16 tokens: a 128K-token
# prompt). Each hash asked costs a Redis field read and, with a disk tier, a stat() per
# rank until the first miss; a router with a longer prompt asks about its first blocks.
MAX_LOOKUP_HASHES = 8192
# A lookup by token ids names at most this many tokens (a 128K-token prompt).
MAX_LOOKUP_TOKENS = 2**17
NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
_HEX = re.compile(r"^[0-9a-f]*$")


def _block_hash(value: str) -> str:
    value = value.lower()
    if not 16 <= len(value) <= 128 or len(value) % 2 or not _HEX.match(value):
        raise ValueError("a block hash must be an even number (16 to 128) of hex digits")
    return value


BlockHashHex = Annotated[str, AfterValidator(_block_hash)]
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**63)]


class LookupRequest(BaseModel):
    """A prompt, as vLLM's block hashes or as its token ids: exactly one of the two."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(
        min_length=1,
        max_length=128,
        pattern=NAMESPACE_PATTERN,
        description="The tiercache namespace the deployments were configured with "
        "(`namespace` in the connector config).",
        examples=["default"],
    )
    # Optional without being nullable: a client sends one of the two, never a null.
    block_hashes: list[BlockHashHex] = Field(
        None,  # type: ignore[arg-type]  # absent is None; a null is refused (not in the type)
        min_length=1,
        max_length=MAX_LOOKUP_HASHES,
        description="vLLM's chained block hashes of the prompt, in order, hex-encoded "
        f"(the same bytes as `request.block_hashes`). 1 to {MAX_LOOKUP_HASHES} of them.",
        examples=[["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]],
    )
    token_ids: list[TokenId] = Field(
        None,  # type: ignore[arg-type]  # as block_hashes
        min_length=1,
        max_length=MAX_LOOKUP_TOKENS,
        description="The prompt's token ids, as the router tokenized it. Each deployment's "
        "blocks are hashed from them as its vLLM engine does (its block size, "
        "`prefix_caching_hash_algo` and seed, from its registration); only full blocks "
        "count. For plain prompts only: LoRA, multimodal inputs, `cache_salt` and prompt "
        f"embeddings change the hashes, so pass `block_hashes` for those. 1 to {MAX_LOOKUP_TOKENS}.",
        examples=[[1, 15043, 3186, 29991]],
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> LookupRequest:
        if (self.block_hashes is None) == (self.token_ids is None):
            raise ValueError("give exactly one of block_hashes and token_ids")
        return self


class TierBlocks(BaseModel):
    s3: int = Field(description="Leading blocks every TP rank holds in the shared S3 tier.")
    disk: int | None = Field(
        None,
        description="Leading blocks every TP rank holds on this node's disk tier "
        "(null when the service has no `disk.path`).",
    )
    peer: int | None = Field(
        None,
        description="Leading blocks a live instance with the peer tier on holds in its CPU "
        "tier (the most of any): what the deployment's other instances with the peer tier "
        "on can read from it over NIXL. Null when no live instance has the peer tier on "
        "(every TP rank's peer record live).",
    )


class InstanceHit(BaseModel):
    """What one vLLM instance of the deployment holds in its own tiers, as its scheduler
    last published it (at most `presence.interval` seconds old, gone `presence.ttl`
    seconds after the instance stops)."""

    instance: str = Field(description="The instance's `instance_id` (default `<hostname>-<pid>`).")
    cpu: int = Field(description="Leading blocks in its CPU tier.")
    disk: int = Field(description="Leading blocks on its disk tier (every TP rank's).")
    prefix_blocks: int = Field(
        description="The longest prefix it can load without recomputing: its CPU and disk "
        "tiers together, or another instance's CPU tier over the peer tier (`peer_blocks`), "
        "or the shared S3 tier, whichever holds most."
    )
    peer: bool = Field(
        False,
        description="Whether its peer tier is on: every TP rank's worker keeps a live peer "
        "record, so the other instances can read its CPU tier and it can read theirs.",
    )
    peer_blocks: int = Field(
        0,
        description="Leading blocks it can read from another live instance's CPU tier over "
        "the peer tier (0 when its own or every other instance's peer tier is off).",
    )


class DeploymentHit(BaseModel):
    model_digest: str = Field(description="Digest of everything that makes the KV bytes compatible.")
    model: str
    tp_size: int
    block_size: int | None = Field(
        None, description="Tokens per block, from the registration (null for older registrations)."
    )
    requested_blocks: int = Field(
        description="Blocks of the prompt asked about (the full blocks of `token_ids`)."
    )
    prefix_blocks: int = Field(
        description="The longest prefix one of its instances can load (any tier): what a "
        "router sends to the instance first in `instances`."
    )
    tiers: TierBlocks
    instances: list[InstanceHit] = Field(
        default_factory=list,
        description="Its live instances, longest loadable prefix first, then by name.",
    )
    error: str | None = Field(
        None,
        description="Why `token_ids` could not be hashed for this deployment (a registration "
        "without block hashing, or an engine whose hash seed is random); its counts are 0.",
    )


class LookupResponse(BaseModel):
    namespace: str
    requested_blocks: int = Field(
        description="Blocks asked about: the hashes given, or the most full blocks of "
        "`token_ids` under any deployment's block size."
    )
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

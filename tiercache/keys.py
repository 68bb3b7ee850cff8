"""Object keys: vLLM's chained block hash plus a digest of everything that makes KV
bytes incompatible, so two models never share an object and two instances of one
model always do."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

HEX_KEY = re.compile(r"^[0-9a-f]{16}/[0-9a-f]{16,128}$")


@dataclass(frozen=True)
class KVSpec:
    """What the bytes of one stored block depend on, for one TP rank."""

    model: str
    revision: str
    dtype: str
    kv_dtype: str
    block_size: int
    layout: str  # a signature of the per-layer tensor shapes/strides as vLLM allocated them
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    tp_rank: int
    namespace: str
    page_bytes: int  # bytes of one block across all layers, this rank

    def model_digest(self) -> str:
        """Digest of everything but the rank: shared by all ranks of one deployment."""
        fields = asdict(self)
        fields.pop("tp_rank")
        return _digest(fields)

    def digest(self) -> str:
        return _digest(asdict(self))


def _digest(fields: dict) -> str:
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def block_hash_hex(block_hash: bytes | object) -> str:
    """vLLM's BlockHash is bytes; older builds wrapped it. Either way, hex it."""
    raw = block_hash if isinstance(block_hash, (bytes, bytearray)) else bytes(block_hash)
    return raw.hex()


def object_key(rank_digest: str, block_hash_hex_value: str) -> str:
    return f"{rank_digest}/{block_hash_hex_value}"


def split_key(key: str) -> tuple[str, str]:
    if not HEX_KEY.fullmatch(key):  # fullmatch: "$" alone would let a trailing newline in
        raise ValueError(f"not a tiercache object key: {key!r}")
    digest, block = key.split("/")
    return digest, block

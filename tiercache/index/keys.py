"""Object keys: vLLM's chained block hash plus a digest of everything that makes KV
bytes incompatible, so two models never share an object and two instances of one
model always do."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

HEX_KEY = re.compile(r"^[0-9a-f]{16}/[0-9a-f]{16,128}$")


@dataclass(frozen=True)
class KVSpec:
    """What the bytes of one stored block depend on, for one TP rank of one pipeline
    stage. The fields after page_bytes have defaults so older call sites still build
    a spec; every field is in the digest."""

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
    pp_size: int = 1
    pp_rank: int = 0  # the pipeline stage: stages of one TP rank hold different layers
    layers: str = ""  # digest of the names of the layers this worker holds
    quantization: str = ""  # the weights' quantization method and settings
    weights: str = ""  # fingerprint of the weight files when no revision is pinned

    def model_digest(self) -> str:
        """Digest of everything but the rank and stage: shared by all ranks and stages
        of one deployment."""
        fields = asdict(self)
        for per_worker in ("tp_rank", "pp_rank", "layers"):
            fields.pop(per_worker)
        return _digest(fields)

    def digest(self) -> str:
        return _digest(asdict(self))


def _digest(fields: object) -> str:
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def layers_digest(layer_names) -> str:
    """Which layers a worker holds, order-free: two pipeline stages never agree."""
    return _digest(sorted(layer_names))


# The files whose bytes are the model: weights in either format, the safetensors
# index, and the config (rope scaling, head counts and the like change the KV too).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.pt")


def weights_fingerprint(directory: str | Path) -> str | None:
    """A cheap identity of the weights in `directory`: config.json's bytes, plus the
    name, size and modification time of each weight file. Rewriting a weight file
    changes its mtime (and usually its size), so new weights at the same path get
    new keys; nothing is hashed but one small file, so it costs a few stat calls.

    A file that links into the Hugging Face cache's content-addressed blobs (a
    snapshot's files do) is named by its blob, which is named by its hash, instead of
    by its mtime: two nodes that downloaded the same revision at different times agree.
    None when the directory holds neither a config nor a weight file."""
    root = Path(directory)
    try:
        config = (root / "config.json").read_bytes()
    except OSError:
        config = b""
    entries: list[list[str | int]] = []
    try:
        files = {path for pattern in WEIGHT_PATTERNS for path in root.glob(pattern)}
        for path in sorted(files):
            target = Path(os.path.realpath(path))
            if path.is_symlink() and target.parent.name == "blobs":
                entries.append([path.name, target.name])
            else:
                stat = path.stat()
                entries.append([path.name, stat.st_size, stat.st_mtime_ns])
    except OSError:
        return None
    if not config and not entries:
        return None
    return _digest({"config": hashlib.sha256(config).hexdigest(), "files": entries})


def block_key(block_hash: bytes, weights_epoch: bytes | None) -> bytes:
    """The name a block is cached under: vLLM's hash of its tokens, keyed by the
    weights epoch once the engine's weights changed in place (a prefix-cache reset):
    the scheduler, and the service's lookups for it, name blocks alike."""
    if weights_epoch is None:
        return block_hash
    return hashlib.blake2b(block_hash, key=weights_epoch, digest_size=32).digest()


def split_key(key: str) -> tuple[str, str]:
    if not HEX_KEY.fullmatch(key):  # fullmatch: "$" alone would let a trailing newline in
        raise ValueError(f"not a tiercache object key: {key!r}")
    digest, block = key.split("/")
    return digest, block

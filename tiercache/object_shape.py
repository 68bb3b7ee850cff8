"""What every object of one rank looks like: its key and the header written into it.
Apart from the tier engine so that the scheduler, the service and the tools can name
objects without importing the movers (boto3, the upload process)."""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.tiers.format import ObjectHeader, PageShape, checksum, sign


@dataclass(frozen=True)
class ObjectShape:
    """What every object of one rank looks like: written into each object's header."""

    model_digest: str
    rank_digest: str
    slot_bytes: int
    layout: str = ""
    dtype: str = ""
    shapes: str = ""

    def key(self, block_hash: bytes) -> str:
        return f"{self.rank_digest}/{block_hash.hex()}"

    def header(self, block_hash: bytes, data: memoryview, integrity_key: bytes | None = None) -> ObjectHeader:
        """The header of the object holding `data`, signed when given an integrity key."""
        plain = ObjectHeader(
            key=self.key(block_hash),
            namespace_digest=self.rank_digest,
            nbytes=len(data),
            checksum=checksum(data),
            layout=self.layout,
            dtype=self.dtype,
            shapes=self.shapes,
        )
        return sign(plain, data, integrity_key)

    @property
    def pages(self) -> PageShape:
        """What a read must find in an object's header to be served into this shape."""
        return PageShape(self.layout, self.dtype, self.shapes)

    @property
    def object_bytes(self) -> int:
        probe = ObjectHeader("0" * 16 + "/" + "0" * 64, self.rank_digest, self.slot_bytes, "0" * 16)
        return probe.data_offset + self.slot_bytes

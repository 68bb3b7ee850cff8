"""What every object of one rank looks like: its key and the header written into it.
Apart from the tier engine so that the scheduler, the service and the tools can name
objects without importing the movers (boto3)."""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.tiers.format import ObjectHeader, PageShape, checksum, checksums_by_part, sign


@dataclass(frozen=True)
class ObjectShape:
    """What every object of one rank looks like: written into each object's header."""

    model_digest: str
    rank_digest: str
    slot_bytes: int
    layout: str = ""
    dtype: str = ""
    shapes: str = ""
    # Where each layer's page starts in a slot, where the reader may verify pages layer
    # by layer (connector/disk_reads.py): each object then carries a checksum per part.
    part_offsets: tuple[int, ...] = ()

    def key(self, block_hash: bytes) -> str:
        return f"{self.rank_digest}/{block_hash.hex()}"

    def header(self, block_hash: bytes, data: memoryview, integrity_key: bytes | None = None) -> ObjectHeader:
        """The header of the object holding `data`, signed when given an integrity key."""
        if self.part_offsets:  # the whole checksum comes from the same pass
            whole, parts = checksums_by_part(data, self.part_offsets)
        else:
            whole, parts = checksum(data), ""
        plain = ObjectHeader(
            key=self.key(block_hash),
            namespace_digest=self.rank_digest,
            nbytes=len(data),
            checksum=whole,
            layout=self.layout,
            dtype=self.dtype,
            shapes=self.shapes,
            parts=parts,
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

"""What every object tier (the node's disk, S3) does, so that the tier engine, GC and
the tools hold tiers of one shape rather than branching on which one they have. The
CPU tier is not one of them: it is slots addressed by number (`cpu.CpuBuffer`), whose
bookkeeping lives in the cache policy."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tiercache.tiers.format import ObjectHeader, PageShape


@runtime_checkable
class ObjectTier(Protocol):
    name: str  # one of tiercache.tiers.TIERS

    def put(self, key: str, data: memoryview, header: ObjectHeader) -> bool:
        """Store one object whole, or not at all; False when it could not be stored."""
        ...

    def get_into(self, key: str, out: memoryview, expect: PageShape | None = None) -> bool:
        """Read an object's pages into `out`, verified against its header (and
        `expect`); False on a miss or any failure, never an exception."""
        ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def close(self) -> None: ...

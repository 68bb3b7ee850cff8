"""tiercache's own exceptions, in one leaf module (it imports nothing from tiercache, so
tiers/ may use it). The modules that raise them re-export them under their old names
(tiercache.config.ConfigError, tiercache.index.redis_conn.RedisUnavailable,
tiercache.tiers.cpu.CpuTierFull, tiercache.tiers.format.CorruptObject)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration refused, with one line per problem naming its field."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"invalid tiercache config ({source}):\n  " + "\n  ".join(problems))


class RedisUnavailable(Exception):
    """Redis did not answer, or is inside its backoff window."""


class CpuTierFull(Exception):
    """Every CPU-tier slot is pinned by an in-flight transfer."""


class CorruptObject(Exception):
    """An object whose header or checksum does not match what was asked for."""


class GcBusy(Exception):
    """A GC pass is already running."""

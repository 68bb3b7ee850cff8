"""The scheduler's account of what each worker reported.

Every TP rank holds its own shard of a block in the same CPU slot, so the scheduler
may act on a report only once every rank that takes part has made it. The account is
kept per rank and per report, never as one summed count per (event, value): with a
sum, two releases of one slot from one rank (a write-down ending while a hit on that
slot is released) unpin it once and leave a pin for ever, and a rank's leftover
"filled" from a failed fill stands in for another rank's missing one at the next
fill, marking a block ready that one rank never copied.

Fills are named by (block hash, slot): a report for a fill that ended (failed, or the
block moved to another slot) cannot be counted towards a later one. Every entry is
dropped once it has been acted on or can no longer be, so the account stays as small
as the number of transfers in flight."""

from __future__ import annotations

from collections import defaultdict


class ReportLedger:
    def __init__(self, ranks: int, disk_ranks: int):
        self.ranks = ranks
        self.disk_ranks = disk_ranks
        self._releases: dict[int, defaultdict[int, int]] = {}  # slot -> rank -> releases not yet acted on
        self._fills: dict[tuple[bytes, int], set[int]] = {}  # (hash, slot) -> ranks that filled it
        self._on_disk: dict[bytes, set[int]] = {}  # hash -> ranks whose disk holds it

    def release(self, rank: int, slot: int) -> int:
        """One release of `slot` by `rank`; how many pins every rank has now released."""
        counts = self._releases.setdefault(slot, defaultdict(int))
        counts[rank] += 1
        if len(counts) < self.ranks:
            return 0
        done = min(counts.values())
        for reporter in list(counts):
            counts[reporter] -= done
            if counts[reporter] == 0:
                del counts[reporter]
        if not counts:
            del self._releases[slot]
        return done

    def fill(self, rank: int, block_hash: bytes, slot: int) -> bool:
        """`rank` copied `block_hash` into `slot`; True once every rank has."""
        ranks = self._fills.setdefault((block_hash, slot), set())
        ranks.add(rank)
        if len(ranks) < self.ranks:
            return False
        del self._fills[(block_hash, slot)]
        return True

    def end_fill(self, block_hash: bytes, slot: int) -> None:
        """This fill failed or is no longer wanted: later reports of it count for nothing."""
        self._fills.pop((block_hash, slot), None)

    def stored_on_disk(self, rank: int, block_hash: bytes) -> bool:
        """`rank` wrote `block_hash` to its disk; True while enough ranks hold it."""
        holders = self._on_disk.setdefault(block_hash, set())
        holders.add(rank)
        return len(holders) >= self.disk_ranks

    def gone_from_disk(self, rank: int, block_hash: bytes) -> None:
        holders = self._on_disk.get(block_hash)
        if holders is not None:
            holders.discard(rank)
            if not holders:
                del self._on_disk[block_hash]

    def forget_disk(self) -> None:
        self._on_disk.clear()

    def open_entries(self) -> int:
        """Reports waiting for other ranks (fills and releases): zero when all is quiet."""
        return len(self._releases) + len(self._fills)

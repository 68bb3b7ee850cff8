"""What a holder exposes beside its CPU slots so that a reader on another machine can
find a block and prove that the bytes it read are that block's, with no call into the
holder: a header per slot and a directory from block to slot, both in host memory
registered with NIXL and read remotely.

A slot's header: its generation, the block it holds (a digest of vLLM's block hash),
the bytes it holds, their checksum and (with an integrity key) their MAC, the same
checksum and MAC the disk and S3 tiers write (tiers/format.py). The generation is odd
while the slot is being rewritten and grows by two with each block the slot holds.

The directory: a hash table of `entries` rows (four times the slots, a power of two),
a block placed in the first free row of the `PROBE` rows from its digest's bucket.
A row names a slot and the generation the block got there. A reader reads the
block's rows, then the slot's bytes and header, then the header again: the bytes are
the block's only where the row, both headers and the block agree on one even
generation (the slot was not rewritten from before the row was read until after the
bytes were), and the checksum (or MAC) holds. A torn row or header never passes."""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass

import torch

HEADER_BYTES = 128
ROW_BYTES = 64
# Directory rows a block may sit in, from its bucket. A block that finds none free is
# unlisted: a miss for readers though its holder has it. With rows four times the slots
# and 16 probed, none of 20,000 stores into a full tier went unlisted (twice and 8:
# 1.7%, which cost a 62-block prefix a block in two reads of three); a reader reads
# 1 KiB of rows per block.
PROBE = 16
ROWS_PER_SLOT = 4
DIGEST_BYTES = 32
CHECKSUM_BYTES = 16  # xxh3-64 as 16 hex characters, as tiers/format.py writes it
MAC_BYTES = 32  # HMAC-SHA256, raw

# gen, nbytes, block digest, checksum (hex), MAC (raw; zeros when unsigned)
_HEADER = struct.Struct(f"<QQ{DIGEST_BYTES}s{CHECKSUM_BYTES}s{MAC_BYTES}s")
# gen, slot, block digest
_ROW = struct.Struct(f"<QQ{DIGEST_BYTES}s")
_GEN = struct.Struct("<Q")


def block_digest(block_hash: bytes) -> bytes:
    """A fixed-width name for a block, whatever the length of vLLM's hash."""
    return hashlib.blake2b(block_hash, digest_size=DIGEST_BYTES).digest()


def directory_entries(num_slots: int) -> int:
    """Rows in the directory: a power of two, at least ROWS_PER_SLOT times the slots,
    so a block finds a free row among its PROBE."""
    return max(PROBE, 1 << (ROWS_PER_SLOT * num_slots - 1).bit_length())


def bucket(digest: bytes, entries: int) -> int:
    return int.from_bytes(digest[:8], "little") & (entries - 1)


@dataclass(frozen=True)
class SlotHeader:
    gen: int
    nbytes: int
    digest: bytes
    checksum: str
    mac: str  # hex, "" when unsigned

    @classmethod
    def parse(cls, raw: bytes | memoryview) -> SlotHeader:
        gen, nbytes, digest, checksum, mac = _HEADER.unpack_from(raw)
        return cls(
            gen,
            nbytes,
            digest,
            checksum.decode("ascii", "replace"),
            "" if not any(mac) else mac.hex(),
        )


@dataclass(frozen=True)
class Row:
    gen: int
    slot: int
    digest: bytes

    @classmethod
    def parse(cls, raw: bytes | memoryview) -> Row:
        return cls(*_ROW.unpack_from(raw))


class SlotTable:
    """The holder's headers and directory, in two tensors registered with NIXL next
    to the CPU buffer. Written only by the holder's process; `retire` and `publish`
    may be called from any of its threads."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.entries = directory_entries(num_slots)
        self.headers = torch.zeros(num_slots, HEADER_BYTES, dtype=torch.uint8)
        self.directory = torch.zeros(self.entries, ROW_BYTES, dtype=torch.uint8)
        self._headers = self.headers.numpy()
        self._rows = self.directory.numpy()
        self._lock = threading.Lock()
        self._row_of: dict[int, int] = {}  # slot -> its directory row
        self.unlisted = 0  # blocks that found no free row (a miss for readers, nothing worse)

    def gen(self, slot: int) -> int:
        return _GEN.unpack_from(self._headers[slot])[0]

    def retire(self, slot: int) -> None:
        """The slot is about to be rewritten: readers from now on miss it."""
        with self._lock:
            self._unlist(slot)
            gen = self.gen(slot)
            if gen % 2 == 0:
                # The generation goes odd before any byte of the slot changes; on x86
                # stores are seen in program order, so a reader that finds the old
                # generation after reading the bytes read them before this line.
                _GEN.pack_into(self._headers[slot], 0, gen + 1)

    def publish(self, slot: int, block_hash: bytes, nbytes: int, checksum: str, mac: str) -> bool:
        """The slot now holds `block_hash` (its first `nbytes` bytes): readers may take
        it. False when the directory had no free row for it."""
        digest = block_digest(block_hash)
        mac_raw = bytes.fromhex(mac) if mac else b"\0" * MAC_BYTES
        with self._lock:
            self._unlist(slot)
            gen = self.gen(slot)
            odd = gen if gen % 2 else gen + 1
            _GEN.pack_into(self._headers[slot], 0, odd)
            _HEADER.pack_into(self._headers[slot], 0, odd, nbytes, digest, checksum.encode("ascii"), mac_raw)
            gen = odd + 1
            _GEN.pack_into(self._headers[slot], 0, gen)
            first = bucket(digest, self.entries)
            for step in range(PROBE):
                row = (first + step) & (self.entries - 1)
                if not _GEN.unpack_from(self._rows[row])[0]:
                    # The generation last: a reader that sees it sees the rest.
                    _ROW.pack_into(self._rows[row], 0, 0, slot, digest)
                    _GEN.pack_into(self._rows[row], 0, gen)
                    self._row_of[slot] = row
                    return True
            self.unlisted += 1
            return False

    def _unlist(self, slot: int) -> None:
        row = self._row_of.pop(slot, None)
        if row is not None:
            self._rows[row] = 0

    @staticmethod
    def rows_of(digest: bytes, entries: int) -> list[int]:
        first = bucket(digest, entries)
        return [(first + step) & (entries - 1) for step in range(PROBE)]

"""Run objects: many consecutive blocks of one rank in one S3 object.

One object per block meant one PUT per 16 or 32 tokens per rank; a run packs up to
`s3.pack_blocks` blocks (or `s3.pack_bytes`) into one PUT. Loads stay block-granular:
every block sits in a frame of fixed size, so the blocks a prefix needs are one
contiguous byte range, fetched with one ranged GET and checked block by block.

Layout (a safetensors file, so `safetensors.safe_open` still reads it):

    8-byte length | JSON header (padded to 4 KiB)     the run's table of contents
    frame 0: block 0's own header (H bytes) | its pages (slot_bytes)
    frame 1: ...

The JSON header names each frame's two parts as U8 tensors ("<i>.header", "<i>.kv")
and, in its metadata, the run id, the rank and every block's hash (what
`tiercache gc --reindex` rebuilds the index from, without reading any pages). A
frame's header is exactly the header a per-block object carried (tiers/format.py:
key, checksum, layout, shapes, and the MAC when an integrity key is set), padded so
that every frame of the run has the same size. A reader therefore needs no part of
the table of contents to check a block: each frame proves itself, and a corrupt
frame fails that block alone.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tiercache.tiers.format import (
    DATA_ALIGN,
    CorruptObject,
    ObjectHeader,
    PageShape,
    check_header,
    decode_header,
    header_length,
    verify,
)

RUN_FORMAT = "tiercache-run"
RUN_FORMAT_VERSION = "2"
RUN_SUFFIX = ".run.safetensors"
RUN_ID_BYTES = 8
# The leading path component of a run's name: this many hex digits of a hash of the
# run's name. S3 serves about 3,500 PUTs a second per prefix; 256 prefixes keep a
# fleet's writes far from that on any one of them.
SPREAD_HEX = 2
_LEN = struct.Struct("<Q")
# The most blocks one run may hold: positions are stored as 16-bit numbers in Redis.
MAX_RUN_BLOCKS = 1024


@dataclass(frozen=True)
class RunGeometry:
    """Where a run's frames lie: frame i is [data_start + i*frame_bytes, +frame_bytes)."""

    data_start: int
    frame_header: int  # H: bytes of each frame's own header
    slot_bytes: int

    @property
    def frame_bytes(self) -> int:
        return self.frame_header + self.slot_bytes

    def byte_range(self, first: int, last: int) -> tuple[int, int]:
        """The inclusive byte range of frames first..last (for `Range: bytes=a-b`)."""
        start = self.data_start + first * self.frame_bytes
        return start, self.data_start + (last + 1) * self.frame_bytes - 1

    def object_bytes(self, blocks: int) -> int:
        return self.data_start + blocks * self.frame_bytes


def spread_of(rank_digest: str, run_hex: str) -> str:
    return hashlib.sha256(f"{rank_digest}/{run_hex}".encode()).hexdigest()[:SPREAD_HEX]


def run_object_name(prefix: str, rank_digest: str, run_hex: str) -> str:
    return f"{prefix}{spread_of(rank_digest, run_hex)}/{rank_digest}/{run_hex}{RUN_SUFFIX}"


def parse_run_name(prefix: str, name: str) -> tuple[str, str] | None:
    """(rank digest, run hex) of a run object's name under `prefix`, else None."""
    if not name.startswith(prefix) or not name.endswith(RUN_SUFFIX):
        return None
    parts = name[len(prefix) : -len(RUN_SUFFIX)].split("/")
    if len(parts) != 3:
        return None
    spread, rank, run = parts
    if not (_is_hex(rank, 16) and _is_hex(run, 2 * RUN_ID_BYTES)) or spread != spread_of(rank, run):
        return None
    return rank, run


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


def encode_frame_header(header: ObjectHeader, length: int) -> bytes:
    """A block's header (format.ObjectHeader.encode) padded with spaces to `length`."""
    raw = header.encode()
    body = raw[_LEN.size :].rstrip(b" ")
    if _LEN.size + len(body) > length:
        raise ValueError(f"a frame header of {len(body)} bytes does not fit in {length}")
    body += b" " * (length - _LEN.size - len(body))
    return _LEN.pack(len(body)) + body


def frame_header_bytes(headers: Sequence[ObjectHeader]) -> int:
    """The frame header size of a run of these blocks: the largest, 4 KiB aligned."""
    return max(len(h.encode()) for h in headers)


@dataclass(frozen=True)
class RunHeader:
    """A run's table of contents, as written in its safetensors header."""

    run_hex: str
    namespace_digest: str
    block_hashes: tuple[bytes, ...]
    geometry: RunGeometry
    layout: str = ""
    dtype: str = ""
    shapes: str = ""

    def encode(self) -> bytes:
        """The run's preamble (length + JSON), padded so frames start 4 KiB aligned."""
        meta = {
            "format": RUN_FORMAT,
            "format_version": RUN_FORMAT_VERSION,
            "run": self.run_hex,
            "namespace_digest": self.namespace_digest,
            "blocks": ",".join(h.hex() for h in self.block_hashes),
            "frame_header_bytes": str(self.geometry.frame_header),
            "slot_bytes": str(self.geometry.slot_bytes),
            "layout": self.layout,
            "dtype": self.dtype,
            "shapes": self.shapes,
        }
        header: dict[str, object] = {"__metadata__": meta}
        offset = 0
        for i in range(len(self.block_hashes)):
            for part, size in (("header", self.geometry.frame_header), ("kv", self.geometry.slot_bytes)):
                header[f"{i}.{part}"] = {
                    "dtype": "U8",
                    "shape": [size],
                    "data_offsets": [offset, offset + size],
                }
                offset += size
        body = json.dumps(header, separators=(",", ":")).encode()
        total = _LEN.size + len(body)
        padded = -(-total // DATA_ALIGN) * DATA_ALIGN
        return _LEN.pack(padded - _LEN.size) + body + b" " * (padded - total)


def decode_run_header(raw: bytes) -> RunHeader:
    """Parse the JSON part of a run's preamble. Untrusted bytes: anything else than a
    well-formed run header is a CorruptObject, never another exception."""
    try:
        header = json.loads(raw.decode().rstrip())
    except (ValueError, RecursionError) as error:
        raise CorruptObject(f"unreadable run header: {type(error).__name__}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != RUN_FORMAT:
        raise CorruptObject("not a tiercache run object")
    try:
        blocks = tuple(bytes.fromhex(h) for h in str(meta["blocks"]).split(",") if h)
        frame_header = int(str(meta["frame_header_bytes"]))
        slot_bytes = int(str(meta["slot_bytes"]))
        run_hex = str(meta["run"])
        namespace = str(meta["namespace_digest"])
    except (KeyError, ValueError, TypeError) as error:
        raise CorruptObject(f"run header field unreadable: {type(error).__name__}") from None
    if not blocks or len(blocks) > MAX_RUN_BLOCKS or frame_header <= 0 or slot_bytes < 0:
        raise CorruptObject("run header describes no plausible run")
    data_start = _LEN.size + len(raw)
    return RunHeader(
        run_hex,
        namespace,
        blocks,
        RunGeometry(data_start, frame_header, slot_bytes),
        str(meta.get("layout", "")),
        str(meta.get("dtype", "")),
        str(meta.get("shapes", "")),
    )


def run_parts(run_header: RunHeader, frames: Sequence[tuple[ObjectHeader, memoryview]]) -> list[memoryview]:
    """The object's bytes as views, in order: preamble, then each frame's header and pages."""
    parts = [memoryview(run_header.encode())]
    for header, pages in frames:
        parts.append(memoryview(encode_frame_header(header, run_header.geometry.frame_header)))
        parts.append(memoryview(pages).cast("B"))
    return parts


@dataclass(frozen=True)
class FrameWant:
    """One block a reader wants from a run: its key, and where its pages go."""

    position: int
    key: str
    out: memoryview | None  # None: the frame lies inside the range but is not wanted


def read_frames(
    stream,
    geometry: RunGeometry,
    wants: Sequence[FrameWant],
    expect: PageShape | None,
    integrity_key: bytes | None,
) -> Iterator[tuple[FrameWant, CorruptObject | None]]:
    """Read consecutive frames from `stream` (a ranged GET's body starting at the first
    want's frame) and check each one on its own, yielding (want, None) for a good
    block and (want, the reason) for a bad one. Frames are of fixed size, so a bad
    frame never throws the ones after it off. A body that ends early raises
    CorruptObject for the frame it ends in (the caller fails it and those after)."""
    scratch = bytearray(geometry.slot_bytes)
    for want in wants:
        head = _read_exact(stream, geometry.frame_header)
        out = want.out if want.out is not None else memoryview(scratch)
        _read_into(stream, out)
        if want.out is None:
            continue
        try:
            length = header_length(head[: _LEN.size])
            if _LEN.size + length > len(head):
                raise CorruptObject(f"frame header of {length} bytes is longer than its frame")
            header = decode_header(head[_LEN.size : _LEN.size + length])
            check_header(header, want.key, len(out))
            if expect is not None:
                expect.check(header)
            verify(header, out, integrity_key)
        except CorruptObject as error:
            yield want, error
            continue
        yield want, None


def _read_exact(stream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise CorruptObject(f"run truncated: wanted {n} bytes, got {len(data)}")
        data += chunk
    return data


def _read_into(stream, out: memoryview) -> None:
    done = 0
    while done < len(out):
        chunk = stream.read(min(len(out) - done, 1 << 20))
        if not chunk:
            raise CorruptObject(f"run truncated at {done} of {len(out)} bytes of a frame")
        out[done : done + len(chunk)] = chunk
        done += len(chunk)


def check_run_bytes(data: bytes, integrity_key: bytes | None = None) -> RunHeader:
    """A whole run object's bytes checked frame by frame (tools and tests): its table
    of contents, or CorruptObject naming the first bad block."""
    import io

    toc = decode_run_header(data[_LEN.size : _LEN.size + header_length(data[: _LEN.size])])
    geometry = toc.geometry
    if len(data) != geometry.object_bytes(len(toc.block_hashes)):
        raise CorruptObject(
            f"run of {len(data)} bytes, its header says {geometry.object_bytes(len(toc.block_hashes))}"
        )
    stream = io.BytesIO(data[geometry.data_start :])
    wants = [
        FrameWant(i, f"{toc.namespace_digest}/{h.hex()}", memoryview(bytearray(geometry.slot_bytes)))
        for i, h in enumerate(toc.block_hashes)
    ]
    for want, error in read_frames(stream, geometry, wants, None, integrity_key):
        if error is not None:
            raise CorruptObject(f"block {want.position} of run {toc.run_hex}: {error}")
    return toc

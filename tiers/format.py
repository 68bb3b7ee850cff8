"""The on-disk and in-S3 object format: a safetensors file holding one block's raw
pages as a single U8 tensor named "kv", with a metadata header that says what the
bytes are (namespace digest, key, layout, dtype, shapes, checksum), and with an
integrity key configured, a MAC over all of it.

Anyone can open an object with `safetensors.safe_open`; nothing is unpickled. The
header is padded so the pages start on a 4 KiB boundary, which lets reads and
O_DIRECT writes move the pages straight between a CPU slot and the file."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace

import xxhash

from tiercache.errors import CorruptObject

FORMAT_VERSION = "1"
DATA_ALIGN = 4096
TENSOR_NAME = "kv"
_LEN = struct.Struct("<Q")
MAC_FIELD = "mac_hmac_sha256"
# Optional: the checksum of each layer's page of the block as well, so a reader that
# reads the pages layer by layer (a disk hit read during the forward) verifies each
# piece while it is still in cache instead of reading the whole block again.
PARTS_FIELD = "part_checksums_xxh3_64"
# Names what a MAC is over, so it cannot be taken for a MAC over anything else.
_MAC_DOMAIN = "tiercache-object-mac-v1"


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def checksum_of(pieces: Iterable[memoryview | bytes]) -> str:
    """`checksum` of the pieces' bytes, in order, as one."""
    digest = xxhash.xxh3_64()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


def checksums_by_part(data: memoryview, offsets: tuple[int, ...]) -> tuple[str, str]:
    """(the checksum of `data`, the parts field): `data` cut at `offsets` (the first
    0), each part hashed while it is in cache from the whole checksum's pass."""
    whole = xxhash.xxh3_64()
    parts = []
    for start, end in zip(offsets, [*offsets[1:], len(data)], strict=True):
        piece = data[start:end]
        whole.update(piece)
        parts.append(f"{end - start}:{xxhash.xxh3_64_hexdigest(piece)}")
    return whole.hexdigest(), ",".join(parts)


def parse_parts(header: ObjectHeader) -> list[tuple[int, int, str]] | None:
    """(start, length, checksum) of each part the header names, covering the pages
    exactly; None where it names none or the field does not add up (the whole
    checksum still holds for such an object)."""
    if not header.parts:
        return None
    out = []
    start = 0
    try:
        for item in header.parts.split(","):
            length, digest = item.split(":")
            out.append((start, int(length), digest))
            start += int(length)
    except ValueError:
        return None
    if start != header.nbytes or any(length < 0 for _, length, _ in out):
        return None
    return out


@dataclass(frozen=True)
class ObjectHeader:
    key: str
    namespace_digest: str
    nbytes: int
    checksum: str
    layout: str = ""
    dtype: str = ""
    shapes: str = ""
    mac: str = ""  # HMAC-SHA256 over signed_fields() and the pages; "" when unsigned
    parts: str = ""  # "<bytes>:<xxh3-64>,..." per part, in order; "" when not written

    def encode(self) -> bytes:
        """The safetensors preamble (length + JSON), padded so the data is aligned."""
        meta = {
            "format": "tiercache",
            "format_version": FORMAT_VERSION,
            "key": self.key,
            "namespace_digest": self.namespace_digest,
            "checksum_xxh3_64": self.checksum,
            "layout": self.layout,
            "dtype": self.dtype,
            "shapes": self.shapes,
        }
        if self.mac:
            meta[MAC_FIELD] = self.mac
        if self.parts:
            meta[PARTS_FIELD] = self.parts
        header = {
            "__metadata__": meta,
            TENSOR_NAME: {"dtype": "U8", "shape": [self.nbytes], "data_offsets": [0, self.nbytes]},
        }
        body = json.dumps(header, separators=(",", ":")).encode()
        total = _LEN.size + len(body)
        padded = -(-total // DATA_ALIGN) * DATA_ALIGN
        # safetensors allows trailing spaces in the header as padding.
        body += b" " * (padded - total)
        return _LEN.pack(len(body)) + body

    @property
    def data_offset(self) -> int:
        return len(self.encode())

    def signed_fields(self) -> bytes:
        """Every field a reader acts on, length-prefixed, for the MAC to start with."""
        fields = [_MAC_DOMAIN, FORMAT_VERSION, self.key, self.namespace_digest, self.nbytes]
        fields += [self.checksum, self.layout, self.dtype, self.shapes]
        text = json.dumps(fields, separators=(",", ":")).encode()
        return _LEN.pack(len(text)) + text


def header_length(prefix: bytes) -> int:
    if len(prefix) < _LEN.size:
        raise CorruptObject("object shorter than its length prefix")
    (length,) = _LEN.unpack_from(prefix)
    if length > 1 << 20:
        raise CorruptObject(f"header length {length} is not plausible")
    return length


def decode_header(raw: bytes) -> ObjectHeader:
    """Parse the JSON part of a safetensors preamble into an ObjectHeader.

    The bytes come from a disk or a bucket, so they are untrusted: anything that is
    not a well-formed tiercache header, whatever its shape, is a CorruptObject (a
    miss for the read path), never another exception."""
    try:
        # Strip the padding first: json.loads scans trailing whitespace slower than it
        # parses the few hundred bytes of header before it.
        text = raw.decode() if isinstance(raw, (bytes, bytearray)) else raw
        header = json.loads(text.rstrip())
    # RecursionError: deeply nested arrays; ValueError covers bad UTF-8 and JSON.
    except (ValueError, RecursionError) as error:
        raise CorruptObject(f"unreadable header: {type(error).__name__}") from None
    meta = _member(header, "__metadata__", dict, "header")
    tensor = _member(header, TENSOR_NAME, dict, "header")
    shape = _member(tensor, "shape", list, TENSOR_NAME)
    nbytes = shape[0] if len(shape) == 1 else None
    # bool is an int to Python, not to a reader of the header.
    if type(nbytes) is not int or nbytes < 0:
        raise CorruptObject(f"tensor shape {shape!r:.80} is not one byte count")
    if meta.get("format") != "tiercache" or tensor.get("data_offsets") != [0, nbytes]:
        raise CorruptObject("not a tiercache object")
    return ObjectHeader(
        key=_member(meta, "key", str),
        namespace_digest=_member(meta, "namespace_digest", str),
        nbytes=nbytes,
        checksum=_member(meta, "checksum_xxh3_64", str),
        layout=_member(meta, "layout", str, default=""),
        dtype=_member(meta, "dtype", str, default=""),
        shapes=_member(meta, "shapes", str, default=""),
        mac=_member(meta, MAC_FIELD, str, default=""),
        parts=_member(meta, PARTS_FIELD, str, default=""),
    )


_REQUIRED = object()


def _member(container: object, name: str, kind: type, where: str = "__metadata__", default=_REQUIRED):
    """container[name], checked to be a `kind`; CorruptObject when it is not."""
    if not isinstance(container, dict):
        raise CorruptObject(f"{where} is a {type(container).__name__}, not an object")
    value = container.get(name, default)
    if value is _REQUIRED:
        raise CorruptObject(f"{where} has no {name!r}")
    if not isinstance(value, kind):
        raise CorruptObject(f"{where}[{name!r}] is a {type(value).__name__}, not a {kind.__name__}")
    return value


def check_header(header: ObjectHeader, key: str, nbytes: int) -> None:
    if header.key != key:
        raise CorruptObject(f"object holds key {header.key!r}, expected {key!r}")
    if header.nbytes != nbytes:
        raise CorruptObject(f"object holds {header.nbytes} bytes, expected {nbytes}")


@dataclass(frozen=True)
class PageShape:
    """What a reader's slots hold: the layout, dtype and per-layer shapes (layer names
    included) it wrote its own objects with. An object whose header says otherwise
    holds other bytes, whatever its checksum says (another pipeline stage's layers, or
    a key named by an older scheme): a CorruptObject, so a miss, never served. An empty
    field is not checked: tools and benchmarks that do not know the shapes read any
    object."""

    layout: str = ""
    dtype: str = ""
    shapes: str = ""

    def check(self, header: ObjectHeader) -> None:
        for name in ("layout", "dtype", "shapes"):
            want, have = getattr(self, name), getattr(header, name)
            if want and have != want:
                raise CorruptObject(f"object {header.key} holds {name} {have!r}, expected {want!r}")


def object_mac(integrity_key: bytes, header: ObjectHeader) -> hmac.HMAC:
    """A MAC started over the header's fields: feed it the pages, in one or more
    pieces, then give its hexdigest to check_mac (or to sign)."""
    mac = hmac.new(integrity_key, digestmod=hashlib.sha256)
    mac.update(header.signed_fields())
    return mac


def sign(header: ObjectHeader, data: memoryview | bytes, integrity_key: bytes | None) -> ObjectHeader:
    """The header with its MAC over itself and `data`; unchanged without a key.
    HMAC-SHA256 rather than keyed BLAKE2b: with the CPU's SHA extensions OpenSSL's
    runs about three times as fast (1.7 against 0.6 GiB/s here)."""
    if integrity_key is None:
        return header
    mac = object_mac(integrity_key, header)
    mac.update(data)
    return replace(header, mac=mac.hexdigest())


def verify(header: ObjectHeader, data: memoryview, integrity_key: bytes | None = None) -> None:
    """Check the pages against the header: with a key, the MAC alone, which covers
    the pages and the header's checksum as well, so they are hashed once, not twice;
    without one, the plain checksum (which anyone who can write an object can forge)."""
    if integrity_key is None:
        check_digest(header, checksum(data))
        return
    verify_pieces(header, [data], integrity_key)


def verify_pieces(
    header: ObjectHeader, pieces: Iterable[memoryview | bytes], integrity_key: bytes | None
) -> None:
    """`verify` for pages that lie in pieces, given in order (a block read into the
    paged KV, where each layer's page is a block of its own tensor)."""
    if integrity_key is None:
        check_digest(header, checksum_of(pieces))
        return
    mac = object_mac(integrity_key, header)
    for piece in pieces:
        mac.update(piece)
    check_mac(header, mac.hexdigest())


def check_mac(header: ObjectHeader, actual: str) -> None:
    if not header.mac:
        raise CorruptObject(f"object {header.key} carries no MAC, and an integrity key is set")
    # As bytes: compare_digest refuses str with non-ASCII, and a header may hold any.
    if not hmac.compare_digest(actual.encode(), header.mac.encode()):
        raise CorruptObject(f"MAC mismatch for {header.key}: written without this integrity key")


def check_digest(header: ObjectHeader, actual: str) -> None:
    if actual != header.checksum:
        raise CorruptObject(f"checksum mismatch for {header.key}: {actual} != {header.checksum}")

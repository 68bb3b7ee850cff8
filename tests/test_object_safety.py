"""Objects from a disk or a bucket are untrusted input: a malformed header is a
corrupt object (a miss), never an exception out of the read path; objects on disk
are readable by their owner only; and with an integrity key, an object that no key
holder wrote is never served."""

from __future__ import annotations

import json
import os
import stat
import struct
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.tiers.disk import DiskTier
from tiercache.tiers.format import CorruptObject, ObjectHeader, checksum, decode_header

SLOT = 8192


def new_key() -> str:
    return f"{uuid.uuid4().hex[:16]}/{uuid.uuid4().hex * 2}"


def payload(seed: int = 1) -> memoryview:
    return memoryview(bytes([seed % 256]) * SLOT)


def plain_header(key: str, data: memoryview) -> ObjectHeader:
    return ObjectHeader(key, key[:16], len(data), checksum(data))


def raw_object(header_json: bytes, data: bytes) -> bytes:
    """A file with this exact header text (no padding) followed by `data`."""
    return struct.pack("<Q", len(header_json)) + header_json + data


def decodes_or_corrupt(raw: bytes) -> None:
    """Only two outcomes are allowed: a header of the right types, or CorruptObject."""
    try:
        header = decode_header(raw)
    except CorruptObject:
        return
    assert type(header.nbytes) is int and header.nbytes >= 0
    assert all(isinstance(value, str) for value in (header.key, header.checksum, header.layout))


# -- malformed headers ------------------------------------------------------------------------

VALID_META = {
    "format": "tiercache",
    "format_version": "1",
    "key": "0" * 16 + "/" + "1" * 64,
    "namespace_digest": "0" * 16,
    "checksum_xxh3_64": "0" * 16,
}

MALFORMED = {
    "metadata is not an object": {"__metadata__": 5, "kv": {"shape": [4], "data_offsets": [0, 4]}},
    "metadata is a list": {"__metadata__": ["format"], "kv": {"shape": [4], "data_offsets": [0, 4]}},
    "shape overflows an int": {"__metadata__": VALID_META, "kv": {"shape": [1e400], "data_offsets": [0, 0]}},
    "shape is a float": {"__metadata__": VALID_META, "kv": {"shape": [4.5], "data_offsets": [0, 4]}},
    "shape is a string": {"__metadata__": VALID_META, "kv": {"shape": ["4"], "data_offsets": [0, 4]}},
    "shape is negative": {"__metadata__": VALID_META, "kv": {"shape": [-4], "data_offsets": [0, -4]}},
    "key is not a string": {
        "__metadata__": {**VALID_META, "key": 7},
        "kv": {"shape": [4], "data_offsets": [0, 4]},
    },
    "checksum is a list": {
        "__metadata__": {**VALID_META, "checksum_xxh3_64": ["0"]},
        "kv": {"shape": [4], "data_offsets": [0, 4]},
    },
    "tensor is a string": {"__metadata__": VALID_META, "kv": "U8"},
    "header is a list": [VALID_META],
}


@pytest.mark.parametrize("header", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_header_is_a_corrupt_object(header):
    with pytest.raises(CorruptObject):
        decode_header(json.dumps(header).encode())


@pytest.mark.parametrize(
    "raw",
    [b"[" * 200_000, b'{"a":' * 100_000, b"\xff\xfe{}", b"1" * 5000],
    ids=["deep list", "deep object", "not utf-8", "huge integer"],
)
def test_a_header_that_is_not_sane_json_is_a_corrupt_object(raw):
    with pytest.raises(CorruptObject):
        decode_header(raw)


def test_the_disk_read_path_turns_a_malformed_header_into_a_miss(tmp_path):
    """The AttributeError, RecursionError and OverflowError these headers raised went
    straight out of DiskTier.get_into and killed the engine's reader."""
    tier = DiskTier(tmp_path, 1 << 20)
    for header in ([b"[" * 200_000], *(json.dumps(h).encode() for h in MALFORMED.values())):
        key = new_key()
        path = tier.path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw_object(header if isinstance(header, bytes) else header[0], bytes(SLOT)))
        assert tier.get_into(key, memoryview(bytearray(SLOT))) is False
        assert not path.exists()  # removed as corrupt
        assert tier.read_header(key) is None


JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
META_FIELDS = st.sampled_from(
    [
        "format",
        "format_version",
        "key",
        "namespace_digest",
        "checksum_xxh3_64",
        "layout",
        "dtype",
        "shapes",
        "mac_hmac_sha256",
    ]
)
HEADERISH = st.fixed_dictionaries(
    {},
    optional={
        "__metadata__": st.dictionaries(META_FIELDS, JSON_VALUES | st.just("tiercache"), max_size=9)
        | JSON_VALUES,
        "kv": st.fixed_dictionaries(
            {},
            optional={
                "dtype": JSON_VALUES,
                "shape": st.lists(JSON_VALUES | st.integers(-2, 2**70), max_size=3) | JSON_VALUES,
                "data_offsets": st.lists(JSON_VALUES | st.integers(-2, 2**70), max_size=3) | JSON_VALUES,
            },
        )
        | JSON_VALUES,
    },
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes_decode_or_are_corrupt(raw):
    decodes_or_corrupt(raw)


@FUZZ
@given(JSON_VALUES | HEADERISH)
def test_fuzz_arbitrary_json_and_headerish_dicts_decode_or_are_corrupt(header):
    decodes_or_corrupt(json.dumps(header).encode())


# -- disk objects readable by their owner only --------------------------------------------------


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o022, 0o000], ids=["umask 022", "umask 000"])
def permissive_umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def aligned_payload(seed: int) -> memoryview:
    """Page-aligned memory, so an O_DIRECT tier really writes with O_DIRECT."""
    buffer = np.empty(SLOT + 4096, dtype=np.uint8)
    start = -buffer.ctypes.data % 4096
    view = memoryview(buffer[start : start + SLOT])
    view[:] = bytes([seed]) * SLOT
    return view


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_disk_objects_and_folders_are_private_whatever_the_umask(tmp_path, permissive_umask, o_direct):
    """KV bytes can be inverted into the prompt that made them: no other user may read
    an object, list a folder, or see a temp file mid-write."""
    root = tmp_path / "made" / "by" / "tiercache"
    tier = DiskTier(root, 1 << 20, o_direct=o_direct)
    keys = [new_key() for _ in range(3)]
    for seed, key in enumerate(keys):
        assert tier.put(key, aligned_payload(seed), plain_header(key, payload(seed)))
    for folder in (tmp_path / "made", tmp_path / "made" / "by", root):
        assert mode(folder) == 0o700, folder
    for key in keys:
        path = tier.path_of(key)
        # The temp file is renamed into place, so the object has the mode it was made with.
        assert mode(path) == 0o600, path
        assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700


def test_an_existing_root_is_left_as_it_is_and_older_objects_are_made_private(tmp_path, permissive_umask):
    """A root the operator made (a hostPath, a shared mount) keeps its mode; objects
    and folders an older tiercache left world-readable are closed on the next start."""
    tmp_path.chmod(0o755)
    key = new_key()
    DiskTier(tmp_path, 1 << 20).put(key, payload(), plain_header(key, payload()))
    path = DiskTier(tmp_path, 1 << 20).path_of(key)
    for opened, permissions in ((path, 0o644), (path.parent, 0o755), (path.parent.parent, 0o755)):
        opened.chmod(permissions)  # as an older tiercache left them
    tier = DiskTier(tmp_path, 1 << 20)
    assert mode(tmp_path) == 0o755
    assert (mode(path), mode(path.parent), mode(path.parent.parent)) == (0o600, 0o700, 0o700)
    assert tier.get_into(key, memoryview(bytearray(SLOT)))

"""Objects from a disk or a bucket are untrusted input: a malformed header is a
corrupt object (a miss), never an exception out of the read path; objects on disk
are readable by their owner only; and with an integrity key, an object that no key
holder wrote is never served."""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import uuid
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.config import ConfigError, S3TierConfig, build_config
from tiercache.connector.driver import ConnectorDriver
from tiercache.engine import ObjectShape, TierEngine
from tiercache.tiers import DISK, S3
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.disk.tier import DiskTier
from tiercache.tiers.format import CorruptObject, ObjectHeader, checksum, decode_header, sign
from tiercache.tiers.s3.runs import check_run_bytes
from tiercache.tiers.s3.tier import Fetch, S3Tier

from support.s3_blocks import fetch_block, put_block

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
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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


# -- an integrity key: objects no key holder wrote are never served ---------------------------

KEY = "integrity-" + uuid.uuid4().hex + uuid.uuid4().hex
OTHER_KEY = "integrity-" + uuid.uuid4().hex + uuid.uuid4().hex


def forged(key: str, data: memoryview, mac_key: str | None) -> ObjectHeader:
    """What anyone who can write to the bucket or the disk can make: a header with the
    right plain checksum, unsigned or signed with a key of their own."""
    header = plain_header(key, data)
    return sign(header, data, mac_key.encode()) if mac_key else header


@pytest.mark.parametrize("forger_key", [None, OTHER_KEY], ids=["unsigned", "wrong key"])
def test_disk_refuses_an_object_no_key_holder_wrote(tmp_path, forger_key):
    key, data = new_key(), payload(3)
    DiskTier(tmp_path, 1 << 20).put(key, data, forged(key, data, forger_key))
    reader = DiskTier(tmp_path, 1 << 20, integrity_key=KEY.encode())
    assert reader.get_into(key, memoryview(bytearray(SLOT))) is False
    assert not reader.path_of(key).exists()  # removed like any corrupt object

    key = new_key()
    reader.put(key, data, forged(key, data, KEY))
    out = memoryview(bytearray(SLOT))
    assert reader.get_into(key, out) and bytes(out) == bytes(data)


def test_a_mac_covers_the_header_as_well_as_the_pages(tmp_path):
    key, data = new_key(), payload(4)
    signed = forged(key, data, KEY)
    reader = DiskTier(tmp_path, 1 << 20, integrity_key=KEY.encode())
    for altered in (replace(signed, layout="LBHNC"), replace(signed, checksum="0" * 16)):
        reader.put(key, data, altered)
        assert reader.get_into(key, memoryview(bytearray(SLOT))) is False
    tampered = bytearray(data)
    tampered[-1] ^= 1
    reader.put(key, memoryview(tampered), replace(signed, checksum=checksum(tampered)))
    assert reader.get_into(key, memoryview(bytearray(SLOT))) is False


def test_inspect_checks_the_mac_given_the_key(tmp_path):
    from rich.console import Console

    from tiercache.ops.object_info import inspect_file

    tier = DiskTier(tmp_path, 1 << 20)
    signed, unsigned, data = new_key(), new_key(), payload(6)
    tier.put(signed, data, forged(signed, data, KEY))
    tier.put(unsigned, data, forged(unsigned, data, None))

    def inspect(key: str, integrity_key: str | None) -> tuple[int, str]:
        console = Console(record=True, width=200)
        code = inspect_file(tier.path_of(key), console, integrity_key.encode() if integrity_key else None)
        return code, console.export_text()

    code, text = inspect(signed, KEY)
    assert code == 0 and "MAC ok" in text
    assert inspect(signed, None)[0] == 0  # without the key, the plain checksum as before
    assert inspect(signed, OTHER_KEY)[0] == 1
    code, text = inspect(unsigned, KEY)
    assert code == 1 and "carries no MAC" in text


@pytest.mark.parametrize("forger_key", [None, OTHER_KEY], ids=["unsigned", "wrong key"])
def test_s3_refuses_an_object_no_key_holder_wrote(real_s3_endpoint, real_bucket, forger_key):
    config = S3TierConfig(bucket=real_bucket, endpoint_url=real_s3_endpoint, region="us-east-1")
    attacker, reader = S3Tier(config), S3Tier(config, integrity_key=KEY.encode())
    try:
        key, data = new_key(), payload(5)
        stored = put_block(attacker, forged(key, data, forger_key), data)
        assert stored is not None
        assert fetch_block(reader, stored, memoryview(bytearray(SLOT))) is Fetch.CORRUPT
        stored = put_block(attacker, forged(key, data, KEY), data)
        assert stored is not None
        out = memoryview(bytearray(SLOT))
        assert fetch_block(reader, stored, out) is Fetch.OK and bytes(out) == bytes(data)
    finally:
        attacker.close()
        reader.close()


def keyed_config(tmp_path, redis_url, s3_endpoint, bucket, integrity_key: str | None, disk: str | None):
    data = {
        "redis_url": redis_url,
        "cpu": {"capacity": 4 * SLOT},
        "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1"},
    }
    if disk:
        data["disk"] = {"path": str(tmp_path / disk), "capacity": "16MiB"}
    # The key comes from the environment, as a deployment's secret would.
    return build_config(data, environ={"TIERCACHE_INTEGRITY_KEY": integrity_key} if integrity_key else {})


def test_a_key_mismatch_between_writer_and_reader_is_a_miss(
    tmp_path, redis, redis_url, real_s3_endpoint, real_bucket
):
    s3_endpoint, bucket = real_s3_endpoint, real_bucket
    model = uuid.uuid4().hex
    blocks = [uuid.uuid4().bytes * 2 for _ in range(3)]

    def cache(integrity_key, disk="disk"):
        config = keyed_config(tmp_path, redis_url, s3_endpoint, bucket, integrity_key, disk)
        return ConnectorDriver(config, SLOT, model=model)

    writer = cache(KEY)
    shape = writer.shape
    for i, block in enumerate(blocks):
        assert writer.put(block, payload(i)) is not None
    assert writer.flush(30)
    writer.close()

    for disk, tier in (("disk", DISK), (None, S3)):
        reader = cache(KEY, disk)
        try:
            assert reader.get(blocks[0]) == (tier, payload(0))
        finally:
            reader.close()

    for disk in ("disk", None):  # a node whose disk holds them, and one that finds them in S3
        stranger = cache(OTHER_KEY, disk)
        try:
            assert [stranger.get(block) for block in blocks[1:]] == [None, None]  # not served
        finally:
            stranger.close()
    disk = DiskTier(tmp_path / "disk", 1 << 24)
    try:
        assert not any(shape.key(block) in disk for block in blocks[1:])  # removed as forged
    finally:
        disk.close()


def test_the_key_stays_out_of_repr_config_check_and_errors(tmp_path, capsys):
    digits = "1234567890" * 4  # YAML would read an unquoted override as a number
    config = build_config({}, environ={"TIERCACHE_INTEGRITY_KEY": digits})
    assert config.integrity_key_bytes() == digits.encode()
    config = build_config({"integrity_key": KEY}, environ={})
    assert config.integrity_key_bytes() == KEY.encode()
    assert KEY not in repr(config) + str(config) + json.dumps(config.redacted())

    path = tmp_path / "tiercache.yaml"
    path.write_text(f"integrity_key: {KEY}\n")
    from typer.testing import CliRunner

    from tiercache.ops.cli import app

    for args in (["config", "check", str(path)], ["config", "check", str(path), "--json"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0 and "integrity_key" in result.output
        assert KEY not in result.output

    short = "s3cr3t-" + uuid.uuid4().hex[:8]
    with pytest.raises(ConfigError) as info:
        build_config({"integrity_key": short}, environ={})
    assert "integrity_key" in str(info.value) and short not in str(info.value)


def test_uploads_write_signed_objects_and_never_log_the_key(
    tmp_path, redis, redis_url, real_s3_endpoint, real_bucket, monkeypatch, caplog, capfd
):
    """The engine's upload threads write each run signed with the integrity key: only
    that key (or the plain checksum) checks its blocks out. The key is in no log line."""
    s3_endpoint, bucket = real_s3_endpoint, real_bucket
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("TIERCACHE_INTEGRITY_KEY", KEY)
    config = keyed_config(tmp_path, redis_url, s3_endpoint, bucket, KEY, "disk")
    buffer = CpuBuffer(4, SLOT, pin_memory=False)
    engine = TierEngine(config, ObjectShape(uuid.uuid4().hex[:16], uuid.uuid4().hex[:16], SLOT), buffer)
    try:
        results = []
        for slot in range(2):
            buffer.view(slot)[:] = payload(slot + 7)
            engine.write_down(bytes([slot]) * 32, slot, results.append)
        assert engine.flush(60)
        assert [r.stored for r in results] == [{DISK: True, S3: True}] * 2
    finally:
        engine.close()
    config_s3 = S3TierConfig(bucket=bucket, endpoint_url=s3_endpoint, region="us-east-1")
    reader = S3Tier(config_s3)
    rank = engine.shape.rank_digest
    bodies = [
        reader.client.get_object(Bucket=bucket, Key=reader.run_name(rank, run))["Body"].read()
        for _, run, _, _ in reader.list_runs(rank)
    ]
    reader.close()
    assert bodies
    for reader_key, served in ((KEY, True), (None, True), (OTHER_KEY, False)):
        for body in bodies:  # every block of every run checks out under the writer's key only
            try:
                check_run_bytes(body, reader_key.encode() if reader_key else None)
                ok = True
            except CorruptObject:
                ok = False
            assert ok is served, reader_key
    output = capfd.readouterr()
    assert KEY not in caplog.text + output.out + output.err

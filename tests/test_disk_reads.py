"""Disk hits read straight into the paged KV during the forward (connector/disk_reads.py):
the bytes land where the forward reads them, layer by layer, and a block that cannot
be read or does not verify is a failed block (vLLM recomputes it), never served."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from tiercache.config import build_config
from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.metadata import OFF_DISK, READ_FAILED, BlockOp, LoadJob, TierCacheMetadata
from tiercache.connector.worker import TierCacheWorker
from tiercache.index.keys import KVSpec
from tiercache.tiers.format import parse_parts

NUM_BLOCKS = 16
# Names whose sorted order (the slot layout) differs from the forward's order.
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(12)]
KEY = "k" * 32

LAYOUTS = {
    # vLLM's CPU backend: block first, each block's page one contiguous piece.
    "cpu backend": lambda: {name: torch.randn(NUM_BLOCKS, 2, 32, 16) for name in LAYERS},
    # K and V apart: each block's page is two pieces.
    "kv first": lambda: {name: torch.randn(2, NUM_BLOCKS, 32, 16) for name in LAYERS},
    # 60 bytes a page: the slot layout pads each layer to 64 bytes.
    "padded pages": lambda: {name: torch.randn(NUM_BLOCKS, 3, 5) for name in LAYERS},
}


def make_worker(kv, disk_root, integrity_key: str | None = None, parts: bool = True) -> TierCacheWorker:
    """`parts`: objects carry a checksum per layer's page (as written where disk hits
    are read in the forward), else only the whole one (as written elsewhere, or by an
    older version): both are read and verified."""
    slot_bytes = PagedKVCopier(kv, NUM_BLOCKS).slot_bytes
    settings = {
        "cpu": {"capacity": 8 * slot_bytes},
        "disk": {"path": str(disk_root), "capacity": 64 * slot_bytes},
    }
    if integrity_key:
        settings["integrity_key"] = integrity_key
    spec = KVSpec("m", "", "float32", "auto", 32, "cpu", len(kv), 2, 16, 1, 0, "t", slot_bytes)
    worker = TierCacheWorker(
        build_config(settings), spec, "digest", NUM_BLOCKS, tp_rank=0, writes_lower_tiers=True, disk_share=0
    )
    worker.register_kv_caches(kv, slot_bytes)
    assert worker.engine.shape.part_offsets  # written where disk hits are read in the forward
    if not parts:
        worker.engine.shape = dataclasses.replace(worker.engine.shape, part_offsets=())
    return worker


def step(worker, meta, layers=LAYERS, check=None) -> None:
    """What vLLM does in one step: start loads, wait for each layer before its
    attention, then save."""
    worker.start_load_kv(meta)
    for name in layers:
        worker.wait_for_layer(name)
        if check:
            check(name)
        worker.save_layer(name, meta)
    worker.wait_for_save(meta)


def store_on_disk(worker, gpu_blocks: list[int]) -> list[bytes]:
    """Store these blocks the way a prompt's step does, and wait for their disk writes."""
    hashes = [bytes([100 + b]) * 32 for b in gpu_blocks]
    stores = [BlockOp(h, b, slot, "cpu") for slot, (h, b) in enumerate(zip(hashes, gpu_blocks, strict=True))]
    step(worker, TierCacheMetadata(stores=stores))
    assert worker.engine.flush(10)
    assert all(worker.engine.disk.contains(worker.engine.shape.key(h)) for h in hashes)
    return hashes


def disk_hit(pairs, req_id="r") -> TierCacheMetadata:
    """A synchronous load of (block hash, paged-KV block) pairs, all on disk."""
    ops = [BlockOp(h, gpu, -1, "disk") for h, gpu in pairs]
    return TierCacheMetadata(loads=[LoadJob(req_id, ops, False)])


def page(kv, name, block):
    tensor = kv[name]
    return tensor[:, block] if tensor.shape[0] == 2 and tensor.dim() == 4 else tensor[block]


@pytest.fixture(params=list(LAYOUTS))
def kv(request):
    torch.manual_seed(0)
    return LAYOUTS[request.param]()


@pytest.fixture(params=[True, False], ids=["checksum per layer", "whole checksum only"])
def parts(request):
    return request.param


@pytest.mark.parametrize("layer_order_known", [True, False], ids=["during the forward", "first step"])
def test_a_disk_hit_lands_in_each_layer_before_its_attention_reads_it(kv, parts, tmp_path, layer_order_known):
    worker = make_worker(kv, tmp_path / "disk", parts=parts)
    try:
        if layer_order_known:
            step(worker, TierCacheMetadata())  # a step that shows every layer's hook
            assert worker._loads.layer_order == LAYERS
        hashes = store_on_disk(worker, [0, 1, 2])
        want = {name: [page(kv, name, b).clone() for b in (0, 1, 2)] for name in LAYERS}
        for name in LAYERS:  # the target blocks hold other bytes before the load
            for b in (9, 10, 11):
                page(kv, name, b).zero_()

        def in_place(name):
            for b, expected in zip((9, 10, 11), want[name], strict=True):
                assert torch.equal(page(kv, name, b), expected), (name, b)

        step(worker, disk_hit(zip(hashes, [9, 10, 11], strict=True)), check=in_place)
        assert worker.take_failed_blocks() == set()
        meta = worker.take_worker_meta()
        assert meta.hits["disk"] == 3
        assert not [r for r in meta.reports if r[1] == READ_FAILED]
        assert worker.take_stats().data["loaded_blocks_disk"] == 3
    finally:
        worker.shutdown()


def corrupt_pages(path: str, at_fraction: float) -> None:
    """Flip one byte of the pages, this far into them (they follow a 4 KiB header)."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(4096 + int((size - 4096) * at_fraction))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "deleted", "another block's object"])
def test_a_disk_object_that_cannot_be_served_fails_only_its_block(kv, parts, tmp_path, damage):
    worker = make_worker(kv, tmp_path / "disk", parts=parts)
    try:
        step(worker, TierCacheMetadata())
        hashes = store_on_disk(worker, [0, 1])
        engine = worker.engine
        bad = engine.shape.key(hashes[1])
        path = engine.disk.layout.path(bad)
        if damage == "flipped byte":
            corrupt_pages(path, 0.7)  # a late layer's page: read after earlier layers went in
        elif damage == "truncated":
            os.truncate(path, os.path.getsize(path) - 100)
        elif damage == "deleted":
            os.unlink(path)
        else:
            shutil.copyfile(engine.disk.layout.path(engine.shape.key(hashes[0])), path)
        good_before = {name: page(kv, name, 0).clone() for name in LAYERS}
        # Two requests in one step: the damaged block fails only its own.
        meta = TierCacheMetadata(
            loads=[
                LoadJob("ok", [BlockOp(hashes[0], 12, -1, "disk")], False),
                LoadJob("bad", [BlockOp(hashes[1], 13, -1, "disk")], False),
            ]
        )
        step(worker, meta)
        assert worker.take_failed_blocks() == {13}
        assert all(torch.equal(page(kv, name, 12), good_before[name]) for name in LAYERS)
        reports = worker.take_worker_meta().reports
        assert (0, READ_FAILED, hashes[1]) in reports
        assert (0, OFF_DISK, hashes[1]) in reports  # the scheduler stops offering it
        assert not os.path.exists(path) and not engine.disk.contains(bad)
        assert worker.take_stats().data["failed_blocks_disk"] == 1
    finally:
        worker.shutdown()


def test_with_an_integrity_key_a_disk_hit_is_served_only_with_its_mac(tmp_path):
    torch.manual_seed(0)
    kv = LAYOUTS["cpu backend"]()
    signer = make_worker(kv, tmp_path / "signed", integrity_key="s" * 32)
    try:
        step(signer, TierCacheMetadata())
        hashes = store_on_disk(signer, [0])
        step(signer, disk_hit([(hashes[0], 5)]))
        assert signer.take_failed_blocks() == set()
        assert all(torch.equal(page(kv, n, 5), page(kv, n, 0)) for n in LAYERS)
    finally:
        signer.shutdown()
    # Another key (or none) did not write this object: it is never served.
    other = make_worker(kv, tmp_path / "signed", integrity_key="o" * 32)
    try:
        step(other, TierCacheMetadata())
        step(other, disk_hit([(hashes[0], 6)]))
        assert other.take_failed_blocks() == {6}
    finally:
        other.shutdown()


def test_a_failed_block_fails_the_rest_of_its_prefix_at_once(tmp_path):
    """A block that cannot even be opened fails with every block after it, as a lost
    CPU block does: those are not read."""
    torch.manual_seed(0)
    kv = LAYOUTS["cpu backend"]()
    worker = make_worker(kv, tmp_path / "disk")
    try:
        step(worker, TierCacheMetadata())
        hashes = store_on_disk(worker, [0, 1, 2])
        os.unlink(worker.engine.disk.layout.path(worker.engine.shape.key(hashes[1])))
        step(worker, disk_hit(zip(hashes, [7, 8, 9], strict=True)))
        assert worker.take_failed_blocks() == {8, 9}
        assert all(torch.equal(page(kv, n, 7), page(kv, n, 0)) for n in LAYERS)
    finally:
        worker.shutdown()


def test_with_a_checksum_per_layer_no_second_pass_reads_the_block(tmp_path, monkeypatch):
    """Each layer's page is verified as it lands, while still in cache: the whole
    block is not read again once every layer is in."""
    from tiercache.connector import disk_reads

    def second_pass(*args):
        raise AssertionError("the block was read again to verify it")

    torch.manual_seed(0)
    kv = LAYOUTS["padded pages"]()
    worker = make_worker(kv, tmp_path / "disk")
    try:
        step(worker, TierCacheMetadata())
        hashes = store_on_disk(worker, [0, 1])
        monkeypatch.setattr(disk_reads, "verify_pieces", second_pass)
        step(worker, disk_hit(zip(hashes, [7, 8], strict=True)))
        assert worker.take_failed_blocks() == set()
        assert all(torch.equal(page(kv, n, 8), page(kv, n, 1)) for n in LAYERS)
    finally:
        worker.shutdown()


def test_part_checksums_cover_the_pages_and_a_bad_field_is_not_trusted():
    from tiercache.tiers.format import ObjectHeader, checksum, checksums_by_part, decode_header

    data = memoryview(os.urandom(1000))
    whole, parts = checksums_by_part(data, (0, 64, 640))
    assert whole == checksum(data)
    header = ObjectHeader("d/k", "d", 1000, whole, parts=parts)
    decoded = decode_header(header.encode()[8:])
    assert decoded == header
    assert [(start, length) for start, length, _ in parse_parts(decoded)] == [(0, 64), (64, 576), (640, 360)]
    assert parse_parts(decoded)[1][2] == checksum(data[64:640])
    # Written without parts (older objects): the field is absent and nothing is parsed.
    assert decode_header(ObjectHeader("d/k", "d", 1000, whole).encode()[8:]).parts == ""
    for bad in ("64:ab,576:cd", "64:ab,936", "x:ab,1000:cd", "-5:ab,1005:cd"):
        assert parse_parts(dataclasses.replace(header, parts=bad)) is None, bad


def test_an_object_with_part_checksums_is_hashed_in_one_pass(monkeypatch):
    """The whole checksum of an object written with a checksum per part comes from
    the parts' pass: the write path does not hash the pages a second time."""
    from tiercache import object_shape
    from tiercache.object_shape import ObjectShape
    from tiercache.tiers.format import checksum

    data = memoryview(os.urandom(3000))
    want = checksum(data)

    def second_pass(_):
        raise AssertionError("the pages were hashed twice")

    monkeypatch.setattr(object_shape, "checksum", second_pass)
    header = ObjectShape("m" * 16, "r" * 16, 3000, part_offsets=(0, 1024, 2048)).header(b"b" * 32, data)
    assert header.checksum == want
    assert [length for _, length, _ in parse_parts(header)] == [1024, 1024, 952]

"""Disk hits read straight into the paged KV during the forward, layer by layer, where
the KV cache is in host memory (vLLM's CPU backend; `disk.load_in_forward`).

Staged instead, a disk hit is read into CPU slots before its request is scheduled,
then copied into the paged KV beside the next forward: two copies, one of them ahead
of the forward, and an engine step more. Read here, it is one copy, from the page
cache into the KV, done by the layer-by-layer load (layerwise.py) as each layer's
turn comes, so a disk hit costs about what a CPU hit does.

Each block's object was opened and its header checked before the forward. A layer's
page of a block is read from the object at that layer's offset in the slot layout
(copier.py) into the block's page of that layer's tensor. Objects written for such
reads carry a checksum per layer's page (format.PARTS_FIELD): each page is verified
as it lands, while still in cache. Other objects (written elsewhere or by an older
version), and any object where an integrity key asks for its MAC, are verified once
every layer is in, over the bytes now in the KV in the slot layout's order. A block
that could not be read, or whose bytes do not verify, is a failed block: vLLM's
recompute policy truncates the request there and computes the rest, so this step's
output of that request is dropped, never served."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from tiercache.errors import CorruptObject
from tiercache.tiers.disk.file_io import DiskPages
from tiercache.tiers.disk.tier import DiskTier
from tiercache.tiers.format import checksum_of, parse_parts, verify_pieces

from .copier import LayerRegion

log = logging.getLogger("tiercache.connector")


def block_pieces(region: LayerRegion, block: int) -> list[memoryview]:
    """The bytes of one block's page of a layer, as writable views of the tensor's
    memory, in the order the copier lays them out in a slot. One view where the page
    is contiguous (the CPU backend's layout); else one per contiguous piece."""
    return _pieces(region.blocks[block])


def _pieces(tensor: torch.Tensor) -> list[memoryview]:
    if tensor.is_contiguous():
        nbytes = tensor.numel() * tensor.element_size()
        return [memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")]
    return [view for part in tensor.unbind(0) for view in _pieces(part)]


@dataclass
class DiskRead:
    gpu_block: int
    pages: DiskPages
    error: CorruptObject | OSError | None = None  # why it cannot be served
    # Per layer (slot order): its part's (start, bytes, checksum), where the object
    # carries one for each layer's page; and whether that part has been verified.
    parts: list[tuple[int, int, str]] | None = None
    verified: list[bool] | None = None


class DiskReads:
    """One step's disk blocks being read into the paged KV: `read_layer` for each
    layer, in any order and from any thread (each layer by one thread), then `check`
    for each block once every layer is in, then `close`."""

    def __init__(
        self, regions: list[LayerRegion], reads: list[DiskRead], disk: DiskTier, integrity_key: bytes | None
    ):
        self.regions = regions  # in slot order
        self.reads = reads
        self._disk = disk
        self._integrity_key = integrity_key
        self._layer_index = {region.name: i for i, region in enumerate(regions)}
        for read in reads:
            self._use_parts(read)

    def _use_parts(self, read: DiskRead) -> None:
        """Verify this block layer by layer, each page as it lands, where its object
        carries a checksum per layer's page (format.PARTS_FIELD). Not with an integrity
        key: a plain checksum per part could be forged, only the MAC over the whole
        object can say who wrote it."""
        if self._integrity_key is not None:
            return
        parts = parse_parts(read.pages.header)
        if parts is None or len(parts) != len(self.regions):
            return
        for (start, length, _), region in zip(parts, self.regions, strict=True):
            if start != region.offset or length < region.nbytes:
                return
        read.parts = parts
        read.verified = [False] * len(parts)

    def __len__(self) -> int:
        return len(self.reads)

    def read_layer(self, region: LayerRegion) -> None:
        layer = self._layer_index[region.name]
        for read in self.reads:
            if read.error is not None:
                continue
            try:
                self._read_page(read, region, layer)
            except (CorruptObject, OSError) as error:
                read.error = error

    @staticmethod
    def _read_page(read: DiskRead, region: LayerRegion, layer: int) -> None:
        views = block_pieces(region, read.gpu_block)
        if read.parts is None or read.verified is None:
            read.pages.read(region.offset, views)
            return
        _, length, expected = read.parts[layer]
        if length > region.nbytes:  # the slot layout's padding after this page
            views.append(memoryview(bytearray(length - region.nbytes)))
        read.pages.read(region.offset, views)
        if checksum_of(views) != expected:
            raise CorruptObject(f"checksum mismatch in layer {region.name} of {read.pages.key}")
        read.verified[layer] = True

    def check(self, index: int) -> None:
        """Verify block `index`'s pages, now in the paged KV, against its header (at
        once where every layer's page was verified as it landed)."""
        read = self.reads[index]
        if read.error is not None or (read.verified is not None and all(read.verified)):
            return
        try:
            verify_pieces(read.pages.header, self._slot_order(read), self._integrity_key)
        except (CorruptObject, OSError) as error:
            read.error = error

    def _slot_order(self, read: DiskRead):
        """The object's pages as they lie in the file: each layer's page from the KV,
        and from the file the padding between them (where a page's size is not a
        multiple of the slot layout's alignment)."""
        at = 0
        for region in self.regions:
            if region.offset > at:
                yield self._file_bytes(read, at, region.offset - at)
            yield from block_pieces(region, read.gpu_block)
            at = region.offset + region.nbytes
        if read.pages.header.nbytes > at:
            yield self._file_bytes(read, at, read.pages.header.nbytes - at)

    @staticmethod
    def _file_bytes(read: DiskRead, at: int, count: int) -> bytearray:
        out = bytearray(count)
        read.pages.read(at, [memoryview(out)])
        return out

    def failed(self) -> set[int]:
        """The paged-KV blocks that did not load, each told to the disk tier (which
        removes an object found corrupt). Called once, when the load is over."""
        failed = set()
        for read in self.reads:
            if read.error is not None:
                failed.add(read.gpu_block)
                self._disk.missed(read.pages.key, read.error)
        return failed

    def close(self) -> None:
        for read in self.reads:
            read.pages.close()

"""One kernel launch moves blocks, every layer at once or one layer at a time, between
the paged KV and slots laid out as the CPU tier lays them out: straight into the
page-locked CPU tier (the GPU reads and writes host memory over PCIe, so no staging
buffer and no separate transfer), or into a device staging buffer.

The plain-torch way is one indexed gather (or scatter) per layer. On an H100 each
such launch costs the host about 18 microseconds, and 32 of them for a 64 MiB batch
took longer to issue than the batch took to cross PCIe: the transfer waited on Python
(see docs/benchmarks-e2e.md, "GPU transfers"). Here the host issues one launch and
the GPU walks a table of layer addresses.

A layer qualifies when each block is `parts` equal contiguous pieces at a fixed
distance from each other: one piece for block-first layouts, two (K and V) for
FlashAttention's `(2, num_blocks, ...)`. Every layer must share those numbers and the
words must be 4-byte aligned; otherwise `FusedBlockCopy.for_regions` returns None and
the copier keeps its per-layer path. Triton ships with vLLM's GPU build; under
`TRITON_INTERPRET=1` the same kernel runs on CPU tensors, which is how it is tested on
machines without a GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # vLLM's CPU build may come without it; the copier falls back
    triton = None

_WORD = 4  # bytes moved per element: int32 words
_CHUNK = 2048  # words per program


if triton is not None:
    # Triton compiles a variant per value class of an integer argument (1, multiples
    # of 16, others); these change from call to call, and a compile in the middle of a
    # request costs about a second, so they are left general. The rest are fixed for
    # the life of an engine and compiled once, at warm-up.
    @triton.jit(do_not_specialize=["first_layer", "pieces_per_item", "work"])
    def _copy_blocks(
        layer_ptrs,  # int64 address of block 0, piece 0, of each layer
        layer_offsets,  # int64 word offset of each layer inside a slot
        first_layer,
        index,  # int64 block id of each item
        rows,  # int64 slot (row of `slots`) of each item
        slots,  # int32 words, one slot per row
        block_stride,  # words between consecutive blocks of a layer
        part_stride,  # words between the pieces of one block
        parts,
        part_words,
        slot_words,
        pieces_per_item,  # layers copied x parts
        chunks_per_piece,
        work,  # items x pieces_per_item x chunks_per_piece
        TO_SLOTS: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        # Each program takes every num_programs-th chunk of the work, so a small grid
        # can do a large copy while leaving the other SMs to the forward.
        for unit in range(tl.program_id(0), work, tl.num_programs(0)):
            item = unit // (pieces_per_item * chunks_per_piece)
            piece = (unit // chunks_per_piece) % pieces_per_item
            chunk = (unit % chunks_per_piece).to(tl.int64)
            layer = first_layer + piece // parts
            part = (piece % parts).to(tl.int64)
            kv = tl.load(layer_ptrs + layer).to(tl.pointer_type(tl.int32))
            kv = kv + tl.load(index + item) * block_stride + part * part_stride
            slot = (
                slots + tl.load(rows + item) * slot_words + tl.load(layer_offsets + layer) + part * part_words
            )
            words = chunk * CHUNK + tl.arange(0, CHUNK)
            inside = words < part_words
            if TO_SLOTS:
                tl.store(slot + words, tl.load(kv + words, mask=inside), mask=inside)
            else:
                tl.store(kv + words, tl.load(slot + words, mask=inside), mask=inside)


@dataclass(frozen=True)
class _Shape:
    parts: int
    part_words: int
    part_stride: int  # in words
    block_stride: int  # in words


def _piece_shape(blocks: torch.Tensor) -> _Shape | None:
    """How a layer's block (dim 0 of `blocks`) splits into equal contiguous pieces."""
    size = blocks.element_size()
    dims = list(zip(blocks.shape[1:], blocks.stride()[1:], strict=True))
    # The longest tail of dimensions that is contiguous in memory is one piece.
    piece_elems, expected = 1, 1
    while dims and (dims[-1][0] == 1 or dims[-1][1] == expected):
        extent, _ = dims.pop()
        piece_elems *= extent
        expected *= extent
    dims = [(extent, stride) for extent, stride in dims if extent != 1]
    if len(dims) > 1:
        return None
    parts, part_stride = dims[0] if dims else (1, 0)
    byte_sizes = (piece_elems * size, part_stride * size, blocks.stride(0) * size, blocks.data_ptr())
    if any(value % _WORD for value in byte_sizes):
        return None
    return _Shape(
        parts, piece_elems * size // _WORD, part_stride * size // _WORD, blocks.stride(0) * size // _WORD
    )


class FusedBlockCopy:
    def __init__(self, shape: _Shape, layer_ptrs: torch.Tensor, layer_offsets: torch.Tensor, slot_bytes: int):
        self._shape = shape
        self._layer_ptrs = layer_ptrs
        self._layer_offsets = layer_offsets
        self._slot_words = slot_bytes // _WORD
        self._layers = len(layer_ptrs)

    @classmethod
    def for_regions(cls, regions, slot_bytes: int, device: torch.device) -> FusedBlockCopy | None:
        """The kernel for these layers, or None where it does not apply (no Triton,
        layers of different shapes, unaligned words): the caller copies layer by layer."""
        if triton is None or slot_bytes % _WORD:
            return None
        shapes = {_piece_shape(region.blocks) for region in regions}
        if len(shapes) != 1 or None in shapes:
            return None
        if any(region.offset % _WORD for region in regions):
            return None
        (shape,) = shapes
        assert shape is not None  # refused above
        # Each layer's pieces must tile its region of the slot exactly.
        if any(shape.parts * shape.part_words * _WORD != region.nbytes for region in regions):
            return None
        ptrs = torch.tensor(
            [region.blocks.data_ptr() for region in regions], dtype=torch.int64, device=device
        )
        offsets = torch.tensor(
            [region.offset // _WORD for region in regions], dtype=torch.int64, device=device
        )
        return cls(shape, ptrs, offsets, slot_bytes)

    def _launch(
        self,
        index: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        to_slots: bool,
        layers: range | None,
        programs: int | None,
    ) -> None:
        shape = self._shape
        layers = layers or range(self._layers)
        pieces = len(layers) * shape.parts
        chunks = math.ceil(shape.part_words / _CHUNK)
        work = len(index) * pieces * chunks
        _copy_blocks[(min(work, programs or work),)](
            self._layer_ptrs,
            self._layer_offsets,
            layers.start,
            index,
            rows,
            slots.view(torch.int32),
            shape.block_stride,
            shape.part_stride,
            shape.parts,
            shape.part_words,
            self._slot_words,
            pieces,
            chunks,
            work,
            TO_SLOTS=to_slots,
            CHUNK=_CHUNK,
        )

    def gather(self, index, rows, slots, layers: range | None = None, programs: int | None = None) -> None:
        """slots[rows[i]] = block index[i], every layer (or `layers`), laid out as a slot.
        `slots` is a (rows, slot_bytes) uint8 tensor the GPU can address: on the device,
        or page-locked host memory. `programs` caps the grid (default: one per chunk)."""
        self._launch(index, rows, slots, True, layers, programs)

    def scatter(self, slots, rows, index, layers: range | None = None, programs: int | None = None) -> None:
        """Block index[i] = slots[rows[i]], every layer (or `layers`)."""
        self._launch(index, rows, slots, False, layers, programs)

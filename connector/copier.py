"""Copies between vLLM's paged KV (one tensor per layer, any layout) and CPU-tier slots.

Each layer is viewed with its block dimension first, `(num_blocks, ...)`; one slot
holds a block's bytes for every layer of this rank, layer after layer. Nothing here
assumes a shape: the block dimension is found by its size.

Copies are batched into runs: consecutive blocks that land in consecutive slots move
in one strided copy per layer. On CUDA the copies run on a dedicated stream out of a
page-locked buffer, ordered after the compute stream, and an event marks their end."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiercache.tiers.cpu import CpuBuffer

_ALIGN = 64  # keeps every layer's region aligned for any dtype view


@dataclass(frozen=True)
class LayerRegion:
    name: str
    blocks: torch.Tensor  # the layer with its block dimension first
    offset: int  # byte offset of this layer inside a slot
    nbytes: int  # bytes of one block of this layer


def runs(block_ids: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """(first block, first slot, length) for each stretch where both go up by one."""
    out: list[tuple[int, int, int]] = []
    for block, slot in zip(block_ids, slots, strict=True):
        if out:
            b0, s0, n = out[-1]
            if block == b0 + n and slot == s0 + n:
                out[-1] = (b0, s0, n + 1)
                continue
        out.append((block, slot, 1))
    return out


def _block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return dim
    raise ValueError(
        f"no dimension of size {num_blocks} (the block count) in a KV tensor of shape {tuple(tensor.shape)}"
    )


class PagedKVCopier:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, staged: bool | None = None):
        if not kv_caches:
            raise ValueError("no KV cache tensors were registered")
        self.num_blocks = num_blocks
        regions = []
        offset = 0
        # Sorted names: every process and rank lays a slot out the same way.
        for name in sorted(kv_caches):
            tensor = kv_caches[name]
            blocks = tensor.movedim(_block_dim(tensor, num_blocks), 0)
            nbytes = math.prod(blocks.shape[1:]) * blocks.element_size()
            regions.append(LayerRegion(name, blocks, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.regions = regions
        self.slot_bytes = offset
        first = regions[0].blocks
        self.device = first.device
        self.dtype = first.dtype
        self.on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        # Staged copies gather a run of blocks (all layers) into one device buffer laid
        # out like the slots, so the host side of the transfer is a single contiguous
        # DMA into page-locked memory. Direct copies suit the CPU backend, where the
        # "device" is host memory already. The staged path runs on CPU too, as its twin.
        self.staged = self.on_cuda if staged is None else staged

    def describe(self) -> tuple[str, str, str]:
        """(layout, dtype, shapes) for object headers: enough to tell what the bytes are."""
        shapes = ";".join(f"{r.name}:{list(r.blocks.shape[1:])}" for r in self.regions)
        return "block-major,layers-sorted-by-name", str(self.dtype).removeprefix("torch."), shapes

    def _slot_view(self, buffer: CpuBuffer, region: LayerRegion) -> torch.Tensor:
        raw = buffer.tensor[:, region.offset : region.offset + region.nbytes]
        return raw.view(region.blocks.dtype).view(buffer.num_slots, *region.blocks.shape[1:])

    def to_slots(self, block_ids: list[int], slots: list[int], buffer: CpuBuffer) -> None:
        """Copy blocks out of the paged KV into CPU slots; returns when the copy is done."""
        self._copy(block_ids, slots, buffer, out_of_kv=True)

    def from_slots(self, slots: list[int], block_ids: list[int], buffer: CpuBuffer) -> None:
        """Copy CPU slots into blocks of the paged KV; returns when the copy is done."""
        self._copy(block_ids, slots, buffer, out_of_kv=False)

    def _copy(self, block_ids: list[int], slots: list[int], buffer: CpuBuffer, out_of_kv: bool) -> None:
        if not block_ids:
            return
        spans = runs(block_ids, slots)
        if self._stream is None:
            self._copy_spans(spans, buffer, out_of_kv, non_blocking=False)
            return
        # The copy stream waits for the forward that wrote (or will read) these blocks.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._copy_spans(spans, buffer, out_of_kv, non_blocking=buffer.pinned)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()

    def _copy_spans(self, spans, buffer: CpuBuffer, out_of_kv: bool, non_blocking: bool) -> None:
        if self.staged:
            self._copy_spans_staged(spans, buffer, out_of_kv, non_blocking)
            return
        for region in self.regions:
            self.copy_region(region, spans, buffer, out_of_kv, non_blocking)

    def copy_region(
        self, region: LayerRegion, spans, buffer: CpuBuffer, out_of_kv: bool, non_blocking: bool = False
    ) -> None:
        """One layer's share of a copy: `spans` as made by `runs`."""
        slots_view = self._slot_view(buffer, region)
        for block, slot, n in spans:
            kv = region.blocks[block : block + n]
            host = slots_view[slot : slot + n]
            if out_of_kv:
                host.copy_(kv, non_blocking=non_blocking)
            else:
                kv.copy_(host, non_blocking=non_blocking)

    def _copy_spans_staged(self, spans, buffer: CpuBuffer, out_of_kv: bool, non_blocking: bool) -> None:
        longest = max(n for _, _, n in spans)
        staging = torch.empty((longest, self.slot_bytes), dtype=torch.uint8, device=self.device)
        for block, slot, n in spans:
            host = buffer.tensor[slot : slot + n]  # n whole slots: contiguous
            stage = staging[:n]
            if out_of_kv:
                for region in self.regions:
                    self._stage_view(stage, region, n).copy_(region.blocks[block : block + n])
                host.copy_(stage, non_blocking=non_blocking)
            else:
                stage.copy_(host, non_blocking=non_blocking)
                for region in self.regions:
                    region.blocks[block : block + n].copy_(self._stage_view(stage, region, n))
            if non_blocking and len(spans) > 1:
                # The next run reuses the staging buffer: wait for this one's transfer.
                torch.cuda.current_stream(self.device).synchronize()

    @staticmethod
    def _stage_view(stage: torch.Tensor, region: LayerRegion, n: int) -> torch.Tensor:
        raw = stage[:, region.offset : region.offset + region.nbytes]
        return raw.view(region.blocks.dtype).view(n, *region.blocks.shape[1:])

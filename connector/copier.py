"""Copies between vLLM's paged KV (one tensor per layer, any layout) and CPU-tier slots.

Each layer is viewed with its block dimension first, `(num_blocks, ...)`; one slot
holds a block's bytes for every layer of this rank, layer after layer. Nothing here
assumes a shape: the block dimension is found by its size.

Three ways to copy, picked per copy:
- one launch (CUDA default): a Triton kernel moves every layer of every block straight
  between the paged KV and the page-locked CPU tier (fused_copy.py);
- staged: one indexed kernel per layer into a bounded device buffer laid out like the
  slots, then one transfer per run of slots (CUDA without Triton or with a layout the
  kernel cannot address);
- direct: one strided copy per layer per run of consecutive blocks and slots (the CPU
  backend, where the "device" is host memory already).
On CUDA the copies run on a dedicated stream ordered after the compute stream, and an
event marks their end; the worker queues them (`queue_to_slots`, `queue_from_slots`)
and acts on the event when it reads done, never holding the host (sync.py)."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from tiercache.tiers.cpu import CpuBuffer

from . import sync
from .fused_copy import FusedBlockCopy

log = logging.getLogger(__name__)

_ALIGN = 64  # keeps every layer's region aligned for any dtype view
# Device memory a staged copy borrows, beyond what vLLM budgeted for its KV cache:
# enough for each batch's host transfer to run near full bandwidth.
STAGING_BYTES = 64 << 20


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


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, its position in `slots`, length) for each stretch of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if out and slot == out[-1][0] + out[-1][2]:
            first, start, n = out[-1]
            out[-1] = (first, start, n + 1)
        else:
            out.append((slot, position, 1))
    return out


def _raw_pages(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], num_blocks: int) -> torch.Tensor:
    """A Mamba layer's state (several tensors, each with the block dimension first,
    lying side by side inside one page per block) as `(num_blocks, page_bytes)` bytes:
    the whole page, padding included, so a slot holds whatever vLLM keeps there."""
    first = min(tensors, key=lambda t: t.data_ptr())
    if any(t.shape[0] != num_blocks for t in tensors):
        raise ValueError(
            f"a Mamba state tensor without {num_blocks} (the block count) as its first dimension: "
            f"{[tuple(t.shape) for t in tensors]}"
        )
    return _pages_of(first, first.stride(0) * first.element_size(), num_blocks)


def _pages_of(first: torch.Tensor, page: int, num_blocks: int) -> torch.Tensor:
    """`(num_blocks, page)` bytes from where `first` starts."""
    storage = first.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=first.device)
    raw.set_(storage, first.data_ptr() - storage.data_ptr(), (num_blocks, page), (page, 1))
    return raw


def _blocks_view(value, num_blocks: int) -> torch.Tensor:
    """One layer's KV with its block dimension first: a tensor as vLLM made it, or a
    Mamba layer's state tensors as raw pages."""
    if isinstance(value, (list, tuple)):
        return _raw_pages(value, num_blocks)
    return value.movedim(_block_dim(value, num_blocks), 0)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


def _block_extent(blocks: torch.Tensor) -> int:
    """Bytes from the start of one block of `blocks` (block dimension first) to the
    end of its last element."""
    if blocks[0].numel() == 0:
        return 0
    dims = zip(blocks.shape[1:], blocks.stride()[1:], strict=True)
    reach = sum((size - 1) * stride for size, stride in dims)
    return (reach + 1) * blocks.element_size()


def _shared_pages(layers: list[tuple[str, torch.Tensor]], page: int, num_blocks: int) -> torch.Tensor:
    """Layers of different groups that view the same pages differently (vLLM's CPU
    build gives Qwen3-Next's linear-attention layer a byte view of just its state, the
    start of a page its full-attention layer fills) as `(num_blocks, page)` bytes: the
    whole page, so a slot holds a block of whichever group owns it, padding included.
    Each view must lie inside the page."""
    for name, blocks in layers:
        if any(stride < 0 for stride in blocks.stride()) or _block_extent(blocks) > page:
            raise ValueError(
                f"layers {name} and {layers[0][0]} share KV memory but not its page size: a block of "
                f"{name} ({list(blocks.shape[1:])}, strides {list(blocks.stride()[1:])}, {blocks.dtype}) "
                f"reaches past the {page}-byte page"
            )
    return _pages_of(layers[0][1], page, num_blocks)


def _block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return dim
    raise ValueError(
        f"no dimension of size {num_blocks} (the block count) in a KV tensor of shape {tuple(tensor.shape)}"
    )


class PagedKVCopier:
    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        staged: bool | None = None,
        staging_bytes: int = STAGING_BYTES,
        fused: bool | None = None,
        stream: sync.CopyStream | None = None,
    ):
        """`stream`: a stand-in for the CUDA copy stream (tests drive the CUDA path's
        ordering with it on CPU tensors); by default one is made on CUDA, none elsewhere."""
        if not kv_caches:
            raise ValueError("no KV cache tensors were registered")
        self.num_blocks = num_blocks
        regions: list[LayerRegion] = []
        offset = 0
        # A hybrid model's KV cache groups overlay one another (vLLM's hybrid KV cache
        # manager): a layer of each group views the same memory, and a block number
        # belongs to one group at a time. One region per distinct memory, then: a slot
        # holds one block of whichever group owns it: where the layers sharing memory
        # view a block differently, the region is the whole page. `region_of` maps
        # every layer name to its region's name (the first, in sorted order, of those
        # sharing it).
        self.region_of: dict[str, str] = {}
        # Sorted names: every process and rank lays a slot out the same way.
        sharing: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
        for name in sorted(kv_caches):
            blocks = _blocks_view(kv_caches[name], num_blocks)
            memory = (blocks.data_ptr(), blocks.stride(0) * blocks.element_size())
            sharing.setdefault(memory, []).append((name, blocks))
        for (_, page), layers in sharing.items():
            name, blocks = layers[0]
            for other, _ in layers:
                self.region_of[other] = name
            if len(layers) > 1 and any(not _same_view(blocks, view) for _, view in layers[1:]):
                blocks = _shared_pages(layers, page, num_blocks)
            nbytes = math.prod(blocks.shape[1:]) * blocks.element_size()
            regions.append(LayerRegion(name, blocks, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.regions = regions
        self.slot_bytes = offset
        first = regions[0].blocks
        self.device = first.device
        self.dtype = first.dtype
        self.on_cuda = self.device.type == "cuda"
        self.stream = stream if stream is not None else sync.CopyStream(self.device) if self.on_cuda else None
        self.layer_numbers = {region.name: i for i, region in enumerate(regions)}
        # Both default to the CUDA path; tests force them on CPU tensors as its twin.
        self.staged = self.on_cuda if staged is None else staged
        self.staging_bytes = staging_bytes
        use_fused = self.on_cuda if fused is None else fused
        self.fused = FusedBlockCopy.for_regions(regions, self.slot_bytes, self.device) if use_fused else None

    @property
    def aliased(self) -> bool:
        """Whether layers share regions (a hybrid model's groups overlay each other)."""
        return len(self.region_of) > len(self.regions)

    def check_groups(self, group_layers: list[list[str]]) -> None:
        """With several KV cache groups, a slot (one block of one group) is sound only
        if each group's layers cover every region, one layer to a region: then block b
        of every region is group g's block b whenever g owns b. vLLM's hybrid manager
        lays groups out so (same page size, same layer count); anything else is refused."""
        if len(group_layers) < 2:
            return
        names = {region.name for region in self.regions}
        for layers in group_layers:
            covered = [self.region_of.get(layer) for layer in layers]
            if len(set(covered)) != len(covered) or set(covered) != names:
                raise ValueError(
                    f"the KV cache group of layers {layers} does not overlay the other groups' memory "
                    "layer for layer"
                )

    def describe(self) -> tuple[str, str, str]:
        """(layout, dtype, shapes) for object headers: enough to tell what the bytes are."""
        shapes = ";".join(f"{r.name}:{list(r.blocks.shape[1:])}" for r in self.regions)
        return "block-major,layers-sorted-by-name", str(self.dtype).removeprefix("torch."), shapes

    def _slot_view(self, buffer: CpuBuffer, region: LayerRegion) -> torch.Tensor:
        raw = buffer.tensor[:, region.offset : region.offset + region.nbytes]
        return raw.view(region.blocks.dtype).view(buffer.num_slots, *region.blocks.shape[1:])

    def to_slots(self, block_ids: list[int], slots: list[int], buffer: CpuBuffer) -> None:
        """Copy blocks out of the paged KV into CPU slots; returns when the copy is done
        (tools and tests: the worker queues its copies)."""
        self._wait(self.queue_to_slots(block_ids, slots, buffer))

    def from_slots(self, slots: list[int], block_ids: list[int], buffer: CpuBuffer) -> None:
        """Copy CPU slots into blocks of the paged KV; returns when the copy is done."""
        self._wait(self.queue_from_slots(slots, block_ids, buffer))

    def queue_to_slots(self, block_ids: list[int], slots: list[int], buffer: CpuBuffer) -> sync.Event | None:
        """Queue a copy of blocks out of the paged KV into CPU slots, after everything
        the forward's stream has queued so far. The slots hold the blocks once the
        returned event reads done (None: done already, as on the CPU backend)."""
        return self._copy(block_ids, slots, buffer, out_of_kv=True)

    def queue_from_slots(
        self, slots: list[int], block_ids: list[int], buffer: CpuBuffer
    ) -> sync.Event | None:
        """Queue a copy of CPU slots into blocks of the paged KV; whatever the forward's
        stream queues from now on runs after it. The slots may be reused once the
        returned event reads done (None: done already)."""
        done = self._copy(block_ids, slots, buffer, out_of_kv=False)
        if done is not None and self.stream is not None:
            self.stream.forward_waits(done)
        return done

    @staticmethod
    def _wait(done: sync.Event | None) -> None:
        if done is not None:
            sync.host_wait(done)

    def one_launch(self, buffer: CpuBuffer) -> bool:
        """Whether copies with this buffer go through the one-launch kernel: the GPU
        must be able to address the slots, which page-locked memory allows."""
        return self.fused is not None and (buffer.pinned or not self.on_cuda)

    def tables(self, block_ids: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, slot numbers) on the device, in one upload, on the current
        stream. On CUDA it goes through page-locked memory: an upload from pageable
        memory would hold the host until the stream is idle, and these are made while a
        forward runs."""
        # Rows of even length keep the second one 16-byte aligned like the first:
        # Triton compiles a kernel per pointer alignment.
        width = len(block_ids) + len(block_ids) % 2
        both = torch.zeros((2, width), dtype=torch.long)
        both[0, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.long)
        both[1, : len(slots)] = torch.tensor(slots, dtype=torch.long)
        if self.on_cuda:
            both = both.pin_memory().to(self.device, non_blocking=True)
        return both[0, : len(block_ids)], both[1, : len(slots)]

    @contextlib.contextmanager
    def queued_after_forward(self):
        """Work inside goes on the copy stream, ordered after everything the forward's
        stream has queued so far; the host does not wait for it. On the CPU backend
        there is no stream: the work is done when it returns."""
        if self.stream is None:
            yield
            return
        with self.stream.after_forward():
            yield

    def mark(self) -> sync.Event | None:
        """An event at this point of the copy stream (None on the CPU backend, where
        queued work is already done)."""
        if self.stream is None:
            return None
        return self.stream.mark()

    def _copy(
        self, block_ids: list[int], slots: list[int], buffer: CpuBuffer, out_of_kv: bool
    ) -> sync.Event | None:
        if not block_ids:
            return None
        with self.queued_after_forward():
            self._copy_blocks(block_ids, slots, buffer, out_of_kv)
            return self.mark()

    def _copy_blocks(
        self, block_ids: list[int], slots: list[int], buffer: CpuBuffer, out_of_kv: bool
    ) -> None:
        non_blocking = buffer.pinned and self.on_cuda
        if self.one_launch(buffer):
            assert self.fused is not None  # one_launch says so
            index, rows = self.tables(block_ids, slots)
            if out_of_kv:
                self.fused.gather(index, rows, buffer.tensor)
            else:
                self.fused.scatter(buffer.tensor, rows, index)
        elif self.staged:
            index, _ = self.tables(block_ids, slots)
            self._copy_staged(index, slots, buffer, out_of_kv, non_blocking)
        else:
            spans = runs(block_ids, slots)
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

    def _copy_staged(
        self, index: torch.Tensor, slots: list[int], buffer: CpuBuffer, out_of_kv: bool, non_blocking: bool
    ) -> None:
        """Blocks gathered (or scattered) on the device into a buffer laid out like the
        slots, which crosses to the host in one transfer per run of consecutive slots.
        Copying run by run instead costs one transfer per layer per run: thousands of
        small ones for blocks scattered across the paged KV."""
        per_batch = max(1, self.staging_bytes // self.slot_bytes)
        staging = torch.empty(
            (min(per_batch, len(slots)), self.slot_bytes), dtype=torch.uint8, device=self.device
        )
        # Everything below is in one stream's order, so a batch cannot overwrite the
        # staging buffer before the last batch's transfers have read it.
        for start in range(0, len(slots), per_batch):
            batch = index[start : start + per_batch]
            n = len(batch)
            stage = staging[:n]
            host_runs = slot_runs(slots[start : start + n])
            if out_of_kv:
                for region in self.regions:
                    torch.index_select(region.blocks, 0, batch, out=self._stage_view(stage, region, n))
                for slot, position, count in host_runs:
                    buffer.tensor[slot : slot + count].copy_(
                        stage[position : position + count], non_blocking=non_blocking
                    )
            else:
                for slot, position, count in host_runs:
                    stage[position : position + count].copy_(
                        buffer.tensor[slot : slot + count], non_blocking=non_blocking
                    )
                for region in self.regions:
                    region.blocks.index_copy_(0, batch, self._stage_view(stage, region, n))

    def warm_up(self, buffer: CpuBuffer) -> None:
        """Build the one-launch kernels now, at start-up, not in the first request (a
        second or two on first use), and check on this machine that they reach the
        CPU tier: block 0 goes to slot 0, is compared, and is written back. Anything
        amiss leaves the other copy paths in their place."""
        if not self.one_launch(buffer):
            return
        assert self.fused is not None  # one_launch says so
        try:
            index, rows = self.tables([0], [0])
            self.fused.gather(index, rows, buffer.tensor)
            self._drain()
            for region in self.regions:
                want = region.blocks[0].cpu().reshape(-1).view(torch.uint8)
                if not torch.equal(buffer.tensor[0, region.offset : region.offset + region.nbytes], want):
                    raise RuntimeError(f"layer {region.name} did not reach the slot intact")
            self.fused.scatter(buffer.tensor, rows, index)
            self._drain()
        except Exception as error:  # a Triton or driver that cannot build or map it
            log.warning(
                "tiercache: the one-launch block copy is unavailable (%s); copying layer by layer", error
            )
            self.fused = None

    def _drain(self) -> None:
        """Wait for every kernel queued so far (warm-up runs before any forward)."""
        if self.on_cuda:  # the warm-up's copies ran on the current stream
            sync.host_wait(torch.cuda.current_stream(self.device))

    @staticmethod
    def _stage_view(stage: torch.Tensor, region: LayerRegion, n: int) -> torch.Tensor:
        raw = stage[:, region.offset : region.offset + region.nbytes]
        return raw.view(region.blocks.dtype).view(n, *region.blocks.shape[1:])

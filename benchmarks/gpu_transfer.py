"""Copies of paged KV blocks between device memory and the CPU tier, as the connector's
worker does them (tiercache.connector.copier.PagedKVCopier into a
tiercache.tiers.cpu.CpuBuffer, page-locked on CUDA), against the raw copy bandwidth of
the same bytes as one contiguous tensor.copy_ (pinned cudaMemcpy on CUDA), measured in
the same run. Needs torch only (no vLLM); prints JSON.

    python benchmarks/gpu_transfer.py                  # CUDA if there is one, else CPU
    python benchmarks/gpu_transfer.py --device cpu     # the CPU twin (vLLM's CPU backend)

Layouts (one tensor per layer, as vLLM's attention backends allocate them):
  flash         (2, num_blocks, block_size, kv_heads, head_size)   FlashAttention
  blocks_first  (num_blocks, 2, block_size, kv_heads, head_size)   FlashInfer and others
Block sets: `scattered` (random block ids, as vLLM's allocator hands them out after a
while) and `contiguous` (one run).

For reference it also times a plain-torch gather: index_select of the blocks into one
contiguous device staging tensor, then one copy to the host (and the reverse for
scatter): what a batched gather kernel would reach, to show the headroom.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiercache.connector.copier import PagedKVCopier, runs  # noqa: E402
from tiercache.tiers.cpu import CpuBuffer  # noqa: E402

LAYOUTS = ("flash", "blocks_first")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def make_caches(args, layout: str, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    page = (args.block_size, args.kv_heads, args.head_size)
    shape = (2, args.num_blocks, *page) if layout == "flash" else (args.num_blocks, 2, *page)
    return {
        f"model.layers.{i}.self_attn": torch.randn(shape, dtype=dtype, device=device)
        for i in range(args.layers)
    }


def reference_times(copier, ids, flat_host, device, pinned: bool, args) -> tuple[float, float]:
    """One index_select per layer into a contiguous device staging tensor, then one
    copy (and the reverse): what a batched gather kernel reaches."""
    index = torch.tensor(ids, device=device)
    total = sum(len(ids) * region.nbytes for region in copier.regions)
    stage = torch.empty(total, dtype=torch.uint8, device=device)
    views = []
    offset = 0
    for region in copier.regions:
        count = len(ids) * region.nbytes
        view = stage[offset : offset + count].view(region.blocks.dtype)
        views.append(view.view(len(ids), *region.blocks.shape[1:]))
        offset += count

    def ref_gather():
        for region, view in zip(copier.regions, views, strict=True):
            torch.index_select(region.blocks, 0, index, out=view)
        flat_host[:total].copy_(stage, non_blocking=pinned)

    def ref_scatter():
        stage.copy_(flat_host[:total], non_blocking=pinned)
        for region, view in zip(copier.regions, views, strict=True):
            region.blocks.index_copy_(0, index, view)

    return timeit(ref_gather, device, args.repeats), timeit(ref_scatter, device, args.repeats)


def bench_layout(args, layout: str, device: torch.device, dtype: torch.dtype) -> dict:
    caches = make_caches(args, layout, device, dtype)
    copier = PagedKVCopier(caches, args.num_blocks)
    pinned = device.type == "cuda"
    buffer = CpuBuffer(args.blocks, copier.slot_bytes, pin_memory=pinned)
    slots = list(range(args.blocks))
    nbytes = args.blocks * copier.slot_bytes
    gen = torch.Generator().manual_seed(0)

    # Raw: the same bytes as one contiguous tensor, to and from the same host buffer.
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = buffer.tensor.view(-1)

    def raw_d2h():
        flat_host.copy_(flat_dev, non_blocking=pinned)

    def raw_h2d():
        flat_dev.copy_(flat_host, non_blocking=pinned)

    raw = {
        "d2h": nbytes / timeit(raw_d2h, device, args.repeats),
        "h2d": nbytes / timeit(raw_h2d, device, args.repeats),
    }
    out: dict = {"slot_bytes": copier.slot_bytes, "bytes_per_transfer": nbytes, "raw_gbps": {}, "cases": {}}
    out["raw_gbps"] = {k: v / 1e9 for k, v in raw.items()}
    for kind in ("scattered", "contiguous"):
        if kind == "scattered":
            ids = torch.randperm(args.num_blocks, generator=gen)[: args.blocks].tolist()
        else:
            ids = list(range(args.blocks))
        gather = timeit(lambda ids=ids: copier.to_slots(ids, slots, buffer), device, args.repeats)
        scatter = timeit(lambda ids=ids: copier.from_slots(slots, ids, buffer), device, args.repeats)

        # Check: a round trip through the slots puts back the same bytes.
        saved = {n: t.clone() for n, t in caches.items()}
        copier.to_slots(ids, slots, buffer)
        for t in caches.values():
            t.zero_()
        copier.from_slots(slots, ids, buffer)
        sync(device)
        bdim = 1 if layout == "flash" else 0
        index = torch.tensor(ids, device=device)
        ok = all(
            torch.equal(caches[n].index_select(bdim, index), saved[n].index_select(bdim, index))
            for n in caches
        )
        for n, t in caches.items():
            t.copy_(saved[n])
        del saved

        rg, rs = reference_times(copier, ids, flat_host, device, pinned, args)
        out["cases"][kind] = {
            "correct_round_trip": ok,
            "gather_gbps": nbytes / gather / 1e9,
            "scatter_gbps": nbytes / scatter / 1e9,
            "gather_vs_raw": nbytes / gather / raw["d2h"],
            "scatter_vs_raw": nbytes / scatter / raw["h2d"],
            "runs_of_blocks": len(runs(ids, slots)),
            "ref_index_select_gather_vs_raw": nbytes / rg / raw["d2h"],
            "ref_index_copy_scatter_vs_raw": nbytes / rs / raw["h2d"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="blocks in the paged KV (default 4099 on CUDA, 515 on CPU)",
    )
    parser.add_argument("--blocks", type=int, default=128, help="blocks per transfer (2048 tokens at 16)")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    device = torch.device(args.device)
    if args.num_blocks is None:
        args.num_blocks = 4099 if device.type == "cuda" else 515  # odd: never equal to another dim
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "args": vars(args),
        "pinned_host_buffer": device.type == "cuda",
        "layouts": {layout: bench_layout(args, layout, device, dtype) for layout in LAYOUTS},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

"""Copies of paged KV blocks between device memory and the CPU tier, as the connector's
worker does them (tiercache.connector.copier.PagedKVCopier into a
tiercache.tiers.cpu.CpuBuffer, page-locked on CUDA), against the raw copy bandwidth of
the same bytes as one contiguous tensor.copy_ (pinned cudaMemcpy on CUDA), measured in
the same run. Needs torch and prometheus_client only (no vLLM, no install of
tiercache); prints JSON, then a table.

    python benchmarks/gpu_transfer.py                  # CUDA if there is one, else CPU
    python benchmarks/gpu_transfer.py --device cpu     # the CPU twin (vLLM's CPU backend)

Layouts (one tensor per layer, as vLLM's attention backends allocate them):
  flash         (2, num_blocks, block_size, kv_heads, head_size)   FlashAttention
  blocks_first  (num_blocks, 2, block_size, kv_heads, head_size)   FlashInfer and others
Block sets: `scattered` (random block ids, as vLLM's allocator hands them out after a
while) and `contiguous` (one run).

Three copier paths, each timed: `fused` (the CUDA default: one Triton kernel moves
every layer's blocks straight between the paged KV and the page-locked CPU tier;
skipped where Triton is missing), `per_layer` (the fallback: one indexed gather or
scatter per layer into a bounded device staging buffer, then one host transfer per run
of slots) and `per_run` (one copy per layer per run of consecutive blocks, straight to
the host: the CPU backend's path). Every
copy is checked: slots are poisoned first and each block of each layer is compared
with the paged KV.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("flash", "blocks_first")


def import_copier():
    """tiercache's copier and CPU buffer, installed or straight from this checkout.
    From the checkout the connector package is mapped without running its __init__,
    which imports vLLM: this script runs on GPU machines without vLLM."""
    try:
        installed = importlib.util.find_spec("tiercache.tiers") is not None
    except ModuleNotFoundError:  # no tiercache at all
        installed = False
    if not installed:
        sys.path.insert(0, str(ROOT))
        # The tiers package's own __init__ runs (it names the tiers the CPU tier
        # imports); the connector's is skipped.
        spec = importlib.util.spec_from_file_location(
            "tiercache.tiers",
            ROOT / "tiers" / "__init__.py",
            submodule_search_locations=[str(ROOT / "tiers")],
        )
        assert spec is not None and spec.loader is not None
        tiers = importlib.util.module_from_spec(spec)
        sys.modules["tiercache.tiers"] = tiers
        spec.loader.exec_module(tiers)
        package = types.ModuleType("tiercache.connector")
        package.__path__ = [str(ROOT / "connector")]
        sys.modules["tiercache.connector"] = package
    else:
        try:
            importlib.import_module("tiercache.connector")
        except ImportError:  # installed without vLLM
            package = types.ModuleType("tiercache.connector")
            package.__path__ = [str(ROOT / "connector")]
            sys.modules["tiercache.connector"] = package
    copier = importlib.import_module("tiercache.connector.copier")
    cpu = importlib.import_module("tiercache.tiers.cpu")
    return copier, cpu.CpuBuffer


copier_module, CpuBuffer = import_copier()
PagedKVCopier = copier_module.PagedKVCopier


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


def slots_hold(copier, buffer, ids, slots) -> bool:
    """Every layer of every block is in its slot, where the slot layout puts it."""
    index = torch.tensor(ids, device=copier.device)
    for region in copier.regions:
        want = region.blocks.index_select(0, index).cpu()
        host = buffer.tensor[slots, region.offset : region.offset + region.nbytes]
        got = host.view(region.blocks.dtype).view(len(ids), *region.blocks.shape[1:])
        if not torch.equal(got, want):
            return False
    return True


def check(copier, buffer, caches, ids, slots) -> dict[str, bool]:
    """Gather into poisoned slots and compare; then wipe those blocks in the paged KV,
    scatter them back, and compare with what was there."""
    for slot in slots:
        buffer.tensor[slot].fill_(0xA5)
    copier.to_slots(ids, slots, buffer)
    gathered = slots_hold(copier, buffer, ids, slots)
    index = torch.tensor(ids, device=copier.device)
    saved = [region.blocks.index_select(0, index) for region in copier.regions]
    for region in copier.regions:
        region.blocks.index_fill_(0, index, 0)
    copier.from_slots(slots, ids, buffer)
    sync(copier.device)
    scattered = all(
        torch.equal(region.blocks.index_select(0, index), before)
        for region, before in zip(copier.regions, saved, strict=True)
    )
    return {"gather_correct": gathered, "scatter_correct": scattered}


def bench_layout(args, layout: str, device: torch.device, dtype: torch.dtype) -> dict:
    caches = make_caches(args, layout, device, dtype)
    pinned = device.type == "cuda"
    copiers = {
        "fused": PagedKVCopier(caches, args.num_blocks, staged=True, fused=True),
        "per_layer": PagedKVCopier(caches, args.num_blocks, staged=True, fused=False),
        "per_run": PagedKVCopier(caches, args.num_blocks, staged=False, fused=False),
    }
    slot_bytes = copiers["per_run"].slot_bytes
    buffer = CpuBuffer(args.blocks, slot_bytes, pin_memory=pinned)
    began = time.perf_counter()
    copiers["fused"].warm_up(buffer)  # builds and checks the kernels: once per engine start
    warm_up_s = time.perf_counter() - began
    if copiers["fused"].fused is None:
        del copiers["fused"]  # no Triton here, or a layout it cannot address
    nbytes = args.blocks * slot_bytes
    gen = torch.Generator().manual_seed(0)

    # Raw: the same bytes as one contiguous tensor, to and from the same host buffer.
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = buffer.tensor.view(-1)
    raw = {
        "d2h": nbytes / timeit(lambda: flat_host.copy_(flat_dev, non_blocking=pinned), device, args.repeats),
        "h2d": nbytes / timeit(lambda: flat_dev.copy_(flat_host, non_blocking=pinned), device, args.repeats),
    }
    out: dict = {
        "slot_bytes": slot_bytes,
        "fused_warm_up_s": warm_up_s if "fused" in copiers else None,
        "bytes_per_transfer": nbytes,
        "raw_gbps": {k: v / 1e9 for k, v in raw.items()},
        "cases": {},
    }
    # Slots in the CPU tier are handed out in any order too: scatter them, in runs of 4.
    slot_order = torch.randperm(args.blocks // 4, generator=gen).tolist()
    scattered_slots = [4 * run + i for run in slot_order for i in range(4)]
    scattered_slots += list(range(len(scattered_slots), args.blocks))
    for kind in ("scattered", "contiguous"):
        if kind == "scattered":
            ids = torch.randperm(args.num_blocks, generator=gen)[: args.blocks].tolist()
            slots = scattered_slots
        else:
            ids, slots = list(range(args.blocks)), list(range(args.blocks))
        case: dict = {
            "runs_of_blocks": len(copier_module.runs(ids, slots)),
            "runs_of_slots": len(copier_module.slot_runs(slots)),
        }
        for path, copier in copiers.items():
            gather = timeit(lambda c=copier, i=ids, s=slots: c.to_slots(i, s, buffer), device, args.repeats)
            scatter = timeit(
                lambda c=copier, i=ids, s=slots: c.from_slots(s, i, buffer), device, args.repeats
            )
            case[path] = {
                **check(copier, buffer, caches, ids, slots),
                "gather_ms": gather * 1e3,
                "scatter_ms": scatter * 1e3,
                "gather_vs_raw": nbytes / gather / raw["d2h"],
                "scatter_vs_raw": nbytes / scatter / raw["h2d"],
            }
        out["cases"][kind] = case
    return out


def table(result: dict) -> str:
    lines = [
        f"{result['device']}, {result['dtype']}, {result['args']['blocks']} blocks a transfer",
        "layout        blocks      path      gather/raw  scatter/raw  gather ms  scatter ms  correct",
    ]
    for layout, data in result["layouts"].items():
        for kind, case in data["cases"].items():
            for path in ("fused", "per_layer", "per_run"):
                if path not in case:
                    continue
                c = case[path]
                ok = c["gather_correct"] and c["scatter_correct"]
                lines.append(
                    f"{layout:13} {kind:11} {path:9} {c['gather_vs_raw']:10.2f} {c['scatter_vs_raw']:12.2f}"
                    f" {c['gather_ms']:10.2f} {c['scatter_ms']:11.2f}  {ok}"
                )
        raw = data["raw_gbps"]
        lines.append(f"{layout:13} raw d2h {raw['d2h']:.1f} GB/s, h2d {raw['h2d']:.1f} GB/s")
        if data["fused_warm_up_s"] is not None:
            lines.append(f"{layout:13} fused kernels built in {data['fused_warm_up_s']:.2f} s (start-up)")
    return "\n".join(lines)


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
    print(table(result))
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

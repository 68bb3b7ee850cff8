"""A CPU-tier hit loaded into the paged KV while a forward runs, on CUDA, and a prompt
stored out of it while the forward writes it. Loads: the time from the start of the
load to the end of the forward, three ways, measured in the same run:

  forward only    the forward with its KV already in place (the floor)
  copy, then      the whole hit copied (PagedKVCopier.from_slots), then the forward
  layer by layer  StreamLayerwiseLoad: one kernel per layer on the copy stream, the
                  forward's stream waiting for each layer's event before using it

The forward is a stand-in with vLLM's shape of work: per layer, it waits for the
layer, then reads every loaded block of that layer (a checksum) and runs matrix
products sized by --layer-ms. Each run poisons the loaded blocks first, and the
checksums the forward saw are compared with those of the right data: a layer read
before it arrived shows up as a wrong checksum, not as a fast time.

Stores: the forward writes the same blocks layer by layer (as attention writes its KV)
and they go to the CPU tier, copied whole after the forward or layer by layer as it
goes (StreamLayerwiseSave), against the forward alone; every slot is poisoned first
and checked after.

Needs torch, Triton and a CUDA GPU (no vLLM, no install of tiercache):

    python benchmarks/gpu_layerwise.py
    python benchmarks/gpu_layerwise.py --layer-ms 0.05   # a forward shorter than the copy
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_transfer import CpuBuffer, PagedKVCopier  # noqa: E402  (maps tiercache from the checkout)

layerwise_gpu = importlib.import_module("tiercache.connector.layerwise_gpu")
StreamLayerwiseLoad = layerwise_gpu.StreamLayerwiseLoad
StreamLayerwiseSave = layerwise_gpu.StreamLayerwiseSave
slots_hold = sys.modules["gpu_transfer"].slots_hold


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=4099)
    parser.add_argument("--blocks", type=int, default=128, help="blocks in the hit (2048 tokens at 16)")
    parser.add_argument(
        "--layer-ms", type=float, default=0.25, help="compute per layer of the stand-in forward"
    )
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument(
        "--programs",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[4, 8, 16, 32, 0],
        help="grid sizes for the per-layer copy kernels (0: one program per chunk)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device("cuda")
    dtype = torch.bfloat16
    shape = (2, args.num_blocks, args.block_size, args.kv_heads, args.head_size)
    caches = {
        f"model.layers.{i}.self_attn": torch.randn(shape, dtype=dtype, device=device)
        for i in range(args.layers)
    }
    order = list(caches)  # the forward's order: layer 0 first
    copier = PagedKVCopier(caches, args.num_blocks)
    buffer = CpuBuffer(args.blocks, copier.slot_bytes, pin_memory=True)
    copier.warm_up(buffer)
    assert copier.fused is not None, "the one-launch copy did not pass its start-up check"

    gen = torch.Generator().manual_seed(0)
    targets = torch.randperm(args.num_blocks, generator=gen)[: args.blocks].tolist()
    slots = list(range(args.blocks))
    copier.to_slots(targets, slots, buffer)  # the hit's data, as a CPU-tier hit holds it
    index = torch.tensor(targets, device=device)
    want = torch.stack([caches[n].index_select(1, index).float().sum() for n in order])

    # Matrix products sized so one layer's compute takes about --layer-ms.
    a = torch.randn(2048, 2048, dtype=dtype, device=device)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    per_product = (time.perf_counter() - began) / 50 * 1e3
    products = max(1, round(args.layer_ms / per_product))

    def poison():
        for cache in caches.values():
            cache.index_fill_(1, index, 0)
        torch.cuda.synchronize()

    def forward(load=None):
        seen = []
        for name in order:
            if load is not None:
                load.wait(name)
            seen.append(caches[name].index_select(1, index).float().sum())
            for _ in range(products):
                a @ a
        return torch.stack(seen)

    def run(kind: str):
        if kind != "forward only":
            poison()
        began = time.perf_counter()
        if kind == "copy, then":
            copier.from_slots(slots, targets, buffer)
            seen = forward()
        elif kind.startswith("layer by layer"):
            load = StreamLayerwiseLoad(copier, buffer, slots, targets, order, programs[kind] or None)
            seen = forward(load)
            load.finish()
        else:
            seen = forward()
        torch.cuda.synchronize()
        return (time.perf_counter() - began) * 1e3, bool(torch.equal(seen, want))

    programs = {f"layer by layer, {p or 'all'} programs": p for p in args.programs}
    kinds = ("forward only", "copy, then", *programs)
    copier.from_slots(slots, targets, buffer)  # "forward only" finds the KV in place
    results = {}
    for kind in kinds:
        if kind != "forward only":
            run(kind)  # warm-up
        times, correct = [], True
        for _ in range(args.repeats):
            if kind == "forward only":
                copier.from_slots(slots, targets, buffer)
            ms, ok = run(kind)
            times.append(ms)
            correct &= ok
        results[kind] = {"ms": statistics.median(times), "min_ms": min(times), "correct": correct}
    copy_ms = statistics.median([run_copy_only(copier, slots, targets, buffer) for _ in range(args.repeats)])
    # The per-layer kernels alone, no forward: the PCIe rate each grid size reaches.
    layers_alone = {}
    for kind, count in programs.items():
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            began = time.perf_counter()
            StreamLayerwiseLoad(copier, buffer, slots, targets, order, count or None).finish()
            times.append((time.perf_counter() - began) * 1e3)
        layers_alone[kind] = statistics.median(times)
    floor = results["forward only"]["ms"]
    out = {
        "device": torch.cuda.get_device_name(device),
        "args": vars(args),
        "hit_bytes": args.blocks * copier.slot_bytes,
        "products_per_layer": products,
        "copy_only_ms": copy_ms,
        "layer_copies_alone_ms": layers_alone,
        "results": results,
        "ratios_to_forward_only": {k: v["ms"] / floor for k, v in results.items()},
        "stores": bench_stores(args, copier, caches, order, buffer, targets, slots, products, a),
    }
    print(json.dumps(out, indent=1))
    print(
        f"{out['device']}: {out['hit_bytes'] >> 20} MiB hit, {args.layers} layers, "
        f"whole copy alone {copy_ms:.2f} ms"
    )
    for kind, r in results.items():
        alone = f"  (copies alone {layers_alone[kind]:.2f} ms)" if kind in layers_alone else ""
        print(
            f"{kind:32} {r['ms']:7.2f} ms  {r['ms'] / floor:5.2f}x forward only  "
            f"correct={r['correct']}{alone}"
        )
    stores = out["stores"]
    store_floor = stores["forward only"]["ms"]
    print("stores: the same blocks written by the forward, then copied to the CPU tier")
    for kind, r in stores.items():
        print(
            f"{kind:32} {r['ms']:7.2f} ms  {r['ms'] / store_floor:5.2f}x forward only  correct={r['correct']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def bench_stores(args, copier, caches, order, buffer, targets, slots, products, a) -> dict:
    """A prompt's blocks written by the forward layer by layer (as attention writes its
    KV), then stored: copied whole after the forward, or layer by layer as it goes.
    Slots are poisoned before each run and compared with the blocks afterwards."""
    device = copier.device
    index = torch.tensor(targets, device=device)
    datasets = [{n: torch.randn_like(caches[n].index_select(1, index)) for n in order} for _ in range(2)]

    def forward(data, saving=None):
        for name in order:
            caches[name].index_copy_(1, index, data[name])  # the attention writes its KV
            if saving is not None:
                saving.save(name)
            for _ in range(products):
                a @ a

    def run(kind: str, data) -> tuple[float, bool]:
        buffer.tensor.fill_(0xA5)
        torch.cuda.synchronize()
        began = time.perf_counter()
        if kind.startswith("layer by layer"):
            saving = StreamLayerwiseSave(copier, buffer, targets, slots, programs[kind] or None)
            forward(data, saving)
            saving.finish()
        else:
            forward(data)
            if kind == "forward, then whole copy":
                copier.to_slots(targets, slots, buffer)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - began) * 1e3
        return elapsed, kind == "forward only" or slots_hold(copier, buffer, targets, slots)

    programs = {f"layer by layer, {p or 'all'} programs": p for p in args.programs}
    results = {}
    for kind in ("forward only", "forward, then whole copy", *programs):
        run(kind, datasets[0])  # warm-up
        times, correct = [], True
        for repeat in range(args.repeats):
            ms, ok = run(kind, datasets[repeat % 2])
            times.append(ms)
            correct &= ok
        results[kind] = {"ms": statistics.median(times), "min_ms": min(times), "correct": correct}
    return results


def run_copy_only(copier, slots, targets, buffer) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    copier.from_slots(slots, targets, buffer)
    return (time.perf_counter() - began) * 1e3


if __name__ == "__main__":
    main()

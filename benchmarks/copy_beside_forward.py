"""What a CPU-tier hit's copy costs the forward that runs beside it, by how the bytes
are moved. On vLLM's CPU backend the forward of a hit is bound by the memory bus (it
streams every weight for a few query tokens), and the hit's copy from the CPU tier into
the paged KV shares that bus from the other core (memory_bus.py). This asks whether
the copy's primitive matters:

- `torch`: what the connector does (`PagedKVCopier.copy_region`): one `copy_` per
  layer of float32 views, from block-major slots into layer-major KV; `torch-u8`, the
  same on byte views;
- `memcpy`: glibc's memcpy per piece (on this glibc it uses non-temporal stores only
  above 240 MiB, so these are ordinary stores that first read every destination line);
- `nt`: non-temporal stores, which skip that read and leave the caches alone (a few
  lines of C, built with the machine's C compiler into a temporary folder; the row is
  left out where there is no compiler).

Each repeat times the forward-like loop alone, then again with one hit-sized copy
started on the other core at the same moment; the difference is what the copy cost
the forward. The primitives take turns within each repeat, so drift reaches them
alike. The pieces and their order are a real hit's: 128 KiB per layer, K and V apart,
8 layers, 32-token blocks of the benchmark model.

    python benchmarks/copy_beside_forward.py [--blocks 62] [--repeats 60]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from harness import machine, median, save
from memory_bus import pinned_forward_like

PIECE = 128 << 10  # one layer's K (or V) of one 32-token block: 32 x 8 heads x 128 x 4 bytes
PIECES_PER_BLOCK = 16  # 8 layers, K and V

NT_SOURCE = r"""
#include <emmintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
static void stream_copy(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head); d += head; s += head; n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
}
void copy_pieces(char **dsts, char **srcs, size_t count, size_t len, int streaming) {
    for (size_t k = 0; k < count; k++) {
        if (streaming) stream_copy(dsts[k], srcs[k], len); else memcpy(dsts[k], srcs[k], len);
    }
    _mm_sfence();
}
"""


def build_library(folder: Path) -> ctypes.CDLL | None:
    """The C rows' library, or None without a C compiler or off x86-64 (SSE2 intrinsics)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    source = folder / "copy_pieces.c"
    source.write_text(NT_SOURCE)
    library = folder / "copy_pieces.so"
    built = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", library, source], capture_output=True)
    if built.returncode != 0:
        print(f"the C rows are left out: {compiler} failed:\n{built.stderr.decode(errors='replace')}")
        return None
    return ctypes.CDLL(str(library))


class Hit:
    """The source slots (block-major) and destination KV (layer-major) of one hit."""

    def __init__(self, blocks: int):
        self.slots = torch.randint(0, 256, (blocks, PIECES_PER_BLOCK, PIECE), dtype=torch.uint8)
        self.kv = torch.zeros(PIECES_PER_BLOCK, blocks, PIECE, dtype=torch.uint8)
        pointers = ctypes.c_void_p * (blocks * PIECES_PER_BLOCK)
        self.srcs = pointers(
            *[self.slots[b, p].data_ptr() for p in range(PIECES_PER_BLOCK) for b in range(blocks)]
        )
        self.dsts = pointers(
            *[self.kv[p, b].data_ptr() for p in range(PIECES_PER_BLOCK) for b in range(blocks)]
        )

    def check(self, copy, primitive: str) -> None:
        """Run `copy` once into a cleared KV and compare it with the slots."""
        self.kv.zero_()
        copy()
        if not torch.equal(self.kv, self.slots.transpose(0, 1)):
            raise SystemExit(f"the {primitive} copy did not move the bytes intact")

    @property
    def nbytes(self) -> int:
        return self.slots.numel()

    def copier(self, primitive: str, library: ctypes.CDLL | None):
        if primitive.startswith("torch"):
            dtype = torch.uint8 if primitive == "torch-u8" else torch.float32
            kv, slots = self.kv.view(dtype), self.slots.view(dtype)

            def copy() -> None:
                for piece in range(PIECES_PER_BLOCK):
                    kv[piece].copy_(slots[:, piece])

            return copy
        assert library is not None
        streaming = int(primitive == "nt")
        return lambda: library.copy_pieces(
            self.dsts, self.srcs, ctypes.c_size_t(len(self.srcs)), ctypes.c_size_t(PIECE), streaming
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=62, help="blocks in the hit (62: a 2000-token prompt)")
    parser.add_argument(
        "--weights-mib", type=int, default=512, help="the benchmark model's weights read per forward"
    )
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--name", default="copy-beside-forward")
    args = parser.parse_args()
    cores, forward_like = pinned_forward_like(args.weights_mib)

    def forward() -> float:
        began = time.perf_counter()
        forward_like()
        return 1000 * (time.perf_counter() - began)

    hit = Hit(args.blocks)
    with tempfile.TemporaryDirectory() as folder:
        library = build_library(Path(folder))
        primitives = ["torch", "torch-u8"] + (["memcpy", "nt"] if library is not None else [])
        copies = {p: hit.copier(p, library) for p in primitives}
        go = threading.Event()
        done = threading.Event()
        job: list = [None]
        copy_ms: list[float] = []

        def copy_thread() -> None:
            os.sched_setaffinity(0, {cores[1]})  # this thread only: Linux sets it per thread
            torch.set_num_threads(1)
            while True:
                go.wait()
                go.clear()
                if job[0] is None:
                    return
                began = time.perf_counter()
                job[0]()
                copy_ms.append(1000 * (time.perf_counter() - began))
                done.set()

        thread = threading.Thread(target=copy_thread)
        thread.start()
        for primitive, copy in copies.items():  # touches every page first, too
            hit.check(copy, primitive)
        rows: dict[str, dict[str, list[float]]] = {
            p: {"alone": [], "beside": [], "copy": []} for p in primitives
        }
        for _ in range(args.repeats):
            for primitive in primitives:  # interleaved, so drift hits every primitive alike
                rows[primitive]["alone"].append(forward())
                job[0] = copies[primitive]
                done.clear()
                go.set()
                rows[primitive]["beside"].append(forward())
                done.wait()
                rows[primitive]["copy"].append(copy_ms[-1])
                time.sleep(0.05)
        job[0] = None
        go.set()
        thread.join()

    result: dict = {"machine": machine(), "args": vars(args), "hit_mib": hit.nbytes / 2**20, "primitives": {}}
    print(
        f"a {hit.nbytes / 2**20:.0f} MiB hit copied beside a forward-like loop "
        f"({args.weights_mib} MiB of weights), medians of {args.repeats}:"
    )
    torch_copy = median(rows["torch"]["copy"])
    for primitive in primitives:
        alone = median(rows[primitive]["alone"])
        extras = [b - a for a, b in zip(rows[primitive]["alone"], rows[primitive]["beside"], strict=True)]
        extra = median(extras)
        low, _, high = statistics.quantiles(extras, n=4)
        copy = median(rows[primitive]["copy"])
        result["primitives"][primitive] = {
            "forward_ms_alone": alone,
            "forward_extra_ms": extra,
            "forward_extra_ms_quartiles": [low, high],
            "forward_ratio": (alone + extra) / alone,
            "copy_ms_beside": copy,
            "copy_vs_torch": copy / torch_copy,
            "raw": rows[primitive],
        }
        print(
            f"  {primitive:8s} forward {alone:6.1f} ms alone, {extra:+5.1f} ms with the copy "
            f"(quartiles {low:+.1f} to {high:+.1f}; {(alone + extra) / alone:.3f}x); "
            f"the copy took {copy:5.1f} ms, {copy / torch_copy:.2f}x torch's"
        )
    save(args.name, result)


if __name__ == "__main__":
    main()

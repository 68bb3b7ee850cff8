"""Plots of the GPU benchmarks' result files for docs/img/gpu.png:

    python benchmarks/gpu_plot.py benchmarks/results/gpu_transfer_h100.json \\
        benchmarks/results/gpu_layerwise_h100.json benchmarks/results/gpu_layerwise_h100_short.json

Left: each copy path's speed over raw pinned memcpy (gather = to the CPU tier,
scatter = back), per layout and block set. Right: loads and stores under a stand-in
forward, over the forward alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMG = Path(__file__).resolve().parent.parent / "docs" / "img" / "gpu.png"
PATHS = ("per_run", "per_layer", "fused")
LABELS = {"per_run": "per run (old)", "per_layer": "per layer, staged", "fused": "one launch (default)"}


def main() -> None:
    transfer = json.loads(Path(sys.argv[1]).read_text())
    layerwise = [json.loads(Path(name).read_text()) for name in sys.argv[2:]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))

    cases = [(layout, kind) for layout in transfer["layouts"] for kind in ("scattered", "contiguous")]
    width = 0.13
    for i, path in enumerate(PATHS):
        for j, direction in enumerate(("gather", "scatter")):
            values = [
                transfer["layouts"][lay]["cases"][kind][path][f"{direction}_vs_raw"] for lay, kind in cases
            ]
            offsets = [c + (2 * i + j - 2.5) * width for c in range(len(cases))]
            left.bar(offsets, values, width, label=f"{LABELS[path]}, {direction}", alpha=0.55 + 0.45 * j)
    left.axhline(0.8, color="black", linestyle="--", linewidth=1, label="target: 0.8")
    left.set_xticks(range(len(cases)), [f"{lay}\n{kind}" for lay, kind in cases])
    left.set_ylabel("speed / raw pinned memcpy")
    left.set_title(f"{transfer['device']}: 2048 tokens, 32 layers, {transfer['dtype']}")
    left.set_ylim(0, 1.3)
    left.legend(fontsize=7, loc="upper center", ncol=3)

    rows = []
    for result in layerwise:
        forward = result["results"]["forward only"]["ms"]
        rows.append((f"load, {forward:.0f} ms forward", result["results"], "copy, then"))
        store_forward = result["stores"]["forward only"]["ms"]
        rows.append((f"store, {store_forward:.1f} ms forward", result["stores"], "forward, then whole copy"))
    kinds = ("whole copy", "layer by layer, 16 programs")
    for i, kind in enumerate(kinds):
        values = []
        for _, data, whole in rows:
            key = whole if kind == "whole copy" else kind
            values.append(data[key]["ms"] / data["forward only"]["ms"])
        right.bar([r + (i - 0.5) * 0.35 for r in range(len(rows))], values, 0.35, label=kind)
    right.axhline(1.0, color="black", linewidth=1, label="forward alone")
    right.set_xticks(range(len(rows)), [label for label, _, _ in rows], fontsize=8)
    right.set_ylabel("time / forward alone")
    right.set_title("256 MiB loaded or stored while a forward runs")
    right.legend(fontsize=8)
    fig.tight_layout()
    IMG.parent.mkdir(exist_ok=True)
    fig.savefig(IMG, dpi=110)
    print("wrote", IMG)


if __name__ == "__main__":
    main()

"""Issue 21's ratios pooled over several `hit_pairs.py` runs, each with a bootstrap
interval, and each run's own figure beside it: how far one run's ratio can say
anything at all about a 5% target on this machine.

    python benchmarks/hit_pairs_pool.py run39 run40 run41

A run's ratio rests on a few requests a kind (9 pairs for the quiet hits, 12
in-flight hits of each kind) whose single times spread by 30-60% on this 2-core VM,
so one run's median ratio moves by several percent from one run to the next with
the code unchanged. Pooling the runs narrows that, without mixing one run's machine
speed into another's: each resample draws every run's requests from that run only
(with replacement), takes that run's ratio, and the pooled ratio is the geometric
mean of the runs' ratios. The interval is the 5th to 95th percentile of the pooled
ratio over the resamples. Requests are the runs' saved results; nothing is re-run.

Ratios, as in hit_pairs.py (the target in brackets):
  quiet       CPU hit / prefix-cache hit just before it, same prompt, same engine (1.05)
  example     CPU hit / ExampleConnector hit, each paired with its engine's
              prefix-cache hit (1.0); and unpaired, the two engines' medians (1.0)
  in flight   CPU hit with its prompt's write-through running / vLLM's prefix-cache
              hit of the same prompt asked at once too, paired (1.05; runs from
              43 on); / vLLM's prefix-cache hit of another prompt asked in the
              in-flight hit's place (1.05; runs 31-42); and / the same engine's
              later prefix-cache hits (1.05)
  disk        disk hit (page cache) / CPU hit, each paired with a prefix-cache hit (1.1)
  control     vLLM's prefix-cache hit in the in-flight place (or asked at once beside
              the in-flight hit) / its later ones: no tiercache hit in it, so how far
              it strays from 1 is the noise alone

A ratio is shown where every run has the requests it needs: runs before 43 have no
paired in-flight hits, runs from 43 on no unpaired prefix-cache hits in the in-flight
place."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

from harness import ttft
from hit_pairs import by_name

RESULTS = Path(__file__).resolve().parent / "results"
Samples = dict[str, list[float]]  # label -> values (TTFTs, or ratios of pairs)


def load(run: str) -> dict:
    path = Path(run) if run.endswith(".json") else RESULTS / f"hit-pairs-{run}.json"
    return json.loads(path.read_text())


def labelled(named: dict[str, dict], label: str, length: int) -> list[dict]:
    """The requests of one kind and length: hit_pairs.py names them label/length/prompt/round."""
    return [r for name, r in named.items() if name.split("/")[:2] == [label, str(length)]]


def paired(named: dict[str, dict], top: str, bottom: str, length: int) -> list[float]:
    """TTFT of `top` over the `bottom` of the same prompt and round, per pair."""
    out = []
    for r in labelled(named, top, length):
        other = named.get("/".join([bottom, *r["name"].split("/")[1:]]))
        if other is not None:
            out.append(ttft(r) / ttft(other))
    return out


def times(named: dict[str, dict], label: str, length: int) -> list[float]:
    return [ttft(r) for r in labelled(named, label, length)]


def samples_of(data: dict, length: int) -> Samples:
    tiercache, example, disk = (
        by_name(data["engines"][e]) for e in ("tiercache", "example", "tiercache_disk")
    )
    return {
        "quiet_pairs": paired(tiercache, "cpu", "pc", length),
        "example_pairs": paired(example, "example", "pc", length),
        "disk_pairs": paired(disk, "disk", "disk_pc", length),
        "cpu": times(tiercache, "cpu", length),
        "example": times(example, "example", length),
        "inflight": times(tiercache, "inflight", length),
        "inflight_pairs": paired(tiercache, "inflight", "pc_at_once", length),
        "pc_at_once": times(tiercache, "pc_at_once", length),
        "pc_inflight": times(tiercache, "pc_inflight", length),
        "pc": times(tiercache, "pc", length),
    }


med = statistics.median


class Ratio:
    """The median of one kind of sample, over the median of another where `bottom` is
    given: every ratio of issue 21 is one of these, and a run can give it only if it
    has both kinds of request."""

    def __init__(self, top: str, bottom: str | None = None):
        self.top, self.bottom = top, bottom
        self.needs = (top,) if bottom is None else (top, bottom)

    def __call__(self, s: Samples) -> float:
        return med(s[self.top]) if self.bottom is None else med(s[self.top]) / med(s[self.bottom])


# label -> (the ratio, its target or None)
RATIOS: dict[str, tuple[Ratio, float | None]] = {
    "quiet: CPU hit / prefix-cache hit, paired": (Ratio("quiet_pairs"), 1.05),
    "example: CPU hit / ExampleConnector hit, each paired": (Ratio("quiet_pairs", "example_pairs"), 1.0),
    "example: CPU hit / ExampleConnector hit, unpaired": (Ratio("cpu", "example"), 1.0),
    "in flight: / prefix-cache hit of its prompt asked at once too, paired": (Ratio("inflight_pairs"), 1.05),
    "in flight: / prefix-cache hit in its place": (Ratio("inflight", "pc_inflight"), 1.05),
    "in flight: / later prefix-cache hits, same engine": (Ratio("inflight", "pc"), 1.05),
    "disk: disk hit / CPU hit, each paired": (Ratio("disk_pairs", "quiet_pairs"), 1.1),
    "control: prefix-cache hit at once beside the in-flight hit / later ones": (
        Ratio("pc_at_once", "pc"),
        None,
    ),
    "control: prefix-cache hit in the in-flight place / later ones": (Ratio("pc_inflight", "pc"), None),
}


def resample(samples: Samples, rng: random.Random) -> Samples:
    return {k: rng.choices(v, k=len(v)) if v else v for k, v in samples.items()}


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def pooled(runs: list[Samples], ratio: Ratio, draws: int, rng: random.Random) -> tuple[float, float, float]:
    """(the pooled ratio, the 5th and 95th percentiles of it over `draws` resamples)."""
    point = geometric_mean([ratio(s) for s in runs])
    spread = sorted(geometric_mean([ratio(resample(s, rng)) for s in runs]) for _ in range(draws))
    return point, spread[int(0.05 * draws)], spread[int(0.95 * draws) - 1]


def report(names: list[str], lengths: list[int], draws: int, seed: int) -> dict:
    datas = [load(n) for n in names]
    rng = random.Random(seed)
    out: dict = {}
    for length in lengths:
        runs = [samples_of(d, length) for d in datas]
        rows = {}
        for label, (ratio, target) in RATIOS.items():
            if not all(s[k] for s in runs for k in ratio.needs):
                continue  # some run has none of these requests (another hit_pairs.py design)
            point, low, high = pooled(runs, ratio, draws, rng)
            rows[label] = {
                "runs": [ratio(s) for s in runs],
                "pooled": point,
                "interval_90": [low, high],
                "target": target,
            }
        out[str(length)] = rows
    return out


def verdict(row: dict) -> str:
    target = row["target"]
    low, high = row["interval_90"]
    if target is None:
        return ""
    if high <= target:
        return "met"
    if low > target:
        return "missed"
    return "not resolved"


def show(names: list[str], result: dict) -> None:
    for length, rows in result.items():
        print(f"\n{length} tokens | " + " | ".join(names) + " | pooled [90% interval] | target |")
        print("|---|" + "---:|" * len(names) + "---|---|")
        for label, row in rows.items():
            runs = " | ".join(f"{r:.3f}" for r in row["runs"])
            low, high = row["interval_90"]
            target = "" if row["target"] is None else f"{row['target']:.2f} {verdict(row)}"
            print(f"| {label} | {runs} | {row['pooled']:.3f} [{low:.3f}, {high:.3f}] | {target} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "runs", nargs="+", help="run names (run39 reads results/hit-pairs-run39.json) or files"
    )
    parser.add_argument("--lengths", default="1000,2000,4000")
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--save", help="write the figures as JSON to this file")
    args = parser.parse_args()
    result = report(args.runs, [int(n) for n in args.lengths.split(",")], args.draws, args.seed)
    show(args.runs, result)
    if args.save:
        Path(args.save).write_text(json.dumps({"runs": args.runs, "lengths": result}, indent=1))


if __name__ == "__main__":
    main()

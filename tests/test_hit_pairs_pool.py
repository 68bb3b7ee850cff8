"""benchmarks/hit_pairs_pool.py: pooled ratios come from each run's own requests, never
from one run's requests mixed into another's, and the verdict follows the interval."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "benchmarks" / "hit_pairs_pool.py"

IN_FLIGHT = "in flight: / prefix-cache hit in its place"
QUIET = "quiet: CPU hit / prefix-cache hit, paired"


def result(name: str, seconds: float) -> dict:
    return {"name": name, "metrics": {"first_token_latency": seconds}}


def run_file(path: Path, speed: float, inflight_over_pc: list[float]) -> Path:
    """A hit_pairs result at 1000 tokens where every hit takes `speed` seconds, but the
    in-flight hits, which take the given multiples of it."""
    tiercache, example, disk = [], [], []
    for p in range(3):
        for r in range(3):
            tiercache += [result(f"pc/1000/{p}/{r}", speed), result(f"cpu/1000/{p}/{r}", speed)]
            example += [result(f"pc/1000/{p}/{r}", speed), result(f"example/1000/{p}/{r}", speed)]
            disk += [result(f"disk/1000/{p}/{r}", speed), result(f"disk_pc/1000/{p}/{r}", speed)]
    for p, multiple in enumerate(inflight_over_pc):
        tiercache += [
            result(f"inflight/1000/{p}/0", speed * multiple),
            result(f"pc_inflight/1000/{100 + p}/0", speed),
        ]
    engines = {
        e: {"warm": [], "results": rs}
        for e, rs in (("tiercache", tiercache), ("example", example), ("tiercache_disk", disk))
    }
    path.write_text(json.dumps({"engines": engines}))
    return path


def pool(*files: Path, out: Path) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            *map(str, files),
            "--lengths",
            "1000",
            "--draws",
            "500",
            "--save",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT / "benchmarks",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["lengths"]["1000"]


def test_runs_of_different_speeds_pool_without_mixing(tmp_path):
    # Both runs have every ratio exactly 1, one at twice the other's times: any
    # resample that drew one run's requests into the other's would stray from 1.
    slow = run_file(tmp_path / "slow.json", 0.100, [1.0] * 12)
    fast = run_file(tmp_path / "fast.json", 0.050, [1.0] * 12)
    rows = pool(slow, fast, out=tmp_path / "pool.json")
    for label, row in rows.items():
        assert row["runs"] == [1.0, 1.0], label
        assert row["interval_90"] == [1.0, 1.0], label
    assert rows[IN_FLIGHT]["target"] == 1.05


def test_the_pooled_ratio_is_the_runs_geometric_mean_and_the_verdict_follows_the_interval(tmp_path):
    a = run_file(tmp_path / "a.json", 0.060, [1.1] * 12)
    b = run_file(tmp_path / "b.json", 0.060, [1.4] * 12)
    rows = pool(a, b, out=tmp_path / "pool.json")
    in_flight = rows[IN_FLIGHT]
    assert in_flight["runs"] == pytest.approx([1.1, 1.4])
    assert in_flight["pooled"] == pytest.approx((1.1 * 1.4) ** 0.5)
    assert in_flight["interval_90"][0] > 1.05  # missed, whatever the resample
    assert rows[QUIET]["interval_90"][1] <= 1.05  # met


def test_a_spread_run_leaves_the_target_unresolved(tmp_path):
    # Half the in-flight hits 0.9x, half 1.2x: the median of a resample falls either side.
    spread = run_file(tmp_path / "spread.json", 0.060, [0.9] * 6 + [1.2] * 6)
    rows = pool(spread, out=tmp_path / "pool.json")
    low, high = rows[IN_FLIGHT]["interval_90"]
    assert low < 1.05 < high


PAIRED = "in flight: / prefix-cache hit of its prompt asked at once too, paired"


def paired_run_file(path: Path, speed: float, inflight_over_pc: list[float]) -> Path:
    """A run of the paired design (run 43 on): each in-flight hit has a prefix-cache hit
    of its own prompt, whose time varies from prompt to prompt."""
    data = json.loads(run_file(path, speed, []).read_text())
    tiercache = data["engines"]["tiercache"]["results"]
    for p, multiple in enumerate(inflight_over_pc):
        pc = speed * (1 + p / 10)
        tiercache += [result(f"pc_at_once/1000/{p}/0", pc), result(f"inflight/1000/{p}/0", pc * multiple)]
    path.write_text(json.dumps(data))
    return path


def test_paired_in_flight_hits_give_the_median_of_each_prompts_ratio(tmp_path):
    # Prefix-cache hits from 1.0x to 2.1x `speed`, each in-flight hit 1.02x its own:
    # the ratio of the two medians would not be 1.02, the median of the pairs is.
    run = paired_run_file(tmp_path / "paired.json", 0.060, [1.02] * 12)
    rows = pool(run, out=tmp_path / "pool.json")
    assert rows[PAIRED]["runs"] == pytest.approx([1.02])
    assert rows[PAIRED]["target"] == 1.05
    assert IN_FLIGHT not in rows  # no unpaired prefix-cache hit in the in-flight place


def test_runs_of_both_designs_pool_only_the_ratios_both_have(tmp_path):
    old = run_file(tmp_path / "old.json", 0.060, [1.0] * 12)
    new = paired_run_file(tmp_path / "new.json", 0.060, [1.0] * 12)
    rows = pool(old, new, out=tmp_path / "pool.json")
    assert PAIRED not in rows and IN_FLIGHT not in rows
    assert rows[QUIET]["runs"] == [1.0, 1.0]

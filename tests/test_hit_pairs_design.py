"""benchmarks/hit_pairs.py's in-flight pairs: each in-flight CPU hit is paired with
vLLM's prefix-cache hit of the same prompt, the order alternating by prompt, and
whether the prompt's write-through was still under way at each hit is read from the
disk tier's renames."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def hit_pairs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import hit_pairs

    return hit_pairs


def asked(items: list[dict]) -> list[str]:
    return ["reset" if "reset_prefix_cache" in i else i["name"].split("/")[0] for i in items]


def test_the_prefix_cache_hit_goes_first_for_even_prompts_and_second_for_odd(hit_pairs):
    ids = [1, 2, 3]
    assert asked(hit_pairs.in_flight_pair((1000, 0), ids, paired=True)) == ["pc_at_once", "reset", "inflight"]
    assert asked(hit_pairs.in_flight_pair((1000, 1), ids, paired=True)) == ["reset", "inflight", "pc_at_once"]
    assert asked(hit_pairs.in_flight_pair((1000, 1), ids, paired=False)) == ["reset", "inflight"]


def test_renamed_at_reads_objects_only(hit_pairs, tmp_path):
    shard = tmp_path / "rank" / "ab"
    shard.mkdir(parents=True)
    (shard / "ab12.safetensors").write_bytes(b"x")
    (shard / ".tmp-1-2-ab34.safetensors").write_bytes(b"half")  # a write not yet renamed
    (tmp_path / "notes.txt").write_text("not an object")
    times = hit_pairs.renamed_at(tmp_path)
    assert times == [(shard / "ab12.safetensors").stat().st_ctime]


def request(name: str, started_at: float) -> dict:
    return {"name": name, "started_at": started_at}


def test_objects_left_counts_the_prompts_renames_after_each_hit_began(hit_pairs):
    results = [
        request("cold/1000/0/0", 100.0),
        request("pc_at_once/1000/0/0", 103.0),
        request("inflight/1000/0/0", 103.2),
        request("cold/1000/1/0", 120.0),
        request("inflight/1000/1/0", 123.0),
        request("pc_at_once/1000/1/0", 123.1),
    ]
    # Prompt 0's objects: 101, 102, 103.1, 103.5, 104; prompt 1's: 121, 123.05.
    engine = {"results": results, "disk_renamed_at": [101.0, 102.0, 103.1, 103.5, 104.0, 121.0, 123.05]}
    named = {r["name"]: r for r in results}
    assert hit_pairs.objects_left(engine, named, (1000, 0)) == {"inflight": 2, "pc_at_once": 3}
    # Prompt 1's writes were over before its second hit: a pair not wholly in flight.
    assert hit_pairs.objects_left(engine, named, (1000, 1)) == {"inflight": 1, "pc_at_once": 0}

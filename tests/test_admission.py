"""The `selective` mover policy (tiercache/admission.py) through the connector's two
halves (connector/driver.py): which evicted blocks go down to disk and S3, and a scan
of blocks read once that leaves the blocks hit in the CPU tier where they are."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tiercache.admission import FrequencySketch
from tiercache.config import build_config
from tiercache.connector.driver import ConnectorDriver
from tiercache.object_shape import ObjectShape
from tiercache.tiers import CPU, DISK

BLOCK = 4096
OBJECT = ObjectShape("0" * 16, "0" * 16, BLOCK).object_bytes


def block(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def data(i: int) -> bytes:
    return np.random.default_rng(i).bytes(BLOCK)


@pytest.fixture
def drivers(tmp_path):
    made: list[ConnectorDriver] = []

    def make(policy: str, slots: int, disk_blocks: int = 0, **movers) -> ConnectorDriver:
        config_data: dict = {
            "cpu": {"capacity": slots * BLOCK},
            "movers": {"policy": policy, "cost_model": "off", **movers},
        }
        if disk_blocks:
            config_data["disk"] = {"path": str(tmp_path / uuid.uuid4().hex), "capacity": disk_blocks * OBJECT}
        cache = ConnectorDriver(build_config(config_data, environ={}), BLOCK, model=uuid.uuid4().hex)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


def put(cache: ConnectorDriver, i: int) -> None:
    cache.put(block(i), data(i))
    assert cache.flush(30)


def tier_of(cache: ConnectorDriver, i: int) -> str | None:
    hit = cache.get(block(i))
    if hit is None:
        return None
    tier, view = hit
    assert bytes(view) == data(i), f"block {i} from {tier} has the wrong bytes"
    return tier


def on_disk(cache: ConnectorDriver) -> set[int]:
    keys = set(cache.engine.disk.keys())
    return {i for i in range(64) if cache.shape.key(block(i)) in keys}


def test_object_size_matches_the_disk_objects(drivers):
    """The capacities below count objects as admission_for does."""
    cache = drivers("selective", slots=2, disk_blocks=8)
    assert cache.shape.object_bytes == OBJECT


def test_a_full_disk_takes_only_blocks_asked_for_again(drivers):
    cache = drivers("selective", slots=2, disk_blocks=2)
    for i in range(4):  # 0 and 1 are evicted while the disk has room: both written
        put(cache, i)
    assert on_disk(cache) == {0, 1}
    put(cache, 4)  # evicts 2, asked for once: the full disk does not take it
    assert on_disk(cache) == {0, 1}
    assert cache.get(block(9)) is None  # a first request for 9 (a miss)...
    put(cache, 9)  # ... and a second, which computes it
    put(cache, 10)
    put(cache, 11)  # 9 is evicted: asked for twice, it displaces the disk's oldest
    assert 9 in on_disk(cache)
    assert on_disk(cache) & {2, 3, 4, 10} == set()
    assert tier_of(cache, 9) == DISK


def test_write_through_still_writes_every_block(drivers):
    cache = drivers("write_through", slots=2, disk_blocks=2)
    for i in range(5):
        put(cache, i)
    assert on_disk(cache) == {3, 4}  # every block went down; the disk's LRU kept the last two


def test_a_scan_does_not_flush_the_blocks_hit_in_the_cpu_tier(drivers):
    results = {}
    for policy in ("write_through", "selective"):
        cache = drivers(policy, slots=4)
        hot = [100, 101]
        for i in hot:
            put(cache, i)
            assert tier_of(cache, i) == CPU
        for i in range(20):  # a scan: blocks read once, more than the tier holds
            put(cache, i)
        results[policy] = [tier_of(cache, i) for i in hot]
    assert results["selective"] == [CPU, CPU]
    assert results["write_through"] == [None, None]  # plain LRU: the scan flushed them


def test_protected_blocks_fall_back_to_probation_past_their_share(drivers):
    """A block hit once long ago does not keep its slot forever: past the protected
    share its place goes to newer hits, and it is evicted like any other."""
    cache = drivers("selective", slots=4, selective_protected_share=0.5)
    for i in (100, 101, 102):
        put(cache, i)
        assert tier_of(cache, i) == CPU
    for i in range(8):
        put(cache, i)
    assert [tier_of(cache, i) for i in (101, 102)] == [CPU, CPU]
    assert tier_of(cache, 100) is None


def driver(redis_url, s3_endpoint, bucket, model, *, disk=None, **movers) -> ConnectorDriver:
    """The selective policy over a 2-block CPU tier and S3, with a disk where `disk` names one."""
    config_data: dict = {
        "redis_url": redis_url,
        "cpu": {"capacity": 2 * BLOCK},
        "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1"},
        "movers": {"policy": "selective", "cost_model": "off", **movers},
    }
    if disk is not None:
        config_data["disk"] = {"path": str(disk), "capacity": 8 * OBJECT}
    return ConnectorDriver(build_config(config_data, environ={}), BLOCK, model=model)


@pytest.mark.parametrize("with_disk", [False, True], ids=["s3", "disk-and-s3"])
def test_s3_takes_only_blocks_asked_for_again(tmp_path, redis_url, s3_endpoint, bucket, with_disk):
    """Each victim goes to its own tiers: a block asked for once is not uploaded, and
    while the disk has room it is written there (a merge once took the scheduler's list
    of tiers twice in a step, the second time empty, and every victim went everywhere)."""
    disk = tmp_path / "disk" if with_disk else None
    cache = driver(redis_url, s3_endpoint, bucket, uuid.uuid4().hex, disk=disk)
    try:
        put(cache, 0)  # asked for once
        assert cache.get(block(1)) is None
        put(cache, 1)  # asked for twice
        put(cache, 2)
        put(cache, 3)  # 0 and 1 are evicted
        if with_disk:
            assert on_disk(cache) == {0, 1}
        assert uploaded(cache) == {block(1)}
    finally:
        cache.close()


def uploaded(cache: ConnectorDriver) -> set[bytes]:
    s3, rank = cache.engine.s3, cache.shape.rank_digest
    return {h for _, run, _, _ in s3.list_runs(rank) for h in s3.read_run_header(rank, run).block_hashes}


def test_sketch_counts_and_forgets():
    sketch = FrequencySketch(capacity=64, sample_factor=10)
    for _ in range(3):
        sketch.add(b"hot")
    sketch.add(b"cold")
    assert sketch.estimate(b"hot") == 3 and sketch.estimate(b"cold") == 1
    assert sketch.estimate(b"never") == 0
    for _ in range(sketch.sample):  # enough counts to halve every counter once
        sketch.add(b"other")
    assert sketch.estimate(b"hot") == 1 and sketch.estimate(b"cold") == 0


def test_sketch_tells_once_from_twice_when_full():
    """Admission compares estimates with 2: a sketch holding as many distinct keys as
    it counts between ageings must still see a key asked for once as once."""
    capacity = 256
    sketch = FrequencySketch(capacity)
    for i in range(sketch.sample - 1):  # all but one count before the first ageing
        sketch.add(i.to_bytes(8, "big"))
    overcounted = sum(sketch.estimate(i.to_bytes(8, "big")) >= 2 for i in range(sketch.sample - 1))
    assert overcounted <= 0.02 * (sketch.sample - 1)

"""The `selective` policy's evidence from the whole fleet (tiercache/admission.py,
tiercache/index/request_counts.py) through the connector's two halves: requests
counted in Redis across schedulers admit a prefix to S3 that no one scheduler saw
twice, a block asked for by many requests goes everywhere at once, and a Redis that
is down leaves each scheduler its own counts."""

from __future__ import annotations

import time
import uuid

from test_admission import block, data, driver, uploaded

from tiercache.connector.driver import ConnectorDriver
from tiercache.index.request_counts import FleetRequestCounts
from tiercache.tiers import CPU, S3


def serve(cache: ConnectorDriver, *blocks: int) -> list[str | None]:
    """One request of these blocks, computing what it misses; their tiers."""
    served = cache.serve([block(i) for i in blocks], [data(i) for i in blocks])
    assert cache.flush(30)
    return served.tiers


def on_disk(cache: ConnectorDriver, i: int) -> bool:
    return cache.shape.key(block(i)) in set(cache.engine.disk.keys())


def test_a_prefix_two_schedulers_each_saw_once_goes_to_s3(redis_url, s3_endpoint, bucket):
    """Each scheduler sees the prefix once; the second learns from Redis that the
    fleet asked for it twice, and uploads it when its CPU tier evicts it. Counting
    per scheduler only, neither does."""
    found = {}
    for ttl in (600.0, 0.0):
        model = uuid.uuid4().hex  # two instances of one model: one index, one bucket
        first = driver(redis_url, s3_endpoint, bucket, model, selective_fleet_ttl_seconds=ttl)
        second = driver(redis_url, s3_endpoint, bucket, model, selective_fleet_ttl_seconds=ttl)
        try:
            serve(first, 1, 2)  # the prefix, once here
            serve(second, 1, 2)  # and once here: the fleet has asked for it twice
            serve(second, 7)
            serve(second, 8)  # its CPU tier evicts the prefix
            found[ttl] = uploaded(second)
        finally:
            first.close()
            second.close()
    assert {block(1), block(2)} <= found[600.0]
    assert found[0.0] == set()


def test_a_block_many_requests_ask_for_goes_everywhere_at_once(tmp_path, redis_url, s3_endpoint, bucket):
    """A block asked for by `selective_everywhere_min_requests` requests is written to
    the disk and S3 while the CPU tier still holds it; and a scheduler that computes
    it for the first time writes it at once too, from the fleet's count."""
    model = uuid.uuid4().hex
    hot = driver(
        redis_url, s3_endpoint, bucket, model, disk=tmp_path / "a", selective_everywhere_min_requests=3
    )
    late = driver(
        redis_url, s3_endpoint, bucket, model, disk=tmp_path / "b", selective_everywhere_min_requests=3
    )
    try:
        assert serve(hot, 5) == [None]  # computed: asked for once
        assert serve(hot, 5) == [CPU]
        assert not on_disk(hot, 5) and uploaded(hot) == set()  # twice: still the CPU tier's alone
        assert serve(hot, 5) == [CPU]  # three requests: popular
        serve(hot, 6)  # the next step writes it down (its slot is not evicted)
        assert on_disk(hot, 5) and block(5) in uploaded(hot)
        assert serve(hot, 5) == [CPU]

        # The other scheduler computes it (from S3 here) and writes it to its own
        # disk at once: the fleet asked for it four times.
        assert serve(late, 5) == [S3]
        serve(late, 6)
        assert on_disk(late, 5)
    finally:
        hot.close()
        late.close()


def test_without_the_rule_a_popular_block_stays_in_the_cpu_tier(tmp_path, redis_url, s3_endpoint, bucket):
    cache = driver(
        redis_url, s3_endpoint, bucket, uuid.uuid4().hex, disk=tmp_path, selective_everywhere_min_requests=0
    )
    try:
        for _ in range(4):
            serve(cache, 5)
        serve(cache, 6)
        assert not on_disk(cache, 5) and uploaded(cache) == set()
    finally:
        cache.close()


def test_redis_down_leaves_each_scheduler_its_own_counts(redis_server, s3_endpoint, bucket):
    """With Redis gone the counts sent are dropped, not waited for, and the admission
    decides from this scheduler's own: a block asked for twice here still qualifies
    for S3, one asked for once does not."""
    cache = driver(redis_server.url, s3_endpoint, bucket, uuid.uuid4().hex)
    try:
        redis_server.stop()
        serve(cache, 1)
        serve(cache, 2)
        assert serve(cache, 2) == [CPU]
        admission = cache.policy.admission
        assert admission.fleet is not None and admission.fleet.wait(5)
        assert admission.fleet.count(block(2)) == 0  # nothing came back
        assert S3 in admission.down_tiers(block(2), 0, None)
        assert S3 not in admission.down_tiers(block(1), 0, None)
    finally:
        cache.close()


def test_fleet_counts_last_their_ttl_and_expire(redis):
    """A request counts for one to two windows of `ttl` seconds; the windows' keys
    expire on their own. The windows are long enough that a loaded machine's stall
    between two requests (the suite runs beside vLLM engines) stays within one."""
    model = uuid.uuid4().hex[:16]
    ttl = 2.0
    one = FleetRequestCounts(redis, model, ttl=ttl, remembered=16, popular_at=3)
    other = FleetRequestCounts(redis, model, ttl=ttl, remembered=16, popular_at=3)
    try:
        one.requested([block(1), block(2)])
        assert one.wait()  # each batch's answer is the count as of its own send
        other.requested([block(1)])
        assert other.wait()
        assert (one.count(block(1)), one.count(block(2)), other.count(block(1))) == (1, 1, 2)
        other.requested([block(1)])
        assert other.wait() and other.count(block(1)) == 3
        assert other.take_popular() == [block(1)] and one.take_popular() == []
        keys = redis.client.keys(f"tc:{{{model}}}:asked:*")
        assert keys and all(0 < redis.client.pttl(key) <= (2 * ttl + 1) * 1000 for key in keys)
        time.sleep(2 * ttl + 0.1)  # two windows on: what was asked for then no longer counts
        one.requested([block(1)])
        assert one.wait() and one.count(block(1)) == 1
    finally:
        one.close()
        other.close()

"""The peer tier wired into the connector: two instances (two `ConnectorDriver`s, each
the scheduler and worker halves of one engine) and a real Redis. One computes and
stores blocks; the other finds them in the first one's CPU tier through presence,
plans a peer load naming that instance, and reads them over NIXL (UCX on loopback)
into its staging slots. A block the holder no longer has, or a holder that is gone,
is a miss from that block on, never other bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from connector.driver import BLOCK_SIZE, ConnectorDriver

from support.nixl import needs_nixl
from support.peer_instance import BLOCK, BLOCKS, blocks, computed, instance
from support.redis_commands import commands_sent

pytestmark = needs_nixl

HOLDER = Path(__file__).parent / "support" / "peer_instance.py"


def started(driver: ConnectorDriver) -> None:
    """One step through `driver`'s worker, which starts its peer tier (the first step
    names the instance to it)."""
    hashes, pages = blocks(99, 1)
    driver.serve(hashes, pages)
    assert driver.worker.peer is not None


@pytest.fixture
def model():
    return uuid.uuid4().hex


def test_a_block_computed_by_one_instance_is_loaded_by_another_from_its_cpu_tier(redis_url, model):
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        hashes, pages = blocks(1)
        computed(a, hashes, pages)
        served = b.serve(hashes)
        assert served.tiers == ["peer"] * BLOCKS
        for kv, page in zip(served.kv, pages, strict=True):
            assert bytes(kv) == page
        assert b.worker.stats.data.get("loaded_blocks_peer") == BLOCKS
        # Staged into b's own CPU tier: its next request is a local hit.
        b.deliver_reports()
        assert b.serve(hashes).tiers == ["cpu"] * BLOCKS
        assert a.worker.stats.data.get("loaded_blocks_peer") is None
    finally:
        b.close()
        a.close()


def test_a_block_loaded_from_a_peer_is_published_as_held_in_the_readers_cpu_tier(redis_url, model):
    """vLLM's KV events say what the publishing instance holds: once a peer's block is
    in the reader's own CPU tier, a `BlockStored` of vLLM's hash, medium CPU, local;
    the holder's events are its own and unchanged by the read."""
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        a.scheduler.tier_events.publish = b.scheduler.tier_events.publish = True
        hashes, pages = blocks(13)
        computed(a, hashes, pages)
        a.scheduler.tier_events.take()
        assert b.serve(hashes).tiers == ["peer"] * BLOCKS
        b.deliver_reports()
        events = b.scheduler.tier_events.take()
        assert [(type(e).__name__, e.medium, e.locality) for e in events] == [
            ("BlockStored", "CPU", "LOCAL")
        ] * BLOCKS
        assert [maybe_convert_block_hash(h) for h in hashes] == [e.block_hashes[0] for e in events]
        assert a.scheduler.tier_events.take() == []
    finally:
        b.close()
        a.close()


def test_instances_on_the_same_new_weights_share_and_others_do_not(redis_url, model, monkeypatch):
    """After the same in-place update and prefix-cache reset on every instance (one
    weights epoch), blocks are cached under their epoch keys, while presence still
    names them by vLLM's hash (what routers know): the peer lookup asks presence for
    vLLM's hashes and reads the holder's slots by epoch key. An instance on other
    weights reads nothing it could use: a miss, never the other weights' KV."""
    a, b, c = (instance(redis_url, name, model) for name in "abc")
    try:
        for driver, epoch in ((a, b"\x01"), (b, b"\x01"), (c, b"\x02")):
            # The fingerprint of the weights each engine holds after the update.
            monkeypatch.setattr("connector.scheduler.loaded_weights_epoch", lambda epoch=epoch: epoch * 16)
            assert driver.scheduler.reset_cache() is not False
        hashes, pages = blocks(4)
        assert a.serve(hashes, pages).hits == 0
        a.deliver_reports()
        assert a.scheduler.tier_events.presence.flush()
        served = b.serve(hashes)
        assert served.tiers == ["peer"] * BLOCKS
        assert [bytes(kv) for kv in served.kv] == pages
        _, other = blocks(5)
        served = c.serve(hashes, other)
        assert [bytes(kv) for kv in served.kv] == other  # computed by c, not a's blocks
    finally:
        for driver in (c, b, a):
            driver.close()


def test_a_waiting_request_asks_redis_for_its_peer_once(redis_url, model):
    """vLLM asks about a waiting request every step: presence's answer of who holds its
    blocks is reused while it holds, as S3's is, rather than a script call per step."""
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        hashes, pages = blocks(5)
        computed(a, hashes, pages)
        request = SimpleNamespace(
            request_id="waiting",
            block_hashes=hashes,
            num_tokens=BLOCKS * BLOCK_SIZE + 1,
            num_prompt_tokens=BLOCKS * BLOCK_SIZE + 1,
        )
        matched = BLOCKS * BLOCK_SIZE
        assert b.scheduler.get_num_new_matched_tokens(request, 0) == (matched, True)
        sent = commands_sent(b.scheduler.redis.client)
        for _ in range(3):
            assert b.scheduler.get_num_new_matched_tokens(request, 0) == (matched, True)
        assert sent == []
    finally:
        b.close()
        a.close()


def test_a_slot_the_holder_rewrites_during_the_read_is_a_miss_from_that_block_on(redis_url, model):
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        hashes, pages = blocks(2)
        computed(a, hashes, pages)
        # b reads the blocks; right after it has found them in a's directory, a's CPU
        # tier rewrites the slot of the third one, as a store reusing it would.
        victim = a.slots.slot_of(hashes[2])
        holder, reader = a.worker.peer.tier, b.worker
        rounds = []
        _, other = blocks(3, 1)

        def read_then_rewrite(agent, pieces, deadline):
            reader_read(agent, pieces, deadline)
            rounds.append(len(pieces))
            if len(rounds) == 1:  # the directory rows: now the slot changes
                holder.retire(victim)
                a.buffer.tensor[victim].numpy()[:] = np.frombuffer(other[0], np.uint8)
                holder.publish(victim, b"\x07" * 32)

        started(b)
        reader_read = reader.peer.tier.agent.read
        reader.peer.tier.agent.read = read_then_rewrite
        served = b.serve(hashes, pages=[b"\x00" * BLOCK] * BLOCKS)
        assert served.tiers == ["peer", "peer"] + [None] * (BLOCKS - 2)
        assert [bytes(kv) for kv in served.kv[:2]] == pages[:2]
        assert rounds, "the peer was never read"
    finally:
        b.close()
        a.close()


def start_holders(redis_url: str, model: str, seeds: dict[str, int]) -> dict[str, subprocess.Popen]:
    """Each named instance in a process of its own, its blocks of its seed stored and
    published. Started together: each takes seconds to import its way up."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    holders = {
        name: subprocess.Popen(
            [sys.executable, str(HOLDER), redis_url, model, name, str(seed)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, seed in seeds.items()
    }
    for name, process in holders.items():
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if line != "READY":
            for other in holders.values():
                other.kill()
            pytest.fail(f"holder {name} did not start: {line!r}")
    return holders


def test_a_holder_killed_before_or_during_the_read_is_a_miss(redis_url, model):
    holders = start_holders(redis_url, model, {"dead": 4, "dying": 5})
    b = instance(redis_url, "b", model)
    try:
        started(b)
        dead, _ = blocks(4)
        dying, _ = blocks(5)
        assert b.scheduler.peers.holder(dead) == ("dead", BLOCKS)
        assert b.scheduler.peers.holder(dying) == ("dying", BLOCKS)
        # Their records and presence stay in Redis until their TTLs, as after a crash.
        holders["dead"].send_signal(signal.SIGKILL)
        holders["dead"].wait()
        reader_read = b.worker.peer.tier.agent.read

        def read_then_kill(agent, pieces, deadline):
            reader_read(agent, pieces, deadline)
            if holders["dying"].poll() is None:  # after the directory rows: it dies
                holders["dying"].send_signal(signal.SIGKILL)
                holders["dying"].wait()

        for hashes in (dead, dying):
            if hashes is dying:
                b.worker.peer.tier.agent.read = read_then_kill
            failed_before = b.worker.stats.data.get("failed_blocks_peer", 0)
            served = b.serve(hashes, pages=[b"\x00" * BLOCK] * BLOCKS)
            assert served.tiers == [None] * BLOCKS
            assert b.worker.stats.data.get("failed_blocks_peer") == failed_before + BLOCKS
            # What b computed instead is stored: the next request hits b's own CPU tier.
            b.deliver_reports()
            again = b.serve(hashes)
            assert again.tiers == ["cpu"] * BLOCKS
            assert [bytes(kv) for kv in again.kv] == [b"\x00" * BLOCK] * BLOCKS
        assert holders["dying"].poll() is not None, "the holder was never read"
    finally:
        b.close()
        for process in holders.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def test_a_holder_that_shut_down_is_a_miss(redis_url, model):
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    hashes, pages = blocks(5)
    try:
        computed(a, hashes, pages)
        a.worker.peer.tier.close()  # its record leaves Redis; its presence stays a while
        served = b.serve(hashes)
        assert served.tiers == [None] * BLOCKS
    finally:
        b.close()
        a.close()


def test_another_namespace_is_never_read(redis_url, model):
    a = instance(redis_url, "a", model, namespace="tenant-a")
    b = instance(redis_url, "b", model, namespace="tenant-b")
    try:
        hashes, pages = blocks(6)
        computed(a, hashes, pages)
        assert b.scheduler.peers.holder(hashes) is None
        read = []
        started(b)
        b.worker.peer.tier.agent.read = lambda *args: read.append(args)
        assert b.serve(hashes).tiers == [None] * BLOCKS
        assert read == []
    finally:
        b.close()
        a.close()


def test_with_the_peer_tier_off_nothing_is_shared(redis_url, model):
    a = instance(redis_url, "a", model, peer=False)
    b = instance(redis_url, "b", model, peer=False)
    try:
        hashes, pages = blocks(7)
        computed(a, hashes, pages)
        assert a.worker.peer is None and b.scheduler.peers is None
        assert b.serve(hashes).tiers == [None] * BLOCKS
        assert b.worker.peer is None
    finally:
        b.close()
        a.close()


def test_a_reader_without_the_peer_tier_ignores_holders(redis_url, model):
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model, peer=False)
    try:
        hashes, pages = blocks(8)
        computed(a, hashes, pages)
        assert b.serve(hashes).tiers == [None] * BLOCKS
    finally:
        b.close()
        a.close()


def test_peer_blocks_come_after_local_ones_in_one_load(redis_url, model):
    """A prefix partly in this instance's CPU tier and partly in a peer's: one load,
    the local blocks copied, the rest read from the peer, bytes as computed."""
    a, b = instance(redis_url, "a", model), instance(redis_url, "b", model)
    try:
        hashes, pages = blocks(9)
        computed(a, hashes, pages)
        assert b.serve(hashes[:2]).tiers == ["peer", "peer"]  # now in b's own CPU tier
        b.deliver_reports()
        served = b.serve(hashes)
        assert served.tiers == ["cpu", "cpu"] + ["peer"] * (BLOCKS - 2)
        assert [bytes(kv) for kv in served.kv] == pages
    finally:
        b.close()
        a.close()


@pytest.fixture
def peers_seen_at_once(monkeypatch):
    """b asks who is live when it computes, before a is: a is seen at b's next ask,
    not up to LIVE_INSTANCES_SECONDS later."""
    monkeypatch.setattr("connector.peer_lookup.LIVE_INSTANCES_SECONDS", 0.0)


def on_disk_only(driver, hashes: list[bytes], pages: list[bytes]) -> None:
    """`driver` computed the blocks and its CPU tier has since evicted them to its disk
    (requests for other blocks took their slots)."""
    driver.serve(hashes, pages)
    assert driver.flush(30)
    for seed in (101, 102, 103):
        other_hashes, other_pages = blocks(seed)
        driver.serve(other_hashes, other_pages)
        assert driver.flush(30)
    assert [driver.policy.local_tier(h) for h in hashes] == ["disk"] * BLOCKS
    assert driver.scheduler.tier_events.presence.flush()  # no longer in its CPU tier


def measured(driver, **load_seconds_per_block: float) -> None:
    """The cost model has timed loads of 2 and 8 blocks from each named tier at these
    seconds a block, and a prefill slower than any of them."""
    cost = driver.scheduler.cost
    cost.observe_forward(1000, 10.0)
    for tier, per_block in load_seconds_per_block.items():
        for count in (2, 8):
            cost.observe_load(tier, count, per_block * count)


@pytest.mark.parametrize("faster", ["peer", "disk"])
def test_blocks_on_this_instances_disk_and_in_a_peers_cpu_tier_load_from_the_one_measured_faster(
    redis_url, model, tmp_path, faster, peers_seen_at_once
):
    """The peer tier sits before disk in the lookup order where the cost model says
    so: over RDMA a peer's memory can beat a local NVMe read, over TCP it may not."""
    a = instance(redis_url, "a", model)
    b = instance(redis_url, "b", model, disk=str(tmp_path / "disk"))
    try:
        hashes, pages = blocks(11)
        on_disk_only(b, hashes, pages)  # before a holds them: b computes them itself
        computed(a, hashes, pages)
        slower = "disk" if faster == "peer" else "peer"
        measured(b, **{faster: 0.001, slower: 0.05})
        served = b.serve(hashes)
        assert served.tiers == [faster] * BLOCKS
        assert [bytes(kv) for kv in served.kv] == pages
    finally:
        b.close()
        a.close()


def test_an_unmeasured_peer_is_tried_in_place_of_a_measured_disk_then_judged(
    redis_url, model, tmp_path, peers_seen_at_once
):
    """A tier never measured counts as free, so the first such hit reads the peer and
    times it; once both are measured, the faster one serves."""
    a = instance(redis_url, "a", model)
    b = instance(redis_url, "b", model, disk=str(tmp_path / "disk"))
    try:
        hashes, pages = blocks(12)
        on_disk_only(b, hashes, pages)
        computed(a, hashes, pages)
        measured(b, disk=0.05)
        request = SimpleNamespace(
            request_id="first",
            block_hashes=hashes,
            num_tokens=BLOCKS * BLOCK_SIZE + 1,
            num_prompt_tokens=BLOCKS * BLOCK_SIZE + 1,
        )
        b.scheduler.get_num_new_matched_tokens(request, 0)
        assert b.scheduler._lookups["first"].tiers == ["peer"] * BLOCKS
        measured(b, peer=1.0)  # as if that read had been this slow
        b.scheduler._lookups.clear()
        b.scheduler.get_num_new_matched_tokens(request, 0)
        assert b.scheduler._lookups["first"].tiers == ["disk"] * BLOCKS
    finally:
        b.close()
        a.close()


def test_without_nixl_the_tier_is_off_and_nothing_else_changes(redis_url, model, monkeypatch):
    a = instance(redis_url, "a", model)
    try:
        hashes, pages = blocks(10)
        computed(a, hashes, pages)
        monkeypatch.setattr("tiercache.tiers.peer.tier.load_nixl", lambda: None)
        monkeypatch.setattr("connector.scheduler.load_nixl", lambda: None)
        b = instance(redis_url, "b", model)
        try:
            assert b.scheduler.peers is None
            assert b.serve(hashes, pages).tiers == [None] * BLOCKS
            assert b.worker.peer is None
            b.deliver_reports()
            assert b.serve(hashes).tiers == ["cpu"] * BLOCKS
        finally:
            b.close()
    finally:
        a.close()

"""What the disk root holds besides its objects stays within one allowance for the
root: the files of objects evicted a moment ago (kept for loads planned before the
eviction was reported), and what a writer killed with `kill -9` left behind.

Evicted files were budgeted per tier, each tier allowed a 32nd of the capacity: 8
digests on one root held 1.25x `disk.capacity` while the usage metric showed the
root within it. And the lingering files of a killed process, or a file renamed into
place before the commit that would have counted it, stayed uncounted until a tier
on the root restarted."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client import REGISTRY
from test_tiers import TMP_PREFIX, bytes_under, key_of, object_size, store

import tiercache.tiers.disk.room as room_module
from tiercache.tiers.disk.tier import LINGER_SHARE, DiskTier


def usage_metric() -> float:
    return REGISTRY.get_sample_value("tiercache_tier_usage_bytes", {"tier": "disk"}) or 0.0


def test_one_lingering_allowance_per_root_however_many_digests_evict(tmp_path):
    object_bytes = object_size(tmp_path)
    capacity = 64 * object_bytes  # 2 objects' worth may linger
    root = tmp_path / "disk"
    digests = [f"{i:x}" * 16 for i in range(1, 9)]
    tiers = [DiskTier(root, capacity, digest=digest) for digest in digests]
    most = 0
    for n in range(24):  # 8 x 24 objects into room for 64: every tier evicts
        for tier, digest in zip(tiers, digests, strict=True):
            store(tier, key_of(n, digest))
            most = max(most, bytes_under(root))
    assert most <= capacity + capacity // LINGER_SHARE
    assert usage_metric() == bytes_under(root)  # the metric counts the lingering files too


_KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import tiercache.tiers.disk.tier as disk
    from tiercache.tiers.disk.index import RootIndex
    from tiercache.tiers.format import ObjectHeader, checksum

    root, digest, how = sys.argv[1], sys.argv[2], sys.argv[5]
    capacity, count = int(sys.argv[3]), int(sys.argv[4])

    def put(tier, i):
        data = np.random.default_rng(i).integers(0, 256, 65536, dtype=np.uint8).tobytes()
        key = f"{digest}/{i:064x}"
        return tier.put(key, memoryview(data), ObjectHeader(key, digest, len(data), checksum(data)))

    tier = disk.DiskTier(root, capacity, digest=digest)
    for i in range(1000, 1000 + count):  # fills the root: some evicted files linger
        assert put(tier, i)
    die = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    if how == "renamed":
        RootIndex.add = die  # the file is in place; the commit that counts it never comes
    else:
        real = disk.write_all
        disk.write_all = lambda fd, *parts: (real(fd, parts[0]), die())  # the header only
    put(tier, 5000)
    """
)


def kill_mid_store(root: Path, digest: str, capacity: int, count: int, how: str) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(root), digest, str(capacity), str(count), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr


def test_what_a_killed_writer_leaves_is_counted_and_reclaimed_without_a_restart(tmp_path, monkeypatch):
    """Two engines of one model share a root (their digest too); one is killed with
    `kill -9` while storing, once right after renaming an object into place and once
    mid-write, each time with evicted files lingering. The engine still running is not
    restarted: its next stores reclaim what the dead one left, and the root stays
    within one allowance."""
    monkeypatch.setattr(room_module, "UNUSED_RECHECK_SECONDS", 0.0)  # sweep at every eviction
    object_bytes = object_size(tmp_path)
    capacity = 64 * object_bytes
    bound = capacity + capacity // LINGER_SHARE
    root, digest = tmp_path / "disk", "abcdefabcdefabcd"
    running = DiskTier(root, capacity, digest=digest)
    for n, how in enumerate(("renamed", "mid-write")):
        kill_mid_store(root, digest, capacity, 70, how)
        if how == "renamed":
            assert (root / digest / "00" / f"{5000:064x}.safetensors").exists()  # never counted
        else:
            assert list(root.rglob(f"{TMP_PREFIX}*"))
        for i in range(100 * n, 100 * n + 70):
            store(running, key_of(i, digest))
            assert bytes_under(root) <= bound
        assert not list(root.rglob(f"{TMP_PREFIX}*"))
        assert running.index.on_disk() == bytes_under(root)  # nothing on disk off the books
    assert not (root / digest / "00" / f"{5000:064x}.safetensors").exists()
    assert len(running) == 64

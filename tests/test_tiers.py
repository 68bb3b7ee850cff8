"""The storage tiers on their own: CPU slots, disk files, S3 objects, and the
safetensors object format they share."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY
from safetensors import safe_open

from tiercache.config import S3TierConfig
from tiercache.index.keys import split_key
from tiercache.tiers.cpu import CpuBuffer, CpuTierFull, SlotAllocator, slots_for
from tiercache.tiers.disk.index import INDEX_DIR, INDEX_FILE, RootIndex
from tiercache.tiers.disk.layout import SUFFIX, TMP_PREFIX
from tiercache.tiers.disk.tier import DiskTier
from tiercache.tiers.format import DATA_ALIGN, ObjectHeader, checksum
from tiercache.tiers.s3.runs import RunGeometry
from tiercache.tiers.s3.tier import Fetch, ObjectBody, S3Tier

from support.faults import TcpProxy
from support.s3_blocks import StoredBlock, fetch_block, put_block

DIGEST = "0123456789abcdef"
BLOCK = 64 * 1024


def key_of(i: int, digest: str = DIGEST) -> str:
    return f"{digest}/{i:064x}"


def payload(i: int, size: int = BLOCK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def header_for(key: str, data: bytes | memoryview) -> ObjectHeader:
    return ObjectHeader(
        key=key,
        namespace_digest=key.split("/")[0],
        nbytes=len(data),
        checksum=checksum(data),
        layout="LBHNC",
        dtype="bfloat16",
        shapes="[[2,8,32,128]]",
    )


def put(tier, i: int, size: int = BLOCK) -> bytes:
    data = payload(i, size)
    key = key_of(i)
    assert tier.put(key, memoryview(data), header_for(key, data))
    return data


def read(tier, i: int, size: int = BLOCK) -> bytes | None:
    out = bytearray(size)
    return bytes(out) if tier.get_into(key_of(i), memoryview(out)) else None


def errors(tier: str, kind: str) -> float:
    return REGISTRY.get_sample_value("tiercache_tier_errors_total", {"tier": tier, "kind": kind}) or 0.0


def evictions(tier: str) -> float:
    return REGISTRY.get_sample_value("tiercache_tier_evictions_total", {"tier": tier}) or 0.0


# -- CPU ------------------------------------------------------------------------------


def test_slot_allocator_lru():
    slots = SlotAllocator(3, BLOCK)
    taken = {}
    for name in "abc":
        slot, evicted = slots.allocate(name)
        assert evicted is None
        taken[name] = slot
        slots.unpin(slot)
    assert sorted(taken.values()) == [0, 1, 2]
    # A read makes "a" the most recent: "b" is now the oldest.
    assert slots.pin("a") == taken["a"]
    slots.unpin(taken["a"])
    before = evictions("cpu")
    slot, evicted = slots.allocate("d")
    assert evicted == "b" and slot == taken["b"]
    assert evictions("cpu") == before + 1
    assert "b" not in slots and slots.slot_of("d") == slot
    slots.unpin(slot)
    slots.touch(["c"])
    assert slots.keys() == ["a", "d", "c"]
    with pytest.raises(KeyError):
        slots.allocate("a")


def test_slot_allocator_never_hands_out_a_pinned_slot():
    slots = SlotAllocator(2, BLOCK)
    a, _ = slots.allocate("a")  # pinned: being filled
    b, _ = slots.allocate("b")
    slots.unpin(b)
    slot, evicted = slots.allocate("c")  # "a" is older but pinned: "b" goes
    assert evicted == "b" and slot == b
    with pytest.raises(CpuTierFull):
        slots.allocate("d")  # both pinned
    # Two readers of one slot: it stays pinned until the last one lets go.
    slots.unpin(a)
    assert slots.pin("a") == a and slots.pin("a") == a  # "a" is now the most recent
    slots.unpin(slot)
    slot_e, evicted = slots.allocate("e")
    assert evicted == "c" and slot_e == slot
    with pytest.raises(CpuTierFull):
        slots.allocate("f")  # "e" is being filled, "a" has two readers
    slots.unpin(a)
    with pytest.raises(CpuTierFull):
        slots.allocate("f")  # one reader left
    slots.unpin(a)
    assert slots.allocate("f") == (a, "a")


def test_slot_removed_while_pinned_is_freed_on_last_unpin():
    slots = SlotAllocator(1, BLOCK)
    slot, _ = slots.allocate("a")
    assert slots.remove("a")
    assert "a" not in slots and not slots.remove("a")
    with pytest.raises(CpuTierFull):
        slots.allocate("b")  # the slot is still being written
    slots.unpin(slot)
    assert slots.allocate("b") == (slot, None)
    assert slots.usage_bytes() == BLOCK
    assert slots.clear() == 1 and len(slots) == 0


def test_cpu_buffer_round_trip():
    buffer = CpuBuffer(4, BLOCK, pin_memory=False)
    assert buffer.tensor.data_ptr() % DATA_ALIGN == 0
    assert buffer.tensor.shape == (4, BLOCK)
    for slot in range(4):
        buffer.view(slot)[:] = payload(slot)
    for slot in range(4):
        assert bytes(buffer.view(slot)) == payload(slot)
    # Views alias the one buffer: no copy per block.
    assert buffer.tensor[2].numpy().tobytes() == payload(2)
    view = buffer.view(3)
    view[:4] = b"\x00\x01\x02\x03"
    assert buffer.tensor[3, :4].tolist() == [0, 1, 2, 3]


def test_slots_for():
    assert slots_for(10 * BLOCK + 5, BLOCK) == 10
    with pytest.raises(ValueError, match="smaller than one block"):
        slots_for(BLOCK - 1, BLOCK)
    with pytest.raises(ValueError):
        SlotAllocator(0)


# -- keys and names ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "../../etc/passwd",
        f"{DIGEST}/../{'0' * 64}",
        f"{DIGEST}/{'0' * 62}/x",
        f"/{DIGEST}/{'0' * 64}",
        f"{DIGEST}/{'0' * 32}/{'0' * 32}",
        f"..{DIGEST[2:]}/{'0' * 64}",
        f"{DIGEST}/{'0' * 63}.",
        f"{DIGEST.upper()}/{'0' * 64}",
        f"{DIGEST}\\{'0' * 64}",
        f"{DIGEST}/{'0' * 64}\n",
        "",
    ],
)
def test_keys_cannot_name_paths(bad, tmp_path):
    with pytest.raises(ValueError):
        split_key(bad)
    tier = DiskTier(tmp_path / "root", 1 << 20)
    with pytest.raises(ValueError):
        tier.path_of(bad)
    with pytest.raises(ValueError):
        S3Tier(S3TierConfig(bucket="kv"), client=object()).object_name(bad)


def test_disk_paths_stay_under_the_root(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    path = tier.path_of(key_of(7))
    assert path.resolve().is_relative_to(tmp_path.resolve())
    assert path.name.endswith(".safetensors")


# -- disk ---------------------------------------------------------------------------------


def test_disk_round_trip(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30)
    data = put(tier, 1)
    assert read(tier, 1) == data
    assert key_of(1) in tier and len(tier) == 1
    assert tier.read_header(key_of(1)).checksum == checksum(data)
    assert read(tier, 2) is None  # a miss is not an error
    assert tier.usage_bytes() == tier.path_of(key_of(1)).stat().st_size
    # Putting a key again is a no-op that succeeds.
    assert tier.put(key_of(1), memoryview(data), header_for(key_of(1), data))
    assert len(tier) == 1
    assert tier.delete(key_of(1)) and not tier.path_of(key_of(1)).exists()
    assert tier.usage_bytes() == 0


def test_disk_o_direct_round_trip(tmp_path):
    buffer = CpuBuffer(2, BLOCK, pin_memory=False)
    buffer.view(0)[:] = payload(3)
    tier = DiskTier(tmp_path, 1 << 30, o_direct=True, fsync=True)
    key = key_of(3)
    assert tier.put(key, buffer.view(0), header_for(key, payload(3)))
    assert tier.get_into(key, buffer.view(1))
    assert bytes(buffer.view(1)) == payload(3)
    # An unaligned source falls back to buffered writes instead of failing.
    odd = payload(4, BLOCK - 100)
    assert tier.put(key_of(4), memoryview(odd), header_for(key_of(4), odd))
    assert read(tier, 4, BLOCK - 100) == odd


def test_disk_o_direct_full_disk_is_a_dropped_store(tmp_path, monkeypatch):
    import errno

    import tiercache.tiers.disk.tier as disk_module

    def no_space(fd, *parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    buffer = CpuBuffer(1, BLOCK, pin_memory=False)
    buffer.view(0)[:] = payload(3)
    tier = DiskTier(tmp_path, 1 << 30, o_direct=True)
    monkeypatch.setattr(disk_module, "write_all", no_space)
    before = errors("disk", "disk_full")
    assert not tier.put(key_of(3), buffer.view(0), header_for(key_of(3), payload(3)))
    assert errors("disk", "disk_full") == before + 1
    assert len(tier) == 0 and not list(tmp_path.rglob(f"{TMP_PREFIX}*"))


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 1 MiB filesystem (tmpfs) that fills up. Mounting needs root, which the
    test command's machines have."""
    mount = tmp_path / "small-fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"a real full disk needs a small tmpfs, and mount refused: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_tier_on_a_really_full_filesystem_drops_stores_and_keeps_serving(small_filesystem):
    tier = DiskTier(small_filesystem, 1 << 30)  # the tier thinks it has room; the disk does not
    before = errors("disk", "disk_full")
    stored = {}
    for i in range(40):  # 40 objects of 68 KiB into 1 MiB
        data = payload(i)
        if tier.put(key_of(i), memoryview(data), header_for(key_of(i), data)):
            stored[i] = data
    assert 5 < len(stored) < 40
    assert errors("disk", "disk_full") >= before + 40 - len(stored)
    assert not list(small_filesystem.rglob(f"{TMP_PREFIX}*"))  # no partial object left behind
    assert len(tier) == len(stored)
    for i, data in stored.items():
        assert read(tier, i) == data
    # Room made (as eviction would): stores work again.
    for i in list(stored)[:3]:
        tier.delete(key_of(i))
    assert tier.put(key_of(99), memoryview(payload(99)), header_for(key_of(99), payload(99)))
    assert read(tier, 99) == payload(99)


def test_disk_reads_objects_written_by_other_safetensors_writers(tmp_path):
    """Objects whose pages do not start at 4 KiB (another writer, an older version)
    are still read, through the slower path."""
    from safetensors.numpy import save_file

    tier = DiskTier(tmp_path, 1 << 30)
    data = payload(11)
    path = tier.path_of(key_of(11))
    path.parent.mkdir(parents=True)
    meta = {
        "format": "tiercache",
        "key": key_of(11),
        "namespace_digest": DIGEST,
        "checksum_xxh3_64": checksum(data),
    }
    save_file({"kv": np.frombuffer(data, dtype=np.uint8)}, str(path), metadata=meta)
    assert (path.stat().st_size - len(data)) % DATA_ALIGN != 0
    restarted = DiskTier(tmp_path, 1 << 30)
    assert read(restarted, 11) == data
    # A big header (over 4 KiB) is read whole too.
    meta["layout"] = "x" * 10_000
    save_file({"kv": np.frombuffer(data, dtype=np.uint8)}, str(path), metadata=meta)
    assert read(restarted, 11) == data


def test_disk_capacity_evicts_least_recently_used(tmp_path):
    probe = DiskTier(tmp_path / "probe", 1 << 30)
    put(probe, 0)
    object_bytes = probe.usage_bytes()
    tier = DiskTier(tmp_path / "tier", 3 * object_bytes)
    for i in range(3):
        put(tier, i)
    assert read(tier, 0) is not None  # 0 is now the most recent; 1 is the oldest
    before = evictions("disk")
    put(tier, 3)
    assert sorted(tier.keys()) == sorted([key_of(0), key_of(2), key_of(3)])
    assert not tier.path_of(key_of(1)).exists()
    assert read(tier, 1) is None
    assert evictions("disk") == before + 1
    assert tier.usage_bytes() <= 3 * object_bytes
    files = list((tmp_path / "tier").rglob("*.safetensors"))
    assert len(files) == 3
    # An object bigger than the whole tier is refused, and evicts nothing.
    big = payload(9, 4 * object_bytes)
    assert not tier.put(key_of(9), memoryview(big), header_for(key_of(9), big))
    assert len(tier) == 3


def test_an_object_evicted_a_moment_ago_still_serves_the_read_planned_from_it(tmp_path):
    """The scheduler plans a disk load from what the workers last reported. Under
    serving load, a write beside the step evicted the oldest object (the one the next
    turn of the oldest conversation asks for) between the plan and the read, and the
    load failed with nothing wrong.
    An evicted object is reported removed at once, but its file lingers, readable,
    until the lingering files outgrow a 32nd of the capacity."""
    probe = DiskTier(tmp_path / "probe", 1 << 30)
    put(probe, 0)
    object_bytes = probe.usage_bytes()
    removed: list[str] = []
    tier = DiskTier(tmp_path / "tier", 128 * object_bytes, on_remove=removed.append)  # 4 may linger
    data = {i: put(tier, i) for i in range(129)}
    victim = int(removed[-1].split("/")[1], 16)
    assert key_of(victim) not in tier
    assert read(tier, victim) == data[victim]  # as a load planned before the report reads it
    files = lambda: list((tmp_path / "tier").rglob("*.safetensors"))  # noqa: E731
    for i in range(129, 140):
        put(tier, i)
        assert len(files()) <= 128 + 4
    assert read(tier, victim) is None  # its grace is over
    # Written again while it lingers: the new object is kept.
    lingering = int(removed[-1].split("/")[1], 16)
    put(tier, lingering)
    for i in range(140, 150):
        put(tier, i)
    assert key_of(lingering) in tier and read(tier, lingering) == data[lingering]
    assert len(files()) <= 128 + 4 and len(tier) == 128


def test_disk_restart_reindexes_by_mtime(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30)
    data = {i: put(tier, i) for i in range(4)}
    object_bytes = tier.usage_bytes() // 4
    # Recency as a restart sees it: 2 oldest, then 0, 3, 1.
    now = time.time()
    for age, i in enumerate([1, 3, 0, 2]):
        os.utime(tier.path_of(key_of(i)), (now - 100 * (age + 1), now - 100 * (age + 1)))
    # A root without its index (an older tiercache wrote it): recency comes from mtimes.
    tier.close()
    shutil.rmtree(tmp_path / INDEX_DIR)
    (tmp_path / "not-a-digest").mkdir()
    (tmp_path / DIGEST / "zz").mkdir(exist_ok=True)
    (tmp_path / DIGEST / "zz" / "junk.txt").write_text("x")

    again = DiskTier(tmp_path, 1 << 30)
    assert again.keys() == [key_of(2), key_of(0), key_of(3), key_of(1)]
    assert again.usage_bytes() == 4 * object_bytes
    assert all(read(again, i) == data[i] for i in range(4))

    # A smaller capacity on restart evicts the oldest by mtime.
    now = time.time()
    for age, i in enumerate([1, 3, 0, 2]):
        os.utime(tier.path_of(key_of(i)), (now - 100 * (age + 1), now - 100 * (age + 1)))
    smaller = DiskTier(tmp_path, 2 * object_bytes)
    assert sorted(smaller.keys()) == sorted([key_of(3), key_of(1)])
    assert not tier.path_of(key_of(2)).exists() and not tier.path_of(key_of(0)).exists()

    # touch() persists recency across a restart.
    smaller.touch(key_of(3))
    assert DiskTier(tmp_path, 1 << 30).keys() == [key_of(1), key_of(3)]


def store(tier: DiskTier, key: str) -> None:
    data = payload(int(key.split("/")[1], 16))
    assert tier.put(key, memoryview(data), header_for(key, data))


def object_size(tmp_path: Path) -> int:
    probe = DiskTier(tmp_path / "probe", 1 << 30)
    put(probe, 0)
    return probe.usage_bytes()


def bytes_under(root: Path) -> int:
    return sum(
        path.stat().st_size for path in root.rglob(f"*{SUFFIX}") if not path.name.startswith(TMP_PREFIX)
    )


_FILLER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from tiercache.tiers.disk.tier import DiskTier
    from tiercache.tiers.format import ObjectHeader, checksum

    root, digest, capacity, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tier = DiskTier(root, capacity, digest=digest)
    print("ready", flush=True)
    sys.stdin.readline()  # both engines store at once
    for i in range(count):
        data = np.random.default_rng(i).integers(0, 256, 65536, dtype=np.uint8).tobytes()
        key = f"{digest}/{i:064x}"
        assert tier.put(key, memoryview(data), ObjectHeader(key, digest, len(data), checksum(data)))
    assert all(tier.path_of(key).exists() for key in tier.keys())
    """
)


def test_an_engine_opens_the_disk_index_while_another_creates_its_schema(tmp_path):
    """Two engines starting at once on one root: one holds the index's write lock
    while it creates the schema, as the other switches the index to WAL. SQLite
    refuses that switch at once, without waiting out its busy timeout, and the second
    engine's disk tier failed to start (test_two_processes_on_one_root_keep_one_budget
    failed that way about one run in three)."""
    (tmp_path / INDEX_DIR).mkdir()
    first = sqlite3.connect(tmp_path / INDEX_DIR / INDEX_FILE, isolation_level=None, check_same_thread=False)
    first.execute("BEGIN IMMEDIATE")
    ends = threading.Timer(0.2, lambda: first.execute("COMMIT"))
    ends.start()
    try:
        index = RootIndex(tmp_path)
        with index.write():  # and it writes, once the first engine's transaction is over
            pass
    finally:
        ends.join()
        first.close()


def test_two_processes_on_one_root_keep_one_budget(tmp_path):
    """Two engines on one node sharing `disk.path` (data-parallel ranks, several
    TP=1 engines), storing at the same time: the root stays within the capacity,
    not within twice it."""
    capacity = 8 * object_size(tmp_path)
    root = tmp_path / "disk"
    engines = [
        subprocess.Popen(
            [sys.executable, "-c", _FILLER, str(root), digest, str(capacity), "12"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for digest in ("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb")
    ]
    try:
        assert [engine.stdout.readline().strip() for engine in engines] == ["ready", "ready"]
        for engine in engines:
            engine.stdin.write("go\n")
            engine.stdin.flush()
        assert [engine.wait(timeout=60) for engine in engines] == [0, 0]
    finally:
        for engine in engines:
            if engine.poll() is None:
                engine.kill()
                engine.wait()
    assert bytes_under(root) <= capacity
    whole = DiskTier(root, 1 << 30)
    assert len(whole.keys()) == 8 and whole.usage_bytes() == bytes_under(root)


def test_an_unused_digests_objects_go_first_then_its_folder(tmp_path):
    """A digest no engine uses any more (new weights, another TP size, keys of an
    older tiercache) is reclaimed before the objects of the digests in use, however
    recently it was used, and its folder goes once empty."""
    object_bytes = object_size(tmp_path)
    live, stale = "1111111111111111", "2222222222222222"
    tier = DiskTier(tmp_path / "disk", 6 * object_bytes, digest=live)
    for i in range(3):
        store(tier, key_of(i, live))
    before = DiskTier(tmp_path / "disk", 6 * object_bytes, digest=stale)  # the engine of the old weights
    for i in range(3):
        store(before, key_of(i, stale))
    before.close()  # ...is gone: nothing uses its digest now
    for i in range(3, 6):
        store(tier, key_of(i, live))
    assert tier.keys() == [key_of(i, live) for i in range(6)]
    assert not (tmp_path / "disk" / stale).exists()
    assert bytes_under(tmp_path / "disk") <= 6 * object_bytes
    # A digest in use is not reclaimed: the least recently used go, whoever's they are.
    other = DiskTier(tmp_path / "disk", 6 * object_bytes, digest=stale)
    store(other, key_of(9, stale))
    assert other.keys() == [key_of(9, stale)] and tier.keys() == [key_of(i, live) for i in range(1, 6)]


_SLOW_WRITER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import tiercache.tiers.disk.tier as disk
    from tiercache.tiers.format import ObjectHeader, checksum

    root, digest = sys.argv[1], sys.argv[2]

    def put(tier, i, size):
        data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
        key = f"{digest}/{i:064x}"
        header = ObjectHeader(key, digest, size, checksum(data))
        return tier.put(key, memoryview(data), header)

    tier = disk.DiskTier(root, 1 << 30)
    assert put(tier, 1, 65536)  # one whole object before the slow one

    def slow_write_all(fd, *parts):
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                written = os.write(fd, view[:65536])
                view = view[written:]
                time.sleep(0.02)

    disk.write_all = slow_write_all
    print("writing", flush=True)
    put(tier, 2, 64 << 20)  # about 20 s at this pace: killed long before
    print("finished", flush=True)
    """
)


def test_kill_9_mid_write_leaves_no_partial_object(tmp_path):
    root = tmp_path / "disk"
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(root), DIGEST],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert child.stdout.readline().strip() == "writing"
        temp_files: list[Path] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            temp_files = list(root.rglob(f"{TMP_PREFIX}*"))
            if temp_files and temp_files[0].stat().st_size > 256 * 1024:
                break
            time.sleep(0.02)
        assert temp_files, "the child never started its slow write"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert temp_files[0].name.startswith(f"{TMP_PREFIX}{child.pid}-")
    assert temp_files[0].exists()  # the dead writer's temp file is still there...

    probe = DiskTier(tmp_path / "probe", 1 << 30)
    partial = probe.path_of(key_of(2)).relative_to(tmp_path / "probe")
    assert not (root / partial).exists()  # ...but never under the object's name

    tier = DiskTier(root, 1 << 30)
    assert tier.keys() == [key_of(1)]  # the complete object survives
    assert read(tier, 1) == payload(1)
    assert read(tier, 2, 64 << 20) is None
    assert not temp_files[0].exists()  # cleaned on start, since its writer is dead
    assert not list(root.rglob(f"{TMP_PREFIX}*"))


_LOCK_HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"partial")
    print("locked", flush=True)
    time.sleep(60)
    """
)


def test_temp_files_are_told_dead_by_their_writers_lock_not_their_pid(tmp_path):
    """A restarted container has a pid namespace of its own: the pid in a dead
    writer's temp file may name a live process here (this one, even), and a live
    writer's pid may mean nothing here. A writer holds a lock on its temp file until
    the rename; the kernel drops it with the writer, whatever namespace it ran in."""
    tier = DiskTier(tmp_path, 1 << 30)
    put(tier, 1)
    folder = tier.path_of(key_of(1)).parent
    held = folder / f"{TMP_PREFIX}4194999-0a0b-{'0' * 64}.safetensors"  # no such pid here
    dead = folder / f"{TMP_PREFIX}{os.getpid()}-0c0d-{'1' * 64}.safetensors"  # a pid alive here
    junk = folder / f"{TMP_PREFIX}notapid-{'2' * 64}.safetensors"
    writer = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(held)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline().strip() == "locked"
        for path in (dead, junk):
            path.write_bytes(b"partial")
        DiskTier(tmp_path, 1 << 30)
        assert held.exists()  # its writer is still at it
        assert not dead.exists() and not junk.exists()
    finally:
        writer.kill()
        writer.wait()
    DiskTier(tmp_path, 1 << 30)
    assert not held.exists()  # its writer is gone now
    assert read(DiskTier(tmp_path, 1 << 30), 1) == payload(1)


@pytest.mark.parametrize("damage", ["flip_data", "flip_header", "truncate", "noise"])
def test_disk_corruption_is_caught(tmp_path, damage):
    removed = []
    tier = DiskTier(tmp_path, 1 << 30, on_remove=removed.append)
    put(tier, 5)
    path = tier.path_of(key_of(5))
    raw = bytearray(path.read_bytes())
    offset = header_for(key_of(5), payload(5)).data_offset
    if damage == "flip_data":
        raw[offset + 1000] ^= 0xFF
    elif damage == "flip_header":
        raw[20:24] = b"\xff\xfe\xfd\xfc"
    elif damage == "truncate":
        raw = raw[: offset + 1000]
    else:
        raw = bytearray(os.urandom(len(raw)))
    path.write_bytes(bytes(raw))
    before = errors("disk", "corrupt")
    out = bytearray(BLOCK)
    assert not tier.get_into(key_of(5), memoryview(out))
    assert errors("disk", "corrupt") == before + 1
    assert key_of(5) not in tier and not path.exists()
    assert removed == [key_of(5)]
    assert tier.usage_bytes() == 0


def test_disk_object_under_the_wrong_name_is_refused(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30)
    put(tier, 1)
    put(tier, 2)
    tier.path_of(key_of(2)).write_bytes(tier.path_of(key_of(1)).read_bytes())
    before = errors("disk", "corrupt")
    assert read(tier, 2) is None
    assert errors("disk", "corrupt") == before + 1
    assert read(tier, 1) == payload(1)
    # A reader asking for the wrong size is refused too, not handed a short block.
    assert read(tier, 1, BLOCK * 2) is None


def test_object_opens_with_safetensors(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30)
    data = put(tier, 6)
    path = tier.path_of(key_of(6))
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        assert meta["key"] == key_of(6)
        assert meta["namespace_digest"] == DIGEST
        assert meta["checksum_xxh3_64"] == checksum(data)
        assert meta["layout"] == "LBHNC" and meta["dtype"] == "bfloat16"
        assert list(f.keys()) == ["kv"]
        tensor = f.get_tensor("kv")
    assert tensor.dtype == np.uint8 and tensor.tobytes() == data
    # The pages start on a 4 KiB boundary, for O_DIRECT and straight reads.
    assert (path.stat().st_size - len(data)) % DATA_ALIGN == 0


# -- S3 -------------------------------------------------------------------------------------


@pytest.fixture
def s3_tier(s3_endpoint, bucket):
    tier = S3Tier(
        S3TierConfig(bucket=bucket, prefix="t/", endpoint_url=s3_endpoint, region="us-east-1", max_attempts=1)
    )
    yield tier
    tier.close()


def put_s3(tier: S3Tier, i: int, size: int = BLOCK) -> tuple[StoredBlock | None, bytes]:
    data = payload(i, size)
    return put_block(tier, header_for(key_of(i), data), data), data


def read_s3(tier: S3Tier, stored: StoredBlock, size: int = BLOCK) -> bytes | None:
    out = bytearray(size)
    return bytes(out) if fetch_block(tier, stored, memoryview(out)) is Fetch.OK else None


def test_s3_round_trip(s3_tier):
    stored, data = put_s3(s3_tier, 1)
    assert stored is not None and read_s3(s3_tier, stored) == data
    names = [item["Key"] for item in s3_tier.client.list_objects_v2(Bucket=s3_tier.bucket)["Contents"]]
    assert names == [s3_tier.run_name(DIGEST, stored.run_hex)]
    assert [(d, run) for d, run, _, _ in s3_tier.list_runs()] == [(DIGEST, stored.run_hex)]
    assert list(s3_tier.list_runs("f" * 16)) == []
    assert s3_tier.ping()


def test_s3_lists_only_the_per_block_objects_of_a_tiercache_before_runs(s3_tier):
    """What GC reclaims (tiers/s3/legacy.py): `<prefix><digest>/<block>.safetensors`."""
    put_s3(s3_tier, 1)
    s3_tier.client.put_object(Bucket=s3_tier.bucket, Key=s3_tier.object_name(key_of(2)), Body=b"old")
    assert [key for key, _, _ in s3_tier.list_objects()] == [key_of(2)]
    assert [key for key, _, _ in s3_tier.list_objects(DIGEST)] == [key_of(2)]
    assert list(s3_tier.list_objects("f" * 16)) == []


def test_s3_many_objects_in_parallel(s3_tier):
    futures = {i: s3_tier.pool.submit(put_s3, s3_tier, i, BLOCK + i) for i in range(16)}
    stored = {i: future.result() for i, future in futures.items()}
    reads = {i: s3_tier.pool.submit(read_s3, s3_tier, stored[i][0], BLOCK + i) for i in range(16)}
    assert all(reads[i].result() == stored[i][1] for i in range(16))


def test_object_body_streams_header_then_pages_as_views():
    preamble, data = b"h" * 4096, payload(7, 3 * BLOCK)
    body = ObjectBody(preamble, memoryview(data))
    assert len(body) == len(preamble) + len(data)
    first = body.read(1 << 20)
    assert bytes(first) == preamble  # a short read where the header ends
    assert isinstance(first, memoryview)  # a view of the slot, not a copy
    rest = []
    while chunk := body.read(10_000):
        rest.append(bytes(chunk))
    assert b"".join(rest) == data
    assert body.tell() == len(body) and body.read(5) == b""
    # botocore rewinds to hash the body, and again to send it on a retry.
    assert body.seek(0) == 0 and body.read() == preamble + data
    assert body.seek(-3, 2) == len(body) - 3 and body.read() == data[-3:]
    assert body.seek(4090) == 4090 and body.read(-1) == preamble[-6:] + data


class CutFirstUpload(TcpProxy):
    """Forwards to S3, but cuts the first connection once it has carried 256 KiB of
    a request: an upload that breaks off mid-body."""

    def __init__(self, upstream_port: int):
        super().__init__(upstream_port)
        self.cut = threading.Event()

    def _pump(self, src, dst) -> None:
        upload = src.getsockname()[1] == self.port  # from the client, towards S3
        if not upload or self.cut.is_set():
            return super()._pump(src, dst)
        self.cut.set()
        carried = 0
        with contextlib.suppress(OSError):
            while carried < 256 * 1024 and (data := src.recv(65536)):
                dst.sendall(data)
                carried += len(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def test_s3_put_cut_mid_body_is_retried_whole(s3_endpoint, bucket):
    """A retried PUT sends the body again from its start (the stream is rewound), so
    the stored object is whole and verifies."""
    proxy = CutFirstUpload(int(s3_endpoint.rsplit(":", 1)[1])).start()
    config = S3TierConfig(bucket=bucket, prefix="t/", region="us-east-1", max_attempts=3)
    through_proxy = S3Tier(config.model_copy(update={"endpoint_url": proxy.url}))
    direct = S3Tier(config.model_copy(update={"endpoint_url": s3_endpoint}))
    try:
        stored, data = put_s3(through_proxy, 5, 2 << 20)
        assert proxy.cut.is_set() and stored is not None
        assert read_s3(direct, stored, 2 << 20) == data
    finally:
        through_proxy.close()
        direct.close()
        proxy.stop()


def test_s3_miss_is_not_an_error(s3_tier):
    before = errors("s3", "client_error")
    never_stored = StoredBlock(key_of(42), DIGEST, "00" * 8, RunGeometry(4096, 4096, BLOCK))
    assert fetch_block(s3_tier, never_stored, memoryview(bytearray(BLOCK))) is Fetch.MISSING
    assert errors("s3", "client_error") == before


def test_s3_unreachable_is_a_bounded_failure(bucket):
    # Nothing listens on this port: every call fails fast with a counted error.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tier = S3Tier(
        S3TierConfig(
            bucket=bucket,
            endpoint_url=f"http://127.0.0.1:{port}",
            region="us-east-1",
            connect_timeout=0.2,
            read_timeout=0.2,
            max_attempts=1,
        )
    )
    try:
        before = errors("s3", "unreachable")
        stored, _ = put_s3(tier, 1)
        assert stored is None
        nowhere = StoredBlock(key_of(1), DIGEST, "00" * 8, RunGeometry(4096, 4096, BLOCK))
        assert fetch_block(tier, nowhere, memoryview(bytearray(BLOCK))) is Fetch.UNAVAILABLE
        assert errors("s3", "unreachable") == before + 2
        assert not tier.ping()
    finally:
        tier.close()

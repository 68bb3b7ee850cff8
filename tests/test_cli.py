"""The `tiercache` command as users run it: the installed console script, in a
subprocess, against a real redis-server and moto's S3 server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tiercache.config import RedisConfig, load_config
from tiercache.connector.driver import ConnectorDriver
from tiercache.index.presence import PresencePublisher
from tiercache.index.redis_conn import GuardedRedis
from tiercache.index.redis_index import Deployment, RedisIndex
from tiercache.ops.local_stack import free_port
from tiercache.tiers.peer.agent import PeerRecord
from tiercache.tiers.peer.registry import PeerRegistry

SLOT = 4096
TIERCACHE = Path(sys.executable).with_name("tiercache")


def run(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(TIERCACHE), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


@pytest.fixture
def setup(redis_url, s3_endpoint, bucket, tmp_path):
    """A config file with every tier, and three blocks of one deployment written
    through the engine into all of them."""
    redis = GuardedRedis(redis_url, RedisConfig())
    redis.client.flushdb()
    redis.close()
    path = tmp_path / "tiercache.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "namespace": "cli-ns",
                "redis_url": redis_url,
                "cpu": {"capacity": 64 * SLOT},
                "disk": {"path": str(tmp_path / "disk")},
                "s3": {
                    "bucket": bucket,
                    "endpoint_url": s3_endpoint,
                    "region": "us-east-1",
                    "capacity": "1MiB",
                },
            }
        )
    )
    config = load_config(path, environ={})
    hashes = [uuid.uuid4().bytes * 2 for _ in range(3)]
    # One prompt of three blocks, through the connector (which registers the deployment).
    cache = ConnectorDriver(config, SLOT, model="tiny-llama")
    shape = cache.shape
    cache.serve(hashes, [h * (SLOT // len(h)) for h in hashes])
    assert cache.flush(30)
    cache.close()
    return path, config, shape, hashes


def test_help_lists_every_command():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    for command in ("serve", "demo", "bench", "stats", "inspect", "gc", "config"):
        assert command in result.stdout
    sub = run("inspect", "--help")
    assert sub.returncode == 0, sub.stderr
    assert "object key" in sub.stdout


def test_stats_json(setup):
    path, _, shape, _ = setup
    result = run("stats", "--config", str(path), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    rows = {(r["namespace"], r["tier"]): r for r in data["rows"]}
    assert rows[("cli-ns", "s3")]["objects"] == 3
    assert rows[("cli-ns", "s3")]["bytes"] == 3 * shape.object_bytes
    assert rows[("cli-ns", "disk")]["objects"] == 3
    assert rows[("cli-ns", "s3")]["model"] == "tiny-llama"
    table = run("stats", "--config", str(path))
    assert table.returncode == 0 and "cli-ns" in table.stdout


def test_gc_prints_its_report(setup):
    path, *_ = setup
    result = run("gc", "--config", str(path))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["namespace"] == "cli-ns"
    assert report["errors"] == []
    assert report["evicted_objects"] == 0  # 3 objects are well under 1MiB
    assert report["orphans"]["scanned"] == 1  # the 3 blocks went into one run object


def test_gc_reindex_rebuilds_a_flushed_index(setup, redis_url):
    path, *_ = setup
    assert run("gc", "--config", str(path)).returncode == 0  # keeps the registry's copy in S3
    redis = GuardedRedis(redis_url, RedisConfig())
    try:
        redis.client.flushall()
        result = run("gc", "--config", str(path), "--reindex")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["registry_restored"] == 1 and report["indexed"] == 3
        assert sum(redis.client.hlen(k) for k in redis.client.scan_iter(match="tc:*:blk:*")) == 3
    finally:
        redis.close()


def test_gc_and_stats_exit_3_when_redis_is_unreachable(tmp_path, s3_endpoint, bucket):
    path = tmp_path / "dead.yaml"
    dead = f"redis://127.0.0.1:{free_port()}/0"
    path.write_text(
        yaml.safe_dump(
            {"namespace": "cli-ns", "redis_url": dead, "s3": {"bucket": bucket, "endpoint_url": s3_endpoint}}
        )
    )
    result = run("gc", "--config", str(path))
    assert result.returncode == 3, result.stdout + result.stderr
    assert any("redis" in problem for problem in json.loads(result.stdout)["errors"])
    stats = run("stats", "--config", str(path), "--json")
    assert stats.returncode == 3 and json.loads(stats.stdout)["errors"]


def test_inspect_an_object_file(setup, tmp_path):
    _, config, shape, hashes = setup
    key = shape.key(hashes[0])
    digest, block = key.split("/")
    obj = config.disk.path / digest / block[:2] / f"{block}.safetensors"
    assert obj.is_file()

    ok = run("inspect", str(obj))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert key in ok.stdout and "checksum ok" in ok.stdout

    corrupt = tmp_path / "corrupt.safetensors"
    shutil.copy(obj, corrupt)
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    bad = run("inspect", str(corrupt))
    assert bad.returncode == 1
    assert "checksum mismatch" in bad.stdout

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(obj.read_bytes()[:-100])
    assert run("inspect", str(truncated)).returncode == 1
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    assert run("inspect", str(junk)).returncode == 1


def test_inspect_a_key_reports_each_tier(setup):
    path, _, shape, hashes = setup
    key = shape.key(hashes[1])
    found = run("inspect", key, "--config", str(path))
    assert found.returncode == 0, found.stdout + found.stderr
    out = found.stdout
    assert "disk (this node)" in out and "s3 index" in out and "s3 object" in out
    assert out.count("present") == 3, out

    missing = run("inspect", shape.key(b"\x01" * 32), "--config", str(path))
    assert missing.returncode == 1
    assert "present" not in missing.stdout

    assert run("inspect", key).returncode == 2  # a key needs a config
    assert run("inspect", "neither-a-file-nor-a-key").returncode == 2


def test_inspect_peers_lists_the_live_peer_records(redis, redis_url, tmp_path):
    """Instances whose workers keep a live peer record are listed, one row per rank,
    with the address and port range their NIXL agents listen on; one publishing
    presence only (peer tier off) is not; with no record, exit 1."""
    path = tmp_path / "tiercache.yaml"
    path.write_text(yaml.safe_dump({"namespace": "cli-ns", "redis_url": redis_url}))
    ranks = (uuid.uuid4().hex[:16], uuid.uuid4().hex[:16])
    dep = Deployment(uuid.uuid4().hex[:16], "cli-ns", "tiny-llama", 2, ranks, SLOT)
    RedisIndex(redis).register(dep)
    for instance in ("node-a", "node-c"):
        presence = PresencePublisher(redis, dep.model_digest, instance)
        presence.update(b"\x01" * 32, "cpu", True)
        assert presence.flush()
    registries = [PeerRegistry(redis, dep.model_digest, rank, "node-a", 30.0) for rank in ranks]
    for rank, registry in enumerate(registries):
        record = PeerRecord(f"agent-{rank}", b"metadata", 0, SLOT, 8, 0, 0, 16, host="10.1.2.3", port=5600)
        assert registry.publish(record)

    listed = run("inspect", "--peers", "--config", str(path))

    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = [line for line in listed.stdout.splitlines() if "node-" in line]
    assert len(rows) == 2 and all("node-a" in row for row in rows), listed.stdout
    assert "agent-0" in rows[0] and f"0 ({ranks[0]})" in rows[0]
    assert "agent-1" in rows[1] and f"1 ({ranks[1]})" in rows[1]
    assert all("10.1.2.3:5600-5699" in row for row in rows), listed.stdout

    for registry in registries:  # a clean shutdown removes the records
        registry.close()
    none = run("inspect", "--peers", "--config", str(path))
    assert none.returncode == 1
    assert "no live peers in namespace cli-ns" in none.stdout


def test_serve_answers_healthz_then_stops_on_sigterm(setup):
    path, *_ = setup
    port = free_port()
    process = subprocess.Popen(
        [str(TIERCACHE), "serve", "--config", str(path), "--port", str(port), "--gc-interval", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TIERCACHE_ADMIN_TOKEN": "cli-token"},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        health = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                health = httpx.get(f"{base}/healthz", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert health is not None and health.status_code == 200, process.poll()
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
        gc = httpx.post(f"{base}/v1/gc", headers={"Authorization": "Bearer cli-token"}, timeout=30)
        assert gc.status_code == 200, gc.text
        assert httpx.post(f"{base}/v1/gc", timeout=10).status_code == 401
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    # uvicorn shuts down cleanly, then re-raises the signal it caught.
    assert process.returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output
    assert "cli-token" not in output


def test_serve_refuses_a_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("s3: {bucket: ok-bucket}\n")  # S3 without redis_url
    result = run("serve", "--config", str(bad))
    assert result.returncode == 2
    assert "redis_url" in result.stderr

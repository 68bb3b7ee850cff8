"""The Grafana dashboard's queries, evaluated by a real Prometheus (Debian's `prometheus`
package; scripts/bootstrap.sh installs it) against real scrapes.

Two scrape targets on loopback: `tiercache serve` (its own series: index, GC, lookups
for routers, dependencies) over a real redis-server and moto's S3 server, and this test
process, where the connector's two halves (driven without vLLM: connector/driver.py)
have stored, evicted, written down and read back blocks on its CPU, disk
and S3 tiers, so every tiercache_* family the connector exports has series. The
counters that only move on a failure get theirs from real failures in this process: a
mover queue of depth 1 flooded while S3 is slow (a dropped write), S3 behind a stopped
proxy (a tier error) and Redis behind one (an index error). Every dashboard query over
tiercache_* series must then return series through Prometheus' HTTP API.

The vllm:* queries are evaluated against one vLLM OpenAI server (the CPU build) with
the connector on a CPU and a disk tier, after prompts sent twice, so that the second
round's blocks come from the connector.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client import REGISTRY, start_http_server

from tiercache.config import build_config
from tiercache.connector.driver import ConnectorDriver
from tiercache.ops.local_stack import free_port
from tiercache.ops.tiny_model import write_tiny_llama
from tiercache.ops.vllm_runner import connector_config, loading_every_hit

from support.faults import TcpProxy
from support.serving import VllmServer, metric, text_of, write_word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "tiercache.json"
BLOCK = 64 * 1024
SCRAPE_INTERVAL_S = 1
# Grafana's $__rate_interval is at least four scrape intervals.
RATE_INTERVAL = "15s"
# Labelled counters with no series until the first failure of their kind: a store
# dropped under backpressure, a tier error, a failed Redis index call.
FAILURE_COUNTERS = (
    "tiercache_mover_dropped_total",
    "tiercache_tier_errors_total",
    "tiercache_index_errors_total",
)


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


def as_promql(expr: str) -> str:
    """Grafana's variables as the dashboard's defaults resolve them: every job, every
    instance, and a rate window of several scrapes."""
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace('"$job"', '".+"')
        .replace('"$instance"', '".+"')
    )


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.25)


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def drive_tier_engine(tmp_path: Path, redis_url: str, s3_endpoint: str, bucket: str) -> None:
    """Blocks through every tier, as the connector moves them: stores written through to
    disk and S3 (a Redis index entry and a write lease each), CPU evictions, reads that
    hit CPU, disk and S3, and lookups that miss."""
    config = build_config(
        {
            "cpu": {"capacity": 2 * BLOCK},
            "disk": {"path": str(tmp_path / "disk"), "capacity": 4 * BLOCK + 16 * 1024},
            "redis_url": redis_url,
            "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1"},
            "movers": {"workers": 2},
        },
        environ={},
    )
    cache = ConnectorDriver(config, BLOCK, model=uuid.uuid4().hex)
    hashes = [i.to_bytes(4, "big") * 8 for i in range(8)]
    try:
        for i, block_hash in enumerate(hashes):
            assert cache.put(block_hash, np.random.default_rng(i).bytes(BLOCK)) is not None
            cache.flush()
        # The newest blocks are in the CPU tier, the next ones on disk (it holds about
        # three objects), the oldest only in S3.
        sources = {cache.get(block_hash)[0] for block_hash in reversed(hashes)}
        assert sources == {"cpu", "disk", "s3"}, sources
        assert cache.get(b"\xff" * 32) is None
        cache.engine.flush()
    finally:
        cache.close()


def counted(family: str) -> float:
    """The sum of every sample of a counter in this process' registry (0 without series)."""
    name = family.removesuffix("_total")
    return sum(
        sample.value
        for collected in REGISTRY.collect()
        if collected.name == name
        for sample in collected.samples
        if sample.name == family
    )


def cause_failures(redis_url: str, s3_endpoint: str, bucket: str) -> None:
    """The failures the failure-only counters count, for real, in this process: the
    connector's halves with a mover queue of one write, over Redis and S3 each behind a
    proxy on loopback. A block's upload is slowed so the next store's write is dropped
    (tiercache_mover_dropped_total); with the S3 proxy stopped a reader's download of
    that block fails (tiercache_tier_errors_total); with the Redis proxy stopped its
    lookup cannot be answered (tiercache_index_errors_total)."""
    redis_link = TcpProxy(urllib.parse.urlsplit(redis_url).port).start()
    s3_link = TcpProxy(urllib.parse.urlsplit(s3_endpoint).port).start()
    config = build_config(
        {
            "cpu": {"capacity": 2 * BLOCK},
            "redis_url": f"redis://127.0.0.1:{redis_link.port}/0",
            "s3": {
                "bucket": bucket,
                "endpoint_url": s3_link.url,
                "region": "us-east-1",
                "max_attempts": 1,
                "connect_timeout": 1,
                "read_timeout": 5,
            },
            "movers": {"workers": 1, "queue_depth": 1},
        },
        environ={},
    )
    model = uuid.uuid4().hex
    first, second, unknown = b"\x01" * 32, b"\x02" * 32, b"\xee" * 32
    writer = ConnectorDriver(config, BLOCK, model=model)
    reader = None
    before = {family: counted(family) for family in FAILURE_COUNTERS}
    try:
        # The first block's upload, slowed by the proxy, holds the queue's only place;
        # the second block's write-down finds it taken and is dropped.
        s3_link.delay = 0.2
        assert writer.put(first, np.random.default_rng(1).bytes(BLOCK)) is not None
        assert writer.put(second, np.random.default_rng(2).bytes(BLOCK)) is not None
        assert writer.flush(timeout=60)
        s3_link.delay = 0.0
        assert counted("tiercache_mover_dropped_total") > before["tiercache_mover_dropped_total"]

        # A reader with an empty CPU tier finds the first block only in S3, which is down.
        reader = ConnectorDriver(config, BLOCK, model=model)
        s3_link.stop()
        assert reader.get(first) is None
        assert counted("tiercache_tier_errors_total") > before["tiercache_tier_errors_total"]

        # With Redis down, the lookup fails: a miss.
        redis_link.stop()
        assert reader.get(unknown) is None
        assert counted("tiercache_index_errors_total") > before["tiercache_index_errors_total"]
    finally:
        for cache in (reader, writer):
            if cache is not None:
                cache.close()
        s3_link.stop()
        redis_link.stop()


def wait_for_scrapes(base: str, targets: int) -> None:
    """Enough successful scrapes of every target for a rate over RATE_INTERVAL."""
    wait_until(lambda: http_ok(f"{base}/-/ready"), 60, "Prometheus to be ready")
    wait_until(
        lambda: len(query(base, f"sum_over_time(up[{RATE_INTERVAL}]) >= 4 and up == 1")) == targets,
        90,
        f"four successful scrapes of {targets} targets",
    )


def queries_without_series(base: str, pattern: str) -> tuple[int, list[str]]:
    """How many dashboard queries mention a family matching `pattern`, and those of
    them that return no series."""
    checked, empty = 0, []
    for title, expr in dashboard_queries():
        if not re.search(pattern, expr):
            continue
        checked += 1
        if not query(base, as_promql(expr)):
            empty.append(f"{title}: {expr}")
    return checked, empty


@pytest.fixture
def service(tmp_path, redis_url, s3_endpoint, bucket):
    """`tiercache serve` on a free loopback port, over the same Redis and bucket."""
    port = free_port()
    config = tmp_path / "service.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "redis_url": redis_url,
                "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1"},
            }
        )
    )
    log = (tmp_path / "service.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tiercache.ops.cli", "serve", "--config", str(config)]
        + ["--host", "127.0.0.1", "--port", str(port), "--gc-interval", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: process.poll() is not None or http_ok(f"{base}/readyz"), 60, "tiercache serve")
        assert process.poll() is None, (tmp_path / "service.log").read_text()
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def start_prometheus(tmp_path: Path, targets: dict[str, str]) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: scripts/bootstrap.sh installs Debian's package"
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics", "static_configs": [{"targets": [target]}]}
            for job, target in targets.items()
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    return process, f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_dashboard_queries_return_series(tmp_path, redis_url, s3_endpoint, bucket, service):
    drive_tier_engine(tmp_path, redis_url, s3_endpoint, bucket)
    cause_failures(redis_url, s3_endpoint, bucket)
    # This process's registry: the tier engine's series, as vLLM's /metrics shows them.
    engine_port = free_port()
    server, thread = start_http_server(engine_port, addr="127.0.0.1")
    # Traffic the service counts: a lookup for a router; its GC runs every second.
    request = urllib.request.Request(
        f"{service}/v1/lookup",
        data=json.dumps({"namespace": "default", "block_hashes": ["ab" * 32]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200

    targets = {"tiercache": service.removeprefix("http://"), "engine": f"127.0.0.1:{engine_port}"}
    prometheus, base = start_prometheus(tmp_path, targets)
    try:
        wait_for_scrapes(base, len(targets))
        service_series = {
            sample["metric"]["__name__"]
            for sample in query(base, '{job="tiercache", __name__=~"tiercache_.+"}')
        }
        expected = {"tiercache_dependency_up", "tiercache_gc_runs_total", "tiercache_service_lookups_total"}
        assert expected <= service_series, service_series

        checked, empty = queries_without_series(base, r"\btiercache_[a-z0-9_]+")
        assert checked >= 20
        assert not empty, "dashboard queries without series:\n" + "\n".join(empty)
        for family in FAILURE_COUNTERS:
            assert any(family in expr for _, expr in dashboard_queries()), family
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        server.shutdown()
        thread.join(timeout=10)


# -- vLLM's own series -------------------------------------------------------------
VOCAB = 2048
VLLM_BLOCK = 32
# vLLM's paged KV of the tiny model: 2 layers x (K, V) x 2 heads x 32 tokens x 64 x 4 bytes.
KV_BLOCK_BYTES = 2 * 2 * 2 * VLLM_BLOCK * 64 * 4
PROMPT_TOKENS = (200, 232, 264)  # 6 to 8 full blocks each
VLLM_ARGS = [
    "--dtype", "float32",
    "--block-size", str(VLLM_BLOCK),
    "--max-model-len", "512",
    "--kv-cache-memory-bytes", str(64 * KV_BLOCK_BYTES),
    "--enforce-eager",
    "--seed", "0",
    # Without vLLM's own prefix cache, the second round's blocks come from the connector.
    "--no-enable-prefix-caching",
]  # fmt: skip
VLLM_ENV = {
    # A connector makes the CPU backend reserve one more core.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "PYTHONHASHSEED": "0",
}


@pytest.mark.vllm
@pytest.mark.slow
def test_dashboard_vllm_queries_return_series(tmp_path):
    model = write_tiny_llama(tmp_path / "model", vocab_size=VOCAB, max_positions=512)
    write_word_tokenizer(model, VOCAB)
    tiers = loading_every_hit(
        {
            "namespace": "dashboard",
            "cpu": {"capacity": 64 * KV_BLOCK_BYTES},
            "disk": {"path": str(tmp_path / "disk")},
        }
    )
    args = [*VLLM_ARGS, "--kv-transfer-config", json.dumps(connector_config(tiers))]
    vllm = VllmServer(model, args, tmp_path / "vllm.log", VLLM_ENV)
    prometheus, base = start_prometheus(tmp_path, {"vllm": f"127.0.0.1:{vllm.port}"})
    try:
        vllm.wait_ready(timeout=300)
        prompts = [
            text_of([3 + (7 * i + 13 * p) % (VOCAB - 3) for i in range(length)])
            for p, length in enumerate(PROMPT_TOKENS)
        ]
        for _ in range(2):  # the second round hits the connector's CPU tier
            for prompt in prompts:
                response = httpx.post(
                    f"{vllm.base}/v1/completions",
                    json={"model": str(model), "prompt": prompt, "max_tokens": 4, "temperature": 0},
                    timeout=120,
                )
                assert response.status_code == 200, response.text
        # Stats reach the front end a moment after the step.
        wait_until(
            lambda: metric(vllm.metrics(), "vllm:external_prefix_cache_hits_total") > 0,
            30,
            "the connector's hits in vLLM's /metrics",
        )

        wait_for_scrapes(base, 1)
        checked, empty = queries_without_series(base, r"\bvllm:[a-z0-9_:]+")
        assert checked >= 8
        assert not empty, "dashboard queries without series:\n" + "\n".join(empty)
        hits = query(base, 'sum(vllm:external_prefix_cache_hits_total{job="vllm"})')
        assert hits and float(hits[0]["value"][1]) > 0, hits
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        vllm.stop()

"""The Grafana dashboard's queries, evaluated by a real Prometheus (Debian's `prometheus`
package; scripts/bootstrap.sh installs it) against real scrapes.

Two scrape targets on loopback: `tiercache serve` (its own series: index, GC, lookups
for routers, dependencies) over a real redis-server and moto's S3 server, and this test
process, where a LocalTierCache (the tier engine and block policy the connector runs in
vLLM's workers) has stored, evicted, written down and read back blocks on its CPU, disk
and S3 tiers, so every tiercache_* family the connector exports has series. Every
dashboard query over tiercache_* series must then return series through
Prometheus' HTTP API, except those over series that exist only after a failure
(QUIET_UNTIL_FAILURE). The vllm:* queries need a vLLM engine with the connector and are
not evaluated here.
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

import numpy as np
import pytest
import yaml
from prometheus_client import start_http_server

from tiercache.config import build_config
from tiercache.engine import LocalTierCache, ObjectShape
from tiercache.testing.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "tiercache.json"
BLOCK = 64 * 1024
SCRAPE_INTERVAL_S = 1
# Grafana's $__rate_interval is at least four scrape intervals.
RATE_INTERVAL = "15s"
# Labelled counters with no series until the first failure of their kind (a store
# dropped under backpressure, a tier error, a failed Redis index call): on a healthy
# run their panels show "No data", so their queries are not required to return series.
QUIET_UNTIL_FAILURE = {
    "tiercache_mover_dropped_total",
    "tiercache_tier_errors_total",
    "tiercache_index_errors_total",
}


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
    shape = ObjectShape(uuid.uuid4().hex[:16], uuid.uuid4().hex[:16], BLOCK, layout="LBHNC", dtype="uint8")
    cache = LocalTierCache(config, shape, pin_memory=False)
    hashes = [i.to_bytes(4, "big") * 8 for i in range(8)]
    try:
        for i, block_hash in enumerate(hashes):
            assert cache.put(block_hash, np.random.default_rng(i).bytes(BLOCK)) is not None
            cache.engine.flush()
        # The newest blocks are in the CPU tier, the next ones on disk (it holds about
        # three objects), the oldest only in S3.
        sources = {cache.get(block_hash)[0] for block_hash in reversed(hashes)}
        assert sources == {"cpu", "disk", "s3"}, sources
        assert cache.get(b"\xff" * 32) is None
        cache.engine.flush()
    finally:
        cache.close()


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
        [sys.executable, "-m", "tiercache.cli", "serve", "--config", str(config)]
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
        wait_until(lambda: http_ok(f"{base}/-/ready"), 60, "Prometheus to be ready")
        # Enough scrapes of both targets for a rate over RATE_INTERVAL.
        wait_until(
            lambda: len(query(base, f"count_over_time(up[{RATE_INTERVAL}]) >= 4 and up == 1")) == 2,
            60,
            "four successful scrapes of both targets",
        )
        service_series = {
            sample["metric"]["__name__"]
            for sample in query(base, '{job="tiercache", __name__=~"tiercache_.+"}')
        }
        expected = {"tiercache_dependency_up", "tiercache_gc_runs_total", "tiercache_service_lookups_total"}
        assert expected <= service_series, service_series

        checked, empty = 0, []
        for title, expr in dashboard_queries():
            families = set(re.findall(r"\btiercache_[a-z0-9_]+", expr))
            if not families or families <= QUIET_UNTIL_FAILURE:
                continue
            checked += 1
            if not query(base, as_promql(expr)):
                empty.append(f"{title}: {expr}")
        assert checked >= 17
        assert not empty, "dashboard queries without series:\n" + "\n".join(empty)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        server.shutdown()
        thread.join(timeout=10)

"""Tests of the observability artifacts: Grafana's provisioning matches the compose file,
and the dashboard is well formed and charts every metric tiercache promises, each one
a series tiercache exports.
"""

from __future__ import annotations

import json
import re
from typing import Any

from support.deploy import (
    DASHBOARD,
    DOCKER_DIR,
    load_yaml,
    mounts,
    services,
)

# The metrics the service and the connector promise (the tiercache_ prefix, Prometheus
# sample names). The dashboard must chart each one.
REQUIRED_METRICS = {
    "tiercache_tier_bytes_total",
    "tiercache_tier_ops_total",
    "tiercache_tier_latency_seconds_bucket",
    "tiercache_tier_usage_bytes",
    "tiercache_tier_evictions_total",
    "tiercache_lease_conflicts_total",
    "tiercache_lookup_hits_total",
    "tiercache_lookup_blocks_total",
}


def test_grafana_provisioning_matches_compose(compose):
    grafana = services(compose)["grafana"]
    mounted = {source: target for source, target in mounts(grafana)}
    provisioning = DOCKER_DIR / "grafana" / "provisioning"
    assert mounted["./docker/grafana/provisioning"] == "/etc/grafana/provisioning"
    datasources = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    (datasource,) = datasources
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    (provider,) = load_yaml(provisioning / "dashboards" / "tiercache.yml")["providers"]
    assert provider["options"]["path"] == mounted["./docker/grafana/dashboards"]
    dashboard = json.loads(DASHBOARD.read_text())
    datasource_var = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert datasource_var["current"]["value"] == datasource["uid"]


def dashboard_panels() -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return [panel for panel in panels if panel["type"] != "row"]


def dashboard_series() -> set[str]:
    names = set()
    for panel in dashboard_panels():
        for target in panel["targets"]:
            names.update(re.findall(r"\b(tiercache_[a-z0-9_]+|vllm:[a-z0-9_:]+)", target["expr"]))
    return names


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    panels = dashboard_panels()
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24


def test_dashboard_charts_every_promised_metric():
    missing = REQUIRED_METRICS - dashboard_series()
    assert not missing, f"no panel for {sorted(missing)}"


def exported_series() -> set[str]:
    """Sample names tiercache's metrics can expose, from the module's metric objects and from
    any registry it defines or registers them with."""
    import prometheus_client
    import prometheus_client.metrics as prom

    import tiercache.metrics as metrics

    suffixes = {
        "counter": ["_total"],
        "gauge": [""],
        "histogram": ["_bucket", "_sum", "_count"],
        "summary": ["_sum", "_count", ""],
    }
    families = []
    for value in vars(metrics).values():
        if isinstance(value, prom.MetricWrapperBase):
            families.extend(value.describe())
        elif isinstance(value, prometheus_client.CollectorRegistry):
            families.extend(value.collect())
    families.extend(prometheus_client.REGISTRY.collect())
    return {
        family.name + suffix
        for family in families
        if family.name.startswith("tiercache_")
        for suffix in suffixes.get(family.type, [""])
    }


def test_dashboard_metrics_exist_in_tiercache():
    exported = exported_series()
    assert exported >= REQUIRED_METRICS, f"not exported: {sorted(REQUIRED_METRICS - exported)}"
    charted = {name for name in dashboard_series() if name.startswith("tiercache_")}
    assert charted <= exported, f"the dashboard charts unknown series {sorted(charted - exported)}"

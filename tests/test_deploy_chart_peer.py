"""The Helm chart's peer tier (issue 47, item 4), rendered by the real `helm`: each vLLM
pod gets its pod IP as peer.host and the port range, a NetworkPolicy opens that range to
this release's vLLM pods only, nothing of it renders when it is off, and it refuses to
render without Redis.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest
import yaml

from support.deploy import (
    CHART,
    TEMPLATES,
    TOOL_TIMEOUT,
    arg_value,
)
from support.deploy_chart import (
    RELEASE,
    by_name,
    env_names,
    helm_template,
    kubernetes_versions,
    render_connector_config,
    selects,
    with_overrides,
)

PEER_VALUES = {"tiercache": {"peer": {"enabled": True, "port": 7000}}, "vllm": {"replicaCount": 3}}


def kubernetes_errors(doc: dict[str, Any], chart: dict[str, Any]) -> list[str]:
    """kubernetes-validate's complaints about one object, strictly, on the oldest and the
    newest Kubernetes the chart allows."""
    import kubernetes_validate

    errors = []
    for version in kubernetes_versions(chart):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{doc['kind']} on {version}: {list(error.path)}: {error.message}")
    return errors


def vllm_pod(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The vLLM workload's pod template labels and its vllm container."""
    (workload,) = [
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"].endswith("-vllm")
    ]
    template = workload["spec"]["template"]
    (container,) = template["spec"]["containers"]
    return template["metadata"]["labels"], container


def peer_ports(container: dict[str, Any]) -> list[int]:
    return [p["containerPort"] for p in container["ports"] if p["name"].startswith("peer-")]


def test_helm_peer_tier_is_wired_for_the_release_vllm_pods(helm, chart, tmp_path):
    """Issue 47, item 4: tiercache.peer.enabled gives each vLLM pod its pod IP as
    peer.host, declares the port range, and opens it to this release's vLLM pods only."""
    from tiercache.config import PEER_PORT_SPAN, build_config

    docs = helm_template(helm, PEER_VALUES, tmp_path)
    labels, container = vllm_pod(docs)
    (host,) = [e for e in container["env"] if e["name"] == "TIERCACHE_PEER__HOST"]
    assert host["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert peer_ports(container) == list(range(7000, 7000 + PEER_PORT_SPAN))
    assert {p["protocol"] for p in container["ports"]} == {"TCP"}
    # The connector's config with the pod's environment over it: what the pod resolves.
    extra = json.loads(arg_value(container["args"], "--kv-transfer-config"))["kv_connector_extra_config"]
    config = build_config(extra, environ={"TIERCACHE_PEER__HOST": "10.244.1.7"})
    assert (config.peer.enabled, config.peer.host, config.peer.port) == (True, "10.244.1.7", 7000)
    assert config.presence.enabled and config.redis_url
    # The service opens no peer tier.
    (configmap,) = by_name(docs, "ConfigMap").values()
    assert "peer" not in yaml.safe_load(configmap["data"]["config.yaml"])

    policy = by_name(docs, "NetworkPolicy")[f"{RELEASE}-vllm-peer"]
    assert not kubernetes_errors(policy, chart)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": 7000, "endPort": 7000 + PEER_PORT_SPAN - 1, "protocol": "TCP"}]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}, "same namespace only: no namespaceSelector, no ipBlock"
    assert selects(spec["podSelector"], labels) and selects(source["podSelector"], labels)
    # Nothing but this release's vLLM pods: not its other components, not another release.
    others = [
        {**labels, "app.kubernetes.io/component": component}
        for component in ("service", "redis", "minio", "minio-bucket")
    ]
    others.append({**labels, "app.kubernetes.io/instance": "other-release"})
    for other in others:
        assert not selects(spec["podSelector"], other), other
        assert not selects(source["podSelector"], other), other


def test_helm_peer_tier_renders_valid_objects(helm, chart, tmp_path):
    docs = helm_template(helm, PEER_VALUES, tmp_path)
    errors = [error for doc in docs for error in kubernetes_errors(doc, chart)]
    assert not errors, "\n".join(errors)


def test_helm_peer_tier_off_renders_none_of_it(helm, tmp_path):
    docs = helm_template(helm, {}, tmp_path)
    _labels, container = vllm_pod(docs)
    assert "TIERCACHE_PEER__HOST" not in env_names(container)
    assert not peer_ports(container)
    extra = json.loads(arg_value(container["args"], "--kv-transfer-config"))["kv_connector_extra_config"]
    assert "peer" not in extra
    assert f"{RELEASE}-vllm-peer" not in by_name(docs, "NetworkPolicy")
    # On without NetworkPolicies: the pods are wired, and no policy is rendered.
    docs = helm_template(helm, {**PEER_VALUES, "networkPolicy": {"enabled": False}}, tmp_path)
    _labels, container = vllm_pod(docs)
    assert "TIERCACHE_PEER__HOST" in env_names(container) and peer_ports(container)
    assert not by_name(docs, "NetworkPolicy")


def test_helm_refuses_peer_without_redis(helm, values, chart):
    overrides = ["redis.enabled=false", "tiercache.s3.enabled=false", "tiercache.peer.enabled=true"]
    result = subprocess.run(
        [helm, "template", RELEASE, str(CHART), *[arg for o in overrides for arg in ("--set", o)]],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT,
    )
    assert result.returncode != 0
    assert "tiercache.peer.enabled needs Redis" in result.stderr
    merged = with_overrides(
        values,
        {"redis": {"enabled": False}, "tiercache": {"s3": {"enabled": False}, "peer": {"enabled": True}}},
    )
    with pytest.raises(ValueError, match="needs Redis"):
        render_connector_config(merged, chart, RELEASE)


def test_chart_peer_port_span_is_tiercache_s(schema):
    """The chart's port range and its bound in the schema are tiercache's PEER_PORT_SPAN."""
    from tiercache.config import PEER_PORT_SPAN

    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    span = re.search(r'define "tiercache.peerPortSpan" -}}\s*(\d+)', helpers)
    assert span and int(span.group(1)) == PEER_PORT_SPAN
    port = schema["properties"]["tiercache"]["properties"]["peer"]["properties"]["port"]
    assert port["maximum"] == 65535 - PEER_PORT_SPAN

"""What the Helm chart tests (tests/test_deploy_chart*.py) share: a Python twin of the
chart's connector config, the value sets the chart must render, and `helm template` with
readers of the manifests it renders."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from support.deploy import CHART, KV_CONNECTOR_KEYS, TOOL_TIMEOUT


def with_overrides(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of a -f file over values.yaml: maps merge, null removes a default key,
    everything else replaces."""
    merged = copy.deepcopy(values)
    for key, value in overrides.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = with_overrides(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# A Python twin of the chart's tiercache.connectorConfig helper: what vLLM gets as
# kv_connector_extra_config for a given set of values.


def chart_fullname(values: dict[str, Any], chart: dict[str, Any], release: str) -> str:
    if values["fullnameOverride"]:
        base = values["fullnameOverride"]
    else:
        name = values["nameOverride"] or chart["name"]
        base = release if name in release else f"{release}-{name}"
    return base[:45].rstrip("-")


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def render_connector_config(values: dict[str, Any], chart: dict[str, Any], release: str) -> dict[str, Any]:
    fullname = chart_fullname(values, chart, release)
    t = values["tiercache"]
    config: dict[str, Any] = {"namespace": t["namespace"], "cpu": {"capacity": t["cpu"]["capacity"]}}
    if values["redis"]["enabled"]:
        redis_url = f"redis://{fullname}-redis:{values['redis']['port']}/0"
    else:
        redis_url = values["externalRedis"]["url"]
    if redis_url:
        config["redis_url"] = redis_url
    if t["disk"]["enabled"]:
        config["disk"] = {"path": t["disk"]["path"], "capacity": t["disk"]["capacity"]}
    if t["s3"]["enabled"]:
        if not redis_url:
            raise ValueError("tiercache.s3.enabled needs Redis")
        s3 = {"bucket": t["s3"]["bucket"], "prefix": t["s3"]["prefix"]}
        endpoint = t["s3"]["endpointUrl"]
        if not endpoint and values["minio"]["enabled"]:
            endpoint = f"http://{fullname}-minio:{values['minio']['port']}"
        if endpoint:
            s3["endpoint_url"] = endpoint
        if t["s3"]["region"]:
            s3["region"] = t["s3"]["region"]
        config["s3"] = s3
    if t["peer"]["enabled"]:
        if not redis_url:
            raise ValueError("tiercache.peer.enabled needs Redis")
        config["peer"] = {"enabled": True, "port": t["peer"]["port"]}
    return deep_merge(config, t["extraConfig"])


# Config sections the chart gives vLLM's connector and not the service: the disk and
# peer tiers belong to the vLLM pods.
VLLM_ONLY = {"disk", "peer"}


def render_kv_transfer_config(values: dict[str, Any], chart: dict[str, Any], release: str) -> dict[str, Any]:
    return {
        **KV_CONNECTOR_KEYS,
        "kv_load_failure_policy": values["vllm"]["kvLoadFailurePolicy"],
        "kv_connector_extra_config": render_connector_config(values, chart, release),
    }


# Value sets the chart must render: each way of running it that values.yaml and README
# document. "defaults": GPU vLLM with the bundled Redis and MinIO. "external": an
# external Redis and S3 without MinIO, with extra config passed through. "aws-irsa": the
# bundled Redis and AWS S3 through IRSA (no MinIO, no credentials). "cpu-vllm": vLLM's
# CPU build as values.yaml describes it. "minimal": the smallest setup. "everything":
# every optional object switched on (local PVs, ServiceMonitor, NetworkPolicy, the peer
# tier).
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external": {
        "redis": {"enabled": False},
        "externalRedis": {"url": "redis://redis.cache.svc:6379/2", "existingSecret": "redis-auth"},
        "minio": {"enabled": False},
        "s3Credentials": {"existingSecret": "aws-creds"},
        "tiercache": {
            "namespace": "llama-prod",
            "cpu": {"capacity": 17179869184},
            "s3": {
                "bucket": "acme-kv-cache",
                "prefix": "vllm/",
                "region": "eu-west-1",
                "endpointUrl": "https://s3.eu-west-1.amazonaws.com",
            },
            "extraConfig": {"movers": {"policy": "write_back", "workers": 8}},
        },
    },
    "aws-irsa": {
        "minio": {"enabled": False},
        "serviceAccount": {
            "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/kv"}
        },
        "tiercache": {"s3": {"bucket": "acme-kv-cache", "region": "us-west-2"}},
    },
    "cpu-vllm": {
        "vllm": {
            "image": {"repository": "tiercache/vllm-tiercache-cpu"},
            "command": ["python", "-m", "vllm.entrypoints.openai.api_server"],
            "blockSize": 32,
            "maxModelLen": 4096,
            "extraArgs": [],
            "extraEnv": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "8"}],
            "resources": {
                "requests": {"cpu": "16", "nvidia.com/gpu": None},
                "limits": {"nvidia.com/gpu": None},
            },
            "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["SYS_NICE"]}},
        },
    },
    "minimal": {
        "redis": {"enabled": False},
        "minio": {"enabled": False},
        "tiercache": {
            "s3": {"enabled": False},
            "disk": {"enabled": False},
            "integrityKey": {"existingSecret": "tiercache-integrity"},
        },
        "nvme": {"type": "emptyDir"},
        "service": {
            "adminToken": {"existingSecret": "tiercache-admin"},
            "lookupToken": {"existingSecret": "tiercache-lookup"},
        },
        "networkPolicy": {"enabled": False},
    },
    "everything": {
        "nvme": {"type": "localPV", "localPV": {"nodes": ["gpu-a", "gpu-b"]}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "networkPolicy": {
            "enabled": True,
            "ingressFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ],
        },
        "vllm": {"maxModelLen": 8192, "servedModelName": "qwen", "replicaCount": 2},
        "tiercache": {"peer": {"enabled": True, "port": 7000}},
        "service": {"namespaceTokensSecret": "tiercache-namespace-tokens"},
        "s3Credentials": {"accessKeyId": "minio-admin", "secretAccessKey": "minio-admin-secret"},
    },
}

RELEASE = "tiercache"


# Kubernetes versions the rendered manifests are validated against: the oldest the chart
# allows (Chart.yaml's kubeVersion) and the newest kubernetes-validate knows.
def kubernetes_versions(chart: dict[str, Any]) -> list[str]:
    from kubernetes_validate.utils import latest_version

    oldest = re.search(r"(\d+\.\d+)", chart["kubeVersion"]).group(1)
    return [oldest, latest_version()]


def helm_template(helm: str, overrides: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    override_file = tmp_path / "overrides.yaml"
    override_file.write_text(yaml.safe_dump(overrides))
    result = subprocess.run(
        [helm, "template", RELEASE, str(CHART), "--namespace", "kv", "-f", str(override_file)],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def env_names(container: dict[str, Any]) -> set[str]:
    return {item["name"] for item in container.get("env", [])}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels and In/NotIn/Exists/DoesNotExist) on labels."""
    if not selector["matchLabels"].items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        if operator == "In" and labels.get(key) not in expression["values"]:
            return False
        if operator == "NotIn" and labels.get(key) in expression["values"]:
            return False
        if (operator == "Exists") != (key in labels) and operator in ("Exists", "DoesNotExist"):
            return False
    return True


def by_name(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}

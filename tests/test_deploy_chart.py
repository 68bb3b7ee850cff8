"""Structural tests of the Helm chart in helm/tiercache, without rendering it: its metadata,
its files, values.yaml against values.schema.json (and values the schema must reject),
every templated value present and every value used, hardened workload values, and the
connector config each documented value set gives vLLM and the service, validated with
tiercache's own config model.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import jsonschema
import pytest

from support.deploy import (
    CHART,
    KV_CONNECTOR_KEYS,
    ROOT,
    TEMPLATES,
    validate_tiercache_config,
)
from support.deploy_chart import (
    RELEASE,
    VARIANTS,
    VLLM_ONLY,
    render_connector_config,
    render_kv_transfer_config,
    with_overrides,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before Python 3.11
    import tomli as tomllib


def test_chart_metadata(chart):
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "tiercache" == CHART.name
    assert chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", chart["version"])
    assert chart["description"].strip()
    with (ROOT / "pyproject.toml").open("rb") as handle:
        version = tomllib.load(handle)["project"]["version"]
    assert str(chart["appVersion"]) == version, "appVersion follows the package version"


EXPECTED_TEMPLATES = {
    "_helpers.tpl",
    "service-deployment.yaml",
    "service-service.yaml",
    "vllm-deployment.yaml",
    "vllm-service.yaml",
    "configmap.yaml",
    "secret.yaml",
    "redis.yaml",
    "minio.yaml",
    "minio-bucket-job.yaml",
    "servicemonitor.yaml",
    "networkpolicy.yaml",
    "pv.yaml",
    "NOTES.txt",
}


def test_chart_files_exist():
    present = {path.name for path in TEMPLATES.iterdir()}
    assert present >= EXPECTED_TEMPLATES
    assert (CHART / ".helmignore").is_file()


def test_values_schema_is_draft7(schema):
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)


def test_values_match_schema(values, schema):
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(values), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


@pytest.mark.parametrize(
    "overrides",
    [
        {"unknownTopLevel": True},
        {"tiercache": {"cpu": {"capacity": "8 gigs"}}},
        {"tiercache": {"disk": {"path": "relative/dir"}}},
        {"tiercache": {"s3": {"bucket": "kv"}}},
        {"nvme": {"type": "nfs"}},
        {"service": {"securityContext": {"runAsNonRoot": False}}},
        {"vllm": {"securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}},
        {"externalRedis": {"url": "http://redis:6379"}},
        {"vllm": {"blockSize": "16"}},
        # The NetworkPolicy names a fixed range that must fit below port 65536.
        {"tiercache": {"peer": {"port": 0}}},
        {"tiercache": {"peer": {"port": 65436}}},
        # Each pod's own address comes from the downward API, never from values.
        {"tiercache": {"peer": {"host": "10.0.0.1"}}},
    ],
    ids=lambda overrides: json.dumps(overrides, separators=(",", ":")),
)
def test_values_schema_rejects(values, schema, overrides):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(with_overrides(values, overrides), schema)


# Paths reached through .Values directly, or through a variable bound to a .Values path.
_VALUES_PATH = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
_ALIAS = re.compile(r"(\$[A-Za-z_][A-Za-z0-9_]*)\s*:=\s*\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def template_values_paths(*, reads_only: bool = False) -> dict[tuple[str, ...], set[str]]:
    """Every .Values path the templates name. reads_only leaves out the bare right-hand side
    of `$x := .Values.a`, which binds a name without reading every key under it."""
    found: dict[tuple[str, ...], set[str]] = {}
    for path in sorted(TEMPLATES.iterdir()):
        text = path.read_text()
        alias_matches = list(_ALIAS.finditer(text))
        # A binding used bare (`$secret`, not `$secret.key`) reads the value it binds.
        alias_spans = [
            match.span(2)
            for match in alias_matches
            if not re.search(re.escape(match.group(1)) + r"(?![.\w])(?!\s*:=)", text)
        ]
        for match in _VALUES_PATH.finditer(text):
            if reads_only and any(lo <= match.start(1) < hi for lo, hi in alias_spans):
                continue
            found.setdefault(tuple(match.group(1).strip(".").split(".")), set()).add(path.name)
        for alias in alias_matches:
            name, base = alias.group(1), alias.group(2)
            for match in re.finditer(re.escape(name) + r"((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text):
                full = (base + match.group(1)).strip(".").split(".")
                found.setdefault(tuple(full), set()).add(path.name)
    return found


def lookup(tree: Any, path: tuple[str, ...]) -> bool:
    node = tree
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_every_templated_value_exists(values):
    paths = template_values_paths()
    assert len(paths) > 50, "the scan found too few .Values paths to be working"
    missing = {".".join(p): sorted(files) for p, files in paths.items() if not lookup(values, p)}
    assert not missing, f".Values paths used in templates but not in values.yaml: {missing}"


def leaf_paths(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    leaves = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            leaves.extend(leaf_paths(value, (*prefix, key)))
        else:
            leaves.append((*prefix, key))
    return leaves


def test_every_value_is_used(values):
    used = set(template_values_paths(reads_only=True))
    unused = [
        ".".join(leaf) for leaf in leaf_paths(values) if not any(leaf[: len(path)] == path for path in used)
    ]
    assert not unused, f"values.yaml keys no template reads: {unused}"


def test_workload_values_are_hardened(values):
    for component in ("service", "vllm", "redis", "minio"):
        pod = values[component]["podSecurityContext"]
        container = values[component]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, component
        assert container["runAsNonRoot"] is True, component
        assert container["allowPrivilegeEscalation"] is False, component
        assert container["capabilities"]["drop"] == ["ALL"], component
        assert values[component]["resources"]["requests"], component
    for component in ("service", "redis", "minio"):
        assert values[component]["securityContext"]["readOnlyRootFilesystem"] is True, component


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chart_connector_config_is_valid(values, schema, chart, variant):
    merged = with_overrides(values, VARIANTS[variant])
    jsonschema.validate(merged, schema)
    kv = render_kv_transfer_config(merged, chart, RELEASE)
    config = validate_tiercache_config(kv["kv_connector_extra_config"])
    tiercache = merged["tiercache"]
    assert (config.s3 is not None) == tiercache["s3"]["enabled"]
    assert (config.disk is not None) == tiercache["disk"]["enabled"]
    if tiercache["s3"]["enabled"] and merged["minio"]["enabled"]:
        assert config.s3.endpoint_url == f"http://{RELEASE}-minio:9000"
    service_config = {k: v for k, v in kv["kv_connector_extra_config"].items() if k not in VLLM_ONLY}
    validate_tiercache_config(service_config)


def test_chart_default_config_uses_bundled_services(values, chart):
    extra = render_connector_config(values, chart, RELEASE)
    assert extra["redis_url"] == f"redis://{RELEASE}-redis:6379/0"
    assert extra["s3"]["endpoint_url"] == f"http://{RELEASE}-minio:9000"
    assert extra["disk"]["path"] == values["tiercache"]["disk"]["path"]


def test_chart_refuses_s3_without_redis(values, chart):
    merged = with_overrides(values, {"redis": {"enabled": False}})
    with pytest.raises(ValueError, match="needs Redis"):
        render_connector_config(merged, chart, RELEASE)


def test_templates_pass_the_config_as_json():
    text = (TEMPLATES / "vllm-deployment.yaml").read_text()
    assert "- --kv-transfer-config" in text
    assert '{{ include "tiercache.kvTransferConfig" . | toJson }}' in text
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    for key, value in KV_CONNECTOR_KEYS.items():
        assert f'"{key}" "{value}"' in helpers


def test_templates_have_probes_and_security():
    for name in ("service-deployment.yaml", "vllm-deployment.yaml", "redis.yaml", "minio.yaml"):
        text = (TEMPLATES / name).read_text()
        for needle in ("livenessProbe:", "readinessProbe:", "securityContext:", "resources:"):
            assert needle in text, f"{name} lacks {needle}"
    secret = (TEMPLATES / "secret.yaml").read_text()
    assert "existingSecret" in secret, "a named Secret replaces the generated one"

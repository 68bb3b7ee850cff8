"""What the deployment-artifact tests (tests/test_deploy_*.py) share: where the artifacts
are, reading YAML, validating a tiercache configuration with the package's own model, and
reading docker-compose.yml the way `docker compose` does (variable interpolation, and a
service's command, environment, mounts and healthcheck)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]

COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKER_DIR = ROOT / "docker"
CHART = ROOT / "helm" / "tiercache"
TEMPLATES = CHART / "templates"
DASHBOARD = DOCKER_DIR / "grafana" / "dashboards" / "tiercache.json"

KV_CONNECTOR_KEYS = {
    "kv_connector": "TierCacheConnector",
    "kv_connector_module_path": "tiercache.connector",
    "kv_role": "kv_both",
}

TOOL_TIMEOUT = 120


def load_yaml(path: Path) -> Any:
    with path.open() as handle:
        return yaml.safe_load(handle)


def validate_tiercache_config(data: dict[str, Any]):
    """Validate with the package's own model; imported here so collection never needs it."""
    from tiercache.config import TierCacheConfig

    return TierCacheConfig.model_validate(data)


# Compose interpolation: $$, $NAME, ${NAME}, ${NAME:-default}, ${NAME-default},
# ${NAME:?err}, ${NAME?err}, ${NAME:+alt}, ${NAME+alt}; a default may nest one level.
_COMPOSE_VAR = re.compile(
    r"\$(?:(?P<escape>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>(?:[^{}]|\{[^{}]*\})*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(text: str, env: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group("escape"):
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        value = env.get(name)
        is_set, non_empty = value is not None, bool(value)
        if op == ":-":
            return value if non_empty else interpolate(arg, env)
        if op == "-":
            return value if is_set else interpolate(arg, env)
        if op in (":?", "?"):
            if (op == ":?" and not non_empty) or (op == "?" and not is_set):
                raise KeyError(f"${{{name}}} is required: {arg}")
            return value
        if op == ":+":
            return interpolate(arg, env) if non_empty else ""
        if op == "+":
            return interpolate(arg, env) if is_set else ""
        if not is_set:
            raise KeyError(f"${{{name}}} has no default")
        return value

    return _COMPOSE_VAR.sub(replace, text)


def interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    return node


def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def command_args(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    assert isinstance(command, list), "commands are written as lists, so nothing is re-split"
    return [str(arg) for arg in command]


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on", {})
    assert isinstance(deps, dict), "depends_on must use the long form with conditions"
    return {name: spec["condition"] for name, spec in deps.items()}


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    result = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            result.append((volume["source"], volume["target"]))
        else:
            source, target = volume.split(":")[:2]
            result.append((source, target))
    return result


def healthcheck_text(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else test

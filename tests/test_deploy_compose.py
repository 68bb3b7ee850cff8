"""Structural tests of docker-compose.yml: every service and profile (the default stack,
gpu, cpu, peer, observability) wired to the others, images pinned, volumes and bind
mounts present, the generated secrets and least-privilege MinIO users, and every
tiercache configuration it produces validated with tiercache's own config model. No
network, no Docker daemon. `docker compose config` runs where Docker's compose plugin is
installed and is skipped, naming the missing binary, where it is not.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.deploy import (
    COMPOSE_FILE,
    DOCKER_DIR,
    KV_CONNECTOR_KEYS,
    ROOT,
    TOOL_TIMEOUT,
    arg_value,
    command_args,
    depends_on,
    environment,
    healthcheck_text,
    interpolate,
    interpolate_tree,
    load_yaml,
    mounts,
    services,
    validate_tiercache_config,
)

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

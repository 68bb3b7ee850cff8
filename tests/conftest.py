"""Shared fixtures: real servers on loopback (where a Docker engine is present,
testcontainers runs Redis and MinIO instead of the local processes), and the CUDA
path's copy kernel on Triton's CPU interpreter.

Two S3 endpoints: `s3_endpoint` is moto (any credentials, fast, for unit tests and
fault injection); `real_s3_endpoint` is SeaweedFS, a real S3-compatible store that
checks every request's signature, for the end-to-end tests. Under Docker both are
the one MinIO container.

The deployment-artifact tests (tests/test_deploy_*.py) share the parsed compose file,
the chart's Chart.yaml, values.yaml and values schema, and the `helm` binary, each read
once per test module."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import uuid
from typing import Any

import pytest

from tiercache.ops.local_stack import RedisServer, SeaweedS3, create_bucket, start_moto

from support.deploy import CHART, COMPOSE_FILE, interpolate_tree, load_yaml
from support.helm import helm_binary


def _docker_available() -> bool:
    if os.environ.get("TIERCACHE_TEST_DOCKER", "auto") == "0" or shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0


DOCKER = _docker_available()


@pytest.fixture(scope="session")
def redis_url():
    if DOCKER:
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7") as container:
            host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0"
        return
    server = RedisServer().start()
    yield server.url
    server.close()


@pytest.fixture
def redis(redis_url):
    """The session Redis, emptied, behind tiercache's guarded client."""
    from tiercache.index.redis_conn import GuardedRedis

    from support.redis_config import PATIENT

    guarded = GuardedRedis(redis_url, PATIENT)
    guarded.client.flushdb()
    yield guarded
    guarded.close()


@pytest.fixture
def redis_server():
    """A private redis-server this test may stop and restart."""
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def s3_endpoint():
    if DOCKER:
        from testcontainers.minio import MinioContainer

        with MinioContainer() as minio:
            config = minio.get_config()
            os.environ["AWS_ACCESS_KEY_ID"] = config["access_key"]
            os.environ["AWS_SECRET_ACCESS_KEY"] = config["secret_key"]
            yield f"http://{config['endpoint']}"
        return
    endpoint = start_moto()
    yield endpoint.url
    endpoint.stop()


@pytest.fixture
def bucket(s3_endpoint):
    name = f"tc-{uuid.uuid4().hex[:12]}"
    create_bucket(s3_endpoint, name)
    return name


@pytest.fixture(scope="session")
def real_s3_endpoint(request):
    """SeaweedFS's S3 gateway (one `weed server` for the session), its credentials in
    this process's environment for boto3's standard chain and every engine process a
    test starts. moto takes any credentials, so the moto tests run on beside it."""
    if DOCKER:
        yield request.getfixturevalue("s3_endpoint")  # MinIO checks signatures too
        return
    server = SeaweedS3().start()
    os.environ.update(server.env)
    yield server.url
    server.close()


@pytest.fixture
def real_bucket(real_s3_endpoint):
    name = f"tc-{uuid.uuid4().hex[:12]}"
    create_bucket(real_s3_endpoint, name)
    return name


@pytest.fixture
def interpreted(monkeypatch):
    """The CUDA path's copy kernel (connector/fused_copy.py) built for Triton's CPU
    interpreter, so it runs on CPU tensors; rebuilt as it was afterwards."""
    from tiercache.connector import fused_copy

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(fused_copy)
    yield
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(fused_copy)


# --------------------------------------------------------------- deployment artifacts


@pytest.fixture(scope="module")
def compose_raw() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)


@pytest.fixture(scope="module")
def compose(compose_raw: dict[str, Any]) -> dict[str, Any]:
    """The compose file as `docker compose` sees it with no variables set: all defaults."""
    return interpolate_tree(compose_raw, {})


@pytest.fixture(scope="module")
def chart() -> dict[str, Any]:
    return load_yaml(CHART / "Chart.yaml")


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return load_yaml(CHART / "values.yaml")


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


@pytest.fixture(scope="module")
def helm() -> str:
    return str(helm_binary())

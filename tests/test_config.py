"""Configuration: sizes, refusals that name their field, environment overrides,
redaction, YAML files and `tiercache config check`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.config import (
    ConfigError,
    MoverConfig,
    TierCacheConfig,
    build_config,
    load_config,
    parse_byte_size,
    redact_url,
)
from tiercache.config_env import env_overrides

TIERCACHE_BIN = Path(sys.executable).with_name("tiercache")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("8GiB", 8 * 2**30),
        ("8GB", 8 * 10**9),
        ("8gb", 8 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("4096", 4096),
        ("100 KiB", 100 * 1024),
        (4096, 4096),
        (2.0**20, 2**20),
    ],
)
def test_byte_sizes(text, expected):
    assert parse_byte_size(text) == expected
    assert build_config({"cpu": {"capacity": text}}, environ={}).cpu.capacity == expected


@pytest.mark.parametrize("bad", ["lots", "8XB", "-1GiB", 0, -5, True, "", [1], 1.5])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        parse_byte_size(bad)
    with pytest.raises(ConfigError) as info:
        build_config({"cpu": {"capacity": bad}}, environ={})
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("cpu.capacity: ")


def test_defaults_without_any_settings():
    config = build_config(None, environ={})
    assert config.namespace == "default"
    assert config.redis_url is None and config.disk is None and config.s3 is None
    assert config.cpu.capacity == 2 * 2**30
    assert config.movers.policy == "write_through"


def test_the_contract_keys(tmp_path):
    config = build_config(
        {
            "namespace": "prod",
            "redis_url": "redis://host:6379/0",
            "cpu": {"capacity": "8GiB"},
            "disk": {"path": str(tmp_path), "capacity": "200GiB"},
            "s3": {
                "bucket": "kv",
                "prefix": "prod/",
                "endpoint_url": "http://minio:9000",
                "region": "us-east-1",
            },
        },
        environ={},
    )
    assert config.namespace == "prod"
    assert config.cpu.capacity == 8 * 2**30
    assert config.disk.path == tmp_path and config.disk.capacity == 200 * 2**30
    assert config.s3.bucket == "kv" and config.s3.prefix == "prod/"
    assert config.s3.endpoint_url == "http://minio:9000" and config.s3.path_style


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"cpu": {"capacty": "1GiB"}}, "cpu.capacty: unknown key"),
        ({"namspace": "x"}, "namspace: unknown key"),
        ({"disk": {"path": "/x", "size": 3}}, "disk.size: unknown key"),
        ({"disk": {"path": "relative/dir"}}, "disk.path: "),
        ({"disk": {"capacity": "1GiB"}}, "disk.path: "),
        ({"namespace": "has space"}, "namespace: "),
        ({"namespace": ""}, "namespace: "),
        ({"redis_url": "http://host:6379"}, "redis_url: "),
        ({"redis_url": "redis://h", "s3": {"bucket": "Bad_Bucket"}}, "s3.bucket: "),
        ({"redis_url": "redis://h", "s3": {"bucket": "kv", "prefix": "/abs"}}, "s3.prefix: "),
        ({"redis_url": "redis://h", "s3": {"bucket": "kv", "prefix": "a/../b"}}, "s3.prefix: "),
        (
            {"redis_url": "redis://h", "s3": {"bucket": "kv", "endpoint_url": "minio:9000"}},
            "s3.endpoint_url: ",
        ),
        ({"redis_url": "redis://h", "s3": {"bucket": "kv", "max_concurrency": 0}}, "s3.max_concurrency: "),
        ({"movers": {"policy": "write_around"}}, "movers.policy: "),
        ({"movers": {"queue_depth": 0}}, "movers.queue_depth: "),
        ({"redis": {"socket_timeout": -1}}, "redis.socket_timeout: "),
    ],
)
def test_refusals_name_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        build_config(data, source="test.yaml", environ={})
    error = info.value
    assert any(problem.startswith(field) for problem in error.problems), error.problems
    assert "test.yaml" in str(error)
    assert field.split(":")[0] in str(error)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        build_config({"cpu": {"capacity": "x"}, "bogus": 1, "movers": {"workers": 0}}, environ={})
    fields = sorted(problem.split(":")[0] for problem in info.value.problems)
    assert fields == ["bogus", "cpu.capacity", "movers.workers"]


def test_the_removed_promote_on_hit_is_refused_and_says_why():
    """movers.promote_on_hit was read nowhere: a setting that did nothing. Gone, and a
    configuration that still sets it is told so, naming it."""
    with pytest.raises(ConfigError) as info:
        build_config({"movers": {"promote_on_hit": False}}, environ={})
    (problem,) = info.value.problems
    assert problem.startswith("movers.promote_on_hit: removed") and "always promoted" in problem
    assert "promote_on_hit" not in MoverConfig.model_fields


@pytest.mark.parametrize("where", ["file", "environment"])
@pytest.mark.parametrize("key", ["upload_process", "yield_to_loads"])
def test_the_removed_cpu_backend_mechanisms_are_refused_and_say_why(tmp_path, where, key):
    """S3 uploads from a process of their own and the write-down gate served vLLM's
    CPU backend until serving runs showed neither made a difference
    (docs/benchmarks.md). A configuration that still sets either, in its file or its
    environment, is told it was removed, by name, rather than that the key is unknown."""
    path = tmp_path / "tiercache.yaml"
    if where == "file":
        path.write_text(f"movers:\n  {key}: true\n")
        environ = {}
    else:
        path.write_text("movers:\n  workers: 2\n")
        environ = {f"TIERCACHE_MOVERS__{key.upper()}": "false"}
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=environ)
    (problem,) = info.value.problems
    assert problem.startswith(f"movers.{key}: removed") and "delete it" in problem
    assert key not in MoverConfig.model_fields


def test_s3_without_redis_is_refused():
    with pytest.raises(ConfigError) as info:
        build_config({"s3": {"bucket": "kv"}}, environ={})
    assert any("s3 needs redis_url" in problem for problem in info.value.problems)
    # With redis_url the same s3 block is accepted.
    assert build_config({"s3": {"bucket": "kv"}, "redis_url": "redis://h:6379"}, environ={}).s3.bucket == "kv"


def test_a_mapping_is_required_at_the_top():
    with pytest.raises(ConfigError) as info:
        build_config(["cpu"], environ={})  # type: ignore[arg-type]
    assert info.value.problems == ["(top level): expected a mapping, got list"]


def test_env_overrides():
    environ = {
        "TIERCACHE_CPU__CAPACITY": "1GiB",
        "TIERCACHE_NAMESPACE": "prod",
        "TIERCACHE_MOVERS__QUEUE_DEPTH": "7",
        "TIERCACHE_ADMIN_TOKEN": "not-config",
        "OTHER_VARIABLE": "ignored",
    }
    assert env_overrides(environ) == {
        "cpu": {"capacity": "1GiB"},
        "namespace": "prod",
        "movers": {"queue_depth": 7},
    }
    # The environment wins over the file's value, and leaves its siblings alone.
    config = build_config({"cpu": {"capacity": "4GiB"}, "movers": {"workers": 3}}, environ=environ)
    assert config.cpu.capacity == 2**30
    assert config.namespace == "prod"
    assert config.movers.queue_depth == 7 and config.movers.workers == 3


def test_env_overrides_are_validated_too():
    with pytest.raises(ConfigError) as info:
        build_config({}, environ={"TIERCACHE_CPU__CAPACITY": "huge"})
    assert info.value.problems[0].startswith("cpu.capacity: ")
    with pytest.raises(ConfigError) as info:
        build_config({}, environ={"TIERCACHE_CPU__SIZE": "1GiB"})
    assert info.value.problems == ["cpu.size: unknown key"]


def test_env_overrides_from_the_process_environment(monkeypatch):
    monkeypatch.setenv("TIERCACHE_CPU__CAPACITY", "1GiB")
    assert build_config({}).cpu.capacity == 2**30


def test_password_is_redacted():
    url = "redis://alice:s3cr3t-pw@redis.example:6379/0"
    config = build_config({"redis_url": url}, environ={})
    assert config.redis_url == url  # the real value is kept for connecting
    shown = config.redacted()
    assert shown["redis_url"] == "redis://alice:***@redis.example:6379/0"
    assert "s3cr3t-pw" not in json.dumps(shown)
    assert redact_url("rediss://:pw@h:1") == "rediss://:***@h:1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def test_redaction_hides_a_password_holding_an_at_sign_and_query_secrets():
    # Review fix: the password ran up to the first "@", so what followed it leaked.
    assert redact_url("redis://alice:pa@ss@w0rd@h:6379/0") == "redis://alice:***@h:6379/0"
    assert redact_url("rediss://:p@x@h:1") == "rediss://:***@h:1"
    shown = redact_url("redis://h:6379/0?password=hunter2&db=1&ssl_password=x2")
    assert shown == "redis://h:6379/0?password=***&db=1&ssl_password=***"


def test_a_refused_redis_url_does_not_echo_its_password():
    with pytest.raises(ConfigError) as info:
        build_config({"redis_url": "http://bob:hunter2@h:6379"}, environ={})
    assert "hunter2" not in str(info.value)
    assert info.value.problems[0].startswith("redis_url: ")


def test_config_is_frozen():
    config = build_config({}, environ={})
    with pytest.raises(ValueError):
        config.namespace = "other"  # type: ignore[misc]


def test_yaml_file(tmp_path):
    path = tmp_path / "tiercache.yaml"
    path.write_text(
        "namespace: prod\n"
        "redis_url: redis://:pw@127.0.0.1:6379/0\n"
        "cpu: {capacity: 512MiB}\n"
        f"disk: {{path: {tmp_path / 'disk'}, capacity: 8GB}}\n"
        "s3: {bucket: kv, prefix: prod/, endpoint_url: 'http://minio:9000', region: us-east-1}\n"
    )
    config = load_config(path, environ={})
    assert isinstance(config, TierCacheConfig)
    assert config.cpu.capacity == 512 * 2**20
    assert config.disk.capacity == 8 * 10**9
    assert config.s3.region == "us-east-1"
    config = load_config(path, environ={"TIERCACHE_CPU__CAPACITY": "1GiB"})
    assert config.cpu.capacity == 2**30


def test_yaml_file_problems(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing, environ={})
    assert info.value.source == str(missing)
    assert "cannot read the file" in info.value.problems[0]

    broken = tmp_path / "broken.yaml"
    broken.write_text("cpu: {capacity: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(broken, environ={})
    assert info.value.problems[0].startswith("not valid YAML")

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty, environ={}).namespace == "default"


def _check(path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TIERCACHE_")}
    environ.update(env or {})
    return subprocess.run(
        [str(TIERCACHE_BIN), "config", "check", str(path), *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
    )


def test_cli_config_check(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(
        "namespace: prod\nredis_url: redis://u:topsecret@h:6379/0\ncpu: {capacity: 512MiB}\n"
        "s3: {bucket: kv, endpoint_url: 'http://minio:9000'}\n"
    )
    result = _check(good, "--json", env={"TIERCACHE_MOVERS__WORKERS": "9"})
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["namespace"] == "prod"
    assert resolved["cpu"]["capacity"] == 512 * 2**20
    assert resolved["movers"]["workers"] == 9
    assert resolved["redis_url"] == "redis://u:***@h:6379/0"
    assert "topsecret" not in result.stdout + result.stderr

    result = _check(good)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "namespace: prod" in result.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu: {capacty: 1GiB}\ndisk: {path: relative}\n")
    result = _check(bad)
    assert result.returncode == 2
    message = " ".join(result.stderr.split())
    assert "cpu.capacty: unknown key" in message
    assert "disk.path" in message
    assert "Traceback" not in result.stderr

    result = _check(good, env={"TIERCACHE_CPU__CAPACITY": "lots"})
    assert result.returncode == 2
    assert "cpu.capacity" in result.stderr

    result = _check(tmp_path / "nope.yaml")
    assert result.returncode == 2
    assert "cannot read the file" in " ".join(result.stderr.split())


def test_an_s3_tier_without_capacity_is_warned_about_at_start(
    tmp_path, redis_url, s3_endpoint, bucket, caplog
):
    """Review fix: with no s3.capacity nothing bounds S3 or the index; say so at start,
    once per vLLM instance (its scheduler half, not each TP rank's tier engine) and
    once by the service."""
    import logging
    from types import SimpleNamespace

    from tiercache.connector.scheduler import TierCacheScheduler
    from tiercache.engine import ObjectShape, TierEngine
    from tiercache.index.keys import KVSpec
    from tiercache.ops.service import create_app
    from tiercache.tiers.cpu import CpuBuffer

    layers = ["model.layers.0.self_attn.attn"]
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=4096), layer_names=layers)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group], num_blocks=8)
    specs = [KVSpec("m", "", "float32", "auto", 16, "cpu", 1, 2, 8, 2, rank, "t", 4096) for rank in range(2)]

    s3 = {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1"}
    unbounded = build_config({"redis_url": redis_url, "s3": s3}, environ={})
    bounded = build_config({"redis_url": redis_url, "s3": {**s3, "capacity": "1GiB"}}, environ={})
    shape = ObjectShape("0" * 16, "1" * 16, 4096)

    def warnings_at_start(config) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            TierCacheScheduler(config, specs, kv_cache_config, worker_count=2).close()
            for _ in specs:  # each TP rank's worker runs a tier engine
                TierEngine(config, shape, CpuBuffer(1, 4096, pin_memory=False)).close()
            service = create_app(config).state.tiercache
            service.start()
            service.close()
        return [r.getMessage() for r in caplog.records if "s3.capacity" in r.getMessage()]

    assert len(warnings_at_start(unbounded)) == 2  # the scheduler half and the service
    assert warnings_at_start(bounded) == []
    path = tmp_path / "unbounded.yaml"
    path.write_text(json.dumps({"redis_url": redis_url, "s3": s3}))
    checked = subprocess.run(
        [sys.executable, "-m", "tiercache.ops.cli", "config", "check", str(path)],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0 and "s3.capacity" in checked.stderr

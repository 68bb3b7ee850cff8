"""Security: Redis over TLS with a CA and an ACL user, secrets kept out of logs,
errors and the HTTP API, keys that cannot leave the disk root, the admin token
compared in constant time, and bad input to the HTTP API answered with a 4xx
(schemathesis against the service's own OpenAPI spec, and hypothesis)."""

from __future__ import annotations

import inspect
import logging
import uuid
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tiercache.config import ConfigError, RedisConfig, S3TierConfig, TierCacheConfig, build_config, redact_url
from tiercache.index.keys import HEX_KEY, split_key
from tiercache.index.leases import Claim, Leases, new_token
from tiercache.index.redis_conn import GuardedRedis, RedisUnavailable
from tiercache.index.redis_index import RedisIndex
from tiercache.ops import service
from tiercache.ops.service import admin as admin_routes
from tiercache.ops.service import auth
from tiercache.ops.service import cache as cache_routes
from tiercache.tiers.disk.tier import DiskTier
from tiercache.tiers.format import ObjectHeader, checksum
from tiercache.tiers.s3.tier import S3Tier

from support.faults import TlsRedisServer
from support.s3_blocks import fetch_block, put_block
from support.single_blocks import acquire_read, add_block, claim_write, publish

PASSWORD = "pw-" + uuid.uuid4().hex


def digest() -> str:
    return uuid.uuid4().hex[:16]


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    server = TlsRedisServer(tmp_path_factory.mktemp("tls-redis"), "tiercache", PASSWORD)
    yield server
    server.close()


# -- rediss:// with a CA and an ACL user -------------------------------------------------------


def test_index_and_leases_over_tls_with_an_acl_user(tls_redis):
    settings_ = RedisConfig(ssl_ca_certs=tls_redis.files["ca"], socket_timeout=2, connect_timeout=2)
    guarded = GuardedRedis(tls_redis.url(PASSWORD), settings_)
    index, leases = RedisIndex(guarded), Leases(guarded)
    model, rank = digest(), digest()
    blocks = [uuid.uuid4().bytes * 2 for _ in range(5)]
    for block in blocks:
        add_block(index, model, rank, block)
    assert index.longest_prefix(model, [rank], blocks) == 5
    token = new_token()
    block = uuid.uuid4().bytes * 2
    assert claim_write(leases, model, rank, block, token) is Claim.ACQUIRED
    publish(leases, model, rank, block, token)
    assert acquire_read(leases, model, rank, block, new_token())
    guarded.close()


def test_tls_without_the_ca_or_with_a_wrong_password_is_a_miss_and_leaks_nothing(tls_redis, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "wrong-" + uuid.uuid4().hex
    cases = [
        GuardedRedis(tls_redis.url(wrong), RedisConfig(ssl_ca_certs=tls_redis.files["ca"])),
        GuardedRedis(tls_redis.url(PASSWORD), RedisConfig()),  # no CA: the certificate is refused
        GuardedRedis(tls_redis.url(PASSWORD).replace("rediss", "redis", 1), RedisConfig()),  # not TLS
    ]
    messages = []
    for guarded in cases:
        with pytest.raises(RedisUnavailable) as info:
            RedisIndex(guarded).longest_prefix(digest(), [digest()], [b"\x01" * 32])
        messages.append(str(info.value))
        guarded.close()
    text = "\n".join(messages) + caplog.text
    assert wrong not in text and PASSWORD not in text
    # The config's own view of the URL hides the password too.
    config = build_config({"redis_url": tls_redis.url(PASSWORD)}, environ={})
    assert PASSWORD not in str(config.redacted()) and "***" in redact_url(config.redis_url)


def test_a_bad_redis_url_in_config_errors_without_the_password():
    from tiercache.config import ConfigError

    with pytest.raises(ConfigError) as info:
        build_config({"redis_url": f"http://user:{PASSWORD}@host:6379"}, environ={})
    assert PASSWORD not in str(info.value)


# -- S3 credentials never in logs, errors or the HTTP API ---------------------------------------


def test_s3_credentials_never_in_logs_errors_or_stats(
    monkeypatch, caplog, s3_endpoint, bucket, redis_url, tmp_path
):
    key_id, secret = "AKIA" + uuid.uuid4().hex[:16].upper(), "secret-" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG)
    texts = []
    data = memoryview(b"\x05" * 4096)
    key = f"{digest()}/{uuid.uuid4().hex * 2}"
    header = ObjectHeader(key, key[:16], len(data), checksum(data))
    for endpoint, bucket_name in (
        (s3_endpoint, bucket),
        (s3_endpoint, "no-such-bucket"),
        ("http://127.0.0.1:1", bucket),
    ):
        config = S3TierConfig(
            bucket=bucket_name, endpoint_url=endpoint, region="us-east-1", connect_timeout=0.5, max_attempts=1
        )
        tier = S3Tier(config)
        stored = put_block(tier, header, data)
        if stored is not None:
            fetch_block(tier, stored, memoryview(bytearray(len(data))))
        try:
            tier.read_run_header(key[:16], "00" * 8)  # raises: missing, or S3's own failure
        except Exception as error:  # noqa: BLE001 - whatever it is, its text must be clean
            texts.append(repr(error) + str(error))
        tier.close()
    config = build_config(
        {
            "redis_url": redis_url,
            "disk": {"path": str(tmp_path / "disk")},
            "s3": {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1"},
        },
        environ={},
    )
    with TestClient(service.create_app(config, admin_token="t" * 32)) as client:
        for path in ("/v1/stats", "/readyz", "/metrics", "/healthz", "/openapi.json"):
            texts.append(client.get(path).text)
        texts.append(client.post("/v1/gc", headers={"Authorization": "Bearer " + "t" * 32}).text)
    texts.append(str(config.redacted()))
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("tiercache"))
    assert "s3 tier" in ours  # the failures above were logged ...
    text = "\n".join(texts) + ours
    assert secret not in text and key_id not in text  # ... without the credentials
    # Not even botocore's own DEBUG output holds the secret key (it names the key id).
    assert secret not in caplog.text


# -- keys and namespaces cannot escape the disk root ------------------------------------------

hexchars = st.text(alphabet="0123456789abcdef", min_size=0, max_size=140)
anything = st.text(min_size=0, max_size=200)
tricky = st.sampled_from(["..", "/", "\\", "\x00", "\n", "%2e%2e", "~", "./", "A", " "])


def key_like():
    return st.one_of(
        anything,
        st.builds(
            lambda a, sep, b: a + sep + b, hexchars, st.sampled_from(["/", "//", "/../", "\\"]), hexchars
        ),
        st.builds(lambda a, t, b: a + t + b, hexchars, tricky, hexchars),
        st.builds(lambda a, b, t: f"{a}/{b}{t}", hexchars, hexchars, tricky),
    )


@pytest.fixture(scope="module")
def disk_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("root")


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=key_like())
def test_keys_cannot_escape_the_disk_root(key, disk_root):
    tier = _disk(disk_root)
    s3 = S3Tier(S3TierConfig(bucket="b", prefix="ns/"), client=object())
    try:
        digest_part, block = split_key(key)
    except ValueError:
        assert not HEX_KEY.fullmatch(key)
        for call in (tier.path_of, s3.object_name, tier.delete):
            with pytest.raises(ValueError):
                call(key)
        with pytest.raises(ValueError):  # refused before any file is opened
            tier.get_into(key, memoryview(bytearray(8)))
        s3.pool.shutdown()
        return
    s3.pool.shutdown()
    assert HEX_KEY.fullmatch(key) and "\n" not in key
    path = tier.path_of(key).resolve()
    assert path.is_relative_to(disk_root.resolve())
    assert path.parent.parent.parent == disk_root.resolve()
    assert ".." not in s3.object_name(key).split("/")


_TIERS: dict[Path, DiskTier] = {}


def _disk(root: Path) -> DiskTier:
    if root not in _TIERS:
        _TIERS[root] = DiskTier(root, 1 << 20)
    return _TIERS[root]


@settings(max_examples=300, deadline=None)
@given(namespace=anything)
def test_namespaces_with_path_characters_are_refused(namespace):
    try:
        config = TierCacheConfig(namespace=namespace)
    except ValueError:
        return
    assert "/" not in config.namespace and "\\" not in config.namespace
    assert config.namespace not in (".", "..") and not config.namespace.startswith(".")


# -- the admin token ----------------------------------------------------------------------------


def test_admin_token_is_compared_in_constant_time(tmp_path):
    source = inspect.getsource(auth)
    assert "hmac.compare_digest" in source
    for module in (auth, admin_routes, cache_routes):
        text = inspect.getsource(module)
        assert "admin ==" not in text and "lookup ==" not in text and "token ==" not in text
    config = build_config({"disk": {"path": str(tmp_path)}}, environ={})
    token = "tok-" + uuid.uuid4().hex
    with TestClient(service.create_app(config, admin_token=token)) as client:
        assert client.post("/v1/gc").status_code == 401
        for wrong in (token[:-1], token + "x", "", "é" * 10, token.upper()):
            value = f"Bearer {wrong}".encode()  # raw bytes: a non-ASCII token too
            response = client.post("/v1/gc", headers=[(b"authorization", value)])
            assert response.status_code == 401, (wrong, response.text)
        # The right token passes the check (then: no S3 configured, so nothing to collect).
        assert client.post("/v1/gc", headers={"Authorization": f"Bearer {token}"}).status_code == 409
    with TestClient(service.create_app(config, admin_token=None)) as client:
        response = client.post("/v1/gc", headers={"Authorization": "Bearer anything"})
        assert response.status_code == 403


# -- the lookup and admin tokens come from the environment or files, never the config ----------


def test_tokens_from_variables_files_and_a_namespace_folder(tmp_path):
    """Issue 39, item 5: TIERCACHE_LOOKUP_TOKEN(_FILE), TIERCACHE_LOOKUP_TOKENS_DIR (a
    mounted Secret: one file per namespace, its data behind `..data` links) and
    TIERCACHE_ADMIN_TOKEN(_FILE), read the same way."""
    secret = tmp_path / "lookup-tokens"
    data = secret / "..2026_11_27_06_00_00.000000001"
    data.mkdir(parents=True)
    (data / "team-a").write_text("token-a\n")
    (data / "team.b").write_text("token-b")
    (secret / "..data").symlink_to(data.name)
    for name in ("team-a", "team.b"):
        (secret / name).symlink_to(f"..data/{name}")
    router = tmp_path / "router-token"
    router.write_text("router-token\n")
    tokens = auth.ServiceTokens.from_environment(
        {
            "TIERCACHE_ADMIN_TOKEN": "admin-token",
            "TIERCACHE_LOOKUP_TOKEN_FILE": str(router),
            "TIERCACHE_LOOKUP_TOKENS_DIR": str(secret),
        }
    )
    assert tokens == auth.ServiceTokens(
        "admin-token", "router-token", {"team-a": "token-a", "team.b": "token-b"}
    )
    admin_file = tmp_path / "admin"
    admin_file.write_text("from-a-file\n")
    assert (
        auth.ServiceTokens.from_environment({"TIERCACHE_ADMIN_TOKEN_FILE": str(admin_file)}).admin
        == "from-a-file"
    )
    nothing = auth.ServiceTokens.from_environment({"TIERCACHE_LOOKUP_TOKEN": ""})
    assert nothing.lookups_open and nothing.admin is None
    # Not config: a config built beside them never sees or refuses them.
    environ = {"TIERCACHE_LOOKUP_TOKEN": "x" * 40, "TIERCACHE_LOOKUP_TOKENS_DIR": str(secret)}
    assert "x" * 40 not in str(
        build_config({}, environ={**environ, "TIERCACHE_ADMIN_TOKEN_FILE": "/nope"}).redacted()
    )

    check = auth.TokenCheck(tokens)
    assert check.grant("token-a") == auth.Grant(namespaces=frozenset({"team-a"}))
    assert check.grant("router-token").may_look_up("anything")
    assert check.grant("admin-token").admin and check.grant("admin-token").may_look_up("team.b")
    assert check.grant("token-a").may_look_up("team-a") and not check.grant("token-a").may_look_up("team.b")
    assert check.grant(None) == check.grant("") == check.grant("token-a ") == auth.Grant()


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        (
            {"TIERCACHE_LOOKUP_TOKEN": "a", "TIERCACHE_LOOKUP_TOKEN_FILE": "{dir}/t"},
            "TIERCACHE_LOOKUP_TOKEN_FILE",
        ),
        ({"TIERCACHE_LOOKUP_TOKEN_FILE": "{dir}/missing"}, "TIERCACHE_LOOKUP_TOKEN_FILE: cannot read"),
        ({"TIERCACHE_ADMIN_TOKEN_FILE": "{dir}/empty"}, "TIERCACHE_ADMIN_TOKEN_FILE: {dir}/empty is empty"),
        ({"TIERCACHE_LOOKUP_TOKENS_DIR": "{dir}/t"}, "TIERCACHE_LOOKUP_TOKENS_DIR: {dir}/t is not a folder"),
        ({"TIERCACHE_LOOKUP_TOKENS_DIR": "{dir}/bad"}, "'-bad' in {dir}/bad is not a namespace name"),
    ],
)
def test_unusable_token_settings_are_refused_naming_the_variable(tmp_path, environ, named):
    (tmp_path / "t").write_text("secret-token-value")
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "-bad").write_text("secret-token-value")
    environ = {k: v.format(dir=tmp_path) for k, v in environ.items()}
    with pytest.raises(auth.TokenError) as info:
        auth.ServiceTokens.from_environment(environ)
    assert named.format(dir=tmp_path) in str(info.value)
    assert "secret-token-value" not in str(info.value)


def test_serve_refuses_an_unusable_token_setting(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIERCACHE_LOOKUP_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(SystemExit) as info:
        service.serve(build_config({}, environ={}), port=0)
    assert info.value.code == 2
    assert "TIERCACHE_LOOKUP_TOKEN_FILE: cannot read" in caplog.text


def test_serve_takes_its_lookup_tokens_from_files(tmp_path, redis_url):
    """`tiercache serve` as the chart runs it: the router token from a file, the
    per-namespace tokens from a mounted folder; lookups without one get a 401."""
    import json
    import os
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from tiercache.ops.local_stack import free_port

    (tmp_path / "router").write_text("router-token-" + uuid.uuid4().hex + "\n")
    (tmp_path / "namespaces").mkdir()
    (tmp_path / "namespaces" / "team-a").write_text("team-a-token")
    config = tmp_path / "service.yaml"
    config.write_text(f"redis_url: {redis_url}\n")
    port = free_port()
    environ = {key: value for key, value in os.environ.items() if not key.startswith("TIERCACHE_")}
    environ |= {
        "TIERCACHE_LOOKUP_TOKEN_FILE": str(tmp_path / "router"),
        "TIERCACHE_LOOKUP_TOKENS_DIR": str(tmp_path / "namespaces"),
    }
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tiercache.ops.cli", "serve", "--config", str(config), "--port", str(port)],
        env=environ,
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def lookup(namespace: str, token: str | None) -> int:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        body = json.dumps({"namespace": namespace, "block_hashes": ["ab" * 32]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/lookup", data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "tiercache serve did not start"
                time.sleep(0.2)
        router = (tmp_path / "router").read_text().strip()
        assert lookup("team-a", None) == 401
        assert lookup("team-a", "team-a-token") == 200
        assert lookup("team-b", "team-a-token") == 401
        assert lookup("team-b", router) == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "lookups need a token" in text and router not in text and "team-a-token" not in text


def test_integrity_key_from_a_file(tmp_path):
    """Issue 39, item 6: compose hands the generated key over as a file."""
    key = "k" * 48
    (tmp_path / "key").write_text(key + "\n")
    config = build_config({}, environ={"TIERCACHE_INTEGRITY_KEY_FILE": str(tmp_path / "key")})
    assert config.integrity_key_bytes() == key.encode()
    with pytest.raises(ConfigError, match="TIERCACHE_INTEGRITY_KEY_FILE: cannot read"):
        build_config({}, environ={"TIERCACHE_INTEGRITY_KEY_FILE": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="both set"):
        build_config(
            {},
            environ={"TIERCACHE_INTEGRITY_KEY_FILE": str(tmp_path / "key"), "TIERCACHE_INTEGRITY_KEY": key},
        )


def test_compose_secrets_are_generated_once_and_the_environment_wins(tmp_path):
    from tiercache.ops.service.generate_secrets import generate

    service_dir, vllm_dir = tmp_path / "service", tmp_path / "vllm"
    generate(service_dir, vllm_dir, environ={})
    first = {p.name: p.read_text() for p in service_dir.iterdir()}
    assert len((vllm_dir / "integrity-key").read_text().strip()) >= 32
    assert (service_dir / "s3-secret-key").read_text() != (vllm_dir / "s3-secret-key").read_text()
    assert service_dir.stat().st_mode & 0o777 == 0o700
    chosen = "chosen-lookup-token-" + uuid.uuid4().hex
    generate(service_dir, vllm_dir, environ={"TIERCACHE_LOOKUP_TOKEN": chosen})
    again = {p.name: p.read_text() for p in service_dir.iterdir()}
    assert again["lookup-token"].strip() == chosen
    assert {k: v for k, v in again.items() if k != "lookup-token"} == {
        k: v for k, v in first.items() if k != "lookup-token"
    }


# -- bad input to the HTTP API gets a 4xx with a clear message ---------------------------------


@pytest.fixture(scope="module")
def api_app(redis_url, s3_endpoint, tmp_path_factory):
    from tiercache.ops.local_stack import create_bucket

    create_bucket(s3_endpoint, "tc-sec-api")
    config = build_config(
        {
            "redis_url": redis_url,
            "disk": {"path": str(tmp_path_factory.mktemp("api-disk"))},
            "s3": {"bucket": "tc-sec-api", "endpoint_url": s3_endpoint, "region": "us-east-1"},
        },
        environ={},
    )
    # No admin token in requests: schemathesis never reaches a flush or a GC.
    return service.create_app(config, admin_token="admin-" + uuid.uuid4().hex)


@pytest.fixture(scope="module")
def api_client(api_app):
    with TestClient(api_app) as client:
        yield client


def test_http_api_against_its_openapi_spec(api_app):
    """schemathesis generates valid and invalid requests for every operation of the
    service's own OpenAPI spec: no 5xx (a 503 is documented for Redis or S3 down),
    and every 4xx says what was wrong."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", api_app)
    seen = {"operations": 0, "4xx": 0}
    for result in schema.get_all_operations():
        operation = result.ok()
        seen["operations"] += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call()
                case.validate_response(response, checks=[not_a_server_error])
                if 400 <= response.status_code < 500:
                    seen["4xx"] += 1
                    assert response.json().get("detail"), response.text

            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing to get wrong (no parameters)
    assert seen["operations"] >= 6 and seen["4xx"] > 0, seen


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.one_of(
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
            ),
            max_leaves=12,
        ),
        st.fixed_dictionaries(
            {"namespace": st.text(max_size=40), "block_hashes": st.lists(st.text(max_size=80), max_size=4)}
        ),
    )
)
def test_bad_lookup_bodies_get_a_4xx_with_a_message(body, api_client):
    response = api_client.post("/v1/lookup", json=body)
    if response.status_code == 200:
        return  # a body that happened to be valid
    assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
    assert response.json().get("detail"), response.text

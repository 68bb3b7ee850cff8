"""The service's endpoints against a real redis-server and moto's S3 server, with
objects written by the tier engine."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.config import build_config
from tiercache.connector.driver import ConnectorDriver
from tiercache.engine import ObjectShape, TierEngine
from tiercache.index.block_hashing import BlockHashing
from tiercache.index.keys import block_key
from tiercache.index.presence import PresencePublisher
from tiercache.index.redis_index import REGISTRY, Deployment, blocks_key, parse_location, runs_key
from tiercache.ops.peers import peer_record_key
from tiercache.ops.service import MAX_LOOKUP_HASHES, collect_stats, create_app
from tiercache.ops.service.models import MAX_LOOKUP_TOKENS
from tiercache.tiers.cpu import CpuBuffer
from tiercache.tiers.peer.agent import PeerRecord
from tiercache.tiers.peer.registry import PeerRegistry, record_key
from tiercache.tiers.s3.tier import S3Tier, make_client

SLOT = 4096
OBJECT = ObjectShape("0" * 16, "1" * 16, SLOT).object_bytes
TOKEN = "s3cr3t-admin-token"


def make_config(redis_url, s3_endpoint=None, bucket=None, *, namespace="ns1", capacity=None, disk=None):
    data = {"namespace": namespace, "redis_url": redis_url, "cpu": {"capacity": 64 * SLOT}}
    if s3_endpoint:
        # Runs of one block: GC figures here count one object per block.
        data["s3"] = {"bucket": bucket, "endpoint_url": s3_endpoint, "region": "us-east-1", "pack_blocks": 1}
        if capacity is not None:
            data["s3"]["capacity"] = capacity
    if disk is not None:
        data["disk"] = {"path": str(disk)}
    return build_config(data, environ={})


@functools.lru_cache
def _client(s3_config):
    return make_client(s3_config)


def digest() -> str:
    return uuid.uuid4().hex[:16]


def blocks(n: int) -> list[bytes]:
    return [uuid.uuid4().bytes + uuid.uuid4().bytes for _ in range(n)]


def store(config, hashes, *, namespace=None, tp=1, model="tiny-llama", tiers=("disk", "s3"), into=None):
    """Write `hashes` through the engine for every TP rank of a fresh deployment (of
    deployment `into`, given one)."""
    model_digest = into.model_digest if into else digest()
    ranks = into.rank_digests if into else tuple(digest() for _ in range(tp))
    object_bytes = ObjectShape(model_digest, ranks[0], SLOT).object_bytes
    namespace = namespace or config.namespace
    deployment = into or Deployment(model_digest, namespace, model, tp, ranks, object_bytes)
    for rank in ranks:
        s3 = S3Tier(config.s3, client=_client(config.s3)) if config.s3 else None
        engine = TierEngine(config, ObjectShape(model_digest, rank, SLOT), CpuBuffer(1, SLOT), s3=s3)
        engine.register(deployment)
        for h in hashes:
            data = h * (SLOT // len(h))
            engine.write_down(h, None, lambda r: None, data=data, tiers=tiers)
        assert engine.flush(30)
        engine.close()
    return deployment


@pytest.fixture
def stack(redis, redis_url, s3_endpoint, bucket, tmp_path):
    """A config with every tier, and a client of the service on it."""
    config = make_config(redis_url, s3_endpoint, bucket, disk=tmp_path / "disk", capacity=8 * OBJECT)
    with TestClient(create_app(config, admin_token=TOKEN)) as client:
        yield config, client


@pytest.fixture(scope="module")
def light(redis_url):
    """A service on Redis alone (no S3 client to build): for input and auth checks."""
    with TestClient(create_app(make_config(redis_url), admin_token=TOKEN)) as client:
        yield client


def admin(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


# -- probes ---------------------------------------------------------------------------
def test_healthz(stack):
    _, client = stack
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_follows_redis_down_and_back(redis_server, s3_endpoint, bucket):
    config = make_config(redis_server.url, s3_endpoint, bucket)
    client = TestClient(create_app(config))
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"redis": {"ok": True}, "s3": {"ok": True}}

    redis_server.stop()
    down = client.get("/readyz")
    assert down.status_code == 503
    body = down.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["redis"]["ok"] is False and "PING" in body["checks"]["redis"]["error"]
    assert body["checks"]["s3"] == {"ok": True}
    # Liveness does not follow a dependency.
    assert client.get("/healthz").status_code == 200
    # Nothing that reads Redis fails with a 500 meanwhile.
    lookup = client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": ["00" * 32]})
    assert lookup.status_code == 503
    stats = client.get("/v1/stats")
    assert stats.status_code == 200 and stats.json()["redis"]["available"] is False
    assert client.get("/metrics").status_code == 200

    redis_server.start()
    for _ in range(50):  # the client reconnects on its next call
        back = client.get("/readyz")
        if back.status_code == 200:
            break
        time.sleep(0.1)
    assert back.status_code == 200, back.text
    # Lookups answer again once the breaker's (short, for the service) backoff ends.
    for _ in range(50):
        lookup = client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": ["00" * 32]})
        if lookup.status_code == 200:
            break
        assert lookup.status_code == 503
        time.sleep(0.1)
    assert lookup.status_code == 200, lookup.text


def test_readyz_names_s3_when_the_bucket_is_missing(redis, redis_url, s3_endpoint):
    config = make_config(redis_url, s3_endpoint, "no-such-bucket-here")
    response = TestClient(create_app(config)).get("/readyz")
    assert response.status_code == 503
    checks = response.json()["checks"]
    assert checks["redis"] == {"ok": True}
    assert checks["s3"]["ok"] is False and "head_bucket" in checks["s3"]["error"]


def test_readyz_names_s3_when_the_endpoint_is_gone(redis, redis_url):
    from tiercache.ops.local_stack import free_port

    config = make_config(redis_url, f"http://127.0.0.1:{free_port()}", "some-bucket")
    response = TestClient(create_app(config)).get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["s3"]["ok"] is False


def test_openapi_describes_every_endpoint(stack):
    _, client = stack
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path, method in [
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
        ("/v1/stats", "get"),
        ("/v1/lookup", "post"),
        ("/v1/namespaces/{namespace}", "delete"),
        ("/v1/gc", "post"),
    ]:
        operation = paths[path][method]
        assert operation.get("description"), f"{method} {path} has no description"
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    lookup = spec["components"]["schemas"]["LookupRequest"]
    assert lookup["properties"]["block_hashes"]["maxItems"] == MAX_LOOKUP_HASHES


# -- lookup ---------------------------------------------------------------------------
def test_lookup_finds_the_longest_prefix_per_deployment(stack, redis):
    config, client = stack
    prompt = blocks(6)
    single = store(config, prompt[:4])  # S3 and disk
    sharded = store(config, prompt[:2], tp=2, tiers=("s3",))
    store(config, prompt, namespace="ns2")  # another namespace: never answered for ns1
    scores_before = redis.client.zrange(
        runs_key(single.model_digest, single.rank_digests[0]), 0, -1, withscores=True
    )

    response = client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": [h.hex() for h in prompt]})

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["namespace"] == "ns1"
    assert body["requested_blocks"] == 6
    assert body["prefix_blocks"] == 4
    by_digest = {d["model_digest"]: d for d in body["deployments"]}
    assert set(by_digest) == {single.model_digest, sharded.model_digest}
    assert by_digest[single.model_digest] == {
        "model_digest": single.model_digest,
        "model": "tiny-llama",
        "tp_size": 1,
        "block_size": None,  # registered without its block hashing
        "requested_blocks": 6,
        "prefix_blocks": 4,
        "tiers": {"s3": 4, "disk": 4, "peer": None},
        "instances": [],
        "error": None,
    }
    assert by_digest[sharded.model_digest]["tiers"] == {"s3": 2, "disk": 0, "peer": None}
    assert body["deployments"][0]["model_digest"] == single.model_digest  # longest first
    # A router asking is not an access: GC order is unchanged.
    scores_after = redis.client.zrange(
        runs_key(single.model_digest, single.rank_digests[0]), 0, -1, withscores=True
    )
    assert scores_after == scores_before

    # A gap ends the prefix; upper-case hex is accepted.
    gap = [prompt[0].hex().upper(), blocks(1)[0].hex(), prompt[2].hex()]
    body = client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": gap}).json()
    assert body["prefix_blocks"] == 1

    body = client.post("/v1/lookup", json={"namespace": "nobody", "block_hashes": [prompt[0].hex()]}).json()
    assert body == {"namespace": "nobody", "requested_blocks": 1, "prefix_blocks": 0, "deployments": []}


def test_lookup_counts_a_missing_rank_as_a_miss(stack, redis):
    config, client = stack
    prompt = blocks(3)
    dep = store(config, prompt, tp=2, tiers=("s3",))
    redis.client.hdel(blocks_key(dep.model_digest, dep.rank_digests[1]), prompt[1])
    body = client.post(
        "/v1/lookup", json={"namespace": "ns1", "block_hashes": [h.hex() for h in prompt]}
    ).json()
    assert body["prefix_blocks"] == 1


def register_hashing(redis, deployment, **hashing):
    """Rewrite a registration as a scheduler with block hashing writes it."""
    updated = dataclasses.replace(deployment, **hashing)
    redis.client.hset(REGISTRY, updated.model_digest, updated.to_json())
    return updated


def test_lookup_by_token_ids_hashes_as_each_deployment_does(stack, redis):
    """Token ids are hashed per deployment (block size, algorithm, seed from its
    registration) into vLLM's hashes; S3, the service's disk and each live instance's
    CPU and disk tiers answer for them."""
    config, client = stack
    tokens = list(range(1000, 1000 + 4 * 16 + 5))  # four full blocks of 16, and a rest
    hashing = BlockHashing("sha256", 16, "vllm-none-hash")
    hashes = hashing.block_hashes(tokens)
    dep = register_hashing(
        redis, store(config, hashes[:3]), block_size=16, hash_algo="sha256", hash_seed="vllm-none-hash"
    )
    near = PresencePublisher(redis, dep.model_digest, "node-a")
    far = PresencePublisher(redis, dep.model_digest, "node-b")
    for block in hashes:  # node-a: everything in CPU, the first two on disk too
        near.update(block, "cpu", True)
    for block in hashes[:2]:
        near.update(block, "disk", True)
    far.update(hashes[1], "cpu", True)  # node-b: not the first block, so nothing leading
    assert near.flush() and far.flush()
    # Another deployment of the namespace, with 32-token blocks and a PYTHONHASHSEED.
    other = register_hashing(redis, store(config, []), block_size=32, hash_algo="sha256_cbor", hash_seed="7")
    other_hashes = BlockHashing("sha256_cbor", 32, "7").block_hashes(tokens)
    cold = PresencePublisher(redis, other.model_digest, "node-c")
    cold.update(other_hashes[0], "disk", True)
    assert cold.flush()

    body = client.post("/v1/lookup", json={"namespace": "ns1", "token_ids": tokens}).json()

    assert body["requested_blocks"] == 4 and body["prefix_blocks"] == 4
    first, second = body["deployments"]
    assert first["model_digest"] == dep.model_digest
    assert (first["block_size"], first["requested_blocks"], first["error"]) == (16, 4, None)
    assert first["tiers"] == {"s3": 3, "disk": 3, "peer": None}
    assert first["instances"] == [
        {"instance": "node-a", "cpu": 4, "disk": 2, "prefix_blocks": 4, "peer": False, "peer_blocks": 0},
        {
            "instance": "node-b",
            "cpu": 0,
            "disk": 0,
            "prefix_blocks": 3,
            "peer": False,
            "peer_blocks": 0,
        },  # S3 serves it three
    ]
    assert (second["block_size"], second["requested_blocks"], second["prefix_blocks"]) == (32, 2, 1)
    assert second["instances"] == [
        {"instance": "node-c", "cpu": 0, "disk": 1, "prefix_blocks": 1, "peer": False, "peer_blocks": 0}
    ]
    # The same answer by hashes, for the deployment whose hashes they are.
    hexes = [h.hex() for h in hashes]
    by_hashes = client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": hexes})
    assert by_hashes.json()["deployments"][0] == first
    # An instance that stops refreshing is gone once its TTL has passed.
    redis.client.zadd(f"tc:{{{dep.model_digest}}}:instances", {"node-b": time.time() - 1})
    body = client.post("/v1/lookup", json={"namespace": "ns1", "token_ids": tokens}).json()
    assert [i["instance"] for i in body["deployments"][0]["instances"]] == ["node-a"]


def publish_peer(redis, deployment, instance, *, cpu_blocks=(), ranks=None, ttl=30.0):
    """What a worker with the peer tier on publishes, without its NIXL agent: its
    instance's presence (these blocks in its CPU tier) and each rank's peer record."""
    presence = PresencePublisher(redis, deployment.model_digest, instance)
    for block in cpu_blocks:
        presence.update(block, "cpu", True)
    assert presence.flush()
    for rank in deployment.rank_digests if ranks is None else ranks:
        record = PeerRecord(f"tc-{instance}-{rank}", b"nixl metadata", 0, SLOT, 8, 0, 0, 16)
        assert PeerRegistry(redis, deployment.model_digest, rank, instance, ttl).publish(record)


def test_lookup_counts_peer_blocks_of_instances_with_live_peer_records(stack, redis):
    """Blocks in a live instance's CPU tier count as tier `peer` only while every rank
    of it keeps a live peer record; an instance with its peer tier off, or whose
    record expired, serves no one else."""
    config, client = stack
    prompt = blocks(4)
    dep = store(config, prompt[:1], tiers=("s3",))
    publish_peer(redis, dep, "node-a", cpu_blocks=prompt)  # holds everything, peer on
    publish_peer(redis, dep, "node-b", cpu_blocks=prompt[:1])  # peer on, holds one
    plain = PresencePublisher(redis, dep.model_digest, "node-c")  # peer tier off
    for block in prompt[:3]:
        plain.update(block, "cpu", True)
    assert plain.flush()
    # Two ranks: one record missing makes the instance no peer (rank r reads rank r).
    sharded = store(config, [], tp=2)
    publish_peer(redis, sharded, "node-d", cpu_blocks=prompt, ranks=sharded.rank_digests[:1])
    ask = {"namespace": "ns1", "block_hashes": [h.hex() for h in prompt]}

    by_digest = {d["model_digest"]: d for d in client.post("/v1/lookup", json=ask).json()["deployments"]}

    hit = by_digest[dep.model_digest]
    assert hit["tiers"] == {"s3": 1, "disk": 0, "peer": 4}
    assert hit["prefix_blocks"] == 4
    assert hit["instances"] == [
        # A tie goes to the instance holding the blocks itself.
        {"instance": "node-a", "cpu": 4, "disk": 0, "prefix_blocks": 4, "peer": True, "peer_blocks": 1},
        {"instance": "node-b", "cpu": 1, "disk": 0, "prefix_blocks": 4, "peer": True, "peer_blocks": 4},
        {"instance": "node-c", "cpu": 3, "disk": 0, "prefix_blocks": 3, "peer": False, "peer_blocks": 0},
    ]
    assert by_digest[sharded.model_digest]["tiers"]["peer"] is None
    assert by_digest[sharded.model_digest]["instances"][0]["peer"] is False

    # Redis lost its scripts (a restart): the same answer, the script loaded again.
    redis.client.script_flush()
    again = client.post("/v1/lookup", json=ask).json()["deployments"]
    assert next(d for d in again if d["model_digest"] == dep.model_digest) == hit

    # node-a's workers stop refreshing: once its record expires, no one reads from it.
    for rank in dep.rank_digests:
        redis.client.pexpire(peer_record_key(dep.model_digest, rank, "node-a"), 1)
    time.sleep(0.05)
    hit = client.post("/v1/lookup", json=ask).json()["deployments"]
    hit = next(d for d in hit if d["model_digest"] == dep.model_digest)
    assert hit["tiers"]["peer"] == 1  # node-b's own
    by_name = {i["instance"]: i for i in hit["instances"]}
    assert (by_name["node-a"]["peer"], by_name["node-a"]["prefix_blocks"]) == (False, 4)  # still its own
    assert (by_name["node-b"]["peer_blocks"], by_name["node-b"]["prefix_blocks"]) == (0, 1)


def test_peer_record_keys_are_the_ones_workers_write():
    assert peer_record_key("a" * 16, "b" * 16, "node-a") == record_key("a" * 16, "b" * 16, "node-a")


def test_lookup_by_token_ids_says_why_a_deployment_cannot_be_hashed(stack, redis):
    config, client = stack
    older = store(config, [])  # registered before block hashing was
    secret = register_hashing(redis, store(config, []), block_size=16, hash_algo="xxhash", hash_seed=None)
    body = client.post("/v1/lookup", json={"namespace": "ns1", "token_ids": list(range(40))}).json()
    errors = {d["model_digest"]: d["error"] for d in body["deployments"]}
    assert "older tiercache" in errors[older.model_digest]
    assert "random seed" in errors[secret.model_digest]
    assert body["prefix_blocks"] == 0 and body["requested_blocks"] == 0


ROUTER_TOKEN = "router-" + uuid.uuid4().hex
NS1_TOKEN = "ns1-" + uuid.uuid4().hex
NS2_TOKEN = "ns2-" + uuid.uuid4().hex


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def test_lookup_needs_a_token_for_its_namespace_once_tokens_are_configured(
    redis, redis_url, s3_endpoint, bucket
):
    """Issue 39, item 5: the lookup API is no open prefix oracle. A missing token, a
    wrong one and another namespace's get one 401 that names nothing cached."""
    config = make_config(redis_url, s3_endpoint, bucket)
    prompt = blocks(3)
    dep = store(config, prompt, tiers=("s3",))
    app = create_app(
        config,
        admin_token=TOKEN,
        lookup_token=ROUTER_TOKEN,
        namespace_tokens={"ns1": NS1_TOKEN, "ns2": NS2_TOKEN},
    )
    ask = {"namespace": "ns1", "block_hashes": [h.hex() for h in prompt]}
    with TestClient(app) as client:
        refused = [
            client.post("/v1/lookup", json=ask),
            client.post("/v1/lookup", json=ask, headers=bearer("not-a-token")),
            client.post("/v1/lookup", json=ask, headers=bearer(NS1_TOKEN + "x")),
            client.post("/v1/lookup", json=ask, headers=bearer(NS2_TOKEN)),  # another namespace's
            client.post("/v1/lookup", json=ask, headers={"Authorization": f"Basic {NS1_TOKEN}"}),
            # Checked before the body: no token, no validation answer either.
            client.post("/v1/lookup", json={"namespace": "../x"}),
        ]
        for response in refused:
            assert response.status_code == 401, response.text
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json() == refused[0].json()
            for cached in (dep.model_digest, dep.model, prompt[0].hex(), "prefix_blocks"):
                assert cached not in response.text

        for token in (NS1_TOKEN, ROUTER_TOKEN, TOKEN):
            answer = client.post("/v1/lookup", json=ask, headers=bearer(token))
            assert answer.status_code == 200, answer.text
            assert answer.json()["prefix_blocks"] == 3
        other = {"namespace": "ns2", "block_hashes": [prompt[0].hex()]}
        assert client.post("/v1/lookup", json=other, headers=bearer(NS2_TOKEN)).status_code == 200
        assert client.post("/v1/lookup", json=other, headers=bearer(ROUTER_TOKEN)).status_code == 200
        # A lookup token is not the admin token.
        for token in (ROUTER_TOKEN, NS1_TOKEN):
            assert client.post("/v1/gc", headers=bearer(token)).status_code == 401
        # Refused lookups are not counted as lookups.
        assert client.get("/v1/stats").json()["namespaces"]["ns1"]["lookups"]["requests"] == 3


def test_lookup_is_open_while_no_lookup_token_is_configured(redis, redis_url):
    """The default without tokens (a service on loopback for one router) stays usable;
    an admin token alone does not close it."""
    with TestClient(create_app(make_config(redis_url), admin_token=TOKEN)) as client:
        ask = {"namespace": "ns1", "block_hashes": ["00" * 32]}
        assert client.post("/v1/lookup", json=ask).status_code == 200
        assert client.post("/v1/lookup", json=ask, headers=bearer("anything")).status_code == 200


def test_lookup_limits_are_a_128k_token_prompt(light):
    """Issue 39, item 5: one request asked up to 65536 hashes or 1M tokens in a 16 MiB
    body. Now 8192 hashes, 131072 tokens, 4 MiB."""
    client = light
    hashes = ["00" * 8] * 8192
    assert client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": hashes}).status_code == 200
    over = client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": [*hashes, "00" * 8]})
    assert over.status_code == 422 and "block_hashes" in over.json()["message"]
    tokens = [1] * 131072
    assert client.post("/v1/lookup", json={"namespace": "ns1", "token_ids": tokens}).status_code == 200
    over = client.post("/v1/lookup", json={"namespace": "ns1", "token_ids": [*tokens, 1]})
    assert over.status_code == 422 and "token_ids" in over.json()["message"]
    # The largest valid body (every token id of 19 digits) fits under the body limit;
    # anything much larger is refused before it is parsed.
    largest = json.dumps({"namespace": "a" * 128, "token_ids": [2**63 - 1] * MAX_LOOKUP_TOKENS})
    assert (
        client.post("/v1/lookup", content=largest, headers={"content-type": "application/json"}).status_code
        == 200
    )
    padded = largest[:-1] + " " * (5 * 2**20 - len(largest)) + "}"
    too_large = client.post("/v1/lookup", content=padded, headers={"content-type": "application/json"})
    assert too_large.status_code == 413, too_large.text


def test_presence_stays_within_its_redis_budget_and_is_rewritten_when_lost(redis):
    """At most 200 bytes of Redis per block; a hash lost (expired, deleted) while the
    publisher thought it there is written whole again, never left half."""
    publisher = PresencePublisher(redis, "f" * 16, "node-a")
    many = blocks(20000)
    for block in many:
        publisher.update(block, "cpu", True)
    assert publisher.flush()
    key = f"tc:{{{'f' * 16}}}:at:node-a"
    assert redis.client.hlen(key) == len(many)
    per_block = redis.client.memory_usage(key, samples=0) / len(many)
    assert per_block <= 200, per_block
    redis.client.delete(key)  # as if the thread had stalled past the TTL
    publisher.update(many[0], "disk", True)
    assert publisher.flush()  # writes the change, finds the hash gone ...
    assert redis.client.hlen(key) == 1
    assert publisher.flush()  # ... and rewrites it whole on the next batch
    assert redis.client.hlen(key) == len(many) and redis.client.hget(key, many[0]) == b"3"


class _Killed(BaseException):
    """The process died: nothing of it runs after this."""


class _DiesAfter:
    """A publisher's Redis whose process is killed after `calls` more calls."""

    def __init__(self, redis, calls: int):
        self.client = redis.client
        self._redis = redis
        self._left = calls

    def call(self, what, fn):
        if self._left == 0:
            raise _Killed
        self._left -= 1
        return self._redis.call(what, fn)


def test_a_rewrite_cut_short_by_a_dead_process_leaves_nothing_for_good(redis):
    """The whole-hash rewrite stages its copy under a temporary key: a process killed
    before the rename left that key behind, with no TTL, for good."""
    publisher = PresencePublisher(redis, "e" * 16, "node-a", ttl=30)
    for block in blocks(3000):  # two batches
        publisher.update(block, "cpu", True)
    publisher.redis = _DiesAfter(redis, 2)  # the staging key cleared, the first batch written
    with pytest.raises(_Killed):
        publisher.flush()
    staging = f"tc:{{{'e' * 16}}}:at:node-a:rewrite"
    assert redis.client.hlen(staging) == 2000
    assert 0 < redis.client.pttl(staging) <= 30_000


BAD_LOOKUPS = [
    ({"namespace": "ns1", "block_hashes": []}, "block_hashes"),
    ({"namespace": "ns1", "block_hashes": ["xyz" * 8]}, "block_hashes.0"),
    ({"namespace": "ns1", "block_hashes": ["00" * 32, "abc"]}, "block_hashes.1"),
    ({"namespace": "ns1", "block_hashes": ["0" * 33]}, "block_hashes.0"),  # odd length
    ({"namespace": "ns1", "block_hashes": ["00" * 65]}, "block_hashes.0"),  # too long
    ({"namespace": "ns1", "block_hashes": [7]}, "block_hashes.0"),
    ({"namespace": "ns1", "block_hashes": "00" * 32}, "block_hashes"),
    ({"namespace": "../etc", "block_hashes": ["00" * 32]}, "namespace"),
    ({"namespace": "", "block_hashes": ["00" * 32]}, "namespace"),
    ({"namespace": "a" * 129, "block_hashes": ["00" * 32]}, "namespace"),
    ({"block_hashes": ["00" * 32]}, "namespace"),
    ({"namespace": "ns1"}, "block_hashes"),
    ({"namespace": "ns1", "block_hashes": ["00" * 32], "token_ids": [1]}, "token_ids"),
    ({"namespace": "ns1", "token_ids": []}, "token_ids"),
    ({"namespace": "ns1", "token_ids": [-1]}, "token_ids.0"),
    ({"namespace": "ns1", "token_ids": [1, True]}, "token_ids.1"),
    ({"namespace": "ns1", "token_ids": ["5"]}, "token_ids.0"),
    ({"namespace": "ns1", "token_ids": [1.5]}, "token_ids.0"),
    ({"namespace": "ns1", "token_ids": None}, "token_ids"),
    ({"namespace": "ns1", "token_ids": [0] * (MAX_LOOKUP_TOKENS + 1)}, "token_ids"),
    ({"namespace": "ns1", "block_hashes": ["00" * 32], "extra": 1}, "extra"),
    ({"namespace": "ns1", "block_hashes": ["00" * 8] * (MAX_LOOKUP_HASHES + 1)}, "block_hashes"),
    ([], "body"),
]


@pytest.mark.parametrize(("payload", "field"), BAD_LOOKUPS, ids=[f for _, f in BAD_LOOKUPS])
def test_lookup_rejects_bad_input_naming_the_field(light, payload, field):
    client = light
    response = client.post("/v1/lookup", json=payload)
    assert response.status_code == 422, response.text
    body = response.json()
    assert field in body["message"]
    assert all({"loc", "msg", "type"} <= set(problem) for problem in body["detail"])


def test_lookup_rejects_bodies_that_are_not_json(light):
    client = light
    for content, headers in [
        (b"{not json", {"content-type": "application/json"}),
        (b"\xff\xfe\x00", {"content-type": "application/json"}),
        (b'{"namespace": "ns1"}', {"content-type": "text/plain"}),
        (b"", {"content-type": "application/json"}),
        (b'{"namespace": NaN, "block_hashes": [Infinity, -Infinity]}', {"content-type": "application/json"}),
        (b'{"namespace": "ns1", "block_hashes": ["\\ud800"]}', {"content-type": "application/json"}),
        (b'{"\\udfff": 1, "namespace": "ns1", "block_hashes": ["' + b"0" * 16 + b'"]}', {}),
    ]:
        response = client.post("/v1/lookup", content=content, headers=headers)
        assert 400 <= response.status_code < 500, (content, response.status_code, response.text)
    huge = client.post(
        "/v1/lookup",
        content=b"[]",
        headers={"content-type": "application/json", "content-length": str(1 << 30)},
    )
    assert huge.status_code in (400, 413)


@pytest.fixture
def live_service(redis, redis_url):
    """The real app on uvicorn on a loopback port: (port, the app's state)."""
    import threading

    import uvicorn

    from tiercache.ops.local_stack import free_port

    app = create_app(make_config(redis_url), admin_token=TOKEN)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield port, app.state.tiercache
    server.should_exit = True
    thread.join(10)


def test_a_chunked_body_over_the_limit_is_refused_once_the_limit_is_read(live_service):
    """No Content-Length to check: the service must count what it reads and stop."""
    import socket
    import threading

    port, state = live_service
    chunk = b"0" * (1 << 20)
    head = b'{"namespace": "ns1", "block_hashes": ["'
    sent = {"bytes": 0}
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)

    def send_body() -> None:
        request = (
            b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        try:
            conn.sendall(request + b"%x\r\n%s\r\n" % (len(head), head))
            for _ in range(20):  # 20 MiB, over the 4 MiB limit
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent["bytes"] += len(chunk)
            conn.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the service answered and closed before the body ended: expected

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = conn.recv(65536)
        if not data:
            break
        answer += data
    sender.join(30)
    conn.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert state.lookups == {}  # the endpoint never ran


HEX = "0123456789abcdefABCDEF"
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


def _is_good_hash(value) -> bool:
    return (
        isinstance(value, str)
        and 16 <= len(value) <= 128
        and len(value) % 2 == 0
        and all(c in HEX for c in value)
    )


def _is_good_namespace(value) -> bool:
    allowed = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return (
        isinstance(value, str)
        and 1 <= len(value) <= 128
        and value[0] in allowed
        and all(c in allowed + "._-" for c in value)
    )


good_hash = st.binary(min_size=8, max_size=64).map(bytes.hex)
bad_hash = (st.text(max_size=140) | st.text(HEX, max_size=140) | json_values).filter(
    lambda v: not _is_good_hash(v)
)
bad_namespace = (st.text(max_size=140) | json_values).filter(lambda v: not _is_good_namespace(v))


@st.composite
def bad_lookups(draw):
    """A lookup body with at least one defect (and maybe more)."""
    body = {
        "namespace": draw(st.sampled_from(["ns1", "other.ns_2-x"]) | bad_namespace),
        "block_hashes": draw(st.lists(good_hash | bad_hash, max_size=6)),
    }
    defect = draw(st.sampled_from(["namespace", "hash", "empty", "type", "extra", "missing"]))
    if defect == "namespace":
        body["namespace"] = draw(bad_namespace)
    elif defect == "hash":
        at = draw(st.integers(0, len(body["block_hashes"])))
        body["block_hashes"].insert(at, draw(bad_hash))
    elif defect == "empty":
        body["block_hashes"] = []
    elif defect == "type":
        body["block_hashes"] = draw(json_values.filter(lambda v: not isinstance(v, list)))
    elif defect == "extra":
        body[draw(st.text(max_size=10).filter(lambda k: k not in body))] = draw(json_values)
    else:
        del body[draw(st.sampled_from(sorted(body)))]
    return body


@settings(max_examples=100, deadline=None)
@given(body=bad_lookups())
def test_lookup_answers_every_bad_body_with_a_4xx(light, body):
    client = light
    response = client.post("/v1/lookup", json=body)
    assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
    json.loads(response.text)


@settings(max_examples=100, deadline=None)
@given(body=json_values, raw=st.binary(max_size=64), as_raw=st.booleans())
def test_lookup_never_answers_500(light, body, raw, as_raw):
    client = light
    if as_raw:
        response = client.post("/v1/lookup", content=raw, headers={"content-type": "application/json"})
    else:
        response = client.post("/v1/lookup", json=body)
    assert response.status_code < 500, (body, raw, response.text)


# -- stats and metrics ------------------------------------------------------------------
def test_stats_per_namespace_and_tier_and_never_the_secret(
    redis, redis_url, s3_endpoint, bucket, tmp_path, monkeypatch
):
    secret = f"AWS-SECRET-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    _client.cache_clear()
    config = make_config(redis_url, s3_endpoint, bucket, disk=tmp_path / "disk", capacity=100 * OBJECT)
    prompt = blocks(5)
    dep = store(config, prompt, tp=2)
    other = store(config, prompt[:2], namespace="ns2", tiers=("s3",))
    _client.cache_clear()
    client = TestClient(create_app(config, admin_token=TOKEN))
    hashes = [h.hex() for h in prompt]
    assert (
        client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": hashes}).json()["prefix_blocks"]
        == 5
    )
    client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": [blocks(1)[0].hex(), *hashes[:4]]})

    response = client.get("/v1/stats")

    assert response.status_code == 200
    assert secret not in response.text
    body = response.json()
    ns1 = body["namespaces"]["ns1"]
    assert ns1["tiers"]["s3"] == {"objects": 10, "bytes": 10 * OBJECT}
    assert ns1["tiers"]["disk"]["objects"] == 10
    assert ns1["tiers"]["disk"]["bytes"] == 10 * OBJECT
    assert ns1["lookups"] == {"requests": 2, "blocks_requested": 10, "blocks_hit": 5, "hit_rate": 0.5}
    assert [d["model_digest"] for d in ns1["deployments"]] == [dep.model_digest]
    ns2 = body["namespaces"]["ns2"]
    assert ns2["tiers"]["s3"] == {"objects": 2, "bytes": 2 * OBJECT}
    assert ns2["lookups"]["requests"] == 0
    rows = {(r["namespace"], r["tier"]): r for r in body["rows"]}
    assert rows[("ns1", "s3")]["objects"] == 10 and rows[("ns2", "s3")]["model_digest"] == other.model_digest
    assert body["s3"]["capacity_bytes"] == 100 * OBJECT and body["s3"]["used_bytes"] == 10 * OBJECT
    assert body["redis"]["available"] is True and body["errors"] == []
    # Nothing else the service says carries it either.
    for path in ("/readyz", "/metrics", "/openapi.json", "/healthz"):
        assert secret not in client.get(path).text
    assert secret not in client.post("/v1/gc", headers=admin()).text

    assert collect_stats(config)["rows"] == body["rows"]


def test_stats_without_redis_scans_the_disk(tmp_path):
    config = build_config({"disk": {"path": str(tmp_path / "d")}, "cpu": {"capacity": 64 * SLOT}}, environ={})
    cache = ConnectorDriver(config, SLOT, model=digest())
    for h in blocks(3):
        assert cache.put(h, h * (SLOT // len(h))) is not None
    assert cache.flush(30)
    cache.close()
    body = TestClient(create_app(config)).get("/v1/stats").json()
    assert body["namespaces"]["(unregistered)"]["tiers"]["disk"]["objects"] == 3
    assert body["redis"]["configured"] is False
    assert TestClient(create_app(config)).get("/readyz").status_code == 200


def test_metrics_exposes_index_series_refreshed_on_scrape(stack):
    config, client = stack
    first = client.get("/metrics")
    assert first.status_code == 200
    assert first.headers["content-type"].startswith("text/plain")
    prompt = blocks(3)
    store(config, prompt, tiers=("s3",))
    client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": [h.hex() for h in prompt]})

    text = client.get("/metrics").text

    assert 'tiercache_index_objects{namespace="ns1",tier="s3"} 3.0' in text
    assert f'tiercache_index_bytes{{namespace="ns1",tier="s3"}} {float(3 * OBJECT)}' in text
    assert 'tiercache_service_lookups_total{namespace="ns1"} 1.0' in text
    assert 'tiercache_service_lookup_hit_blocks_total{namespace="ns1"} 3.0' in text
    assert 'tiercache_dependency_up{dependency="redis"} 1.0' in text
    assert f'tiercache_s3_capacity_bytes{{namespace="ns1"}} {float(8 * OBJECT)}' in text
    assert "tiercache_lookup_blocks_total" in text  # the process-wide series too
    names = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }
    assert all(n.startswith(("tiercache_", "python_", "process_")) for n in names), names


# -- admin ------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path"), [("post", "/v1/gc"), ("delete", "/v1/namespaces/ns1")])
def test_admin_needs_the_token(light, method, path):
    call = getattr(light, method)
    missing = call(path)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert call(path, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    assert call(path, headers={"Authorization": "Bearer "}).status_code == 401
    wrong = call(path, headers=admin("not-the-token"))
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    assert wrong.json() == missing.json()
    assert call(path, headers=admin(TOKEN + "x")).status_code == 401
    assert call(path, headers=admin(TOKEN)).status_code in (200, 409)  # 409: no S3 to collect


def test_admin_is_refused_when_no_token_is_configured(redis, redis_url, s3_endpoint, bucket):
    client = TestClient(create_app(make_config(redis_url, s3_endpoint, bucket), admin_token=None))
    for response in (client.post("/v1/gc", headers=admin()), client.delete("/v1/namespaces/ns1")):
        assert response.status_code == 403
        assert "TIERCACHE_ADMIN_TOKEN is unset" in response.json()["detail"]


def test_flush_namespace_endpoint(stack, redis, tmp_path):
    config, client = stack
    mine, theirs = blocks(3), blocks(2)
    dep = store(config, mine)
    other = store(config, theirs, namespace="ns2")

    bad = client.delete("/v1/namespaces/..bad", headers=admin())
    assert bad.status_code == 422 and "namespace" in bad.json()["message"]
    response = client.delete("/v1/namespaces/ns1", headers=admin())

    assert response.status_code == 200, response.text
    report = response.json()
    assert report["deployments"] == [{"model_digest": dep.model_digest, "model": "tiny-llama"}]
    assert report["index_entries_removed"] == 3
    assert report["s3_objects_deleted"] == 3
    assert report["disk_objects_deleted"] == 3
    lookup = client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": [mine[0].hex()]}).json()
    assert lookup["deployments"] == []
    lookup = client.post("/v1/lookup", json={"namespace": "ns2", "block_hashes": [theirs[0].hex()]}).json()
    assert lookup["deployments"][0]["model_digest"] == other.model_digest
    assert lookup["prefix_blocks"] == 1
    stats = client.get("/v1/stats").json()
    assert "ns1" not in stats["namespaces"] or stats["namespaces"]["ns1"]["deployments"] == []


def test_gc_endpoint_keeps_capacity(stack, redis):
    config, client = stack  # capacity: 8 objects
    hashes = blocks(12)
    dep = store(config, hashes, tiers=("s3",))
    rank = dep.rank_digests[0]
    for i, h in enumerate(hashes):
        run, _ = parse_location(redis.client.hget(blocks_key(dep.model_digest, rank), h))
        redis.client.zadd(runs_key(dep.model_digest, rank), {run: 1000.0 + i}, xx=True)

    response = client.post("/v1/gc", headers=admin(), params={"sweep_orphans": "false"})

    assert response.status_code == 200, response.text
    report = response.json()
    assert report["evicted_objects"] == 4 and report["used_bytes_after"] == 8 * OBJECT
    assert report["orphans"]["scanned"] == 0
    assert set(redis.client.hkeys(blocks_key(dep.model_digest, dep.rank_digests[0]))) == set(hashes[4:])
    stats = client.get("/v1/stats").json()
    assert stats["gc"]["evicted_objects"] == 4 and stats["gc"]["runs"]["ok"] == 1
    assert "tiercache_gc_evicted_objects_total 4.0" in client.get("/metrics").text
    bad = client.post("/v1/gc", headers=admin(), params={"grace_seconds": "-1"})
    assert bad.status_code == 422 and "grace_seconds" in bad.json()["message"]


def test_gc_endpoint_without_s3(redis, redis_url):
    client = TestClient(create_app(make_config(redis_url), admin_token=TOKEN))
    response = client.post("/v1/gc", headers=admin())
    assert response.status_code == 409
    assert "s3 is not configured" in response.json()["detail"]


def test_background_gc_runs_on_its_interval(redis, redis_url, s3_endpoint, bucket):
    config = make_config(redis_url, s3_endpoint, bucket, capacity=2 * OBJECT)
    dep = store(config, blocks(5), tiers=("s3",))
    with TestClient(create_app(config, gc_interval=0.1)) as client:
        for _ in range(100):
            stats = client.get("/v1/stats").json()
            if stats["gc"]["runs"]["ok"]:
                break
            time.sleep(0.1)
        assert stats["gc"]["runs"]["ok"] >= 1
        assert stats["gc"]["evicted_objects"] == 3
    assert redis.client.hlen(blocks_key(dep.model_digest, dep.rank_digests[0])) == 2


def test_unreadable_registry_entries_are_skipped(stack, redis, tmp_path):
    config, client = stack
    prompt = blocks(2)
    dep = store(config, prompt, tiers=("s3",))
    outside = tmp_path / "precious"
    outside.mkdir()
    evil = Deployment("e" * 16, "ns1", "evil", 1, (f"../../{outside.name}",), OBJECT)
    redis.client.hset(REGISTRY, mapping={"junk": "not json", "evil": evil.to_json(), "odd": '{"model": 1}'})

    stats = client.get("/v1/stats").json()
    assert [d["model_digest"] for d in stats["namespaces"]["ns1"]["deployments"]] == [dep.model_digest]
    lookup = {"namespace": "ns1", "block_hashes": [h.hex() for h in prompt]}
    body = client.post("/v1/lookup", json=lookup).json()
    assert [d["model_digest"] for d in body["deployments"]] == [dep.model_digest]
    assert client.post("/v1/gc", headers=admin()).status_code == 200
    assert client.delete("/v1/namespaces/ns1", headers=admin()).status_code == 200
    assert outside.is_dir()


def test_lookup_of_a_hybrid_model_ends_where_every_kv_cache_group_can_serve(stack, redis):
    from tiercache.index.kv_groups import group_key

    config, client = stack
    prompt = blocks(6)
    model_digest, rank = digest(), digest()
    shape = ObjectShape(model_digest, rank, SLOT)
    # Full attention, and a 64-token sliding window over 32-token blocks: a hit ending
    # at block n needs the window group's blocks n-2 and n-1.
    deployment = dataclasses.replace(
        Deployment(model_digest, config.namespace, "tiny-gemma", 1, (rank,), shape.object_bytes),
        block_size=32,
        groups=("full", "window:64:0"),
    )
    engine = TierEngine(config, shape, CpuBuffer(1, SLOT), s3=S3Tier(config.s3, client=_client(config.s3)))
    engine.register(deployment)
    stored = [*prompt, *(group_key(h, 1) for h in prompt[1:4])]  # the window group lacks 4 and 5
    for h in stored:
        engine.write_down(h, None, lambda r: None, data=h * (SLOT // len(h)), tiers=("disk", "s3"))
    assert engine.flush(30)
    engine.close()

    response = client.post("/v1/lookup", json={"namespace": "ns1", "block_hashes": [h.hex() for h in prompt]})

    (hit,) = [d for d in response.json()["deployments"] if d["model_digest"] == model_digest]
    assert hit["prefix_blocks"] == 4 and hit["tiers"] == {"s3": 4, "disk": 4, "peer": None}


def test_lookup_names_blocks_under_the_weights_epoch_a_deployment_registered(stack, redis):
    """After new weights in place and a reset, engines name blocks under a weights
    epoch (keys.block_key) and register it. The lookup hashed without it: it reported
    the objects from before the reset as hits and never saw the ones stored since."""
    config, client = stack
    prompt = blocks(4)
    epoch = bytes(range(16))
    dep = store(config, prompt)  # all four stored under vLLM's own hashes, before the reset
    store(config, [block_key(h, epoch) for h in prompt[:3]], into=dep)  # three since
    register_hashing(redis, dep, weights_epoch=epoch.hex())
    body = client.post(
        "/v1/lookup", json={"namespace": "ns1", "block_hashes": [h.hex() for h in prompt]}
    ).json()
    assert body["prefix_blocks"] == 3
    assert body["deployments"][0]["tiers"] == {"s3": 3, "disk": 3, "peer": None}

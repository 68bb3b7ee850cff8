"""The peer tier end to end, as operators run it: two vLLM OpenAI servers on vLLM's CPU
build (tests/support/serving.py), each with a CPU tier only (no disk, no S3), one
Redis. The holder answers a prompt; the reader, which never saw it, answers it from
the holder's CPU tier over NIXL with the holder's output, and its /metrics counts the
blocks in loaded_blocks{tier="peer"}. TP=1 and TP=2 on both. And a holder killed
(SIGKILL, every process of it) once it has published a prompt: the reader finds it in
Redis still, fails to read it, recomputes, and answers as the holder did.

One pair of servers per TP size, started together, serves every test of that size."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis as redis_py

from tiercache.ops.tiny_model import write_tiny_llama
from tiercache.ops.vllm_runner import assert_same_output, connector_config, loading_every_hit

from support.nixl import needs_nixl
from support.serving import EOS, VllmServer, metric, word, write_word_tokenizer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs_nixl,
]

VOCAB = 2048
BLOCK = 32
PROMPT_BLOCKS = 6  # full blocks of each prompt: what a peer load can serve
OUTPUT_TOKENS = 8
# vLLM's paged KV of this model: 2 layers x (K, V) x 2 heads x 32 tokens x 64 x 4 bytes.
KV_BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 64 * 4
SERVER_ARGS = [
    "--dtype", "float32",
    "--block-size", str(BLOCK),
    "--max-model-len", "1024",
    # Two servers at once: each takes 64 blocks of host memory for its KV, not a share of it.
    "--kv-cache-memory-bytes", str(64 * KV_BLOCK_BYTES),
    "--enforce-eager",
    "--seed", "0",
    # A prompt asked again is served by tiercache, not by vLLM's own prefix cache.
    "--no-enable-prefix-caching",
    "--enable-prompt-tokens-details",
]  # fmt: skip
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "PYTHONHASHSEED": "0"}  # one block hash on both
# Long enough that a killed holder's presence and NIXL record outlive it for the whole
# test: the reader then tries it, as a reader does after a crash, rather than missing it.
RECORD_TTL = 120
LOADED, FAILED = "vllm:tiercache_loaded_blocks_total", "vllm:tiercache_failed_blocks_total"


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(EOS + 1, VOCAB) for _ in range(PROMPT_BLOCKS * BLOCK + 7)]


SHARED = prompt(4747)  # the holder computes it, the reader loads it
LOST = prompt(4748)  # the holder computes it and is killed before the reader asks


@dataclass
class Answer:
    token_ids: list[int]
    top_logprobs: dict[str, float]  # the first output token's: token id -> logprob
    cached_tokens: int

    def as_result(self) -> dict:
        """The shape vllm_runner.assert_same_output compares."""
        return {"token_ids": self.token_ids, "top_logprobs": self.top_logprobs}


def ask(server: VllmServer, ids: list[int]) -> Answer:
    body = {
        "model": str(server.model),
        "prompt": ids,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
        "return_token_ids": True,
    }
    response = httpx.post(f"{server.base}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, (response.text, server.log_tail())
    reply = response.json()
    choice = reply["choices"][0]
    first = choice["logprobs"]["top_logprobs"][0]
    return Answer(
        token_ids=choice["token_ids"],
        top_logprobs={word_id(token): logprob for token, logprob in first.items()},
        cached_tokens=reply["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


def word_id(token: str) -> str:
    """The id of support.serving's word `w<id>x`."""
    token_id = token.removeprefix("w").removesuffix("x")
    assert word(int(token_id)) == token, token
    return token_id


def counter(server: VllmServer, name: str, tier: str) -> float:
    return metric(server.metrics(), name, tier=tier)


def counter_reaches(server: VllmServer, name: str, tier: str, want: float, timeout: float = 30) -> float:
    """The counter once it reaches `want` (stats reach the front end a moment after
    the step), or as it stands after `timeout`."""
    deadline = time.monotonic() + timeout
    while (value := counter(server, name, tier)) < want and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def listed(redis_url: str, instance: str) -> int:
    """How many blocks `instance`'s presence in Redis lists (its CPU tier's)."""
    with redis_py.Redis.from_url(redis_url) as client:
        return sum(client.hlen(key) for key in client.scan_iter(match=f"tc:*:at:{instance}"))


def published(redis_url: str, instance: str, blocks: int, timeout: float = 60) -> None:
    """Wait until `instance`'s presence lists `blocks` blocks: the holder has stored
    them in its CPU tier, and its publisher (every 0.2 s) has written them."""
    deadline = time.monotonic() + timeout
    while (now := listed(redis_url, instance)) < blocks:
        assert time.monotonic() < deadline, f"{instance} lists {now} blocks in Redis, not {blocks}"
        time.sleep(0.2)


class Pair:
    """A holder and a reader: two servers of one deployment (one model, one TP size),
    each with its own CPU tier and instance id, both publishing to one Redis."""

    def __init__(self, model: Path, redis_url: str, tp: int, workdir: Path):
        self.model, self.redis_url, self.tp, self.workdir = model, redis_url, tp, workdir
        # Started together: their engine start-ups overlap.
        self.holder = self._start("holder")
        self.reader = self._start("reader")
        try:
            self.holder.wait_ready()
            self.reader.wait_ready()
        except BaseException:
            self.stop()
            raise

    def instance(self, role: str) -> str:
        return f"e2e-peer-{role}-tp{self.tp}"

    def _start(self, role: str) -> VllmServer:
        extra = {
            "cpu": {"capacity": 256 * KV_BLOCK_BYTES},
            "redis_url": self.redis_url,
            "instance_id": self.instance(role),
            "presence": {"interval": 0.2, "ttl": RECORD_TTL},
            "peer": {"enabled": True, "ttl": RECORD_TTL},
        }
        args = [*SERVER_ARGS, "--kv-transfer-config", json.dumps(connector_config(loading_every_hit(extra)))]
        env = dict(ENV)
        if self.tp > 1:
            args += ["--tensor-parallel-size", str(self.tp), "--distributed-executor-backend", "mp"]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(self.tp))
        return VllmServer(self.model, args, self.workdir / f"{role}.log", env)

    def live_holder(self) -> VllmServer:
        """The holder, started again if a test killed it (only where tests run out of
        the file's order: the test that kills it comes last)."""
        if self.holder.process.poll() is not None:
            self.holder = self._start("holder-again")
            self.holder.wait_ready()
        return self.holder

    def stop(self) -> None:
        for server in (self.holder, self.reader):
            server.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("peer-model") / "llama", vocab_size=VOCAB, seed=0)
    write_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def pair(request, model, redis_url, tmp_path_factory) -> Iterator[Pair]:
    servers = Pair(model, redis_url, request.param, tmp_path_factory.mktemp(f"peer-tp{request.param}"))
    yield servers
    servers.stop()


def test_a_server_answers_from_another_servers_cpu_tier(pair: Pair):
    """With TP=2 on both, each rank reads its own shard from the holder's same rank."""
    holder, reader = pair.live_holder(), pair.reader
    loaded_before, failed_before = counter(reader, LOADED, "peer"), counter(reader, FAILED, "peer")
    listed_before = listed(pair.redis_url, pair.instance("holder"))
    computed = ask(holder, SHARED)
    published(pair.redis_url, pair.instance("holder"), listed_before + PROMPT_BLOCKS)
    from_peer = ask(reader, SHARED)
    assert computed.cached_tokens == 0
    assert from_peer.cached_tokens == PROMPT_BLOCKS * BLOCK, reader.log_tail()
    # vLLM sums the workers' counts: each rank loaded its shard of the 6 blocks.
    want = loaded_before + PROMPT_BLOCKS * pair.tp
    assert counter_reaches(reader, LOADED, "peer", want) == want, reader.log_tail()
    assert counter(reader, FAILED, "peer") == failed_before  # (a holder killed before: counted then)
    assert counter(holder, LOADED, "peer") == 0
    assert from_peer.token_ids == computed.token_ids
    assert_same_output(from_peer.as_result(), computed.as_result())


@pytest.mark.parametrize("pair", [1], ids=["tp1"], indirect=True)
def test_a_holder_killed_before_the_read_is_recomputed(pair: Pair):
    """The holder dies with every process of it (as when its node is lost) after it
    computed the prompt and published it. Its presence and NIXL record stay in Redis
    until their TTLs, so the reader plans a peer load, the read fails, and vLLM
    recomputes: the holder's answer, never an error."""
    holder, reader = pair.live_holder(), pair.reader
    listed_before = listed(pair.redis_url, pair.instance("holder"))
    computed = ask(holder, LOST)
    published(pair.redis_url, pair.instance("holder"), listed_before + PROMPT_BLOCKS)
    holder.kill()
    loaded_before = {tier: counter(reader, LOADED, tier) for tier in ("peer", "cpu")}
    failed_before = counter(reader, FAILED, "peer")

    recomputed = ask(reader, LOST)
    assert recomputed.cached_tokens == 0  # the load failed: vLLM recomputed all of it
    assert recomputed.token_ids == computed.token_ids
    assert_same_output(recomputed.as_result(), computed.as_result())
    failed = counter_reaches(reader, FAILED, "peer", failed_before + PROMPT_BLOCKS)
    assert failed == failed_before + PROMPT_BLOCKS, reader.log_tail()
    assert counter(reader, LOADED, "peer") == loaded_before["peer"]
    assert "tiercache: peer e2e-peer-holder-tp1 failed" in reader.log_tail(100_000)

    # The reader is well, and stored what it computed: its own CPU tier serves it now.
    again = ask(reader, LOST)
    assert again.cached_tokens == PROMPT_BLOCKS * BLOCK
    want = loaded_before["cpu"] + PROMPT_BLOCKS
    assert counter_reaches(reader, LOADED, "cpu", want) == want, reader.log_tail()
    assert again.token_ids == computed.token_ids

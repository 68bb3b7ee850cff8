"""A burst of requests on prefixes only the disk holds, through vLLM's OpenAI server,
as after a restart or a scale-out where many requests share a few system prompts
(issue 39, item 1): every request reuses its prefix, and each distinct block is read
from disk once, the requests that came while it was being staged sharing that fill.

Two servers on one disk: the first computes the prefixes (written through to disk);
a fresh one, whose CPU tier and prefix cache are empty, takes the burst. Disk hits are
staged through CPU slots, as on GPUs (`disk.load_in_forward` off): that is where a
fill in flight is shared."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tiercache.ops.tiny_model import write_tiny_llama
from tiercache.ops.vllm_runner import connector_config, loading_every_hit

from support.serving import EOS, VllmServer, metric, text_of, write_word_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VOCAB = 2048
BLOCK = 32
PREFIXES = 4
PREFIX_BLOCKS = 32
PER_PREFIX = 6  # requests of the burst on each prefix
SUFFIX_TOKENS = 40
# vLLM's paged KV of this model: 2 layers x (K, V) x 2 heads x 32 tokens x 64 x 4 bytes.
KV_BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 64 * 4
CPU_TIER_SLOTS = 160  # all of the burst's 128 distinct blocks staged at once
KV_CACHE_BLOCKS = 1000  # the whole burst, each request with blocks of its own while it loads
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "PYTHONHASHSEED": "0", "VLLM_SERVER_DEV_MODE": "1"}
LOADED = "vllm:tiercache_loaded_blocks_total"
FAILED = "vllm:tiercache_failed_blocks_total"
TIERS = ("cpu", "disk")
GAUGES = ("vllm:tiercache_pinned_slots", "vllm:tiercache_loads_in_flight")


def prompts(seed: int, count: int, blocks: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = range(EOS + 1, VOCAB)
    return [[rng.choice(words) for _ in range(blocks * BLOCK)] for _ in range(count)]


PREFIX_IDS = prompts(39, PREFIXES, PREFIX_BLOCKS)


def with_suffix(prefix: list[int], n: int) -> list[int]:
    rng = random.Random(f"suffix {n}")  # (an int seed is taken by its absolute value)
    return prefix + [rng.choice(range(EOS + 1, VOCAB)) for _ in range(SUFFIX_TOKENS)]


async def complete_all(base: str, model: str, prompts: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts))) as client:

        async def one(ids: list[int]) -> dict:
            body = {"model": model, "prompt": text_of(ids), "max_tokens": 2, "temperature": 0}
            response = await client.post(f"{base}/v1/completions", json=body, timeout=300)
            response.raise_for_status()
            return response.json()

        return await asyncio.gather(*(one(ids) for ids in prompts))


def counts(text: str, name: str) -> dict[str, float]:
    return {tier: metric(text, name, tier=tier) for tier in TIERS}


def quiet(server: VllmServer, model: str, timeout: float = 60) -> None:
    """Every write-down and load over: vLLM carries the workers' reports only in
    engine steps, so tiny requests keep steps coming until the gauges are zero."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        asyncio.run(complete_all(server.base, model, [[5, 6, 7]]))
        text = server.metrics()
        if not any(metric(text, gauge) for gauge in GAUGES):
            return
        time.sleep(0.3)
    raise AssertionError("the tiers did not settle")


@pytest.fixture(scope="module")
def burst(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("serve-burst")
    model = write_tiny_llama(workdir / "model", vocab_size=VOCAB, max_positions=2048)
    write_word_tokenizer(model, VOCAB)
    extra = loading_every_hit(
        {
            "cpu": {"capacity": CPU_TIER_SLOTS * KV_BLOCK_BYTES},
            "disk": {"path": str(workdir / "disk"), "load_in_forward": False},
        }
    )
    args = [
        "--dtype", "float32",
        "--block-size", str(BLOCK),
        "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(KV_CACHE_BLOCKS * KV_BLOCK_BYTES),
        "--enforce-eager",
        "--seed", "0",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(connector_config(extra)),
    ]  # fmt: skip
    # The first server stores the prefixes (on disk); a fresh one, whose CPU tier and
    # prefix cache are empty, takes the burst: the scale-out or restart the issue
    # describes. (POST /reset_prefix_cache would reset tiercache too.)
    server = VllmServer(model, args, workdir / "store.log", ENV)
    try:
        server.wait_ready()
        name = str(model)
        asyncio.run(complete_all(server.base, name, [with_suffix(p, -1) for p in PREFIX_IDS]))
        quiet(server, name)
    finally:
        server.stop()
    server = VllmServer(model, args, workdir / "server.log", ENV)
    try:
        server.wait_ready()
        before = server.metrics()
        burst = [with_suffix(p, n) for n in range(PER_PREFIX) for p in PREFIX_IDS]
        responses = asyncio.run(complete_all(server.base, name, burst))
        quiet(server, name)
        after = server.metrics()
    finally:
        server.stop()
    loaded = {t: n - counts(before, LOADED)[t] for t, n in counts(after, LOADED).items()}
    failed = {t: n - counts(before, FAILED)[t] for t, n in counts(after, FAILED).items()}
    return {
        "responses": responses,
        "loaded": loaded,
        "failed": failed,
        "log": (workdir / "server.log").read_text(errors="replace")[-4000:],
    }


def test_every_request_of_the_burst_reuses_its_prefix(burst):
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in burst["responses"]]
    assert len(cached) == PREFIXES * PER_PREFIX
    assert min(cached) >= PREFIX_BLOCKS * BLOCK, (cached, burst["log"])
    assert burst["failed"] == {tier: 0 for tier in TIERS}, burst["log"]


def test_each_distinct_block_is_read_from_disk_once(burst):
    assert burst["loaded"]["disk"] == PREFIXES * PREFIX_BLOCKS, (burst["loaded"], burst["log"])

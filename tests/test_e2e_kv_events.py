"""vLLM's own KV event publisher carries tiercache's tiers, and the service's lookup
answers from what a running engine published. One engine (vLLM's CPU build, the tiny
random Llama, prefix caching on so vLLM publishes its GPU blocks too) with a ZMQ
publisher; a subscriber decodes the batches with msgspec as vLLM's own consumers do."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from fastapi.testclient import TestClient

from tiercache.config import build_config
from tiercache.index.block_hashing import BlockHashing
from tiercache.ops.local_stack import free_port
from tiercache.ops.service import create_app
from tiercache.ops.tiny_model import write_tiny_llama
from tiercache.ops.vllm_runner import connector_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
NAMESPACE = "e2e-events"
INSTANCE = "e2e-node:8000"
# The tiny Llama's slot: 2 layers x K and V x 2 KV heads x 32 tokens x 64 dims x 4 bytes.
SLOT = 2 * 2 * 2 * BLOCK * 64 * 4


class Subscriber:
    """A SUB socket on the engine's publisher, decoding every batch as it comes."""

    def __init__(self, port: int):
        from vllm.distributed.kv_events import KVEventBatch

        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []
        self.seqs: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                _topic, seq, payload = self.socket.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events.extend(self.decoder.decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.socket.close(linger=0)

    def of(self, kind: str, medium: str) -> list[bytes]:
        """Every hash in events of `kind` for `medium`, in order."""
        return [
            h
            for e in list(self.events)
            if type(e).__name__ == kind and e.medium == medium
            for h in e.block_hashes
        ]

    def held(self, medium: str) -> set[bytes]:
        """What the events say `medium` holds now."""
        state: set[bytes] = set()
        for event in list(self.events):
            if event.medium != medium:
                continue
            if type(event).__name__ == "BlockStored":
                state.update(event.block_hashes)
            elif type(event).__name__ == "BlockRemoved":
                state.difference_update(event.block_hashes)
        return state


def leading(hashes: list[bytes], held: set[bytes]) -> int:
    return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))


def wait_for(condition, timeout: float, what: str, state=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {state()}"
        time.sleep(0.2)


def test_events_carry_the_tiers_and_lookups_answer_from_them(tmp_path, redis, redis_url, monkeypatch):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Full 32-byte hashes in events (vLLM's default sends their low 64 bits as ints),
    # so the events' hashes can be compared with the service's whole ones.
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    model = write_tiny_llama(tmp_path / "model")
    port = free_port()
    extra = {
        "namespace": NAMESPACE,
        "redis_url": redis_url,
        "instance_id": INSTANCE,
        "cpu": {"capacity": 6 * SLOT},  # two prompts of four blocks do not fit
        "disk": {"path": str(tmp_path / "disk")},
        "presence": {"interval": 0.5, "ttl": 60},  # longer than the wait for shutdown below
    }
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=1024,
        kv_cache_memory_bytes=32 * 2**20,
        enable_prefix_caching=True,
        enforce_eager=True,
        kv_transfer_config=connector_config(extra),
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"},
    )
    subscriber = Subscriber(port)
    service = TestClient(
        create_app(build_config({"namespace": NAMESPACE, "redis_url": redis_url}, environ={}))
    )
    try:
        time.sleep(1.0)  # a SUB socket misses what is published before it joins
        first = [(7 * i + 3) % 2000 for i in range(4 * BLOCK + 1)]
        second = [(11 * i + 5) % 2000 for i in range(4 * BLOCK + 1)]
        sampling = SamplingParams(max_tokens=1, temperature=0, detokenize=False)

        def run(tokens):
            llm.generate([TokensPrompt(prompt_token_ids=tokens)], sampling, use_tqdm=False)

        hashing = BlockHashing("sha256", BLOCK, "vllm-none-hash")
        first_hashes, second_hashes = hashing.block_hashes(first), hashing.block_hashes(second)
        assert len(first_hashes) == len(second_hashes) == 4

        # Disk writes are reported on later steps: keep the engine stepping.
        filler = 0

        def on_disk(hashes: list[bytes]) -> bool:
            nonlocal filler
            filler += 1
            run([(13 * i + filler) % 2000 for i in range(BLOCK // 2)])  # no full block
            missing = set(hashes) - set(subscriber.of("BlockStored", "STORAGE"))
            on_disk.last = f"{len(missing)} of {len(hashes)} blocks not on disk"
            return not missing

        # The first prompt's blocks must be on disk before the second prompt comes: a
        # slot a disk write still holds is never evicted, so with all six slots held the
        # second prompt's stores would be dropped (a miss, by design), not evicting any.
        run(first)
        wait_for(lambda: on_disk(first_hashes), 120, "the first prompt's disk stores", lambda: on_disk.last)
        run(second)
        wait_for(lambda: on_disk(second_hashes), 120, "the second prompt's disk stores", lambda: on_disk.last)
        # Six slots, eight blocks: the second prompt's stores evicted blocks of the first.
        assert subscriber.of("BlockRemoved", "CPU")

        # vLLM's own GPU events name the blocks as the service hashes token ids.
        assert set(first_hashes + second_hashes) <= set(subscriber.of("BlockStored", "GPU"))
        # Every block went to the CPU tier and to disk, under the same hashes.
        assert set(first_hashes + second_hashes) <= set(subscriber.of("BlockStored", "CPU"))
        # Only the first prompt's blocks made room (the LRU order itself is checked in
        # tests/test_tier_events.py).
        assert set(subscriber.of("BlockRemoved", "CPU")) <= set(first_hashes)
        stored = next(e for e in subscriber.events if e.medium == "STORAGE")
        assert (stored.locality, stored.ownership, stored.block_size) == ("LOCAL", "tiercache", BLOCK)
        assert subscriber.seqs == list(range(subscriber.seqs[0], subscriber.seqs[0] + len(subscriber.seqs)))

        # The lookup, by token ids and by the events' hashes, answers what the events say.
        def answers(tokens, hashes):
            cpu, disk = subscriber.held("CPU"), subscriber.held("STORAGE")
            want = {"instance": INSTANCE, "cpu": leading(hashes, cpu), "disk": leading(hashes, disk)}
            want["prefix_blocks"] = leading(hashes, cpu | disk)
            want |= {"peer": False, "peer_blocks": 0}  # this engine's peer tier is off
            by_tokens = service.post("/v1/lookup", json={"namespace": NAMESPACE, "token_ids": tokens})
            by_hashes = service.post(
                "/v1/lookup", json={"namespace": NAMESPACE, "block_hashes": [h.hex() for h in hashes]}
            )
            assert by_tokens.status_code == by_hashes.status_code == 200, (by_tokens.text, by_hashes.text)
            (dep,) = by_tokens.json()["deployments"]
            (same,) = by_hashes.json()["deployments"]
            answers.last = (dep, want)
            return dep["instances"] == [want] and same["instances"] == [want]

        for tokens, hashes in [(first, first_hashes), (second, second_hashes)]:
            wait_for(lambda t=tokens, h=hashes: answers(t, h), 15, "the presence to catch up")
            dep, want = answers.last
            assert dep["block_size"] == BLOCK and dep["requested_blocks"] == 4 and dep["error"] is None
            assert dep["prefix_blocks"] == want["prefix_blocks"] == 4  # every block is on disk
        assert answers.last[1]["cpu"] > 0  # the second prompt is still in the CPU tier
    finally:
        subscriber.close()
        llm.llm_engine.engine_core.shutdown()

    # A clean shutdown takes the instance's presence out of Redis, well before its TTL.
    def gone() -> bool:
        body = service.post("/v1/lookup", json={"namespace": NAMESPACE, "token_ids": first}).json()
        return body["deployments"][0]["instances"] == []

    wait_for(gone, 60, "the instance to leave at shutdown")

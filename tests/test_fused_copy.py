"""The one-launch block copy of the CUDA path (connector/fused_copy.py), run on CPU
tensors through Triton's interpreter: the same kernel, the same address arithmetic,
checked byte for byte against the per-layer copies on each KV layout vLLM uses."""

from __future__ import annotations

import importlib

import pytest
import torch

from tiercache.connector import fused_copy
from tiercache.connector.copier import PagedKVCopier
from tiercache.tiers.cpu import CpuBuffer

NUM_BLOCKS = 13
LAYOUTS = {
    "flash-attn [2, blocks, block_size, heads, head]": (lambda: torch.randn(2, NUM_BLOCKS, 32, 2, 8), 2),
    "flashinfer [blocks, 2, block_size, heads, head]": (lambda: torch.randn(NUM_BLOCKS, 2, 32, 2, 8), 1),
    "mla [blocks, block_size, latent]": (lambda: torch.randn(NUM_BLOCKS, 32, 24), 1),
    "bf16 flash-attn": (lambda: torch.randn(2, NUM_BLOCKS, 32, 2, 8).to(torch.bfloat16), 2),
}


@pytest.fixture
def interpreted(monkeypatch):
    """fused_copy with its kernel built for Triton's CPU interpreter; rebuilt as it
    was afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(fused_copy)
    yield
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(fused_copy)


@pytest.mark.parametrize("staging_slots", [3, 64], ids=["batches of three", "one batch"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_launch_copy_matches_the_per_layer_copies(interpreted, layout, staging_slots):
    make, parts = LAYOUTS[layout]
    torch.manual_seed(2)
    kv = {f"model.layers.{i}.attn": make() for i in range(3)}
    direct = PagedKVCopier(kv, NUM_BLOCKS, staged=False)
    fused = PagedKVCopier(
        kv, NUM_BLOCKS, staged=True, fused=True, staging_bytes=staging_slots * direct.slot_bytes
    )
    assert fused.fused is not None, "this layout should take the one-launch path"
    assert fused.fused._shape.parts == parts

    blocks, slots = [12, 3, 4, 5, 0, 9, 1], [6, 7, 0, 1, 2, 3, 5]
    want = CpuBuffer(8, direct.slot_bytes, pin_memory=False)
    got = CpuBuffer(8, direct.slot_bytes, pin_memory=False)
    got.tensor.fill_(0x5A)
    direct.to_slots(blocks, slots, want)
    fused.to_slots(blocks, slots, got)
    for slot in slots:
        assert torch.equal(got.tensor[slot], want.tensor[slot]), slot
    assert (got.tensor[4] == 0x5A).all()  # outside the copy: untouched

    targets = [0, 2, 6, 7, 8, 10, 11]
    expected = {name: t.clone() for name, t in kv.items()}
    for name, tensor in expected.items():
        dim = next(d for d, s in enumerate(tensor.shape) if s == NUM_BLOCKS)
        for src, dst in zip(blocks, targets, strict=True):
            tensor.movedim(dim, 0)[dst] = kv[name].movedim(dim, 0)[src]
    fused.from_slots(slots, targets, got)
    for name in kv:
        assert torch.equal(kv[name], expected[name]), name


def test_layouts_the_kernel_cannot_address_fall_back_to_per_layer_copies(interpreted):
    # K/V and heads both outside the block dimension: each block is pieces at two
    # different distances, which one stride cannot describe.
    kv = {f"l{i}": torch.randn(2, 4, NUM_BLOCKS, 8) for i in range(2)}
    copier = PagedKVCopier(kv, NUM_BLOCKS, staged=True, fused=True)
    assert copier.fused is None
    # Layers of different shapes (a hybrid model) share no one launch either.
    mixed = {"a": torch.randn(NUM_BLOCKS, 2, 8), "b": torch.randn(NUM_BLOCKS, 4, 8)}
    assert PagedKVCopier(mixed, NUM_BLOCKS, staged=True, fused=True).fused is None

    buffer = CpuBuffer(4, copier.slot_bytes, pin_memory=False)
    original = {name: t.clone() for name, t in kv.items()}
    copier.to_slots([5, 2], [1, 3], buffer)
    for tensor in kv.values():
        tensor.zero_()
    copier.from_slots([1, 3], [5, 2], buffer)
    for name, tensor in kv.items():
        for block in (5, 2):
            assert torch.equal(tensor[:, :, block], original[name][:, :, block])
        assert not tensor[:, :, 0].any()  # a block outside the copy stays wiped


def test_warm_up_builds_the_kernel_and_leaves_the_paged_kv_as_it_was(interpreted):
    kv = {f"l{i}": torch.randn(2, NUM_BLOCKS, 32, 2, 8) for i in range(2)}
    before = {name: t.clone() for name, t in kv.items()}
    copier = PagedKVCopier(kv, NUM_BLOCKS, staged=True, fused=True)
    copier.warm_up()
    assert copier.fused is not None
    for name in kv:
        assert torch.equal(kv[name], before[name])


def test_a_kernel_that_cannot_build_leaves_the_per_layer_copies(interpreted, monkeypatch, caplog):
    kv = {f"l{i}": torch.randn(NUM_BLOCKS, 2, 32, 2, 8) for i in range(2)}
    copier = PagedKVCopier(kv, NUM_BLOCKS, staged=True, fused=True)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(copier.fused, "gather", no_compiler)
    copier.warm_up()
    assert copier.fused is None
    assert "PTX assembly failed" in caplog.text
    original = {name: t.clone() for name, t in kv.items()}
    buffer = CpuBuffer(2, copier.slot_bytes, pin_memory=False)
    copier.to_slots([7], [1], buffer)
    copier.from_slots([1], [3], buffer)
    for name, tensor in kv.items():
        assert torch.equal(tensor[3], original[name][7])

"""The one-launch block copy of the CUDA path (connector/fused_copy.py) and the
layer-by-layer loads built on it (connector/layerwise_gpu.py), run on CPU tensors
through Triton's interpreter: the same kernel, the same address arithmetic, checked
byte for byte against the per-layer copies on each KV layout vLLM uses."""

from __future__ import annotations

import pytest
import torch

from tiercache.connector.copier import PagedKVCopier
from tiercache.connector.layerwise_gpu import StreamLayerwiseLoad
from tiercache.tiers.cpu import CpuBuffer

NUM_BLOCKS = 13
LAYOUTS = {
    "flash-attn [2, blocks, block_size, heads, head]": (lambda: torch.randn(2, NUM_BLOCKS, 32, 2, 8), 2),
    "flashinfer [blocks, 2, block_size, heads, head]": (lambda: torch.randn(NUM_BLOCKS, 2, 32, 2, 8), 1),
    "mla [blocks, block_size, latent]": (lambda: torch.randn(NUM_BLOCKS, 32, 24), 1),
    "bf16 flash-attn": (lambda: torch.randn(2, NUM_BLOCKS, 32, 2, 8).to(torch.bfloat16), 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_launch_copy_matches_the_per_layer_copies(interpreted, layout):
    make, parts = LAYOUTS[layout]
    torch.manual_seed(2)
    kv = {f"model.layers.{i}.attn": make() for i in range(3)}
    direct = PagedKVCopier(kv, NUM_BLOCKS, staged=False)
    fused = PagedKVCopier(kv, NUM_BLOCKS, fused=True)
    assert fused.fused is not None, "this layout should take the one-launch path"
    assert fused.fused._shape.parts == parts

    blocks, slots = [12, 3, 4, 5, 0, 9, 1], [6, 7, 0, 1, 2, 3, 5]
    want = CpuBuffer(8, direct.slot_bytes, pin_memory=False)
    got = CpuBuffer(8, direct.slot_bytes, pin_memory=False)
    got.tensor.fill_(0x5A)
    assert fused.one_launch(got)
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
    copier = PagedKVCopier(kv, NUM_BLOCKS, fused=True)
    copier.warm_up(CpuBuffer(2, copier.slot_bytes, pin_memory=False))
    assert copier.fused is not None
    for name in kv:
        assert torch.equal(kv[name], before[name])


def broken_build(*args, **kwargs):
    raise RuntimeError("PTX assembly failed")


def lands_nothing(*args, **kwargs):
    return None  # as if the GPU could not reach the host memory it was given


@pytest.mark.parametrize("fault", [broken_build, lands_nothing], ids=["does not build", "lands nothing"])
def test_a_kernel_that_fails_its_start_up_check_leaves_the_per_layer_copies(
    interpreted, monkeypatch, caplog, fault
):
    kv = {f"l{i}": torch.randn(NUM_BLOCKS, 2, 32, 2, 8) for i in range(2)}
    copier = PagedKVCopier(kv, NUM_BLOCKS, fused=True)
    monkeypatch.setattr(copier.fused, "gather", fault)
    buffer = CpuBuffer(2, copier.slot_bytes, pin_memory=False)
    copier.warm_up(buffer)
    assert copier.fused is None
    assert "one-launch block copy is unavailable" in caplog.text
    original = {name: t.clone() for name, t in kv.items()}
    copier.to_slots([7], [1], buffer)
    copier.from_slots([1], [3], buffer)
    for name, tensor in kv.items():
        assert torch.equal(tensor[3], original[name][7])


def test_a_layer_by_layer_load_puts_each_layer_it_is_asked_for_in_place(interpreted):
    torch.manual_seed(3)
    kv = {f"model.layers.{i}.attn": torch.randn(2, NUM_BLOCKS, 32, 2, 8) for i in range(4)}
    copier = PagedKVCopier(kv, NUM_BLOCKS, fused=True)
    buffer = CpuBuffer(6, copier.slot_bytes, pin_memory=False)
    blocks, slots, targets = [4, 9, 2], [5, 0, 3], [11, 1, 7]
    copier.to_slots(blocks, slots, buffer)
    original = {name: t.clone() for name, t in kv.items()}
    # The forward's order, with a layer this rank does not hold and one left out.
    order = ["model.layers.3.attn", "model.layers.0.attn", "elsewhere", "model.layers.2.attn"]
    # Three programs for dozens of chunks: each walks its share of the work.
    load = StreamLayerwiseLoad(copier, buffer, slots, targets, order, programs=3)
    for name in order:
        load.wait(name)
    load.finish()
    for name, tensor in kv.items():
        for src, dst in zip(blocks, targets, strict=True):
            want = original[name][:, src] if name != "model.layers.1.attn" else original[name][:, dst]
            assert torch.equal(tensor[:, dst], want), (name, dst)
        assert torch.equal(tensor[:, 0], original[name][:, 0])  # a block outside the load


def test_a_layer_by_layer_load_needs_memory_the_kernel_can_reach():
    kv = {"l0": torch.randn(NUM_BLOCKS, 2, 8)}
    copier = PagedKVCopier(kv, NUM_BLOCKS, fused=False)
    with pytest.raises(ValueError, match="page-locked"):
        StreamLayerwiseLoad(copier, CpuBuffer(2, copier.slot_bytes, pin_memory=False), [0], [1], ["l0"])

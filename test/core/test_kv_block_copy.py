"""kv_block_copy (ops/kv_block_copy.py) under TRITON_INTERPRET=1: the values torch's copy_
writes, only into the destination's blocks, for the state cache's layouts (a row of the
uniform cache from one frame of a batch; a per-layer cache's row), and the fallbacks."""
from __future__ import annotations

import os

import pytest
import torch

from photon_core.ops import kv_block_copy as K

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the kernel runs under TRITON_INTERPRET=1 here")


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(K, "INTERPRET_ON_CPU", True)
    launches = []
    real = K._kv_block_copy_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid, kw["VEC"]))
                return real[grid](*args, **kw)
            return launch
    monkeypatch.setattr(K, "_kv_block_copy_kernel", Spy())
    return launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [16, 5])          # 16-byte aligned blocks (VEC > 1) or not
def test_uniform_cache_row_from_one_frame_of_a_batch(on_cpu, dtype, d):
    g = torch.Generator().manual_seed(0)
    layers, heads, t, rows, cap = 3, 4, 37, 3, 50
    batch = torch.randn(layers, 2, 2, heads, t + 5, d, generator=g).to(dtype)
    src = batch[:, :, 1:2, :, :t]                   # frame 1 of 2, its first t positions
    data = torch.randn(layers, 2, rows, heads, cap, d, generator=g).to(dtype)
    want = data.clone()
    want[:, :, 2:3, :, :t] = src
    K.kv_block_copy(data[:, :, 2:3, :, :t], src)
    assert torch.equal(data, want)                  # the row's blocks, nothing else
    (grid, vec), = on_cpu
    assert grid[0] == layers * 2 * heads
    assert vec == (16 // data.element_size() if d == 16 else 1)


def test_per_layer_row_with_a_cast(on_cpu):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 3, 64, 8, generator=g).half()        # [rows, Hkv, S, D]
    src = torch.randn(3, 20, 8, generator=g)                 # fp32 prefix k of one layer
    want = k.clone()
    want[1][:, :20] = src.half()
    K.kv_block_copy(k[1][:, :20], src)
    assert torch.equal(k, want)
    assert len(on_cpu) == 1


def test_layouts_it_cannot_take_fall_back_to_copy(on_cpu):
    g = torch.Generator().manual_seed(2)
    dst = torch.zeros(4, 6, 8)
    src = torch.randn(4, 8, 6, generator=g).transpose(1, 2)  # D not contiguous
    K.kv_block_copy(dst, src)
    assert torch.equal(dst, src) and on_cpu == []
    with pytest.raises(ValueError, match="shapes differ"):
        K.kv_block_copy(torch.zeros(2, 3), torch.zeros(3, 2))


def test_off_the_switch_it_is_torch_copy(monkeypatch):
    launches = []
    monkeypatch.setattr(K, "_kv_block_copy_kernel", type("S", (), {
        "__getitem__": lambda self, grid: launches.append(grid)})())
    dst, src = torch.zeros(2, 5, 4), torch.randn(2, 5, 4)
    K.kv_block_copy(dst, src)                        # a CPU tensor: torch's copy_
    assert torch.equal(dst, src) and launches == []

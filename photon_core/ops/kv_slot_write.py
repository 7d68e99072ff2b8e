"""A decode step's k/v rows into the state cache, each row at its own slot: slot = pos % S on
a ring (a sliding layer's `window` slots), pos on a full-length layer. k, v [b, Hkv * D]
(unit column stride, e.g. buffer views), states [R, Hkv, S, D], rows [b], pos [b] device
tensors (graph-capturable).

`kv_slot_write_reference` is the torch form (two index writes after the slot arithmetic: 3
launches); `kv_slot_write_triton` writes k and v in one launch, one program per (row, k/v
head); diff-tested under TRITON_INTERPRET=1 (test_gemma4_ops.py). The fused backend's
window_attention op uses it (fast/window_state_ops.py).
"""
from __future__ import annotations

import torch

from ._triton import tl, triton
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait


def kv_slot_write_reference(k: torch.Tensor, v: torch.Tensor, k_state: torch.Tensor,
                            v_state: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                            ring: bool) -> None:
    hkv, S, d = k_state.shape[1:]
    slot = torch.remainder(pos, S) if ring else pos
    k_state[rows, :, slot] = k.reshape(-1, hkv, d)
    v_state[rows, :, slot] = v.reshape(-1, hkv, d)


@triton.jit
def _kv_slot_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, rows_ptr, pos_ptr, n_slots,
                          stride_k, stride_v, stride_r, stride_h, stride_t,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, RING: tl.constexpr,
                          GDC: tl.constexpr = False):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    i = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    p = tl.load(pos_ptr + i)
    if RING:
        p = p % n_slots
    d = tl.arange(0, BLOCK_D)
    m = d < D
    kk = tl.load(k_ptr + i * stride_k + h * D + d, mask=m)
    vv = tl.load(v_ptr + i * stride_v + h * D + d, mask=m)
    off = row * stride_r + h * stride_h + p * stride_t + d
    tl.store(kc_ptr + off, kk.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + off, vv.to(vc_ptr.dtype.element_ty), mask=m)


def kv_slot_write_triton(k: torch.Tensor, v: torch.Tensor, k_state: torch.Tensor,
                         v_state: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                         ring: bool, pdl: bool = False) -> None:
    b = k.shape[0]
    hkv, S, d = k_state.shape[1:]
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.shape[-1] == v.shape[-1] == hkv * d
    assert k_state.stride() == v_state.stride() and k_state.stride(3) == 1
    _, gdc, launch_kw = pdl_launch(pdl, k)     # (pdl: ops/pdl.py)
    _kv_slot_write_kernel[(b, hkv)](
        k, v, k_state, v_state, rows, pos, S, k.stride(0), v.stride(0), k_state.stride(0),
        k_state.stride(1), k_state.stride(2), D=d, BLOCK_D=triton.next_power_of_2(d),
        RING=ring, GDC=gdc, num_warps=1 if d <= 128 else 4, **launch_kw)

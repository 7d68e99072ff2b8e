"""A Gated DeltaNet layer's decode step between its projections, over a decode bucket's rows,
in ONE launch: the causal conv (+ SiLU) of q | k | v, the gated delta rule (gates, q / k L2
norms, state decay, delta write, read-out) and the gated RMSNorm of the read-out
(rmsnorm_gated: per value head, times SiLU(z)).

The fused backend ran these as three launches per layer (causal_conv1d_rows_triton,
gated_delta_rows_triton, rmsnorm_gated_rows_triton), the conv output and the read-out making
a round trip through memory in the model dtype between them. Here they stay in registers,
rounded to the model dtype where those kernels stored them, so the math and its roundings
are theirs (the sums' order inside a tile may differ: not bit for bit).

grid (b, Hk): program (r, j) owns key head j of row r: its q and k channels, the v channels
of its Hv / Hk value heads (no other program reads or writes those conv-state channels:
the state is shifted in place without a race between programs), and those value heads' fp32
[Dk, Dv] states, each updated as one tile. The new conv and delta states are stored only for
active rows (a row riding along keeps its state); every row's output is written.

Torch reference: `delta_net_rows_reference`, the three ops' references (gated_delta_net.py,
rmsnorm_gated.py) in sequence.
"""
from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, tl, triton
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from .gated_delta_net import conv1d_rows, delta_rule_rows
from .gated_delta_rule import check_rows_state
from .rmsnorm_gated import rmsnorm_gated

if HAVE_TRITON:     # the one-token math of the delta rule kernels
    from .gated_delta_rule import _delta_update, _raw_delta_gates, _unit_qk


def delta_net_rows_reference(qkv, z, b_in, a_in, conv_weight, conv_state, a_log, dt_bias,
                             norm_weight, state, dims, eps: float,
                             active: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [b, C] (before the conv), z [b, Hv Dv] -> the gated norm's output [b, Hv Dv];
    conv_state [>= b, C, K-1] and state [>= b, Hv, Dk, Dv] (fp32) updated for active rows."""
    b = qkv.shape[0]
    hk, hv, dk, dv = dims
    c = conv1d_rows(qkv, conv_weight, conv_state[:b], active)
    o = delta_rule_rows(c, b_in, a_in, a_log, dt_bias, state[:b], dims, active)
    return rmsnorm_gated(o.reshape(b, hv, dv), z.reshape(b, hv, dv), norm_weight,
                         eps).reshape(b, hv * dv)


@triton.jit
def _conv_load(x_row, cw_ptr, cs_row, ch, cmask, cs_c, cs_k, K: tl.constexpr,
               K_P2: tl.constexpr, CM: tl.constexpr):
    """Channels ch of one row: SiLU(causal conv) in fp32 (the conv rows kernel's math) and
    the shifted window (the new state) - all loads, no store."""
    j = tl.arange(0, K_P2)
    hist = j < K - 1
    sp = cs_row + ch[:, None] * cs_c + j[None, :] * cs_k
    window = tl.load(sp, mask=cmask[:, None] & hist[None, :], other=0.0).to(tl.float32)
    x = tl.load(x_row + ch, mask=cmask, other=0.0, cache_modifier=CM)
    window = tl.where((j == K - 1)[None, :], x.to(tl.float32)[:, None], window)
    w = tl.load(cw_ptr + ch[:, None] * K + j[None, :], mask=cmask[:, None] & (j < K)[None, :],
                other=0.0).to(tl.float32)
    acc = tl.sum(window * w, axis=1)
    nxt = tl.load(sp + cs_k, mask=cmask[:, None] & (j < K - 2)[None, :], other=0.0)
    nxt = tl.where((j == K - 2)[None, :], x.to(cs_row.dtype.element_ty)[:, None], nxt)
    out = acc / (1.0 + tl.exp(-acc))
    return out.to(x_row.dtype.element_ty).to(tl.float32), nxt


@triton.jit
def _conv_store(cs_row, ch, cmask, cs_c, cs_k, nxt, go, K: tl.constexpr, K_P2: tl.constexpr):
    """The new conv state of channels ch (after a barrier: every thread has read the old)."""
    j = tl.arange(0, K_P2)
    if go != 0:
        tl.store(cs_row + ch[:, None] * cs_c + j[None, :] * cs_k, nxt,
                 mask=cmask[:, None] & (j < K - 1)[None, :])


@triton.jit
def delta_net_group(x_row, z_row, b_row, a_row, cw_ptr, cs_row, s_row, o_row, alog_ptr,
                    dtb_ptr, nw_ptr, go, hk, cs_c, cs_k, eps, HK: tl.constexpr,
                    HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    DK_P2: tl.constexpr, DV_P2: tl.constexpr, K: tl.constexpr,
                    K_P2: tl.constexpr, CM: tl.constexpr):
    """Key head hk of one row (row pointers: qkv before the conv, z, b, a, conv state, fp32
    delta state, output): the conv of its q / k / v channels, its value heads' delta rule
    and gated norm; the states written only when go != 0. (Also one instruction of the hybrid
    megakernel: megakernel/hybrid_kernel.py, with CM ".cg": the row's projections were
    written by other SMs during the launch, read from L2, never a stale L1 line.)"""
    # every value head: its loads first (conv windows, state tile, z, gates: one round trip),
    # one barrier (the conv state is shifted in place), then the stores and the math
    dk = tl.arange(0, DK_P2)
    kmask = dk < DK
    dv = tl.arange(0, DV_P2)
    vmask = dv < DV
    smask = kmask[:, None] & vmask[None, :]
    qc = hk * DK + dk
    kc = (HK + hk) * DK + dk
    q, q_nxt = _conv_load(x_row, cw_ptr, cs_row, qc, kmask, cs_c, cs_k, K, K_P2, CM)
    k, k_nxt = _conv_load(x_row, cw_ptr, cs_row, kc, kmask, cs_c, cs_k, K, K_P2, CM)
    dt = o_row.dtype.element_ty
    nw = tl.load(nw_ptr + dv, mask=vmask, other=0.0).to(tl.float32)
    for gi in tl.static_range(HV // HK):
        h = hk * (HV // HK) + gi
        vc = 2 * HK * DK + h * DV + dv
        v, v_nxt = _conv_load(x_row, cw_ptr, cs_row, vc, vmask, cs_c, cs_k, K, K_P2, CM)
        sp = s_row + h * DK * DV + dk[:, None] * DV + dv[None, :]
        s = tl.load(sp, mask=smask, other=0.0)
        zz = tl.load(z_row + h * DV + dv, mask=vmask, other=0.0,
                     cache_modifier=CM).to(tl.float32)
        g, beta = _raw_delta_gates(
            tl.load(a_row + h, cache_modifier=CM).to(tl.float32)
            + tl.load(dtb_ptr + h).to(tl.float32),
            tl.load(alog_ptr + h).to(tl.float32),
            tl.load(b_row + h, cache_modifier=CM).to(tl.float32), b_row)
        tl.debug_barrier()      # every thread has read the old conv windows before any shift
        if gi == 0:
            _conv_store(cs_row, qc, kmask, cs_c, cs_k, q_nxt, go, K, K_P2)
            _conv_store(cs_row, kc, kmask, cs_c, cs_k, k_nxt, go, K, K_P2)
            q, k = _unit_qk(q, k, DK)
        _conv_store(cs_row, vc, vmask, cs_c, cs_k, v_nxt, go, K, K_P2)
        s = _delta_update(s, k, v, g, beta)
        if go != 0:
            tl.store(sp, s, mask=smask)
        o = tl.sum(s * q[:, None], axis=0).to(dt).to(tl.float32)    # the read-out, stored
        # the gated RMSNorm of the head (rmsnorm_gated's roundings)
        rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)
        y = (o * rstd).to(dt).to(tl.float32)
        y = (nw * y).to(dt).to(tl.float32)
        tl.store(o_row + h * DV + dv, (y * (zz / (1.0 + tl.exp(-zz)))).to(dt), mask=vmask)


@triton.jit
def _delta_net_rows_kernel(x_ptr, z_ptr, b_ptr, a_ptr, cw_ptr, cs_ptr, s_ptr, o_ptr, alog_ptr,
                           dtb_ptr, nw_ptr, act_ptr, s_x, s_z, s_b, s_a, s_o, cs_b, cs_c, cs_k,
                           s_s, eps, HAS_ACTIVE: tl.constexpr, HK: tl.constexpr,
                           HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           DK_P2: tl.constexpr, DV_P2: tl.constexpr, K: tl.constexpr,
                           K_P2: tl.constexpr, GDC: tl.constexpr = False):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    bi = tl.program_id(0)
    hk = tl.program_id(1)
    go = 1
    if HAS_ACTIVE:
        go = tl.load(act_ptr + bi)
    delta_net_group(x_ptr + bi * s_x, z_ptr + bi * s_z, b_ptr + bi * s_b, a_ptr + bi * s_a,
                    cw_ptr, cs_ptr + bi * cs_b, s_ptr + bi * s_s, o_ptr + bi * s_o, alog_ptr,
                    dtb_ptr, nw_ptr, go, hk, cs_c, cs_k, eps, HK, HV, DK, DV, DK_P2, DV_P2, K,
                    K_P2, "")


# warps per program (0: 4, 8 above a 128 x 128 state tile); the fused backend reads it when it
# lowers a step (a module switch for bench/ab_switch.py). Qwen 3.5 0.8B on the H200 (session
# 12): 4.3 us per launch with 4 warps (209 registers, no spill), 5.8 with 8, 9.3 with 16; 2
# warps spill
NUM_WARPS = 0


def delta_net_rows_triton(qkv: torch.Tensor, z: torch.Tensor, b_in: torch.Tensor,
                          a_in: torch.Tensor, conv_weight: torch.Tensor,
                          conv_state: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                          norm_weight: torch.Tensor, state: torch.Tensor,
                          dims: tuple[int, int, int, int], eps: float,
                          active: torch.Tensor | None = None, out: torch.Tensor | None = None,
                          num_warps: int = 0, pdl: bool = False) -> torch.Tensor:
    """As delta_net_rows_reference (in place on the states), one launch: qkv [b, C = 2 Hk Dk
    + Hv Dv] before the conv, z [b, Hv Dv], b_in / a_in [b, Hv] (any row strides, unit last
    stride), conv_weight [C, K], conv_state [>= b, C, K-1] (any strides), a_log / dt_bias
    [Hv], norm_weight [Dv], state [>= b, Hv, Dk, Dv] fp32 (inner dims contiguous), dims (Hk,
    Hv, Dk, Dv), active [b] bool or None (all rows), out [b, Hv Dv] (unit last stride; new
    when None), num_warps (0: NUM_WARPS's rule), pdl (ops/pdl.py) -> out in qkv's dtype."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    hk, hv, dk, dv = dims
    b, c = qkv.shape
    kw = conv_weight.shape[-1]
    if c != 2 * hk * dk + hv * dv or conv_weight.numel() != c * kw or hv % hk or \
            z.shape != (b, hv * dv) or \
            b_in.shape != (b, hv) or a_in.shape != (b, hv) or a_log.shape != (hv,) or \
            dt_bias.shape != (hv,) or norm_weight.shape != (dv,):
        raise ValueError(f"delta_net_rows_triton: shapes qkv {tuple(qkv.shape)}, z "
                         f"{tuple(z.shape)}, b_in {tuple(b_in.shape)}, a_in "
                         f"{tuple(a_in.shape)} do not fit {dims}")
    if conv_state.dim() != 3 or conv_state.shape[0] < b or conv_state.shape[1:] != (c, kw - 1) \
            or kw < 2:
        raise ValueError(f"conv state {tuple(conv_state.shape)} does not fit [>={b}, {c}, "
                         f"{kw - 1}]")
    check_rows_state(state, active, b, dims)
    conv_weight = conv_weight.reshape(c, kw).contiguous()
    qkv, z, b_in, a_in = (t if t.stride(-1) == 1 else t.contiguous()
                          for t in (qkv, z, b_in, a_in))
    if out is None:
        out = torch.empty(b, hv * dv, dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (b, hv * dv) or out.stride(-1) != 1 or out.dtype != qkv.dtype:
        raise ValueError(f"out must be [{b}, {hv * dv}] in qkv's dtype, unit last stride")
    act = active.view(torch.uint8) if active is not None else qkv
    tile = triton.next_power_of_2(dk) * triton.next_power_of_2(dv)
    _, gdc, launch_kw = pdl_launch(pdl, qkv)
    _delta_net_rows_kernel[(b, hk)](
        qkv, z, b_in, a_in, conv_weight, conv_state, state, out, a_log.contiguous(),
        dt_bias.contiguous(), norm_weight.contiguous(), act, qkv.stride(0), z.stride(0),
        b_in.stride(0), a_in.stride(0), out.stride(0), conv_state.stride(0),
        conv_state.stride(1), conv_state.stride(2), state.stride(0), eps,
        HAS_ACTIVE=active is not None, HK=hk, HV=hv, DK=dk, DV=dv,
        DK_P2=triton.next_power_of_2(dk), DV_P2=triton.next_power_of_2(dv), K=kw,
        K_P2=triton.next_power_of_2(kw), GDC=gdc,
        num_warps=num_warps or (4 if tile <= 16384 else 8), **launch_kw)
    return out

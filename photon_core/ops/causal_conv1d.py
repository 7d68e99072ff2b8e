"""Depthwise causal 1D convolution with SiLU, as a prefill over a sequence and a one-token step.

Each channel c has its own K-tap filter w[c, :]; output t sees inputs t-K+1 .. t. The layer
keeps the last K-1 inputs as its state, so a sequence can be continued token by token (or by
another prefill) exactly as if it had been processed in one piece.
Triton kernels (diff-tested under TRITON_INTERPRET=1): the one-token step, the step over a
decode bucket's rows, and the prefill in the decoder's row layout (x [T, C]: the fast
encode's image-prefix pass, where the reference's cat + depthwise conv took ~0.6 ms of Qwen
3.5 0.8B's 640x480 encode on the H200, session 16).
  x      [B, C, T]      inputs (channels first)
  state  [B, C, K-1]    the K-1 inputs before x (zeros at the start of a sequence)
  weight [C, K]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (SiLU(conv(x)) [B, C, T], new state [B, C, K-1]). state None = zeros."""
    b, c, t = x.shape
    k = weight.shape[1]
    if state is None:
        state = x.new_zeros(b, c, k - 1)
    full = torch.cat([state.to(x.dtype), x], dim=-1)             # [B, C, K-1+T]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=c)   # [B, C, T]
    return F.silu(out).to(x.dtype), full[:, :, -(k - 1):].clone()


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token: x [B, C] -> SiLU(conv) [B, C]; state [B, C, K-1] is updated in place."""
    window = torch.cat([state, x.unsqueeze(-1).to(state.dtype)], dim=-1)   # [B, C, K]
    out = (window.to(weight.dtype) * weight).sum(-1)
    state.copy_(window[:, :, 1:])
    return F.silu(out).to(x.dtype)


# -- Triton: the one-token step ----------------------------------------------------------------
# grid (B, cdiv(C, BC)): each program owns BC channels of one sequence: it loads their K-1 state
# taps and the new input, takes the K-tap dot product with the filter in fp32, applies SiLU and
# writes the shifted window back as the new state (in place: a program touches only its own
# channels). The state may be strided (e.g. a slot of a batched state tensor); x and the
# output are [B, C] with unit channel stride.
try:
    import triton
    import triton.language as tl
except ImportError:   # the torch reference above needs no Triton
    triton = None

if triton is not None:
    @triton.jit
    def _causal_conv1d_step_kernel(x_ptr, w_ptr, s_ptr, o_ptr, C, sx_b, ss_b, ss_c, ss_k,
                                   so_b, K: tl.constexpr, K_P2: tl.constexpr, BC: tl.constexpr):
        bi = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = c < C
        j = tl.arange(0, K_P2)                                      # tap; K-1 is the new input
        hist = j < K - 1
        m2 = cmask[:, None] & hist[None, :]
        sp = s_ptr + bi * ss_b + c[:, None] * ss_c + j[None, :] * ss_k
        window = tl.load(sp, mask=m2, other=0.0).to(tl.float32)     # [BC, K_P2]
        x = tl.load(x_ptr + bi * sx_b + c, mask=cmask, other=0.0)
        is_new = (j == K - 1)[None, :]
        window = tl.where(is_new, x.to(tl.float32)[:, None], window)
        w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=cmask[:, None] & (j < K)[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.sum(window * w, axis=1)
        out = acc / (1.0 + tl.exp(-acc))                             # SiLU
        tl.store(o_ptr + bi * so_b + c, out.to(o_ptr.dtype.element_ty), mask=cmask)
        # new state = window[:, 1:]: tap j of the new state is tap j+1 of the window. The
        # reference rounds the new input to the state's dtype first; so does this store.
        nxt = tl.load(sp + ss_k, mask=cmask[:, None] & (j < K - 2)[None, :], other=0.0)
        nxt = tl.where((j == K - 2)[None, :], x.to(s_ptr.dtype.element_ty)[:, None], nxt)
        tl.store(sp, nxt, mask=m2)


def causal_conv1d_step_triton(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                              block_c: int = 256) -> torch.Tensor:
    """Same contract as causal_conv1d_step: x [B, C], weight [C, K], state [B, C, K-1] (updated
    in place) -> SiLU(conv) [B, C] in x's dtype."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, c = x.shape
    k = weight.shape[1]
    if state.shape != (b, c, k - 1):
        raise ValueError(f"state shape {tuple(state.shape)} != {(b, c, k - 1)}")
    if k < 2:
        raise ValueError("causal_conv1d_step_triton needs a kernel of at least 2 taps")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(b, c, dtype=x.dtype, device=x.device)
    bc = min(block_c, triton.next_power_of_2(c))
    _causal_conv1d_step_kernel[(b, triton.cdiv(c, bc))](
        x, weight, state, out, c, x.stride(0), state.stride(0), state.stride(1), state.stride(2),
        out.stride(0), K=k, K_P2=triton.next_power_of_2(k), BC=bc)
    return out


# -- Triton: the one-token step over a decode bucket's rows -------------------------------------
# grid (b, cdiv(C, BC)): as the step kernel, for rows 0 .. b-1 of the runtime's state cache (row
# r's state in slot r of a [rows, C, K-1] tensor, any strides), x and the output strided views
# of the backend's buffers (unit channel stride). Every row's output is computed; the new
# state is stored only where active[r] (an inactive row riding along in the bucket keeps its
# state exactly: no clone, no copy-back). active is read on the device (CUDA-graph friendly).
if triton is not None:
    @triton.jit
    def _causal_conv1d_rows_kernel(x_ptr, w_ptr, s_ptr, o_ptr, act_ptr, C, sx_b, ss_b, ss_c,
                                   ss_k, so_b, HAS_ACTIVE: tl.constexpr, K: tl.constexpr,
                                   K_P2: tl.constexpr, BC: tl.constexpr):
        bi = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = c < C
        j = tl.arange(0, K_P2)
        hist = j < K - 1
        m2 = cmask[:, None] & hist[None, :]
        sp = s_ptr + bi * ss_b + c[:, None] * ss_c + j[None, :] * ss_k
        window = tl.load(sp, mask=m2, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + bi * sx_b + c, mask=cmask, other=0.0)
        window = tl.where((j == K - 1)[None, :], x.to(tl.float32)[:, None], window)
        w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=cmask[:, None] & (j < K)[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.sum(window * w, axis=1)
        out = acc / (1.0 + tl.exp(-acc))                             # SiLU
        tl.store(o_ptr + bi * so_b + c, out.to(o_ptr.dtype.element_ty), mask=cmask)
        go = 1
        if HAS_ACTIVE:
            go = tl.load(act_ptr + bi)
        if go != 0:
            nxt = tl.load(sp + ss_k, mask=cmask[:, None] & (j < K - 2)[None, :], other=0.0)
            nxt = tl.where((j == K - 2)[None, :], x.to(s_ptr.dtype.element_ty)[:, None], nxt)
            tl.store(sp, nxt, mask=m2)


def causal_conv1d_rows_triton(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                              active: torch.Tensor | None = None, out: torch.Tensor | None = None,
                              block_c: int = 256) -> torch.Tensor:
    """A decode step over rows 0 .. b-1 (the runtime's form of gated_delta_net.conv1d_rows):
    x [b, C] (unit channel stride, any row stride), weight [C, K], state [>= b, C, K-1] (row r
    in slot r; updated in place for the rows with active[r], all rows when active is None),
    active [b] bool on x's device, out [b, C] (written; new when None) -> out."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, c = x.shape
    k = weight.shape[-1]
    weight = weight.reshape(c, k).contiguous()
    if state.dim() != 3 or state.shape[0] < b or state.shape[1:] != (c, k - 1) or k < 2:
        raise ValueError(f"state shape {tuple(state.shape)} does not fit [>={b}, {c}, {k - 1}] "
                         "(kernel of at least 2 taps)")
    if active is not None and (active.shape != (b,) or active.dtype != torch.bool):
        raise ValueError(f"active must be a [{b}] bool tensor")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(b, c, dtype=x.dtype, device=x.device)
    elif out.shape != (b, c) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{b}, {c}] with unit last stride")
    bc = min(block_c, triton.next_power_of_2(c))
    act = active.view(torch.uint8) if active is not None else x
    _causal_conv1d_rows_kernel[(b, triton.cdiv(c, bc))](
        x, weight, state, out, act, c, x.stride(0), state.stride(0), state.stride(1),
        state.stride(2), out.stride(0), HAS_ACTIVE=active is not None, K=k,
        K_P2=triton.next_power_of_2(k), BC=bc)
    return out


# -- Triton: the prefill over a sequence in the decoder's row layout -----------------------------
# grid (cdiv(T, BT), cdiv(C, BC)): a program owns BT tokens x BC channels of x [T, C] (unit
# channel stride: the in-projection GEMM's output as it is, no transpose); tap k of token t
# reads input t - (K-1) + k, from x where that is >= 0, else from the state passed in. fp32
# sums, SiLU, one rounding to x's dtype; out [T, C] in the same layout. The programs of the
# first token block also write the new state (the last K-1 inputs: x's tail, the old state's
# tail where T < K-1) into a new tensor, so no program reads a state another one writes.
if triton is not None:
    @triton.jit
    def _causal_conv1d_prefill_kernel(x_ptr, w_ptr, s_ptr, o_ptr, ns_ptr, T, C, sx_t, ss_c,
                                      ss_k, so_t, K: tl.constexpr, K_P2: tl.constexpr,
                                      BT: tl.constexpr, BC: tl.constexpr):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        tm, cm = t < T, c < C
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for k in tl.static_range(K):
            r = t - (K - 1) + k                                  # the input this tap reads
            xv = tl.load(x_ptr + r[:, None] * sx_t + c[None, :],
                         mask=(tm & (r >= 0))[:, None] & cm[None, :], other=0.0)
            sv = tl.load(s_ptr + c[None, :] * ss_c + (K - 1 + r)[:, None] * ss_k,
                         mask=(tm & (r < 0))[:, None] & cm[None, :], other=0.0)
            v = tl.where((r >= 0)[:, None], xv.to(tl.float32), sv.to(tl.float32))
            wk = tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)
            acc += v * wk[None, :]
        out = acc / (1.0 + tl.exp(-acc))                          # SiLU
        tl.store(o_ptr + t[:, None] * so_t + c[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=tm[:, None] & cm[None, :])
        if tl.program_id(0) == 0:    # (names of their own: a Triton branch keeps each type)
            j = tl.arange(0, K_P2)                               # new state tap j: input T-(K-1)+j
            rn = T - (K - 1) + j
            jm = j < K - 1
            xn = tl.load(x_ptr + rn[None, :] * sx_t + c[:, None],
                         mask=cm[:, None] & (jm & (rn >= 0))[None, :], other=0.0)
            sn = tl.load(s_ptr + c[:, None] * ss_c + (K - 1 + rn)[None, :] * ss_k,
                         mask=cm[:, None] & (jm & (rn < 0))[None, :], other=0.0)
            nv = tl.where((rn >= 0)[None, :], xn.to(ns_ptr.dtype.element_ty),
                          sn.to(ns_ptr.dtype.element_ty))
            tl.store(ns_ptr + c[:, None] * (K - 1) + j[None, :], nv,
                     mask=cm[:, None] & jm[None, :])


def causal_conv1d_prefill_triton(x: torch.Tensor, weight: torch.Tensor,
                                 state: torch.Tensor | None = None, block_t: int = 16,
                                 block_c: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_conv1d_prefill for one sequence in the row layout: x [T, C] (unit channel
    stride), weight [C, K], state [1, C, K-1] (None = zeros; not modified) -> (SiLU(conv)
    [T, C] in x's dtype, the new state [1, C, K-1] in x's dtype). The same math as the
    reference, not the same bits (fp32 sums, one rounding)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    t, c = x.shape
    k = weight.shape[-1]
    weight = weight.reshape(c, k).contiguous()
    if state is None:
        state = x.new_zeros(1, c, k - 1)
    if state.shape != (1, c, k - 1) or k < 2:
        raise ValueError(f"state shape {tuple(state.shape)} != {(1, c, k - 1)} (kernel of at "
                         "least 2 taps)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    new_state = torch.empty(1, c, k - 1, dtype=x.dtype, device=x.device)
    bc = min(block_c, triton.next_power_of_2(c))
    bt = min(block_t, triton.next_power_of_2(max(t, 1)))
    _causal_conv1d_prefill_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](
        x, weight, state, out, new_state, t, c, x.stride(0), state.stride(1), state.stride(2),
        out.stride(0), K=k, K_P2=triton.next_power_of_2(k), BT=bt, BC=bc,
        num_warps=4)
    return out, new_state

"""The gated delta rule (Gated DeltaNet's linear attention), per value head h:

    S_t = exp(g_t) * S_{t-1}                       decay the state      S: [Dk, Dv], fp32
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T    delta-rule write (correct what S predicts)
    o_t = S_t^T q_t

q and k are L2-normalised (eps 1e-6 inside the rsqrt) and q is scaled by Dk^-0.5 before use;
with fewer key heads than value heads each q/k head serves Hv/Hk consecutive value heads.
All arithmetic is fp32; outputs are cast back to v's dtype.

Three forms, equal up to float rounding:
  gated_delta_step     one token, state updated in place (decode)
  gated_delta_scan     token-by-token loop over a sequence (readable reference)
  gated_delta_chunked  chunks of C tokens: within a chunk the sequential writes are solved at
                       once with a unit lower-triangular system (the "UT transform"), then one
                       state update per chunk (prefill)
Shapes: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dk, Dv].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """-> fp32 [B, Hv, T, D] q (normalised, scaled), k (normalised), v; g, beta [B, Hv, T]."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    q = l2norm(q) * q.shape[-1] ** -0.5
    return q, l2norm(k), v, g, beta


def _new_state(v: torch.Tensor, dk: int, state):
    b, hv, _, dv = v.shape
    return torch.zeros(b, hv, dk, dv, dtype=torch.float32, device=v.device) if state is None \
        else state.float()


def gated_delta_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state [B, Hv, Dk, Dv] fp32,
    updated in place. -> o [B, Hv, Dv] in v's dtype."""
    qf, kf, vf, gf, bf = _prepare(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None])
    qf, kf, vf, gf, bf = qf[:, :, 0], kf[:, :, 0], vf[:, :, 0], gf[:, :, 0], bf[:, :, 0]
    s = state * gf.exp()[..., None, None]
    pred = (s * kf[..., None]).sum(-2)                         # S^T k   [B, Hv, Dv]
    s = s + kf[..., None] * ((vf - pred) * bf[..., None])[..., None, :]
    state.copy_(s)
    return (s * qf[..., None]).sum(-2).to(v.dtype)


def gated_delta_scan(q, k, v, g, beta, state: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. -> (o [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] fp32)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    s = _new_state(vf, kf.shape[-1], state)
    out = torch.empty_like(vf)
    for t in range(vf.shape[2]):
        s = s * gf[:, :, t].exp()[..., None, None]
        pred = (s * kf[:, :, t, :, None]).sum(-2)
        s = s + kf[:, :, t, :, None] * ((vf[:, :, t] - pred) * bf[:, :, t, None])[..., None, :]
        out[:, :, t] = (s * qf[:, :, t, :, None]).sum(-2)
    return out.transpose(1, 2).to(v.dtype), s


def gated_delta_chunked(q, k, v, g, beta, state: torch.Tensor | None = None, chunk: int = 64
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of gated_delta_scan (same arguments and results)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    b, h, t, dk = kf.shape
    dv = vf.shape[-1]
    s = _new_state(vf, dk, state)
    pad = (-t) % chunk
    qf, kf, vf = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, vf))
    gf, bf = (F.pad(x, (0, pad)) for x in (gf, bf))      # padded tokens: g = 0, beta = 0
    n = (t + pad) // chunk
    qc, kc, vc = (x.reshape(b, h, n, chunk, -1) for x in (qf, kf, vf))
    gc, bc = gf.reshape(b, h, n, chunk), bf.reshape(b, h, n, chunk)

    cum = gc.cumsum(-1)                                            # log decay from chunk start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    kb, vb = kc * bc[..., None], vc * bc[..., None]
    # Within a chunk, token i's write depends on the earlier writes of the chunk:
    # (I + A) u = beta*v, A[i,j] = beta_i k_i.k_j decay(j->i) for j < i; likewise for the
    # decayed keys that read the state carried in from the previous chunk.
    a = (kb @ kc.transpose(-1, -2)) * decay
    a = a.masked_fill(~torch.ones_like(future).tril(-1), 0.0) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(a, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a, kb * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay                     # causal, diagonal included
    q_dec = qc * cum.exp()[..., None]
    k_dec = kc * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(vc)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s                        # corrections to write
        out[:, :, i] = q_dec[:, :, i] @ s + attn[:, :, i] @ v_new
        s = s * cum[:, :, i, -1].exp()[..., None, None] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, n * chunk, dv)[:, :, :t]
    return out.transpose(1, 2).to(v.dtype), s


# -- Triton: the one-token step ----------------------------------------------------------------
# grid (B, Hv, cdiv(Dv, BV)): each program owns a [Dk, BV] slice of one head's fp32 state and
# does normalise q/k -> decay -> delta write -> read, all in registers; the state is updated in
# place (each program reads and writes only its own slice).
try:
    import triton
    import triton.language as tl
except ImportError:   # the torch reference above needs no Triton
    triton = None

if triton is not None:
    @triton.jit
    def _gated_delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr,
                                 HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                                 DV: tl.constexpr, DK_P2: tl.constexpr, BV: tl.constexpr):
        bi = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        hk = h // (HV // HK)
        dk = tl.arange(0, DK_P2)
        kmask = dk < DK
        dv = vb * BV + tl.arange(0, BV)
        vmask = dv < DV
        q = tl.load(q_ptr + (bi * HK + hk) * DK + dk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (bi * HK + hk) * DK + dk, mask=kmask, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + (bi * HV + h) * DV + dv, mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + bi * HV + h).to(tl.float32)
        beta = tl.load(b_ptr + bi * HV + h).to(tl.float32)
        sp = s_ptr + (bi * HV + h) * DK * DV + dk[:, None] * DV + dv[None, :]
        smask = kmask[:, None] & vmask[None, :]
        s = tl.load(sp, mask=smask, other=0.0) * tl.exp(g)
        pred = tl.sum(s * k[:, None], axis=0)
        s = s + k[:, None] * ((v - pred) * beta)[None, :]
        tl.store(sp, s, mask=smask)
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + (bi * HV + h) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=vmask)


def gated_delta_step_triton(q, k, v, g, beta, state: torch.Tensor, block_v: int = 32) -> torch.Tensor:
    """Same contract as gated_delta_step (state fp32 contiguous, updated in place)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert state.dtype == torch.float32 and state.is_contiguous()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    bv = min(block_v, triton.next_power_of_2(dv))
    _gated_delta_step_kernel[(b, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, state, out, HK=hk, HV=hv, DK=dk, DV=dv,
        DK_P2=triton.next_power_of_2(dk), BV=bv)
    return out

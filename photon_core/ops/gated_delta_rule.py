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
Triton kernels (below the references): gated_delta_step_triton and gated_delta_chunked_triton.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .unit_lower_solve import unit_lower_solve_reference, unit_lower_solve_triton


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates from the projections a, b [..., Hv]: log decay
    g = -exp(A_log) * softplus(a + dt_bias) (fp32) and beta = sigmoid(b) (b's dtype)."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


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


# gated_delta_chunked(fast=True): its chunk, and FAST = False makes it the reference form (the
# A/B baseline of bench/ab_encode.py). FAST_SCAN (on since session 16): on CUDA the loop over
# chunks as the Triton scan kernel (_gdr_chunk_scan_kernel, TF32 dots for 16-bit inputs) at
# SCAN_CHUNK tokens per chunk - one launch per layer instead of ~8 per chunk (session 16 call
# 1, Qwen 3.5 0.8B's 640x480 encode: replay 15.74-16.05 -> 13.67-14.42 ms, kernels 14.17 ->
# 13.07 ms, launches 2971 -> 2305, the state's error vs fp32 as the torch loop's)
FAST_CHUNK = 128
FAST = True
FAST_SCAN = True
SCAN_CHUNK = 64
# value columns per program of the scan kernel (grid: B Hv x Dv / SCAN_BLOCK_V; Qwen 3.5 0.8B:
# 16 heads x 4 = 64 programs at 32); 16 (128 programs) was slower on the H200: 1.096 vs 1.040
# ms per encode (session 18 call 6)
SCAN_BLOCK_V = 32
# SCAN_TWO_PASS (session 19): the scan as two launches - the states pass (chunks in order,
# 2 of the 5 dots) and the outputs pass (every chunk at once, SCAN_OUT_BLOCK_V value columns
# per program); see _gdr_chunk_states_kernel. Qwen 3.5 0.8B's 640x480 encode on the H200
# (session 19 call 7, same process): graph replay 5.51-5.55 -> 5.26-5.28 ms with 32 output
# columns per program (the scan 1.044 ms -> 0.375 + 0.363), 5.53 -> 5.16 ms with 64 (the
# outputs pass 0.275 ms); the state bitwise the same as the one-pass kernel's
SCAN_TWO_PASS = True
SCAN_OUT_BLOCK_V = 64
# FAST_PREP (session 16; on since session 17 call 1): with the scan kernel, what feeds it -
# q / k / v's fp32 transposed copies, the l2 norms, the gates' cumsum, the decays, the chunk
# matrices and the solve's right-hand sides (~1 ms in ~250 launches of the eager 0.8B encode,
# session 16 call 3) - as ONE launch per layer (_gdr_fast_prep_kernel) before the solve
# (Qwen 3.5 0.8B's 640x480 encode graph replay 9.60 -> 7.51-7.58 ms, launches 2071 -> 1261)
FAST_PREP = True
# FAST_SOLVE (session 18): the prep's unit lower-triangular systems solved by the Triton kernel
# of ops/unit_lower_solve.py (blocked substitution, a program per system and 64 columns)
# instead of torch.linalg.solve_triangular (cuBLAS's batched trsm and its copies): Qwen 3.5
# 0.8B's 640x480 encode on the H200 (session 18 calls 3-6), graph replay 6.63-6.67 -> 5.82-5.83
# ms (call 6, u and w written apart: no copies), the solve 0.669 ms (+ ~0.15 ms of copies) ->
# 0.244 ms per encode; the state's error vs fp32 k / v / conv / recurrent 0.056 / 0.054 /
# 0.063 / 0.058 -> 0.048 / 0.048 / 0.059 / 0.064
FAST_SOLVE = True
# FAST_GATES (session 18): with FAST_PREP, the prep kernel makes the gates from the raw
# projections (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b): delta_gates' math,
# the decode kernels' _raw_delta_gates) instead of ~8 torch launches per layer before it
# (gated_delta_chunked(raw_gates=...)): Qwen 3.5 0.8B's 640x480 encode on the H200 (session 18
# call 7) graph replay 5.81-5.88 -> 5.57-5.58 ms, launches 1081 -> 937; the state's error vs
# fp32 k / v / conv / recurrent 0.048 / 0.048 / 0.059 / 0.064 -> 0.050 / 0.049 / 0.069 / 0.068
# (the bf16 reference form's 0.047 / 0.047 / 0.062 / 0.054; softplus as log(1 + e^x) in fp32,
# where torch takes log1p)
FAST_GATES = True


def _scan_on_device(v: torch.Tensor) -> bool:
    """The fast form's loop as the Triton scan kernel (CUDA; tests force it in the interpreter)."""
    return FAST_SCAN and v.is_cuda and triton is not None


@contextlib.contextmanager
def tf32_matmuls(on: bool = True):
    """fp32 matmuls on TF32 tensor cores inside when on (CUDA; read when a matmul is issued,
    so a CUDA graph captured inside keeps them); the process's setting restored after. The
    flag is torch's, process-wide: another thread's CUDA fp32 matmuls issued meanwhile get
    TF32 too (the engine captures its encode graphs on one thread)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on or prev
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def gated_delta_chunked(q, k, v, g, beta, state: torch.Tensor | None = None, chunk: int = 64,
                        fast: bool = False, raw_gates=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of gated_delta_scan (same arguments and results). fast: the encode's
    form (close, not bitwise): chunks of FAST_CHUNK tokens, one triangular solve for both
    right-hand sides and, for bf16 / fp16 inputs on CUDA, the fp32 matmuls on TF32 tensor
    cores (10-bit mantissas: finer than the inputs' own; the per-chunk products 23.4 -> 10.9
    us per layer on the H200, docs/benchmarks.md session 15 - the two fp32 FFMA GEMMs of the
    encode's profile then blamed on this rule were the vision attention's, session 16); with
    FAST_SCAN (the default) on CUDA the loop over chunks is the Triton scan kernel.
    raw_gates (A_log, dt_bias): g / beta are the raw projections a / b (delta_gates' inputs);
    the scan form's prep kernel makes the gates itself (FAST_GATES), the others first."""
    if fast and FAST:
        scan = _scan_on_device(v)
        with tf32_matmuls(v.dtype != torch.float32):
            return _chunked(q, k, v, g, beta, state, SCAN_CHUNK if scan else FAST_CHUNK, True,
                            scan=scan, raw_gates=raw_gates)
    return _chunked(q, k, v, g, beta, state, chunk, False, raw_gates=raw_gates)


def _chunked(q, k, v, g, beta, state, chunk: int, one_solve: bool, scan: bool = False,
             raw_gates=None):
    """scan: the loop over chunks through _gdr_chunk_scan_kernel (TF32 dots for 16-bit
    inputs, exact fp32 otherwise), fed the u, w and cum computed here (FAST_PREP: by
    _gdr_fast_prep_kernel and the solve). raw_gates: as gated_delta_chunked's."""
    if raw_gates is not None and not (scan and FAST_PREP and FAST_GATES):
        g, beta = delta_gates(g, beta, *raw_gates)
        raw_gates = None
    if scan and FAST_PREP:
        return _prepped_scan(q, k, v, g, beta, state, chunk, raw_gates=raw_gates)
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
    if one_solve:
        uw = torch.linalg.solve_triangular(a, torch.cat([vb, kb * cum.exp()[..., None]], -1),
                                           upper=False, unitriangular=True)
        u, w = uw[..., :dv], uw[..., dv:]
    else:
        u = torch.linalg.solve_triangular(a, vb, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(a, kb * cum.exp()[..., None], upper=False,
                                          unitriangular=True)
    if scan:
        return _scan_from(q, k, v, u, w, cum, state, s, chunk)
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


def _scan_from(q, k, v, u, w, cum, state, s, chunk: int, precision: str | None = None,
               block_v: int | None = None):
    """The scan kernel over the chunks' u / w [B, H, N, C, D] and cum [B, H, N, C] from the
    fp32 state s (a copy of `state`, which stays as given) -> (o [B, T, Hv, Dv], s).
    precision None: TF32 dots for 16-bit inputs, exact fp32 for fp32 ones."""
    b, h, n = u.shape[:3]
    dv, dk = u.shape[-1], w.shape[-1]
    # compact [B, T, Hv, Dv] (v may be a view of the conv's column-major output: an
    # empty_like would copy its strides, and the kernel writes rows in order)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if state is not None:       # (the kernel updates s in place; state stays as given)
        s = s.clone(memory_format=torch.contiguous_format)
    # (the kernel takes unit-stride rows: u / w are column slices of the solve's result,
    # whose reshape may stay a view with the rows 2 Dv apart)
    _chunk_scan(q.contiguous(), k.contiguous(),
                u.reshape(b * h, n * chunk, dv).contiguous(),
                w.reshape(b * h, n * chunk, dk).contiguous(),
                cum.reshape(b * h, n * chunk).contiguous(), s, o, chunk,
                precision or _precision(v), block_v or SCAN_BLOCK_V)
    return o, s


def _precision(v: torch.Tensor) -> str:
    return "ieee" if v.dtype == torch.float32 else "tf32"


def _prepped_scan(q, k, v, g, beta, state, chunk: int, precision: str | None = None,
                  block_v: int | None = None, raw_gates=None):
    """The scan form fed by _gdr_fast_prep_kernel: per (chunk, value head) the l2-normed
    keys, the gates' cumsum (raw_gates: the gates themselves), the unit lower-triangular chunk
    matrix I + A and the right-hand sides [beta v | beta k e^cum] in one launch; then the one
    solve (FAST_SOLVE: ops/unit_lower_solve.py's kernel, else torch's) and the scan kernel
    (gated_delta_chunked_triton, and the fast form with FAST_PREP)."""
    b, t, hv, dv = v.shape
    dk = k.shape[-1]
    n = triton.cdiv(t, chunk)
    a, rhs, cum = _fast_prep(k, v, g, beta, chunk, precision or _precision(v), raw_gates)
    if FAST_SOLVE:          # u and w written apart, contiguous (no copies in _scan_from)
        u, w = unit_lower_solve_triton(a, rhs, split=dv)
    else:
        uw = unit_lower_solve_reference(a, rhs)
        u, w = uw[..., :dv], uw[..., dv:]
    s = _new_state(v.transpose(1, 2), dk, state)
    shape = (b, hv, n, chunk)
    return _scan_from(q, k, v, u.reshape(*shape, dv), w.reshape(*shape, dk),
                      cum.reshape(shape), state, s, chunk, precision, block_v)


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
    # the one-token math shared by the step kernel and the rows kernel
    @triton.jit
    def _unit_qk(q, k, DK: tl.constexpr):
        """q, k L2-normalised (eps 1e-6), q scaled by DK^-0.5."""
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        return q, k

    @triton.jit
    def _raw_delta_gates(x, a_log, b, b_ptr):
        """delta_gates: x = a + dt_bias -> g = -exp(A_log) softplus(x); beta = sigmoid(b),
        rounded to b's dtype (b_ptr's element type)."""
        sp_x = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(a_log) * sp_x
        beta = 1.0 / (1.0 + tl.exp(-b))
        return g, beta.to(b_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _delta_update(s, k, v, g, beta):
        """S' = exp(g) S + k ((v - k^T exp(g) S) beta)^T over a [DK, BV] tile of S."""
        s = s * tl.exp(g)
        pred = tl.sum(s * k[:, None], axis=0)
        return s + k[:, None] * ((v - pred) * beta)[None, :]

if triton is not None:
    @triton.jit
    def _gated_delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, alog_ptr,
                                 dtb_ptr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                                 DV: tl.constexpr, DK_P2: tl.constexpr, BV: tl.constexpr,
                                 RAW_GATES: tl.constexpr):
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
        q, k = _unit_qk(q, k, DK)
        v = tl.load(v_ptr + (bi * HV + h) * DV + dv, mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + bi * HV + h).to(tl.float32)
        beta = tl.load(b_ptr + bi * HV + h).to(tl.float32)
        if RAW_GATES:   # g_ptr / b_ptr hold the projections a / b: the gates of delta_gates
            g, beta = _raw_delta_gates(g + tl.load(dtb_ptr + h).to(tl.float32),
                                       tl.load(alog_ptr + h).to(tl.float32), beta, b_ptr)
        sp = s_ptr + (bi * HV + h) * DK * DV + dk[:, None] * DV + dv[None, :]
        smask = kmask[:, None] & vmask[None, :]
        s = _delta_update(tl.load(sp, mask=smask, other=0.0), k, v, g, beta)
        tl.store(sp, s, mask=smask)
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + (bi * HV + h) * DV + dv, o.to(o_ptr.dtype.element_ty), mask=vmask)


def gated_delta_step_triton(q, k, v, g, beta, state: torch.Tensor, block_v: int = 32,
                            a_log: torch.Tensor | None = None,
                            dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as gated_delta_step (state fp32 contiguous, updated in place). With a_log
    and dt_bias [Hv] given, g and beta are the raw projections a and b and the kernel applies
    delta_gates itself (saves the half-dozen tiny launches of the gate math)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert state.dtype == torch.float32 and state.is_contiguous()
    raw = a_log is not None
    if raw != (dt_bias is not None) or (raw and (a_log.shape != (hv,) or dt_bias.shape != (hv,))):
        raise ValueError(f"a_log and dt_bias go together, each [{hv}]")
    if g.shape != (b, hv) or beta.shape != (b, hv):
        raise ValueError(f"g / beta must be [{b}, {hv}]")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    bv = min(block_v, triton.next_power_of_2(dv))
    _gated_delta_step_kernel[(b, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, state, out, a_log if raw else g, dt_bias if raw else g, HK=hk, HV=hv,
        DK=dk, DV=dv, DK_P2=triton.next_power_of_2(dk), BV=bv, RAW_GATES=raw)
    return out


# -- Triton: the one-token step over a decode bucket's rows -------------------------------------
# grid (b, Hv, cdiv(Dv, BV)): as the one-token step with the gates in the kernel, for rows
# 0 .. b-1 of the runtime's state cache: q | k | v read straight from the conv output row
# (qkv [b, 2 Hk Dk + Hv Dv], any row stride), the raw projections b_in / a_in [b, Hv] (any row
# stride), row r's fp32 state in slot r of [rows, Hv, Dk, Dv], the output into a strided
# [b, Hv Dv] view. Every row's output is computed; the new state is stored only where
# active[r] (inactive rows keep theirs: no clone of the state).
if triton is not None:
    @triton.jit
    def _gated_delta_rows_kernel(qkv_ptr, b_ptr, a_ptr, s_ptr, o_ptr, alog_ptr, dtb_ptr,
                                 act_ptr, s_qkv, s_b, s_a, s_o, s_s,
                                 HAS_ACTIVE: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
                                 DK: tl.constexpr, DV: tl.constexpr, DK_P2: tl.constexpr,
                                 BV: tl.constexpr):
        bi = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        hk = h // (HV // HK)
        dk = tl.arange(0, DK_P2)
        kmask = dk < DK
        dv = vb * BV + tl.arange(0, BV)
        vmask = dv < DV
        row = qkv_ptr + bi * s_qkv
        q = tl.load(row + hk * DK + dk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(row + (HK + hk) * DK + dk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * HK * DK + h * DV + dv, mask=vmask, other=0.0).to(tl.float32)
        q, k = _unit_qk(q, k, DK)
        # the gates of delta_gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
        g, beta = _raw_delta_gates(
            tl.load(a_ptr + bi * s_a + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32),
            tl.load(alog_ptr + h).to(tl.float32),
            tl.load(b_ptr + bi * s_b + h).to(tl.float32), b_ptr)
        sp = s_ptr + bi * s_s + h * DK * DV + dk[:, None] * DV + dv[None, :]
        smask = kmask[:, None] & vmask[None, :]
        s = _delta_update(tl.load(sp, mask=smask, other=0.0), k, v, g, beta)
        go = 1
        if HAS_ACTIVE:
            go = tl.load(act_ptr + bi)
        if go != 0:
            tl.store(sp, s, mask=smask)
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + bi * s_o + h * DV + dv, o.to(o_ptr.dtype.element_ty), mask=vmask)


def check_rows_state(state: torch.Tensor, active: torch.Tensor | None, b: int,
                     dims: tuple[int, int, int, int]) -> None:
    """The rows kernels' delta state [>= b, Hv, Dk, Dv] fp32 (inner dims contiguous) and
    active [b] bool (or None), else a ValueError."""
    _, hv, dk, dv = dims
    if state.dtype != torch.float32 or state.shape[0] < b or state.shape[1:] != (hv, dk, dv) \
            or state[0].stride() != (dk * dv, dv, 1):
        raise ValueError(f"state must be fp32 [>={b}, {hv}, {dk}, {dv}], inner dims contiguous")
    if active is not None and (active.shape != (b,) or active.dtype != torch.bool):
        raise ValueError(f"active must be a [{b}] bool tensor")


def gated_delta_rows_triton(qkv: torch.Tensor, b_in: torch.Tensor, a_in: torch.Tensor,
                            a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                            dims: tuple[int, int, int, int], active: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, block_v: int | None = None
                            ) -> torch.Tensor:
    """A decode step over rows 0 .. b-1 (the runtime's form of gated_delta_net.delta_rule_rows):
    qkv [b, 2 Hk Dk + Hv Dv] (after the conv), b_in / a_in [b, Hv] (raw projections), a_log /
    dt_bias [Hv], state [>= b, Hv, Dk, Dv] fp32 (row r in slot r, inner dims contiguous;
    updated in place for the active rows), dims (Hk, Hv, Dk, Dv), active [b] bool or None (all),
    out [b, Hv Dv] (new when None; unit last stride) -> out in qkv's dtype. block_v None: 32
    value columns per program, 16 when that gives fewer than ~128 programs (batch 1: the
    state is read and written once, so the step wants enough programs to fill the GPU)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    hk, hv, dk, dv = dims
    b = qkv.shape[0]
    if qkv.shape != (b, 2 * hk * dk + hv * dv) or b_in.shape != (b, hv) or \
            a_in.shape != (b, hv) or hv % hk or a_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"gated_delta_rows_triton: shapes qkv {tuple(qkv.shape)}, b_in "
                         f"{tuple(b_in.shape)}, a_in {tuple(a_in.shape)} do not fit {dims}")
    check_rows_state(state, active, b, dims)
    qkv, b_in, a_in = (t if t.stride(-1) == 1 else t.contiguous() for t in (qkv, b_in, a_in))
    if out is None:
        out = torch.empty(b, hv * dv, dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (b, hv * dv) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{b}, {hv * dv}] with unit last stride")
    if block_v is None:
        block_v = 32 if b * hv * triton.cdiv(dv, 32) >= 128 else 16
    bv = min(block_v, triton.next_power_of_2(dv))
    act = active.view(torch.uint8) if active is not None else qkv
    _gated_delta_rows_kernel[(b, hv, triton.cdiv(dv, bv))](
        qkv, b_in, a_in, state, out, a_log.contiguous(), dt_bias.contiguous(), act,
        qkv.stride(0), b_in.stride(0), a_in.stride(0), out.stride(0), state.stride(0),
        HAS_ACTIVE=active is not None, HK=hk, HV=hv, DK=dk, DV=dv,
        DK_P2=triton.next_power_of_2(dk), BV=bv)
    return out


# -- Triton: the chunked prefill ----------------------------------------------------------------
# Two kernels and a solve, the same algebra as gated_delta_chunked:
#  1. grid (chunks, B*Hv), every chunk at once (_gdr_fast_prep_kernel): normalise k,
#     cumulative log decay, I + A with the strictly lower A = (beta k k^T) * decay, and the
#     right-hand sides [beta v | beta k e^cum], stored fp32 with cum; then torch's batched
#     triangular solve gives u and w. (Until session 16 the kernel inverted I + A itself, row
#     by row in registers: 9 KB of spills on sm_90, the form session 11 measured 2.3x slower
#     than torch's.)
#  2. grid (B*Hv, Dv/BV), chunks in order: the [Dk, BV] fp32 state stays in registers;
#     v_new = u - w S, o = (q e^cum) S + causal(q k^T decay) v_new,
#     S = e^cum_last S + (k e^(cum_last - cum))^T v_new; the final state is stored.
#     With SCAN_TWO_PASS (the default since session 19) step 2 is two launches: the states
#     (chunks in order: v_new and S only, each chunk's starting S stored) and the outputs
#     (grid (B*Hv*chunks, Dv/BV): every chunk's o from its stored S at once).
# fp32 throughout; `precision` is tl.dot's input precision ("ieee" exact fp32, "tf32" faster).
if triton is not None:
    @triton.jit
    def _l2norm_rows(x):
        return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]

    @triton.jit
    def _chunk_rows(x_ptr, bi, t, hk, dk, mask, T, HK: tl.constexpr, DK: tl.constexpr):
        """One chunk's q or k rows (key head hk, tokens t) in fp32, l2-normed."""
        x = tl.load(x_ptr + ((bi * T + t[:, None]) * HK + hk) * DK + dk[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        return _l2norm_rows(x)

    @triton.jit
    def _chunk_output(q, k, cum, s, v_new, r, PREC: tl.constexpr):
        """A chunk's output from the state S it starts with: (q e^cum) S + causal(q k^T
        decay) v_new (q already scaled)."""
        causal = r[:, None] >= r[None, :]
        attn = tl.dot(q, tl.trans(k), input_precision=PREC)
        attn = tl.where(causal, attn * tl.exp(tl.where(causal, cum[:, None] - cum[None, :],
                                                       0.0)), 0.0)
        return tl.dot(q * tl.exp(cum)[:, None], s, input_precision=PREC) + \
            tl.dot(attn, v_new, input_precision=PREC)

    @triton.jit
    def _chunk_v_new(u_ptr, w_ptr, row0, r, dk, dv, kmask, vmask, s, DK: tl.constexpr,
                     DV: tl.constexpr, PREC: tl.constexpr):
        """A chunk's v_new = u - w S (u, w: the solve's rows of the chunk at row0)."""
        u = tl.load(u_ptr + (row0 + r[:, None]) * DV + dv[None, :], mask=vmask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + (row0 + r[:, None]) * DK + dk[None, :], mask=kmask[None, :],
                    other=0.0)
        return u - tl.dot(w, s, input_precision=PREC)

    @triton.jit
    def _chunk_carry(s, k, cum, v_new, r, C: tl.constexpr, PREC: tl.constexpr):
        """The state after a chunk: e^cum_last S + (k e^(cum_last - cum))^T v_new."""
        last = tl.sum(tl.where(r == C - 1, cum, 0.0), axis=0)
        k_dec = k * tl.exp(last - cum)[:, None]
        return s * tl.exp(last) + tl.dot(tl.trans(k_dec), v_new, input_precision=PREC)

    @triton.jit
    def _gdr_fast_prep_kernel(k_ptr, v_ptr, g_ptr, b_ptr, a_ptr, rhs_ptr, cum_ptr, T, TP,
                              sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h,
                              sb_b, sb_t, sb_h, alog_ptr, dtb_ptr, HK: tl.constexpr,
                              HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                              DK_P2: tl.constexpr, DV_P2: tl.constexpr, C: tl.constexpr,
                              PREC: tl.constexpr, RAW: tl.constexpr = False):
        """Program (chunk ci, batch x value head bh): I + A [C, C] (A[i, j] = beta_i k_i.k_j
        e^(cum_i - cum_j), j < i, keys l2-normed), the solve's right-hand sides [beta v |
        beta k e^cum] [C, DV + DK] and cum [C] (the gates' cumsum from the chunk's start),
        fp32; tokens past T: zeros (g = beta = 0), as the torch form's padding. RAW: g_ptr /
        b_ptr hold the raw projections a / b, the gates made here (delta_gates' math, with
        A_log / dt_bias [HV])."""
        ci = tl.program_id(0)
        bh = tl.program_id(1)
        bi = bh // HV
        h = bh % HV
        hk = h // (HV // HK)
        r = tl.arange(0, C)
        t = ci * C + r
        tm = t < T
        dk = tl.arange(0, DK_P2)
        dv = tl.arange(0, DV_P2)
        k = tl.load(k_ptr + bi * sk_b + t[:, None] * sk_t + hk * sk_h + dk[None, :],
                    mask=tm[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)
        k = _l2norm_rows(k)
        v = tl.load(v_ptr + bi * sv_b + t[:, None] * sv_t + h * sv_h + dv[None, :],
                    mask=tm[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + bi * sg_b + t * sg_t + h * sg_h, mask=tm, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + bi * sb_b + t * sb_t + h * sb_h, mask=tm,
                       other=0.0).to(tl.float32)
        if RAW:
            g, beta = _raw_delta_gates(g + tl.load(dtb_ptr + h).to(tl.float32),
                                       tl.load(alog_ptr + h).to(tl.float32), beta, b_ptr)
            g = tl.where(tm, g, 0.0)
            beta = tl.where(tm, beta, 0.0)
        cum = tl.cumsum(g, axis=0)
        lower = r[:, None] > r[None, :]
        kb = k * beta[:, None]
        a = tl.dot(kb, tl.trans(k), input_precision=PREC)
        a = tl.where(lower, a * tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)),
                     tl.where(r[:, None] == r[None, :], 1.0, 0.0))
        row0 = bh * TP + ci * C
        tl.store(a_ptr + (row0 + r[:, None]) * C + r[None, :], a)
        rp = rhs_ptr + (row0 + r[:, None]) * (DV + DK)
        tl.store(rp + dv[None, :], v * beta[:, None], mask=(dv < DV)[None, :])
        tl.store(rp + DV + dk[None, :], kb * tl.exp(cum)[:, None], mask=(dk < DK)[None, :])
        tl.store(cum_ptr + row0 + r, cum)

    @triton.jit
    def _gdr_chunk_scan_kernel(q_ptr, k_ptr, u_ptr, w_ptr, cum_ptr, s_ptr, o_ptr, T, TP, NC,
                               HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                               DV: tl.constexpr, DK_P2: tl.constexpr, BV: tl.constexpr,
                               C: tl.constexpr, PREC: tl.constexpr):
        bh = tl.program_id(0)
        vb = tl.program_id(1)
        bi = bh // HV
        h = bh % HV
        hk = h // (HV // HK)
        r = tl.arange(0, C)
        dk = tl.arange(0, DK_P2)
        kmask = dk < DK
        dv = vb * BV + tl.arange(0, BV)
        vmask = dv < DV
        sp = s_ptr + bh * DK * DV + dk[:, None] * DV + dv[None, :]
        smask = kmask[:, None] & vmask[None, :]
        s = tl.load(sp, mask=smask, other=0.0)
        scale = 1.0 / tl.sqrt(DK * 1.0)
        for ci in range(NC):
            t = ci * C + r
            tm = t < T
            qk_mask = tm[:, None] & kmask[None, :]
            q = _chunk_rows(q_ptr, bi, t, hk, dk, qk_mask, T, HK, DK) * scale
            k = _chunk_rows(k_ptr, bi, t, hk, dk, qk_mask, T, HK, DK)
            row0 = bh * TP + ci * C
            cum = tl.load(cum_ptr + row0 + r)
            v_new = _chunk_v_new(u_ptr, w_ptr, row0, r, dk, dv, kmask, vmask, s, DK, DV, PREC)
            o = _chunk_output(q, k, cum, s, v_new, r, PREC)
            tl.store(o_ptr + ((bi * T + t[:, None]) * HV + h) * DV + dv[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=tm[:, None] & vmask[None, :])
            s = _chunk_carry(s, k, cum, v_new, r, C, PREC)
        tl.store(sp, s, mask=smask)

    # SCAN_TWO_PASS: the scan in two launches. (1) states: per (head, value block), chunks in
    # order, only what carries the state - v_new = u - w S (stored), S = e^cum_last S +
    # (k e^(cum_last - cum))^T v_new - and each chunk's starting S stored; (2) outputs: a
    # program per (head, chunk, value block), all chunks at once: o = (q e^cum) S_chunk +
    # causal(q k^T decay) v_new. The same products in the same order per chunk as the one-pass
    # kernel; the sequential part does 2 of its 5 dots.
    @triton.jit
    def _gdr_chunk_states_kernel(k_ptr, u_ptr, w_ptr, cum_ptr, s_ptr, st_ptr, vn_ptr, T, TP,
                                 NC, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                                 DV: tl.constexpr, DK_P2: tl.constexpr, BV: tl.constexpr,
                                 C: tl.constexpr, PREC: tl.constexpr):
        bh = tl.program_id(0)
        vb = tl.program_id(1)
        bi = bh // HV
        hk = (bh % HV) // (HV // HK)
        r = tl.arange(0, C)
        dk = tl.arange(0, DK_P2)
        kmask = dk < DK
        dv = vb * BV + tl.arange(0, BV)
        vmask = dv < DV
        smask = kmask[:, None] & vmask[None, :]
        sp = s_ptr + bh * DK * DV + dk[:, None] * DV + dv[None, :]
        s = tl.load(sp, mask=smask, other=0.0)
        for ci in range(NC):
            tl.store(st_ptr + ((bh * NC + ci) * DK + dk[:, None]) * DV + dv[None, :], s,
                     mask=smask)
            t = ci * C + r
            k = _chunk_rows(k_ptr, bi, t, hk, dk, (t < T)[:, None] & kmask[None, :], T, HK, DK)
            row0 = bh * TP + ci * C
            cum = tl.load(cum_ptr + row0 + r)
            v_new = _chunk_v_new(u_ptr, w_ptr, row0, r, dk, dv, kmask, vmask, s, DK, DV, PREC)
            tl.store(vn_ptr + (row0 + r[:, None]) * DV + dv[None, :], v_new,
                     mask=vmask[None, :])
            s = _chunk_carry(s, k, cum, v_new, r, C, PREC)
        tl.store(sp, s, mask=smask)

    @triton.jit
    def _gdr_chunk_out_kernel(q_ptr, k_ptr, vn_ptr, cum_ptr, st_ptr, o_ptr, T, TP, NC,
                              HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                              DV: tl.constexpr, DK_P2: tl.constexpr, BV: tl.constexpr,
                              C: tl.constexpr, PREC: tl.constexpr):
        pid = tl.program_id(0)
        vb = tl.program_id(1)
        bh = pid // NC
        ci = pid % NC
        bi = bh // HV
        h = bh % HV
        hk = h // (HV // HK)
        r = tl.arange(0, C)
        dk = tl.arange(0, DK_P2)
        kmask = dk < DK
        dv = vb * BV + tl.arange(0, BV)
        vmask = dv < DV
        t = ci * C + r
        tm = t < T
        qk_mask = tm[:, None] & kmask[None, :]
        q = _chunk_rows(q_ptr, bi, t, hk, dk, qk_mask, T, HK, DK) * (1.0 / tl.sqrt(DK * 1.0))
        k = _chunk_rows(k_ptr, bi, t, hk, dk, qk_mask, T, HK, DK)
        row0 = bh * TP + ci * C
        cum = tl.load(cum_ptr + row0 + r)
        s = tl.load(st_ptr + ((bh * NC + ci) * DK + dk[:, None]) * DV + dv[None, :],
                    mask=kmask[:, None] & vmask[None, :], other=0.0)
        v_new = tl.load(vn_ptr + (row0 + r[:, None]) * DV + dv[None, :], mask=vmask[None, :],
                        other=0.0)
        o = _chunk_output(q, k, cum, s, v_new, r, PREC)
        tl.store(o_ptr + ((bi * T + t[:, None]) * HV + h) * DV + dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=tm[:, None] & vmask[None, :])


def gated_delta_chunked_triton(q, k, v, g, beta, state: torch.Tensor | None = None,
                               chunk: int = 64, block_v: int = 32, precision: str = "ieee"
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as gated_delta_chunked: -> (o [B, T, Hv, Dv] in v's dtype, final state
    [B, Hv, Dk, Dv] fp32, a new tensor; `state` is not modified). _prepped_scan with its dots
    at `precision` (since session 16; on the H200 in session 17: test_real_sizes_on_gpu)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != (b, t) or g.shape != (b, t, hv) or \
            beta.shape != (b, t, hv) or hv % hk or chunk < 16 or chunk & (chunk - 1):
        raise ValueError("gated_delta_chunked_triton: shapes do not fit (or chunk is not a "
                         "power of two >= 16)")
    if t == 0:
        return torch.empty_like(v), _new_state(v.transpose(1, 2), dk, state).clone()
    return _prepped_scan(q, k, v, g, beta, state, chunk, precision, block_v)


def _fast_prep(k, v, g, beta, chunk: int, precision: str, raw_gates=None):
    """_gdr_fast_prep_kernel over k [B, T, Hk, Dk], v [B, T, Hv, Dv] (unit last stride),
    g / beta [B, T, Hv] -> (I + A [B Hv, N, C, C], right-hand sides [B Hv, N, C, Dv + Dk],
    cum [B Hv, N C]), fp32, N = cdiv(T, C). raw_gates (A_log, dt_bias): g / beta are the raw
    projections a / b and the kernel makes the gates (delta_gates)."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    n = triton.cdiv(t, chunk)
    dev = v.device
    a = torch.empty(b * hv, n, chunk, chunk, dtype=torch.float32, device=dev)
    rhs = torch.empty(b * hv, n, chunk, dv + dk, dtype=torch.float32, device=dev)
    cum = torch.empty(b * hv, n * chunk, dtype=torch.float32, device=dev)
    _gdr_fast_prep_kernel[(n, b * hv)](
        k, v, g, beta, a, rhs, cum, t, n * chunk, *k.stride()[:3], *v.stride()[:3],
        *g.stride(), *beta.stride(), *(raw_gates or (g, g)), HK=hk, HV=hv, DK=dk, DV=dv,
        DK_P2=max(16, triton.next_power_of_2(dk)), DV_P2=max(16, triton.next_power_of_2(dv)),
        C=chunk, PREC=precision, RAW=raw_gates is not None, num_warps=8)
    return a, rhs, cum


def _chunk_scan(q, k, u, w, cum, s, o, chunk: int, precision: str, block_v: int = 32) -> None:
    """_gdr_chunk_scan_kernel over q, k [B, T, Hk, Dk] (contiguous), u / w [B Hv, TP, Dv / Dk]
    and cum [B Hv, TP] fp32 (TP = the chunks' padded length), the fp32 state s [B, Hv, Dk,
    Dv] (updated in place) -> o [B, T, Hv, Dv]."""
    b, t, hk, dk = q.shape
    hv, dv = o.shape[2], o.shape[3]
    tp = u.shape[1]
    nc = tp // chunk
    dk_p2 = max(16, triton.next_power_of_2(dk))
    bv = max(16, min(block_v, triton.next_power_of_2(dv)))
    if SCAN_TWO_PASS:
        st = torch.empty(b * hv, nc, dk, dv, dtype=torch.float32, device=o.device)
        vn = torch.empty(b * hv, tp, dv, dtype=torch.float32, device=o.device)
        _gdr_chunk_states_kernel[(b * hv, triton.cdiv(dv, bv))](
            k, u, w, cum, s, st, vn, t, tp, nc, HK=hk, HV=hv, DK=dk, DV=dv, DK_P2=dk_p2,
            BV=bv, C=chunk, PREC=precision, num_warps=8,
            num_stages=chunk_states_stages(chunk, dk_p2, bv, k.element_size()))
        bo = max(16, min(SCAN_OUT_BLOCK_V, triton.next_power_of_2(dv)))
        _gdr_chunk_out_kernel[(b * hv * nc, triton.cdiv(dv, bo))](
            q, k, vn, cum, st, o, t, tp, nc, HK=hk, HV=hv, DK=dk, DV=dv, DK_P2=dk_p2, BV=bo,
            C=chunk, PREC=precision, num_warps=8)
        return
    _gdr_chunk_scan_kernel[(b * hv, triton.cdiv(dv, bv))](
        q, k, u, w, cum, s, o, t, tp, nc, HK=hk, HV=hv, DK=dk, DV=dv, DK_P2=dk_p2,
        BV=bv, C=chunk, PREC=precision, num_warps=8,
        num_stages=chunk_scan_stages(chunk, dk_p2, bv, q.element_size()))


# a block's shared memory on sm_90 is 227 KB (232,448 bytes); the estimate below is within a
# few KB of what Triton asks for, so the budget leaves ~10 KB for version-to-version drift
CHUNK_SCAN_SMEM_BUDGET = 216 * 1024


def chunk_states_stages(chunk: int, dk_p2: int, bv: int, elem: int) -> int:
    """num_stages of `_gdr_chunk_states_kernel` (SCAN_TWO_PASS): per stage one chunk's k (input
    dtype), w (fp32 [C, Dk]), u (fp32 [C, BV]) and cum, on ~2 [C, Dk] fp32 tiles of scratch;
    the most stages (<= 3) within CHUNK_SCAN_SMEM_BUDGET."""
    return _stages_within(2 * chunk * dk_p2 * 4,
                          chunk * dk_p2 * (elem + 4) + chunk * bv * 4 + chunk * 4)


def chunk_scan_stages(chunk: int, dk_p2: int, bv: int, elem: int) -> int:
    """num_stages of `_gdr_chunk_scan_kernel`: its loop over chunks is software-pipelined, each
    stage beyond the first buffers one chunk's q, k (input dtype, `elem` bytes), w (fp32
    [C, Dk]), u (fp32 [C, BV]) and cum in shared memory, on top of ~3 [C, Dk] fp32 tiles of
    dot scratch. At Qwen 3.5's sizes (C 64, Dk 128, BV 32) fp32 inputs asked 296,960 bytes with
    3 stages (over the H200's limit; 189,440 with 2) and 16-bit inputs 231,424 (1 KB under
    it; 156,672 with 2): the most stages whose estimate fits CHUNK_SCAN_SMEM_BUDGET (checked
    by compiling for sm_90 on the CPU: bench/compile_sm90.py, test_sm90_resources.py)."""
    return _stages_within(3 * chunk * dk_p2 * 4,
                          chunk * dk_p2 * (2 * elem + 4) + chunk * bv * 4 + chunk * 4)


def _stages_within(base: int, per_stage: int) -> int:
    """The most software-pipelining stages (3, 2 or 1) whose shared-memory estimate - `base`
    bytes of scratch plus `per_stage` for each stage beyond the first - fits
    CHUNK_SCAN_SMEM_BUDGET."""
    for stages in (3, 2):
        if base + (stages - 1) * per_stage <= CHUNK_SCAN_SMEM_BUDGET:
            return stages
    return 1

"""The batched decode step of the fast path, as graph-capturable pieces over GPU-resident state.

Every row (batch slot) keeps on the device: its last hidden state, its next position, its
phase (0 text, 1 x, 2 y, 3 size), whether it is a detect row, whether its next text pick is
its first (no answer-marker mask), its sampling settings, and whether it takes part in the
current step (`active`). One step of a row is

    sample:  values from the current hidden state (the heads its phase needs)
             text -> token (lm head; answer marker masked after the first pick)
             x    -> continue/stop token (lm head) + coordinate (coord head)
             y    -> coordinate (coord head);  size -> (w, h) (size head)
    forward: embed the value just sampled (token / coordinate / size, chosen by phase, ON THE
             GPU: GPU-resident feedback), run the decoder at the row's position, store the new
             hidden state, advance position and phase (active rows only).

The sampled values land in `out` [rows, 4] int64 (token, coord bin, width bin, height bin),
which the pipelined decoder stages to the host. The host never feeds a value back.

The math mirrors photon_core.moondream (text.decoder, region, sampling) exactly; only the
batching (per-row positions and a key mask over the static cache) differs.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from ..models.moondream2 import region as mdregion
from ..models.moondream2.rope import rope_angles
from .static_kv_cache import StaticKVCache

PHASE_TEXT, PHASE_X, PHASE_Y, PHASE_SIZE = 0, 1, 2, 3
OUT_TOKEN, OUT_COORD, OUT_W, OUT_H = 0, 1, 2, 3


class StepState:
    """Preallocated device state for `rows` batch slots (written only by start() and steps)."""

    def __init__(self, model, rows: int, kv: StaticKVCache, options=None):
        from ..engine import EngineOptions
        options = options or EngineOptions()
        cfg, w = model.config, model.weights
        dev, dt = w.device, w.dtype
        self.options = options
        self.sdpa = use_sdpa(options.attention, dev)
        self.rows, self.kv = rows, kv
        self.cfg, self.w = cfg, w
        self.hidden = torch.zeros(rows, cfg.text.dim, device=dev, dtype=dt)
        self.pos = torch.zeros(rows, device=dev, dtype=torch.long)
        self.phase = torch.zeros(rows, device=dev, dtype=torch.long)
        self.is_detect = torch.zeros(rows, device=dev, dtype=torch.bool)
        self.first = torch.zeros(rows, device=dev, dtype=torch.bool)
        self.active = torch.zeros(rows, device=dev, dtype=torch.bool)
        self.temperature = torch.zeros(rows, device=dev, dtype=torch.float32)
        self.top_p = torch.ones(rows, device=dev, dtype=torch.float32)
        self.seed = torch.zeros(rows, device=dev, dtype=torch.long)    # sampling rows' seeds
        self.drawn = torch.zeros(rows, device=dev, dtype=torch.long)
        self.out = torch.zeros(rows, 4, device=dev, dtype=torch.long)
        self.row_ids = torch.arange(rows, device=dev)
        self.rope_perm = rope_perms(cfg.text.rot_dim, cfg.text.head_dim, dev)
        self.key_ids = torch.arange(kv.capacity, device=dev)
        cb = cfg.region.coord_out_dim
        sb = cfg.region.size_out_dim // 2
        # value tables: the exact floats the reference feeds back (python double -> dtype)
        self.coord_table = torch.tensor([mdregion.bin_to_coordinate(i, cb) for i in range(cb)],
                                        dtype=torch.float64).to(device=dev, dtype=dt)
        self.size_table = torch.tensor([mdregion.bin_to_size(i, sb) for i in range(sb)],
                                       dtype=torch.float64).to(device=dev, dtype=dt)
        self.generators: list = [None] * rows      # eager (CPU) seeded sampling, per row
        self.fused = None
        if use_fused(options.fused, dev, dt):
            from .fused_step import FusedDecoder
            self.fused = FusedDecoder(model, rows, kv, coord_table=self.coord_table,
                                      size_table=self.size_table,
                                      deterministic=options.deterministic)

    def set_row(self, row: int, hidden: torch.Tensor, pos: int, phase: int, is_detect: bool,
                temperature: float, top_p: float, generator=None,
                seed: int | None = None) -> None:
        """Called by start() after the prefill (device fills, no host sync)."""
        self.hidden[row].copy_(hidden)
        self.pos[row:row + 1].fill_(pos)
        self.phase[row:row + 1].fill_(phase)
        self.is_detect[row:row + 1].fill_(is_detect)
        self.first[row:row + 1].fill_(True)
        self.temperature[row:row + 1].fill_(temperature)
        self.top_p[row:row + 1].fill_(top_p)
        if seed is not None:
            self.seed[row:row + 1].fill_(seed)
        elif self.seed.is_cuda:      # unseeded: from the CUDA generator (torch.manual_seed
            self.seed[row:row + 1].random_(0, 2 ** 31)    # repeats it), no host sync
        # (on the CPU, sampling rows draw with their torch.Generator: the seed is unused)
        self.generators[row] = generator


def use_fused(fused: str, device, dtype) -> bool:
    """EngineOptions.fused: "auto" = the fused Triton decoder + lm head (fused_step.py) on CUDA
    for bf16/fp16 models when triton imports; the torch step elsewhere (the CPU, and fp32,
    where outputs must equal the reference path's bit for bit). "on" / "off" force it."""
    if fused == "off":
        return False
    from .kernels import HAVE_TRITON
    if fused == "on":
        return HAVE_TRITON
    return (HAVE_TRITON and torch.device(device).type == "cuda"
            and dtype in (torch.bfloat16, torch.float16))


# -- sample pieces ----------------------------------------------------------------------
def _lm_logits(st: StepState, b: int) -> torch.Tensor:
    w, tk = st.w, st.cfg.tokenizer
    if st.fused is not None:
        logits = st.fused.lm_logits(st.hidden[:b], b)
    else:
        logits = w.linear(w.layer_norm(st.hidden[:b], "text.post_ln"), "text.lm_head")
    # text rows after their first pick never pick the answer marker again (reference _pick)
    mask = (st.phase[:b] == PHASE_TEXT) & ~st.first[:b]
    col = logits[:, tk.answer_id]
    logits[:, tk.answer_id] = torch.where(mask, torch.full_like(col, float("-inf")), col)
    return logits


def lm_greedy(st: StepState, b: int) -> None:
    if st.fused is not None:
        st.fused.lm_greedy(st.hidden[:b], st.out, st.phase, st.first,
                           st.cfg.tokenizer.answer_id, b)
        return
    st.out[:b, OUT_TOKEN] = _lm_logits(st, b).argmax(dim=-1)


def _triton_on(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors (or anywhere under TRITON_INTERPRET=1, as in CI)."""
    from .kernels import HAVE_TRITON
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def lm_sample(st: StepState, b: int) -> None:
    """Temperature / top-p rows sample, the others take the argmax (graph-capturable; the
    GPU path's sampler: a row's draw depends only on its seed and position)."""
    logits = _lm_logits(st, b)
    greedy = logits.argmax(dim=-1)
    temp = st.temperature[:b]
    probs = torch.softmax(logits.float() / temp.clamp_min(1e-6)[:, None], dim=-1)
    sp, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sp, dim=-1) - sp
    top_p = st.top_p[:b, None]
    keep = (before <= top_p) | (top_p >= 1.0)
    sp = sp * keep
    sp = sp / sp.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(probs).scatter(-1, order, sp)
    if _triton_on(probs):  # seeded by the row's seed and position (kernels/seeded_sample.py)
        from .kernels.seeded_sample import seeded_sample
        drawn = seeded_sample(probs, st.seed[:b], st.pos[:b], st.drawn[:b])
    else:                  # the process's CUDA generator: a task's seed is not honoured
        drawn = torch.multinomial(probs, 1).squeeze(-1)
    st.out[:b, OUT_TOKEN] = torch.where(temp > 0, drawn, greedy)


def lm_sample_eager(st: StepState, b: int) -> None:
    """CPU path: each sampling row draws with its own seeded generator, exactly like the
    reference (photon_core.moondream.sampling.sample on that row's logits)."""
    from ..models.moondream2.sampling import sample

    logits = _lm_logits(st, b)
    toks = logits.argmax(dim=-1)
    temps = st.temperature[:b].tolist()
    tops = st.top_p[:b].tolist()
    for i in range(b):
        if temps[i] > 0:
            toks[i] = sample(logits[i], temps[i], tops[i], st.generators[i])
    st.out[:b, OUT_TOKEN] = toks


def coord(st: StepState, b: int) -> None:
    if st.fused is not None:
        st.fused.region_head("coord", st.hidden[:b], st.out, OUT_COORD, 1, b)
        return
    logits = st.w.mlp(st.hidden[:b], "region.coord_decoder")
    st.out[:b, OUT_COORD] = logits.argmax(dim=-1)


def size(st: StepState, b: int) -> None:
    if st.fused is not None:
        st.fused.region_head("size", st.hidden[:b], st.out, OUT_W, 2, b)
        return
    logits = st.w.mlp(st.hidden[:b], "region.size_decoder").view(b, 2, -1)
    st.out[:b, OUT_W:OUT_H + 1] = logits.argmax(dim=-1)


# -- forward piece ----------------------------------------------------------------------
def _fourier(v: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    f = 2 * math.pi * v @ freqs          # same association as region.fourier
    return torch.cat([f.cos(), f.sin()], dim=-1)


def feedback_embedding(st: StepState, b: int) -> torch.Tensor:
    """The next input embedding of each row, from what this step sampled (on the GPU)."""
    w = st.w
    out = st.out[:b]
    tok = F.embedding(out[:, OUT_TOKEN], w["text.wte"])
    c = st.coord_table[out[:, OUT_COORD]][:, None]
    c_emb = w.linear(_fourier(c, w["region.coord_features"]), "region.coord_encoder")
    s = st.size_table[out[:, OUT_W:OUT_H + 1]]
    s_emb = w.linear(_fourier(s, w["region.size_features"]), "region.size_encoder")
    phase = st.phase[:b, None]
    return torch.where(phase == PHASE_TEXT, tok,
                       torch.where(phase == PHASE_SIZE, s_emb, c_emb))


def rope_perms(rot_dim: int, head_dim: int, device=None) -> torch.Tensor:
    """[2, head_dim] source channels for rope(): output channel c (rotated pair j = c // 2,
    written interleaved like rope.apply_rope) is x[perm[0, c]] * C[c] + x[perm[1, c]] * S[c]:
    even c: re_j * cos_j + im_j * (-sin_j);  odd c: im_j * cos_j + re_j * sin_j
    (re_j = x[j], im_j = x[rot/2 + j]); pass-through channels: x[c] * 1 + x[c] * 0."""
    half = rot_dim // 2
    a = [c // 2 if c % 2 == 0 else half + c // 2 for c in range(rot_dim)]
    b = [half + c // 2 if c % 2 == 0 else c // 2 for c in range(rot_dim)]
    rest = list(range(rot_dim, head_dim))
    return torch.tensor([a + rest, b + rest], device=device)


def rope_tables(pos: torch.Tensor, rot_dim: int, head_dim: int):
    """Full-width fp32 tables for rope(): C = [cos_0, cos_0, cos_1, cos_1, .., 1..],
    S = [-sin_0, sin_0, -sin_1, sin_1, .., 0..] ([b, 1, 1, head_dim]), built once per step
    from rope.rope_angles."""
    cos, sin = rope_angles(pos, rot_dim)                      # [b, rot/2]
    b, half = cos.shape
    one = torch.ones(b, head_dim - 2 * half, device=pos.device)
    zero = torch.zeros_like(one)
    c = torch.cat([torch.stack([cos, cos], dim=-1).flatten(-2), one], dim=-1)
    s = torch.cat([torch.stack([-sin, sin], dim=-1).flatten(-2), zero], dim=-1)
    return c[:, None, None, :], s[:, None, None, :]


def rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """rope.apply_rope (same output channel order: rotated pairs interleaved) in a few
    kernels: x[perm[0]]*C + x[perm[1]]*S in fp32 (rope_perms, rope_tables). Same math:
    re*cos + im*(-sin), im*cos + re*sin; the pass-through channels get x*1 + x*0."""
    xf = x.float()
    return torch.addcmul(xf.index_select(-1, perm[0]) * c, xf.index_select(-1, perm[1]),
                         s).to(x.dtype)


def use_sdpa(attention: str, device) -> bool:
    """EngineOptions.attention: "sdpa" | "matmul" | "auto" (SDPA on CUDA, matmul on the CPU)."""
    return attention == "sdpa" or (attention == "auto" and torch.device(device).type == "cuda")


def attend(q, keys, values, mask, sdpa: bool) -> torch.Tensor:
    """One query per row against the static cache (mask: bool [b, 1, 1, L] for SDPA, else
    additive [b*nh, 1, L]). Measured (docs/benchmarks.md): on the H200, masked SDPA is ~5 %
    faster per step than matmul + softmax + matmul (2.33 vs 2.46 ms at batch 1); on the CPU
    masked SDPA is ~30x slower than the matmul form. "auto" picks per device."""
    b, nh, _, hd = q.shape
    if sdpa:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=keys.shape[1] != nh)
    length = keys.shape[2]
    k3 = keys.reshape(b * nh, length, hd)
    v3 = values.reshape(b * nh, length, hd)
    scores = torch.baddbmm(mask, q.reshape(b * nh, 1, hd), k3.transpose(1, 2),
                           alpha=hd ** -0.5)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, v3).view(b, nh, 1, hd)


def decoder_step(st: StepState, x: torch.Tensor, b: int, attn_len: int) -> torch.Tensor:
    """x [b, dim] at positions st.pos[:b] through all blocks; k/v into the static cache."""
    w, cfg, kv = st.w, st.cfg.text, st.kv
    hd, nh, nkv, dim = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.dim
    pos = st.pos[:b]
    rc, rs = rope_tables(pos, cfg.rot_dim, hd)
    rows = st.row_ids[:b]
    pos_w = pos.clamp(max=kv.capacity - 1)
    visible = st.key_ids[None, :attn_len] <= pos[:, None]                   # [b, L]
    sdpa = st.sdpa or nh != nkv
    if sdpa:
        mask = visible[:, None, None, :]
    else:
        mask = torch.zeros(b, attn_len, device=x.device, dtype=x.dtype).masked_fill(
            ~visible, float("-inf"))
        mask = mask[:, None, :].expand(b, nh, attn_len).reshape(b * nh, 1, attn_len)
    for i in range(cfg.n_layers):
        p = f"text.blocks.{i}"
        h = w.layer_norm(x, p + ".ln")
        qkv = w.linear(h, p + ".attn.qkv")
        # rotate q and k in one pass (elementwise: the same values as rotating each)
        qk = rope(qkv[:, :(nh + nkv) * hd].view(b, nh + nkv, 1, hd), rc, rs, st.rope_perm)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, (nh + nkv) * hd:]
        kv.write_step(i, rows, pos_w, k[:, :, 0], v.view(b, nkv, hd))
        keys, values = kv.keys_values(i, b, attn_len)
        a = attend(q, keys, values, mask, sdpa)
        a = w.linear(a.reshape(b, dim), p + ".attn.proj")
        x = x + a + w.mlp(h, p + ".mlp")
    return x


def forward(st: StepState, b: int, attn_len: int | None = None) -> None:
    """Feed the sampled values back and advance every active row by one position."""
    attn_len = attn_len or st.kv.capacity
    if st.fused is not None:       # the same, in fused kernels (fused_step.py)
        st.fused.feed(st.out, st.phase, b)
        st.fused.decoder(None, st.pos[:b], b)
        st.fused.advance(st, b)
        return
    x = feedback_embedding(st, b)
    hidden = decoder_step(st, x, b, attn_len)
    act = st.active[:b]
    st.hidden[:b] = torch.where(act[:, None], hidden, st.hidden[:b])
    st.pos[:b] += act.long()
    ph = st.phase[:b]
    nxt = torch.where(ph == PHASE_X, PHASE_Y,
                      torch.where(ph == PHASE_Y,
                                  torch.where(st.is_detect[:b], PHASE_SIZE, PHASE_X),
                                  torch.where(ph == PHASE_SIZE, PHASE_X, ph)))
    st.phase[:b] = torch.where(act, nxt, ph)
    st.first[:b] &= ~act

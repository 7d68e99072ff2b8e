"""GPU-resident feedback in one launch: each row's next input embedding from the values the
step just sampled, chosen by the row's phase (decode_step.feedback_embedding in torch is ~20
kernels that compute all three candidates and pick one; here each row computes only its own).

grid (rows, dim / BLOCK_D); per row, read `out` [rows, 4] (token, coordinate bin, width bin,
height bin) and `phase` (the phase numbers are the family's, FeedbackWeights.token_phase /
size_phase; Moondream 2's: text 0, x 1, y 2, size 3):
  token phase:  wte[token]
  size phase:   size_encoder(fourier([size_table[w], size_table[h]]))   size_features [2, SF]
  any other:    coord_encoder(fourier(coord_table[bin]))       coord_features [1, CF]
fourier(v) = [cos(2 pi v @ F), sin(2 pi v @ F)]: each intermediate (2 pi v, v @ F, cos, sin,
the encoder output) is rounded to the model dtype like the torch ops of the reference
(region.fourier, then a Linear), the dot products accumulate in fp32. The embedding is written
as fp32 into the fused decoder's residual stream x [rows, dim].

Torch reference (the eager backend's feedback): `feedback_embedding_reference`, which computes
all three candidates and picks by phase with `where`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .pdl import pdl_launch, pdl_launch_dependents, pdl_wait

TWO_PI = 6.283185307179586


@triton.jit
def _encode(v_w, v_h, feat_ptr, w_ptr, b_ptr, offs, dmask,
            NF: tl.constexpr, TWO_ROWS: tl.constexpr):
    """encoder(fourier(v)) for the output channels `offs` (fp32, rounded to the dtype)."""
    dt = w_ptr.dtype.element_ty
    j = tl.arange(0, NF)
    tw = (6.283185307179586 * v_w).to(dt).to(tl.float32)
    f = tw * tl.load(feat_ptr + j).to(tl.float32)
    if TWO_ROWS:
        th = (6.283185307179586 * v_h).to(dt).to(tl.float32)
        f = f + th * tl.load(feat_ptr + NF + j).to(tl.float32)
    f = f.to(dt).to(tl.float32)
    c = tl.cos(f).to(dt).to(tl.float32)
    s = tl.sin(f).to(dt).to(tl.float32)
    rows = w_ptr + offs[:, None].to(tl.int64) * (2 * NF) + j[None, :]
    wc = tl.load(rows, mask=dmask[:, None], other=0.0).to(tl.float32)
    ws = tl.load(rows + NF, mask=dmask[:, None], other=0.0).to(tl.float32)
    e = tl.sum(wc * c[None, :] + ws * s[None, :], axis=1)
    e = e + tl.load(b_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    return e.to(dt).to(tl.float32)


@triton.jit
def _feedback_kernel(out_ptr, phase_ptr, wte_ptr, ctab_ptr, stab_ptr,
                     cfeat_ptr, cw_ptr, cb_ptr, sfeat_ptr, sw_ptr, sb_ptr, x_ptr,
                     D, stride_x, CF: tl.constexpr, SF: tl.constexpr,
                     BLOCK_D: tl.constexpr, TOKEN_PHASE: tl.constexpr = 0,
                     SIZE_PHASE: tl.constexpr = 3, GDC: tl.constexpr = False):
    pdl_launch_dependents(GDC)
    pdl_wait(GDC)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs < D
    phase = tl.load(phase_ptr + row)
    if phase == TOKEN_PHASE:
        tok = tl.load(out_ptr + row * 4)
        e = tl.load(wte_ptr + tok * D + offs, mask=dmask, other=0.0).to(tl.float32)
    elif phase == SIZE_PHASE:
        vw = tl.load(stab_ptr + tl.load(out_ptr + row * 4 + 2)).to(tl.float32)
        vh = tl.load(stab_ptr + tl.load(out_ptr + row * 4 + 3)).to(tl.float32)
        e = _encode(vw, vh, sfeat_ptr, sw_ptr, sb_ptr, offs, dmask, SF, True)
    else:
        vc = tl.load(ctab_ptr + tl.load(out_ptr + row * 4 + 1)).to(tl.float32)
        e = _encode(vc, vc, cfeat_ptr, cw_ptr, cb_ptr, offs, dmask, CF, False)
    tl.store(x_ptr + row * stride_x + offs, e, mask=dmask)


DEFAULT_NAMES = {"wte": "text.wte", "coord_features": "region.coord_features",
                 "coord_encoder": "region.coord_encoder",
                 "size_features": "region.size_features",
                 "size_encoder": "region.size_encoder"}


class FeedbackWeights:
    """The tensors the kernel reads, contiguous, gathered once."""

    def __init__(self, w, coord_table: torch.Tensor, size_table: torch.Tensor,
                 names: dict | None = None, token_phase: int = 0, size_phase: int = 3):
        """w: the checkpoint's tensors by name; names: role -> tensor name prefix (wte,
        coord_features, coord_encoder, size_features, size_encoder), Moondream's by default;
        token_phase / size_phase: the phases feeding back a token / a size (the family's)."""
        n = dict(DEFAULT_NAMES, **(names or {}))
        self.token_phase, self.size_phase = token_phase, size_phase
        self.wte = w[n["wte"]].contiguous()
        self.coord_table, self.size_table = coord_table, size_table
        self.cfeat = w[n["coord_features"]].contiguous()
        self.cw = w[n["coord_encoder"] + ".weight"].contiguous()
        self.cb = w[n["coord_encoder"] + ".bias"].contiguous()
        self.sfeat = w[n["size_features"]].contiguous()
        self.sw = w[n["size_encoder"] + ".weight"].contiguous()
        self.sb = w[n["size_encoder"] + ".bias"].contiguous()
        assert self.cfeat.shape[0] == 1 and self.sfeat.shape[0] == 2
        self.cf, self.sf = self.cfeat.shape[1], self.sfeat.shape[1]
        assert self.cw.shape[1] == 2 * self.cf and self.sw.shape[1] == 2 * self.sf
        assert self.cf & (self.cf - 1) == 0 and self.sf & (self.sf - 1) == 0, "powers of two"


def feedback_embedding(fw: FeedbackWeights, out: torch.Tensor, phase: torch.Tensor,
                       x: torch.Tensor, block_d: int = 32, pdl: bool = False) -> torch.Tensor:
    """out [b, 4] int64, phase [b] int64 -> x [b, dim] (fp32) = each row's next embedding."""
    b, d = x.shape
    assert out.is_contiguous() and out.shape[1] == 4 and x.stride(1) == 1
    _, gdc, launch_kw = pdl_launch(pdl, x)
    _feedback_kernel[(b, triton.cdiv(d, block_d))](
        out, phase, fw.wte, fw.coord_table, fw.size_table, fw.cfeat, fw.cw, fw.cb, fw.sfeat,
        fw.sw, fw.sb, x, d, x.stride(0), CF=fw.cf, SF=fw.sf, BLOCK_D=block_d,
        TOKEN_PHASE=fw.token_phase, SIZE_PHASE=fw.size_phase, GDC=gdc, num_warps=4,
        **launch_kw)
    return x


# -- torch reference ----------------------------------------------------------------------
def _fourier(v: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    f = 2 * math.pi * v @ freqs          # same association as the reference's region.fourier
    return torch.cat([f.cos(), f.sin()], dim=-1)


def feedback_embedding_reference(fw: FeedbackWeights, out: torch.Tensor,
                                 phase: torch.Tensor) -> torch.Tensor:
    """out [b, 4] int64, phase [b] -> [b, dim] in the model dtype: by phase (fw.token_phase,
    fw.size_phase, else a coordinate) the token embedding or the encoder of the value sampled."""
    tok = F.embedding(out[:, 0], fw.wte)
    c = fw.coord_table[out[:, 1]][:, None]
    c_emb = F.linear(_fourier(c, fw.cfeat), fw.cw, fw.cb)
    s = fw.size_table[out[:, 2:4]]
    s_emb = F.linear(_fourier(s, fw.sfeat), fw.sw, fw.sb)
    ph = phase[:, None]
    return torch.where(ph == fw.token_phase, tok, torch.where(ph == fw.size_phase, s_emb, c_emb))


def token_embedding_reference(wte: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The feedback of a text-only family: the embedding of the token sampled (out[:, 0])."""
    return F.embedding(out[:, 0], wte)

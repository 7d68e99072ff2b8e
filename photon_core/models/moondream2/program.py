"""Moondream 2's decode step as a program for the runtime's backends (photon_core/fast/
program.py): written once here, run by the eager backend (the ops' torch references) and the
fused backend (the Triton kernels), for decode steps and prompt prefills alike.

Phi "parallel" block, per layer i (h = x + attn(ln(x)) + mlp(ln(x)), as text.py):
    h        = LayerNorm(x)                                  blocks.i.ln
    qkv, g   = h Wqkv^T + b,  gelu_tanh(h Wfc1^T + b)         blocks.i.attn.qkv, blocks.i.mlp.fc1
    a        = attention(qkv) over the layer's k/v           (partial rotary, state kv[i])
    x       += a Wproj^T + b  +  g Wfc2^T + b                 blocks.i.attn.proj, blocks.i.mlp.fc2
Buffers: h [dim]; u = [qkv | a | g] (so [a | g] is one K range: the fused backend streams
[Wproj, Wfc2] in one GEMV, and [Wqkv; Wfc1] in another). Heads (sampling, skill_protocol.py):
lm = post_ln + lm_head (answer-marker rule), coord = coord_decoder MLP, size = size_decoder
MLP (width | height halves). Feedback: by phase, the token embedding or the coord / size
encoder of the value sampled.
"""
from __future__ import annotations

import torch

from ...program import (AttentionSpec, Feedback, Head, LayerState, Program,
                             ProgramBuilder, StepSpec)
from . import region
from .config import MoondreamConfig, TextConfig
from .skill_protocol import FEEDBACK, NEXT_PHASE, OUT_COORD, OUT_TOKEN, OUT_W, PHASE_TEXT


def _mlp_head(name: str) -> tuple:
    b = ProgramBuilder()
    b.linear("hidden", ["head_h"], [f"region.{name}_decoder.fc1"], ["gelu_tanh"])
    b.linear("head_h", ["logits"], [f"region.{name}_decoder.fc2"])
    return b.build()


def decoder_ops(t: TextConfig) -> tuple:
    """The text decoder's blocks as ops: the one description of a Moondream 2 block (the
    reference text.decoder runs it too)."""
    b = ProgramBuilder()
    for i in range(t.n_layers):
        p = f"text.blocks.{i}"
        b.norm("x", "h", p + ".ln")
        b.linear("h", ["qkv", "g"], [p + ".attn.qkv", p + ".mlp.fc1"], [None, "gelu_tanh"])
        b.attention("qkv", "a", layer=i)
        b.residual(["a", "g"], [p + ".attn.proj", p + ".mlp.fc2"])
    return b.build()


def step_program(config: MoondreamConfig) -> Program:
    t, r = config.text, config.region
    hd, nh, nkv = t.head_dim, t.n_heads, t.n_kv_heads
    n_qkv = (nh + 2 * nkv) * hd
    lm = ProgramBuilder()
    lm.norm("hidden", "h", "text.post_ln")
    lm.linear("h", ["logits"], ["text.lm_head"])
    head_ff = max(r.coord_out_dim, r.size_out_dim, t.vocab_size)
    return Program(
        dim=t.dim,
        buffers=(("h", (("h", t.dim),)),
                 ("u", (("qkv", n_qkv), ("a", nh * hd), ("g", t.ff_dim))),
                 ("head", (("head_h", r.inner_dim),)),
                 ("logits", (("logits", head_ff),))),
        ops=decoder_ops(t),
        attention=AttentionSpec(nh, nkv, hd, t.rot_dim),
        state=tuple(LayerState("kv", i) for i in range(t.n_layers)),
        heads=(("lm", Head(lm.build(), "logits", OUT_TOKEN, mask_answer=True)),
               ("coord", Head(_mlp_head("coord"), "logits", OUT_COORD)),
               ("size", Head(_mlp_head("size"), "logits", OUT_W, segments=2))),
        feedback=Feedback("region", (
            ("wte", "text.wte"), ("coord_features", "region.coord_features"),
            ("coord_encoder", "region.coord_encoder"), ("size_features", "region.size_features"),
            ("size_encoder", "region.size_encoder")),
            by_phase=tuple(FEEDBACK[p] for p in range(len(NEXT_PHASE)))),
        vocab=t.vocab_size)



def step_spec(model) -> StepSpec:
    """The runtime's view of a MoondreamModel: its program, phase table and feedback tables
    (the exact floats the reference feeds back: python double -> the model dtype)."""
    cfg, w = model.config, model.weights
    cb, sb = cfg.region.coord_out_dim, cfg.region.size_out_dim // 2
    tables = {
        "coord": torch.tensor([region.bin_to_coordinate(i, cb) for i in range(cb)],
                              dtype=torch.float64).to(device=w.device, dtype=w.dtype),
        "size": torch.tensor([region.bin_to_size(i, sb) for i in range(sb)],
                             dtype=torch.float64).to(device=w.device, dtype=w.dtype)}
    return StepSpec(step_program(cfg), NEXT_PHASE, cfg.tokenizer.answer_id, tables,
                    answer_phase=PHASE_TEXT)

"""Moondream 2's decode step as a step program for the megakernel (a stand-in for the lowering
of the issue-11 step program, written from what fused_step.py runs).

Per block i (Phi parallel block; the fused backend's order and weights):
  ln.i        h = LN(x)                                  (one instruction per row)
  w1qkv.i     u[:, qkv] = h Wqkv^T + bqkv                (rows [0, n_qkv) of W1)
  w1fc1.i     u[:, g]   = gelu_tanh(h Wfc1^T + bfc1)     (rows [n_qkv, n1) of W1)
  attn.i      rotary + k/v write + attention of each (row, head) -> u[:, a]
  w2.i        x += [a | g] W2^T + b2                     (W2 = [Wproj, Wfc2])
then the step's tail, as the fused backend's advance() and lm_greedy():
  advance     hidden = x (model dtype), pos += 1, phase / first advanced (active rows)
  ln.post     h = LN(hidden)
  lm          logits = h Wlm^T + blm
  argmax      out[:, 0] = argmax (the answer marker masked after a row's first text pick)
The weights are the FusedDecoder's own tensors (its W1 / W2 concatenations): nothing is
copied, so a diff against the fused backend compares the same bits.

The feedback embedding (fused feed()) stays one launch before the megakernel.
"""
from __future__ import annotations

import torch

from ..fast.kernels import gemv as G
from ..fast.kernels.decode_attention import AttentionScratch
from .instructions import (OP_ADVANCE, OP_ARGMAX, OP_ATTN, OP_GEMV_LM, OP_GEMV_W1,
                           OP_GEMV_W2, OP_LN, Operand, ProgramOp)


class MoondreamLowering:
    """The program (ops), the buffers its operands name, and the shapes / GEMV configs the
    kernel is specialized on, for a FusedDecoder `fd` and a StepState `st` at bucket b."""

    def __init__(self, fd, st, b: int):
        cfg = fd.cfg
        self.b = b
        self.cfg = cfg
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_qkv = fd.n_qkv
        self.a_off = fd.n_qkv
        n1 = fd.w1[0].shape[0]
        kw2 = fd.w2[0].shape[1]
        kv = fd.kv
        self.scratch = AttentionScratch(b, nh, hd, kv.capacity, fd.scratch.chunk,
                                        fd.x.device)
        bufs: dict[str, torch.Tensor] = {
            "x": fd.x, "h": fd.h, "u": fd.u, "logits": fd.logits,
            "cos": fd.cos, "sin": fd.sin,
            "sc_m": self.scratch.m, "sc_l": self.scratch.l, "sc_acc": self.scratch.acc,
            "post_ln_w": fd.post_ln[0], "post_ln_b": fd.post_ln[1],
            "lm_w": fd.lm_w, "lm_b": fd.lm_b,
            "hidden": st.hidden, "pos": st.pos, "phase": st.phase, "out": st.out,
            "active": st.active.view(torch.uint8), "first": st.first.view(torch.uint8),
            "is_detect": st.is_detect.view(torch.uint8),
        }
        for i in range(cfg.n_layers):
            bufs.update({f"w1.{i}": fd.w1[i], f"b1.{i}": fd.b1[i], f"w2.{i}": fd.w2[i],
                         f"b2.{i}": fd.b2[i], f"ln_w.{i}": fd.ln[i][0],
                         f"ln_b.{i}": fd.ln[i][1],
                         f"kc.{i}": kv.data[i, 0], f"vc.{i}": kv.data[i, 1]})
        self.buffers = bufs
        d = cfg.dim
        # the kernel takes one row stride per buffer kind (constexpr): check them
        assert fd.x.stride(0) == d and fd.h.stride(0) == d and st.hidden.stride(0) == d
        assert fd.logits.stride(0) == cfg.vocab_size and st.out.stride(0) == 4
        assert fd.lm_w.shape == (cfg.vocab_size, d) and fd.lm_w.is_contiguous()
        kc = kv.data[0, 0]
        # shapes the kernel is specialized on
        self.shape = dict(
            B=b, D=d, SU=fd.u.stride(0), KW2=kw2, N1=n1, V=cfg.vocab_size,
            NH=nh, NKV=nkv, HD=hd, HALF=fd.cos.shape[1], CAP=kv.capacity,
            N_TABLE=fd.cos.shape[0], CHUNK=self.scratch.chunk, NSPLIT=self.scratch.n_split,
            S_ROW=kc.stride(0), S_HEAD=kc.stride(1), S_POS=kc.stride(2),
            ANSWER_ID=st.cfg.tokenizer.answer_id)
        # GEMV block shapes: the fused backend's picks in deterministic mode (no split-K),
        # so each output is summed in the same order as there
        self.gemv_cfg = {
            OP_GEMV_W1: G.pick(b, n1, d, G.EPI_QKV_GELU, deterministic=True),
            OP_GEMV_W2: G.pick(b, d, kw2, G.EPI_RESIDUAL, deterministic=True),
            OP_GEMV_LM: G.pick(b, cfg.vocab_size, d, G.EPI_STORE, deterministic=True),
        }
        for c in self.gemv_cfg.values():
            assert c.split_k == 1
        self.ops = self._program(cfg.n_layers, n1, nh * hd)

    def _program(self, n_layers: int, n1: int, gap: int) -> list[ProgramOp]:
        O = Operand
        ops: list[ProgramOp] = []
        prev = ()
        for i in range(n_layers):
            ops.append(ProgramOp(f"ln.{i}", OP_LN, {"inp": O("x"), "gamma": O(f"ln_w.{i}"),
                                                    "beta": O(f"ln_b.{i}"), "out": O("h")},
                                 {"in_f32": 1}, prev))
            w1 = {"inp": O("h"), "w": O(f"w1.{i}"), "bias": O(f"b1.{i}"), "out": O("u")}
            p1 = {"n_split": self.n_qkv, "gap": gap}
            ops.append(ProgramOp(f"w1qkv.{i}", OP_GEMV_W1, w1, p1, (f"ln.{i}",),
                                 rows=(0, self.n_qkv)))
            ops.append(ProgramOp(f"w1fc1.{i}", OP_GEMV_W1, w1, p1, (f"ln.{i}",),
                                 rows=(self.n_qkv, n1)))
            ops.append(ProgramOp(f"attn.{i}", OP_ATTN,
                                 {"qkv": O("u"), "kc": O(f"kc.{i}"), "vc": O(f"vc.{i}"),
                                  "pos": O("pos"), "out": O("u", self.a_off)},
                                 {"layer": i}, (f"w1qkv.{i}",)))
            ops.append(ProgramOp(f"w2.{i}", OP_GEMV_W2,
                                 {"inp": O("u", self.a_off), "w": O(f"w2.{i}"),
                                  "bias": O(f"b2.{i}"), "out": O("x")}, {},
                                 (f"attn.{i}", f"w1fc1.{i}"), rows=(0, self.cfg.dim)))
            prev = (f"w2.{i}",)
        ops.append(ProgramOp("advance", OP_ADVANCE,
                             {"x": O("x"), "out_hidden": O("hidden"), "active": O("active"),
                              "out_pos": O("pos"), "out_phase": O("phase"),
                              "is_detect": O("is_detect"), "out_first": O("first")}, {}, prev))
        ops.append(ProgramOp("ln.post", OP_LN, {"inp": O("hidden"), "gamma": O("post_ln_w"),
                                                "beta": O("post_ln_b"), "out": O("h")},
                             {"in_f32": 0}, ("advance",)))
        ops.append(ProgramOp("lm", OP_GEMV_LM, {"inp": O("h"), "w": O("lm_w"),
                                                "bias": O("lm_b"), "out": O("logits")}, {},
                             ("ln.post",), rows=(0, self.cfg.vocab_size)))
        ops.append(ProgramOp("argmax", OP_ARGMAX,
                             {"logits": O("logits"), "out": O("out"), "phase": O("phase"),
                              "first": O("first")},
                             {"mask_col": self.shape["ANSWER_ID"]}, ("lm",)))
        return ops

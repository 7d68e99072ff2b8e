"""A step program (photon_core/program.py) lowered for the megakernel, over the fused
backend's own tensors (fast/fused_backend.py: its concatenated GEMV weights, its row buffers,
its rotary tables): nothing is copied, so a diff against the fused backend compares the same
bits.

Supported block shape (Moondream 2's Phi parallel block; any family whose program has the
same op pattern gets it): per layer i, three stages (each waits only for the one before):
  w1qkv.i / w1fc1.i  h = LayerNorm(x) (fp32 residual in; every instruction computes it for
             the bucket's rows into its program's private scratch `hs`), then the fused
             backend's ONE GEMV [Wqkv; Wfc1] cut at n_split: u[qkv] = h Wqkv^T + b (rows
             [0, n_split), what the attention waits for), u[g] = gelu_tanh(h Wfc1^T + b)
  attn.i     rotary + k/v write + split attention of each (row, head, group of key splits);
             the last instruction of a (row, head) to finish merges its splits into u[a]
  w2.i       x += [a | g] W2^T + b2 (one K range of u)
then the step's tail, as the fused backend's row_advance and the "lm" head's pick:
  advance    hidden = x (model dtype), pos += 1, phase = phase_next[phase, kind], first = 0
  lm         h = LN(hidden) (fused as above), logits = h Wlm^T + blm
  argmax     out[:, col] (the answer-marker rule)
The feedback (fused feed()) stays one launch before the megakernel.
"""
from __future__ import annotations

import torch

from ..ops import gemv as G
from ..ops.decode_attention import AttentionScratch
from .instructions import (OP_ADVANCE, OP_ARGMAX, OP_ATTN, OP_GEMV_LM, OP_GEMV_W1,
                           OP_GEMV_W2, Operand, ProgramOp)


GEMV_CHOICES = ("fused", "fma", "small", "pipe", "pipe_fma", "pipe_same")
PIPE_TILE = (16, 256)       # "pipe" / "pipe_fma" rows x K per step unless "@ROWSxK" is given


def parse_gemv(gemv: str) -> tuple[str, tuple[int, int]]:
    """"pipe_fma@16x512" -> ("pipe_fma", (16, 512)); other choices take no tile."""
    name, _, tile = gemv.partition("@")
    if name not in GEMV_CHOICES or (tile and not name.startswith("pipe")):
        raise ValueError(f"gemv must be one of {GEMV_CHOICES} (pipe*: optionally "
                         f"@ROWSxK), not {gemv!r}")
    if not tile:
        return name, PIPE_TILE
    rows, k = (int(v) for v in tile.split("x"))
    return name, (rows, k)


def is_pipe(gemv: str) -> bool:
    """The GEMVs run as kernel._gemv_pipe (one software-pipelined stream per instruction)."""
    return parse_gemv(gemv)[0].startswith("pipe")


def gemv_configs(b: int, n1: int, d: int, kw2: int, vocab: int, n_split: int,
                 gemv: str = "fused") -> dict:
    """The GEMV block shapes per GEMV op. "fused": the fused backend's picks (its residual
    GEMV in deterministic mode: no split-K), so each output is summed in the same order as
    there; "fma" (b=1): FMA tiles of 8 rows x 512 K, 4 per step (K % 2048 == 0), streamed
    double-buffered (kernel._gemv_stream) where the shape allows (b > 1: as "small");
    "small": register-light tensor-core tiles (64 x 64; 16 x 128 for the residual GEMV);
    "pipe" / "pipe_fma" (kernel._gemv_pipe): tiles of PIPE_TILE (or "@ROWSxK") rows x K per
    pipelined step for every GEMV, tensor cores ("pipe") or at b=1 FMA ("pipe_fma"; b > 1:
    tensor cores); 16 rows give ~128 row tiles per op on 132 SMs; "pipe_same": the fused
    picks' K tiles (the same sums as the fused backend), as pipelined streams."""
    gemv, (rows, bk) = parse_gemv(gemv)
    if gemv == "pipe_same":
        # the fused backend's picks run as pipelined streams, each output summed in the
        # same order: tl.dot tiles keep their BLOCK_K (the row count does not change the
        # sums) but take 16 rows; FMA tiles keep their shape (their final reduction's tree
        # follows the tile; with the fused kernels' 4 warps it is the same)
        cfg = gemv_configs(b, n1, d, kw2, vocab, n_split, "fused")
        for op, c in cfg.items():
            if c.dot and (op != OP_GEMV_W1 or n_split % 16 == 0):
                cfg[op] = G.GemvConfig(16, c.block_k, 1, c.num_warps, 1, True)
        return cfg
    if gemv.startswith("pipe"):
        dot = gemv == "pipe" or b > 1
        cfg = {}
        for op, (n, k, epi) in ((OP_GEMV_W1, (n1, d, G.EPI_QKV_GELU)),
                                (OP_GEMV_W2, (d, kw2, G.EPI_RESIDUAL)),
                                (OP_GEMV_LM, (vocab, d, G.EPI_STORE))):
            c = G.GemvConfig(rows, bk, 1, 8, 1, dot)
            split = n_split if op == OP_GEMV_W1 else 0
            if not (c.fits(b, n, k, epi) and split % rows == 0):
                raise Unsupported(f"gemv {gemv}@{rows}x{bk} does not fit n={n} k={k}")
            cfg[op] = c
        return cfg
    cfg = {
        OP_GEMV_W1: G.pick(b, n1, d, G.EPI_QKV_GELU),
        OP_GEMV_W2: G.pick(b, d, kw2, G.EPI_RESIDUAL, deterministic=True),
        OP_GEMV_LM: G.pick(b, vocab, d, G.EPI_STORE),
    }
    if gemv == "small" or (gemv == "fma" and b > 1):
        # register-light tensor-core tiles (sm_90, 8 warps, with unroll 4: W1 / lm 64 x 64 ->
        # 32 KB per group; the residual GEMV 16 x 128 -> 16 KB, N = dim is small); tl.dot adds
        # each output's K products in order whatever the tile, as the fused picks do
        for op, (n, k, epi, c) in (
                (OP_GEMV_W1, (n1, d, G.EPI_QKV_GELU, G.GemvConfig(64, 64, 1, 8, 1, True))),
                (OP_GEMV_W2, (d, kw2, G.EPI_RESIDUAL, G.GemvConfig(16, 128, 1, 8, 1, True))),
                (OP_GEMV_LM, (vocab, d, G.EPI_STORE, G.GemvConfig(64, 64, 1, 8, 1, True)))):
            split = n_split if op == OP_GEMV_W1 else 0
            if c.fits(b, n, k, epi) and split % c.block_n == 0:
                cfg[op] = c
    if gemv == "fma" and b == 1:
        for op, (n, k, epi) in ((OP_GEMV_W1, (n1, d, G.EPI_QKV_GELU)),
                                (OP_GEMV_W2, (d, kw2, G.EPI_RESIDUAL)),
                                (OP_GEMV_LM, (vocab, d, G.EPI_STORE))):
            split = n_split if op == OP_GEMV_W1 else 0
            # 8 rows x 4 x 512 K: 32 KB of weights per streamed step
            fma = G.GemvConfig(8, 512, 1, 8, 1, False)
            if k % 2048 == 0 and fma.fits(b, n, k, epi) and split % fma.block_n == 0:
                cfg[op] = fma
    for c in cfg.values():
        assert c.split_k == 1
    return cfg


class Unsupported(ValueError):
    """The program has an op pattern the megakernel has no lowering for."""


class ProgramLowering:
    """The program (ops), the buffers its operands name, and the shapes / GEMV configs the
    kernel is specialized on, for a FusedBackend `fd` and a StepState `st` at bucket b."""

    def __init__(self, fd, st, b: int, n_sm: int, gemv: str = "fused", head: bool = True):
        """n_sm: programs at most (each gets a private LayerNorm scratch of b rows).
        gemv: the GEMV block shapes, GEMV_CHOICES (gemv_configs). head=False: the program
        ends at the advance (no lm / argmax instructions: the runtime's forward piece,
        whose lm pick is the next step's sample piece)."""
        self.head = head
        parse_gemv(gemv)
        self.pipe = is_pipe(gemv)
        p = self.program = fd.program
        a = p.attention
        self.b = b
        nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        w = fd.w
        self.scratch = AttentionScratch(b, nh, hd, fd.kv.capacity, fd.scratch.chunk,
                                        fd.x.device)
        h, u, logits = fd.bufs["h"], fd.bufs.get("u"), fd.bufs["logits"]
        if u is None:
            raise Unsupported("no u buffer")
        lm_ops = p.head("lm").ops
        if len(lm_ops) != 2 or lm_ops[0].kind != "norm" or lm_ops[1].kind != "linear":
            raise Unsupported("lm head: norm + linear expected")
        post_ln = lm_ops[0].weights[0]
        lm = fd.fused_gemvs.get(lm_ops[1])
        if lm is None or lm["epi"] != G.EPI_STORE or lm["off"] != 0 or lm["bias"] is None:
            raise Unsupported("lm head: one GEMV into the logits buffer expected")
        head = p.head("lm")
        self.answer_col = head.col
        # per program: the LayerNorm output of the bucket's rows, the fused GEMVs' input
        self.hs = torch.zeros(n_sm * b * p.dim, device=fd.x.device, dtype=h.dtype)
        bufs: dict[str, torch.Tensor] = {
            "x": fd.x, "hs": self.hs, "u": u, "logits": logits,
            "cos": fd.cos, "sin": fd.sin,
            "sc_m": self.scratch.m, "sc_l": self.scratch.l, "sc_acc": self.scratch.acc,
            "post_ln_w": w[post_ln + ".weight"], "post_ln_b": w[post_ln + ".bias"],
            "lm_w": lm["w"], "lm_b": lm["bias"],
            "hidden": st.hidden, "pos": st.pos, "phase": st.phase, "kind": st.kind,
            "out": st.out, "phase_next": st.phase_next,
            "active": st.active.view(torch.uint8), "first": st.first.view(torch.uint8),
        }
        d = p.dim
        self.layers = self._layers(fd, w, bufs)
        self.buffers = bufs
        # the kernel takes one row stride per buffer kind (constexpr): check them
        assert fd.x.stride(0) == d and st.hidden.stride(0) == d
        assert st.out.stride(0) == 4 and st.phase_next.is_contiguous()
        assert lm["w"].shape[1] == d and lm["w"].is_contiguous()
        for name, t in bufs.items():
            assert t.is_contiguous(), name
        kc = fd.kv.data[0, 0]
        n1 = self.layers[0]["w1"]["w"].shape[0]
        kw2 = self.layers[0]["w2"]["w"].shape[1]
        vocab = lm["w"].shape[0]
        # shapes the kernel is specialized on
        self.shape = dict(
            B=b, D=d, SU=u.stride(0), KW2=kw2, N1=n1, V=vocab, LS=logits.stride(0),
            NH=nh, NKV=nkv, HD=hd, HALF=fd.cos.shape[1], CAP=fd.kv.capacity,
            N_TABLE=fd.cos.shape[0], CHUNK=self.scratch.chunk, NSPLIT=self.scratch.n_split,
            S_ROW=kc.stride(0), S_HEAD=kc.stride(1), S_POS=kc.stride(2),
            NK=st.phase_next.shape[1], ANSWER_ID=-1 if st.spec.answer_id is None
            else st.spec.answer_id, OUT_COL=head.col)
        self.gemv_cfg = gemv_configs(b, n1, d, kw2, vocab, self.layers[0]["w1"]["n_split"],
                                     gemv)
        self.ops = self._program(len(self.layers))

    def _layers(self, fd, w, bufs) -> list[dict]:
        """Match the program's ops to the supported block pattern; register its tensors."""
        p = self.program
        ops = list(p.ops)
        if len(ops) % 4:
            raise Unsupported("blocks of 4 ops (norm, linear, attention, residual) expected")
        layers = []
        for i in range(0, len(ops), 4):
            norm, lin, att, res = ops[i:i + 4]
            if (norm.kind, lin.kind, att.kind, res.kind) != ("norm", "linear", "attention",
                                                               "residual"):
                raise Unsupported(f"op pattern at {i}")
            if norm.norm != "layer" or norm.src != ("x",) or norm.dst != ("h",):
                raise Unsupported("LayerNorm x -> h expected")
            w1, w2 = fd.fused_gemvs.get(lin), fd.fused_gemvs.get(res)
            if w1 is None or w1["epi"] != G.EPI_QKV_GELU or w1["buf"] != "u" or w1["off"]:
                raise Unsupported("linear: one [qkv | gelu] GEMV into u expected")
            if w2 is None or w2["src_buf"] != "u":
                raise Unsupported("residual: one GEMV over a K range of u expected")
            if w1["bias"] is None or w2["bias"] is None:
                raise Unsupported("GEMVs without bias")
            qkv_buf, qkv_off, _ = p.segment(att.src[0])
            a_buf, a_off, _ = p.segment(att.dst[0])
            if (qkv_buf, qkv_off) != ("u", 0) or a_buf != "u" or w1["n_split"] != qkv_off + \
                    (p.attention.n_heads + 2 * p.attention.n_kv_heads) * p.attention.head_dim:
                raise Unsupported("attention: qkv at u[0:n_split] expected")
            k = len(layers)
            slot = fd.layer_slot[att.layer]
            bufs.update({f"w1.{k}": w1["w"], f"b1.{k}": w1["bias"], f"w2.{k}": w2["w"],
                         f"b2.{k}": w2["bias"], f"ln_w.{k}": w[norm.weights[0] + ".weight"],
                         f"ln_b.{k}": w[norm.weights[0] + ".bias"],
                         f"kc.{k}": fd.kv.data[slot, 0], f"vc.{k}": fd.kv.data[slot, 1]})
            layers.append(dict(w1=w1, w2=w2, a_off=a_off, res_off=w2["src_off"]))
        return layers

    def _program(self, n_layers: int) -> list[ProgramOp]:
        O = Operand
        ops: list[ProgramOp] = []
        prev = ()
        dim = self.program.dim
        for i in range(n_layers):
            L = self.layers[i]
            n_split, n1 = L["w1"]["n_split"], L["w1"]["w"].shape[0]
            w1 = {"inp": O("hs"), "w": O(f"w1.{i}"), "bias": O(f"b1.{i}"), "out": O("u"),
                  "ln_inp": O("x"), "ln_gamma": O(f"ln_w.{i}"), "ln_beta": O(f"ln_b.{i}")}
            p1 = {"n_split": n_split, "gap": L["w1"]["gap"], "ln_in_f32": 1}
            ops.append(ProgramOp(f"w1qkv.{i}", OP_GEMV_W1, w1, p1, prev,
                                 rows=(0, n_split)))
            # (fill: with compile_program(fill=True) its rows go to the programs by their
            # free time, around the attention that runs beside it)
            ops.append(ProgramOp(f"w1fc1.{i}", OP_GEMV_W1, w1, dict(p1, fill=1), prev,
                                 rows=(n_split, n1)))
            ops.append(ProgramOp(f"attn.{i}", OP_ATTN,
                                 {"qkv": O("u"), "kc": O(f"kc.{i}"), "vc": O(f"vc.{i}"),
                                  "pos": O("pos"), "out": O("u", L["a_off"])},
                                 {"layer": i}, (f"w1qkv.{i}",)))
            ops.append(ProgramOp(f"w2.{i}", OP_GEMV_W2,
                                 {"inp": O("u", L["res_off"]), "w": O(f"w2.{i}"),
                                  "bias": O(f"b2.{i}"), "out": O("x")}, {},
                                 (f"attn.{i}", f"w1fc1.{i}"), rows=(0, dim)))
            prev = (f"w2.{i}",)
        ops.append(ProgramOp("advance", OP_ADVANCE,
                             {"x": O("x"), "out_hidden": O("hidden"), "active": O("active"),
                              "out_pos": O("pos"), "out_phase": O("phase"), "kind": O("kind"),
                              "table": O("phase_next"), "out_first": O("first")}, {}, prev))
        if not self.head:
            return ops
        ops.append(ProgramOp("lm", OP_GEMV_LM,
                             {"inp": O("hs"), "w": O("lm_w"), "bias": O("lm_b"),
                              "out": O("logits"), "ln_inp": O("hidden"),
                              "ln_gamma": O("post_ln_w"), "ln_beta": O("post_ln_b")},
                             {"ln_in_f32": 0}, ("advance",),
                             rows=(0, self.shape["V"])))
        ops.append(ProgramOp("argmax", OP_ARGMAX,
                             {"logits": O("logits"), "out": O("out"), "phase": O("phase"),
                              "first": O("first")},
                             {"mask_col": self.shape["ANSWER_ID"]}, ("lm",)))
        return ops

"""A hybrid family's step program (Qwen 3.5: Gated DeltaNet + gated attention layers) lowered
for the megakernel (hybrid_kernel.py), over the fused backend's own tensors (its joined GEMV
weights, row buffers, state cache, rotary tables): nothing of the model is copied but a few
small per-layer vectors as fp32 (the same values: the kernels read them as fp32).

The program's ops, in order, each one ProgramOp waiting for the one before it:
  norm rms_zc x -> h; linear h -> [...]   one GEMV whose instructions first compute the norm
                                          of x into their program's scratch (OP_HGEMV)
  ... + act_mul silu (gate, up) -> m      the same, epilogue act(gate) * up (EPI_GATED)
  conv1d -> delta_rule -> gated_norm      OP_DELTA per (row, key head)
  gated_attention                         OP_GATTN per (row, query head, key split), then
                                          OP_GMERGE per (row, query head)
  residual                                OP_HGEMV adding into the fp32 x
then the row advance and, with head=True, the lm head (norm of hidden + GEMV) and its pick.
The chain is serial (each op waits for the whole previous one): correct by transitivity;
overlap between independent ops (Moondream's fill schedule) is not done here yet.
"""
from __future__ import annotations

import triton

import torch

from ..ops import gemv as G
from .instructions import (OP_ADVANCE, OP_ARGMAX, OP_DELTA, OP_GATTN, OP_GMERGE, OP_HGEMV,
                           Operand, ProgramOp)
from .lowering import Unsupported
from . import hybrid_kernel as HK


def _block_k(ks) -> int:
    for bk in (128, 64, 32, 16):
        if all(k % bk == 0 for k in ks):
            return bk
    raise Unsupported(f"GEMV widths {sorted(set(ks))} are not multiples of 16")


class HybridLowering:
    """ops / buffers / shape of fused backend `fd`'s hybrid program at bucket b (n_sm:
    programs at most, each with a private norm scratch of b rows)."""

    def __init__(self, fd, st, b: int, n_sm: int, head: bool = True, block_n: int = 32,
                 attn_splits: int | None = None):
        """attn_splits: key splits per (row, head) of attention (None: about one attention
        instruction per program, at most 32)."""
        p = self.program = fd.program
        if p.delta is None or getattr(fd, "rows_lowering", None) is None:
            raise Unsupported("no Gated DeltaNet program with the fused rows kernels")
        if b > 16:
            raise Unsupported("more than 16 rows")
        self.head, self.b, self.fd = head, b, fd
        a, rl, kv = p.attention, fd.rows_lowering, fd.kv
        self.dt = dt = kv.dtype
        dev = fd.x.device
        u, logits = fd.bufs.get("u"), fd.bufs["logits"]
        if u is None:
            raise Unsupported("no u buffer")
        self.hs = torch.zeros(n_sm * b * p.dim, device=dev, dtype=dt)
        ns = self.n_split = attn_splits or max(1, min(32, n_sm // (b * a.n_heads)))
        self.attn_scratch = torch.zeros(b * a.n_heads * ns * 2 * a.head_dim, device=dev,
                                        dtype=dt)
        f32 = dict(device=dev, dtype=torch.float32)
        self.attn_m = torch.zeros(b * a.n_heads * ns, **f32)
        self.attn_l = torch.zeros(b * a.n_heads * ns, **f32)
        self.attn_acc = torch.zeros(b * a.n_heads * ns * a.head_dim, **f32)
        bufs: dict[str, torch.Tensor] = {
            "x": fd.x, "hs": self.hs, "u": u, "logits": logits, "cos": rl.cos, "sin": rl.sin,
            "attn_scratch": self.attn_scratch, "attn_m": self.attn_m, "attn_l": self.attn_l,
            "attn_acc": self.attn_acc,
            "hidden": st.hidden, "pos": st.pos, "pos_offset": st.pos_offset,
            "phase": st.phase, "kind": st.kind, "out": st.out, "phase_next": st.phase_next,
            "active": st.active.view(torch.uint8), "first": st.first.view(torch.uint8)}
        self.buffers = bufs
        self._f32: dict[str, torch.Tensor] = {}
        self.eps_seen: set[float] = set()
        self.ops: list[ProgramOp] = []
        self.n_gemv_k: list[int] = []
        self._lower(fd, st, bufs)
        if len(self.eps_seen) > 1:
            raise Unsupported(f"norms with different eps {sorted(self.eps_seen)}")
        self.eps = self.eps_seen.pop() if self.eps_seen else 1e-6
        d = p.dim
        conv = next(iter(v for k, v in kv.states.items() if k[0] == "conv"))
        rec = next(iter(v for k, v in kv.states.items() if k[0] == "recurrent"))
        kc = kv.data[0, 0]
        cw0 = next(iter(v for k, v in self._f32.items() if k.startswith("conv_w.")))
        assert fd.x.stride(0) == d and st.hidden.stride(0) == d and st.out.stride(0) == 4
        for name, t in bufs.items():
            assert t.is_contiguous(), name
        bk = _block_k(self.n_gemv_k)
        dm = p.delta
        self.shape = dict(
            B=b, D=d, SU=u.stride(0), V=self.vocab, LS=logits.stride(0),
            NK=st.phase_next.shape[1], OUT_COL=p.head("lm").col, BB=16, BN=block_n, BK=bk,
            IEEE=dt == torch.float32, HK=dm.n_k_heads, HV=dm.n_v_heads, DK=dm.k_dim,
            DV=dm.v_dim, KC=cw0.shape[1], CS_B=conv.stride(0), CS_C=conv.stride(1),
            CS_K=conv.stride(2), S_S=rec.stride(0), NH=a.n_heads, NKV=a.n_kv_heads,
            HD=a.head_dim, R=rl.cos.shape[1], NTAB=rl.cos.shape[0], CAP=kv.capacity,
            S_ROW=kc.stride(0), S_HEAD=kc.stride(1), S_POS=kc.stride(2),
            BS=max(16, min(64, 8192 // triton.next_power_of_2(a.head_dim))), NSPLIT=ns,
            ANSWER_ID=-1)
        if kc.stride(3) != 1 or rec.stride(3) != 1 or rec.stride(2) != dm.v_dim:
            raise Unsupported("cache / state layouts")
        # one GEMV config for every GEMV op (the compiler reads its block_n)
        self.gemv_cfg = {OP_HGEMV: G.GemvConfig(block_n, bk, 1, 8, 1, True)}

    # -- helpers ------------------------------------------------------------------------
    def _f(self, name: str, t: torch.Tensor) -> str:
        """A small per-layer vector / matrix as an fp32 buffer (exact: wider or the same)."""
        self._f32[name] = t.detach().float().contiguous()
        self.buffers[name] = self._f32[name]
        return name

    def _gemv(self, name, g, src: Operand, out: Operand, epi: int, after, sx: int, sy: int,
              norm=None):
        """norm: (norm op, x operand name, input fp32?) computed into hs first."""
        w = g["w"]
        if g.get("bias") is not None:
            raise Unsupported(f"{name}: a GEMV with a bias")
        if epi in (HK.EPI_GATED_SILU, HK.EPI_GATED_GELU) and w.shape[0] % 2:
            raise Unsupported(f"{name}: gated GEMV of {w.shape[0]} rows")
        self.buffers[f"w.{name}"] = w
        args = {"inp": src, "w": Operand(f"w.{name}"), "out": out}
        params = {"epi": epi, "k": w.shape[1], "sx": sx, "sy": sy}
        if norm is not None:
            nop, xin, f32 = norm
            self.eps_seen.add(nop.eps)
            args.update(ln_inp=Operand(xin),
                        ln_gamma=Operand(self._f(f"nw.{name}",
                                                 self.fd.w[nop.weights[0] + ".weight"])))
            params["ln_in_f32"] = int(f32)
        self.n_gemv_k.append(w.shape[1])
        self.ops.append(ProgramOp(name, OP_HGEMV, args, params, after, rows=(0, w.shape[0])))
        return (name,)

    def _lower(self, fd, st, bufs) -> None:
        p = self.program
        O = Operand
        su = fd.bufs["u"].stride(0)
        d = p.dim
        ops = list(p.ops)
        prev: tuple = ()
        i = 0
        while i < len(ops):
            op = ops[i]
            tag = f"{i}"
            if op.kind == "norm":
                if op.norm != "rms_zc" or op.src != ("x",) or i + 1 >= len(ops):
                    raise Unsupported(f"norm {op.norm} at {i}")
                lin = ops[i + 1]
                g = fd.fused_gemvs.get(lin)
                if lin.kind != "linear" or lin.src != op.dst or g is None or g["buf"] != "u":
                    raise Unsupported(f"norm at {i}: one GEMV into u after it expected")
                epi = {G.EPI_STORE: HK.EPI_STORE}.get(g["epi"])
                if g["epi"] == G.EPI_GATED:
                    epi = HK.EPI_GATED_SILU if g["act"] == "silu" else HK.EPI_GATED_GELU
                    i += 1                       # the act_mul is in the GEMV's epilogue
                if epi is None:
                    raise Unsupported(f"linear at {i + 1}: epilogue {g['epi']}")
                prev = self._gemv(f"lin{tag}", g, O("hs"), O("u", g["off"]), epi, prev, d, su,
                                  norm=(op, "x", True))
                i += 2
            elif op.kind == "conv1d":
                conv, delta, gnorm = ops[i:i + 3]
                if (delta.kind, gnorm.kind) != ("delta_rule", "gated_norm") or \
                        delta.src[0] != conv.dst[0] or gnorm.src[0] != delta.dst[0]:
                    raise Unsupported(f"conv1d at {i}: conv -> delta_rule -> gated_norm")
                seg = {s: p.segment(s) for s in (conv.src[0], delta.src[1], delta.src[2],
                                                  gnorm.src[1], gnorm.dst[0])}
                if any(bb != "u" for bb, _, _ in seg.values()):
                    raise Unsupported("delta net operands outside u")
                cw = fd.w[conv.weights[0] + ".weight"]
                cw = cw[:, 0] if cw.dim() == 3 else cw
                L = conv.layer
                bufs[f"conv_state.{L}"] = fd.kv.states[("conv", L)]
                bufs[f"state.{L}"] = fd.kv.states[("recurrent", L)]
                self.eps_seen.add(gnorm.eps)
                args = {"qkv": O("u", seg[conv.src[0]][1]), "z": O("u", seg[gnorm.src[1]][1]),
                        "b_in": O("u", seg[delta.src[1]][1]),
                        "a_in": O("u", seg[delta.src[2]][1]),
                        "out": O("u", seg[gnorm.dst[0]][1]),
                        "conv_w": O(self._f(f"conv_w.{L}", cw)),
                        "conv_state": O(f"conv_state.{L}"), "state": O(f"state.{L}"),
                        "a_log": O(self._f(f"a_log.{L}", fd.w[delta.weights[0]])),
                        "dt_bias": O(self._f(f"dt_bias.{L}", fd.w[delta.weights[1]])),
                        "norm_w": O(self._f(f"gnorm_w.{L}",
                                            fd.w[gnorm.weights[0] + ".weight"]))}
                self.ops.append(ProgramOp(f"delta{tag}", OP_DELTA, args, {"layer": L}, prev))
                prev = (f"delta{tag}",)
                i += 3
            elif op.kind == "gated_attention":
                (qg, k, v), dst = op.src, op.dst[0]
                seg = {s: p.segment(s) for s in (qg, k, v, dst)}
                if any(bb != "u" for bb, _, _ in seg.values()):
                    raise Unsupported("attention operands outside u")
                slot = fd.layer_slot[op.layer]
                self.eps_seen.add(op.eps)
                L = op.layer
                bufs[f"kc.{L}"], bufs[f"vc.{L}"] = fd.kv.data[slot, 0], fd.kv.data[slot, 1]
                args = {"qg": O("u", seg[qg][1]), "k": O("u", seg[k][1]),
                        "v": O("u", seg[v][1]), "out": O("u", seg[dst][1]),
                        "kc": O(f"kc.{L}"), "vc": O(f"vc.{L}"),
                        "q_norm": O(self._f(f"q_norm.{L}", fd.w[op.weights[0] + ".weight"])),
                        "k_norm": O(self._f(f"k_norm.{L}", fd.w[op.weights[1] + ".weight"])),
                        "pos": O("pos"), "pos_offset": O("pos_offset"),
                        "scratch": O("attn_scratch")}
                self.ops.append(ProgramOp(f"attn{tag}", OP_GATTN, args, {"layer": L}, prev))
                self.ops.append(ProgramOp(f"merge{tag}", OP_GMERGE,
                                          {"qg": args["qg"], "out": args["out"]},
                                          {"layer": L}, (f"attn{tag}",)))
                prev = (f"merge{tag}",)
                i += 1
            elif op.kind == "residual":
                g = fd.fused_gemvs.get(op)
                if g is None or g["src_buf"] != "u" or g["epi"] != G.EPI_RESIDUAL:
                    raise Unsupported(f"residual at {i}: one GEMV over u expected")
                prev = self._gemv(f"res{tag}", g, O("u", g["src_off"]), O("x"),
                                  HK.EPI_RESIDUAL, prev, su, d)
                i += 1
            else:
                raise Unsupported(f"op {op.kind} at {i}")
        self.ops.append(ProgramOp("advance", OP_ADVANCE,
                                  {"x": O("x"), "out_hidden": O("hidden"),
                                   "active": O("active"), "out_pos": O("pos"),
                                   "out_phase": O("phase"), "kind": O("kind"),
                                   "table": O("phase_next"), "out_first": O("first")},
                                  {}, prev))
        head = p.head("lm")
        hops = head.ops
        if len(hops) != 2 or hops[0].kind != "norm" or hops[0].norm != "rms_zc" or \
                hops[1].kind != "linear" or head.segments != 1 or head.mask_answer:
            raise Unsupported("lm head: rms_zc norm + linear expected")
        g = fd.fused_gemvs.get(hops[1])
        if g is None or g["epi"] != G.EPI_STORE or g["off"] != 0 or \
                fd.program.segment(head.logits)[0] != g["buf"]:
            raise Unsupported("lm head: one GEMV into the logits buffer expected")
        self.vocab = g["w"].shape[0]
        if not self.head:
            self.n_gemv_k.append(g["w"].shape[1])
            return
        ls = fd.bufs[g["buf"]].stride(0)
        self._gemv("lm", g, O("hs"), O(g["buf"]), HK.EPI_STORE, ("advance",), d, ls,
                   norm=(hops[0], "hidden", False))
        self.ops.append(ProgramOp("argmax", OP_ARGMAX,
                                  {"logits": O(g["buf"]), "out": O("out"), "phase": O("phase"),
                                   "first": O("first")}, {"mask_col": -1}, ("lm",)))

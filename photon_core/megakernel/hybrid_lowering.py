"""A hybrid family's step program (Qwen 3.5: Gated DeltaNet + gated attention layers; Gemma 4:
window attention over rings / the capacity with KV sharing, sandwich norms, per-layer inputs)
lowered for the megakernel (hybrid_kernel.py), over the fused backend's own tensors (its
joined GEMV weights, row buffers, state cache, rotary tables): nothing of the model is copied
but a few small per-layer vectors as fp32 (the same values: the kernels read them as fp32).

The program's ops, in order, each one ProgramOp waiting for the one before it:
  norm x -> h; linear h -> [...]          one GEMV whose instructions first compute the norm
                                          (zero-centred or plain RMSNorm) of x into their
                                          program's scratch (OP_HGEMV)
  ... + act_mul (gate, up) -> m           the same, epilogue act(gate) * up (EPI_GATED)
  linear x -> p; act_mul (p, q) -> m      a GEMV of the fp32 x, epilogue act(p) * q
  linear s -> [o]                         a GEMV of a buffer's columns (store)
  conv1d -> delta_rule -> gated_norm      OP_DELTA per (row, key head)
  gated_attention                         OP_GATTN per (row, query head, key split), then
                                          OP_GMERGE per (row, query head)
  window_attention                        OP_WATTN per (row, query head, key split), then
                                          OP_WMERGE per (row, query head)
  norm o -> h; add x += h [; scale x]     OP_NORMADD per row
  residual                                OP_HGEMV adding into the fp32 x
  per_layer_input (first op)              the fused backend's launch, before the kernel
                                          (`pre`, run by MegakernelStep.feed)
then the row advance and, with head=True, the lm head (norm of hidden + GEMV) and its pick
(Gemma 4's softcap head: head=False only).
The chain is serial (each op waits for the whole previous one): correct by transitivity;
overlap between independent ops (Moondream's fill schedule) is not done here yet.
"""
from __future__ import annotations

import triton

import torch

from ..ops import gemv as G
from .instructions import (OP_ADVANCE, OP_ARGMAX, OP_DELTA, OP_GATTN, OP_GMERGE, OP_HGEMV,
                           OP_NORMADD, OP_WATTN, OP_WMERGE, Operand, ProgramOp)
from .lowering import Unsupported, parse_gemv
from . import hybrid_kernel as HK


# the GEMV tiles (kernel._hgemv): at one row FMA over 8-row x 1024-column tiles (Moondream 2's
# measured b=1 choice, "pipe_fma@8x1024"): 8 rows per block let a 1024-output GEMV reach 128
# programs; more rows tl.dot over 16 x 512 ("pipe@16x512", Moondream's b=8 choice)
TILE_FMA, TILE_DOT = (8, 1024), (16, 512)


def is_hybrid(fd) -> bool:
    """Fused backend `fd`'s program takes this lowering (Gated DeltaNet or window-attention
    layers: Qwen 3.5, Gemma 4), not lowering.ProgramLowering's (Moondream 2)."""
    return getattr(getattr(fd, "program", None), "delta", None) is not None or \
        bool(getattr(fd, "window", False))


def gemv_tile(gemv: str, b: int, ks) -> tuple[bool, int, int]:
    """A variant's GEMV field -> (FMA, BN, BK) of the hybrid kernel's GEMVs: "auto" (the
    defaults above), "pipe_fma[@RxK]" (FMA at one row; tl.dot above) or "pipe[@RxK]"; BK at
    most the widest K's power of two (a tile no wider than the GEMVs)."""
    name, _, tile = gemv.partition("@")
    if name not in ("auto", "pipe", "pipe_fma") or (tile and name == "auto"):
        raise Unsupported(f"GEMV {gemv!r} (the hybrid kernel takes auto, pipe[@RxK] or "
                          f"pipe_fma[@RxK])")
    fma = b == 1 and name in ("auto", "pipe_fma")
    bn, bk = TILE_FMA if fma else TILE_DOT
    if tile:
        bn, bk = parse_gemv(gemv)[1]
        if bn & (bn - 1) or bk & (bk - 1) or bn < (2 if name == "pipe_fma" else 16) or \
                bk < 16:
            raise Unsupported(f"GEMV tile {tile}: powers of two, BK >= 16, BN >= 16 (2 for "
                              f"pipe_fma)")
        if not fma:
            bn = max(bn, 16)         # (tl.dot: 16 rows at least; pipe_fma's 8 above one row)
    return fma, bn, min(bk, max(16, triton.next_power_of_2(max(ks, default=16))))


class HybridLowering:
    """ops / buffers / shape of fused backend `fd`'s hybrid program at bucket b (n_sm:
    programs at most, each with a private norm scratch of b rows)."""

    def __init__(self, fd, st, b: int, n_sm: int, head: bool = True, gemv: str = "auto",
                 attn_splits: int | None = None):
        """gemv: the GEMV tiles (gemv_tile); attn_splits: key splits per (row, head) of
        attention (None: about one attention instruction per program, at most 32)."""
        p = self.program = fd.program
        if not is_hybrid(fd):
            raise Unsupported("neither Gated DeltaNet nor window-attention layers")
        if p.delta is not None and getattr(fd, "rows_lowering", None) is None:
            raise Unsupported("a Gated DeltaNet program without the fused rows kernels")
        if b > 16:
            raise Unsupported("more than 16 rows")
        self.head, self.b, self.fd = head, b, fd
        self.pre = None           # a closure run before the kernel (Gemma's per-layer input)
        a, kv = p.attention, fd.kv
        dt = kv.dtype
        dev = fd.x.device
        u, logits = fd.bufs.get("u"), fd.bufs["logits"]
        if u is None:
            raise Unsupported("no u buffer")
        self.hs = torch.zeros(n_sm * b * p.dim, device=dev, dtype=dt)
        las = [op.param("attn") for op in p.ops if op.kind == "window_attention"]
        n_heads = las[0].n_heads if las else a.n_heads
        if any(la.n_heads != n_heads for la in las):
            raise Unsupported("window layers with different head counts")
        hdm = max([la.head_dim for la in las] + [a.head_dim])
        ns = self.n_split = attn_splits or max(1, min(32, n_sm // (b * n_heads)))
        self.attn_scratch = torch.zeros(b * n_heads * ns * 3 * hdm, device=dev, dtype=dt)
        f32 = dict(device=dev, dtype=torch.float32)
        self.attn_m = torch.zeros(b * n_heads * ns, **f32)
        self.attn_l = torch.zeros(b * n_heads * ns, **f32)
        self.attn_acc = torch.zeros(b * n_heads * ns * hdm, **f32)
        rl = getattr(fd, "rows_lowering", None)
        if rl is not None:
            cos, sin = rl.cos, rl.sin
        else:
            cos, sin = next(iter(fd.rotary.tables.values()))
        bufs: dict[str, torch.Tensor] = {
            "x": fd.x, "hs": self.hs, "u": u, "logits": logits, "cos": cos, "sin": sin,
            "attn_scratch": self.attn_scratch, "attn_m": self.attn_m, "attn_l": self.attn_l,
            "attn_acc": self.attn_acc,
            "hidden": st.hidden, "pos": st.pos, "pos_offset": st.pos_offset,
            "phase": st.phase, "kind": st.kind, "out": st.out, "phase_next": st.phase_next,
            "active": st.active.view(torch.uint8), "first": st.first.view(torch.uint8)}
        for name, t in fd.bufs.items():      # every row buffer of the program (h, ple, ...)
            bufs.setdefault(name, t)
        self.buffers = bufs
        self._f32: dict[str, torch.Tensor] = {}
        self.eps_seen: set[float] = set()
        self.ops: list[ProgramOp] = []
        self.n_gemv_k: list[int] = []
        self.window_scale = 1.0
        d = p.dim
        # the window layers' two head sizes (sliding: "_S", global: "_F")
        sl = [la for la in las if la.window is not None]
        fu = [la for la in las if la.window is None]
        self.hd_s = sl[0].head_dim if sl else (fu[0].head_dim if fu else a.head_dim)
        self.hd_f = fu[0].head_dim if fu else self.hd_s
        nkv_s = sl[0].n_kv_heads if sl else (fu[0].n_kv_heads if fu else a.n_kv_heads)
        nkv_f = fu[0].n_kv_heads if fu else nkv_s
        for la in las:
            full = la.window is None
            if (la.head_dim, la.n_kv_heads) != ((self.hd_f, nkv_f) if full else
                                                (self.hd_s, nkv_s)):
                raise Unsupported("window layers of one type with different shapes")
            if la.head_dim & (la.head_dim - 1):
                raise Unsupported(f"head size {la.head_dim} (not a power of two)")
        scales = {la.scale for la in las}
        if len(scales) > 1:
            raise Unsupported(f"window layers with different score scales {scales}")
        self.window_scale = scales.pop() if scales else 1.0
        self._lower(fd, st, bufs)
        if len(self.eps_seen) > 1:
            raise Unsupported(f"norms with different eps {sorted(self.eps_seen)}")
        self.eps = self.eps_seen.pop() if self.eps_seen else 1e-6
        assert fd.x.stride(0) == d and st.hidden.stride(0) == d and st.out.stride(0) == 4
        for name, t in bufs.items():
            assert t.is_contiguous(), name
        fma, block_n, bk = gemv_tile(gemv, b, self.n_gemv_k)
        sh = dict(B=b, D=d, SU=u.stride(0), V=self.vocab, LS=logits.stride(0),
                  NK=st.phase_next.shape[1], OUT_COL=p.head("lm").col, BB=16, BN=block_n,
                  BK=bk, FMA=fma, IEEE=dt == torch.float32, NH=n_heads, CAP=kv.capacity, NSPLIT=ns,
                  HD_S=self.hd_s, HD_F=self.hd_f, NKV_S=nkv_s, NKV_F=nkv_f,
                  BSW_S=max(16, min(64, 8192 // self.hd_s)),
                  BSW_F=max(16, min(64, 8192 // self.hd_f)), HDM=hdm, ANSWER_ID=-1)
        if p.delta is not None:
            dm = p.delta
            conv = next(iter(v for k, v in kv.states.items() if k[0] == "conv"))
            rec = next(iter(v for k, v in kv.states.items() if k[0] == "recurrent"))
            kc = kv.data[0, 0]
            cw0 = next(iter(v for k, v in self._f32.items() if k.startswith("conv_w.")))
            if kc.stride(3) != 1 or rec.stride(3) != 1 or rec.stride(2) != dm.v_dim:
                raise Unsupported("cache / state layouts")
            sh.update(HK=dm.n_k_heads, HV=dm.n_v_heads, DK=dm.k_dim, DV=dm.v_dim,
                      KC=cw0.shape[1], CS_B=conv.stride(0), CS_C=conv.stride(1),
                      CS_K=conv.stride(2), S_S=rec.stride(0), NKV=a.n_kv_heads, HD=a.head_dim,
                      R=rl.cos.shape[1], NTAB=rl.cos.shape[0], S_ROW=kc.stride(0),
                      S_HEAD=kc.stride(1), S_POS=kc.stride(2),
                      BS=max(16, min(64, 8192 // triton.next_power_of_2(a.head_dim))))
        else:   # (the DeltaNet / gated-attention code is built but never runs: any shapes)
            sh.update(HK=1, HV=1, DK=16, DV=16, KC=4, CS_B=1, CS_C=1, CS_K=1, S_S=1,
                      NKV=nkv_s, HD=self.hd_s, R=2, NTAB=1, S_ROW=1, S_HEAD=1, S_POS=1, BS=16)
        self.shape = sh
        # one GEMV config for every GEMV op (the compiler reads its block_n)
        self.gemv_cfg = {OP_HGEMV: G.GemvConfig(block_n, bk, 1, 8, 1, True)}

    # -- helpers ------------------------------------------------------------------------
    def _f(self, name: str, t: torch.Tensor) -> str:
        """A small per-layer vector / matrix as an fp32 buffer (exact: wider or the same)."""
        self._f32[name] = t.detach().float().contiguous()
        self.buffers[name] = self._f32[name]
        return name

    def _gemv(self, name, g, src: Operand, out: Operand, epi: int, after, sx: int, sy: int,
              norm=None, fp32_in: bool = False, mul=None):
        """norm: (norm op, x operand name, input fp32?) computed into hs first; fp32_in: the
        input is the fp32 residual x; mul: (operand, row stride) of an act * mul epilogue."""
        w = g["w"]
        if g.get("bias") is not None:
            raise Unsupported(f"{name}: a GEMV with a bias")
        if epi in (HK.EPI_GATED_SILU, HK.EPI_GATED_GELU) and w.shape[0] % 2:
            raise Unsupported(f"{name}: gated GEMV of {w.shape[0]} rows")
        self.buffers[f"w.{name}"] = w
        args = {"inp": src, "w": Operand(f"w.{name}"), "out": out}
        params = {"epi": epi, "k": w.shape[1], "sx": sx, "sy": sy, "fp32_in": int(fp32_in)}
        if norm is not None:
            nop, xin, f32 = norm
            if nop.norm not in ("rms_zc", "rms"):
                raise Unsupported(f"{name}: norm {nop.norm}")
            self.eps_seen.add(nop.eps)
            args.update(ln_inp=Operand(xin),
                        ln_gamma=Operand(self._f(f"nw.{name}",
                                                 self.fd.w[nop.weights[0] + ".weight"])))
            params["ln_in_f32"] = int(f32) + 2 * int(nop.norm == "rms")
        if mul is not None:
            args["mul"] = mul[0]
            params["s_mul"] = mul[1]
        self.n_gemv_k.append(w.shape[1])
        self.ops.append(ProgramOp(name, OP_HGEMV, args, params, after, rows=(0, w.shape[0])))
        return (name,)

    def _seg(self, name: str) -> tuple[Operand, int]:
        """A segment as (operand, its buffer's row stride)."""
        buf, off, _ = self.program.segment(name)
        return Operand(buf, off), self.fd.bufs[buf].stride(0)

    def _linear_gemv(self, lin):
        """The fused backend's GEMV record of a linear, or (one output, K not a multiple of
        16: the fused backend runs torch's linear) its weight as one."""
        g = self.fd.fused_gemvs.get(lin)
        if g is None and len(lin.dst) == 1 and all(a is None for a in lin.acts):
            w = self.fd.w[lin.weights[0] + ".weight"]
            if self.fd.w.get(lin.weights[0] + ".bias") is not None:
                raise Unsupported(f"linear {lin.weights[0]}: a bias")
            buf, off, _ = self.program.segment(lin.dst[0])
            g = dict(w=w.contiguous(), bias=None, buf=buf, off=off, epi=G.EPI_STORE)
        if g is None:
            raise Unsupported(f"linear {lin.weights}: no one-GEMV lowering")
        return g

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
            nxt = ops[i + 1] if i + 1 < len(ops) else None
            if op.kind == "per_layer_input" and i == 0:
                # (one GEMV + its torch tail, run before the kernel as the feedback is)
                self.pre = fd.lowered[0]
                i += 1
            elif op.kind == "norm" and op.src == ("x",) and nxt is not None and \
                    nxt.kind == "linear" and nxt.src == op.dst:
                g = self._linear_gemv(nxt)
                epi = {G.EPI_STORE: HK.EPI_STORE}.get(g["epi"])
                if g["epi"] == G.EPI_GATED:
                    epi = HK.EPI_GATED_SILU if g["act"] == "silu" else HK.EPI_GATED_GELU
                    i += 1                       # the act_mul is in the GEMV's epilogue
                if epi is None:
                    raise Unsupported(f"linear at {i + 1}: epilogue {g['epi']}")
                prev = self._gemv(f"lin{tag}", g, O("hs"), O(g["buf"], g["off"]), epi, prev,
                                  d, fd.bufs[g["buf"]].stride(0), norm=(op, "x", True))
                i += 2
            elif op.kind == "norm" and op.norm == "rms" and nxt is not None and \
                    nxt.kind == "add" and nxt.src == op.dst and nxt.dst == ("x",):
                # the sandwich norm + residual add (+ the layer scalar right after)
                src, s_src = self._seg(op.src[0])
                self.eps_seen.add(op.eps)
                args = {"src": src, "x": O("x"),
                        "w": O(self._f(f"sw.{i}", fd.w[op.weights[0] + ".weight"]))}
                after = ops[i + 2] if i + 2 < len(ops) else None
                scaled = after is not None and after.kind == "scale" and after.dst == ("x",)
                if scaled:
                    args["scale"] = O(self._f(f"scale.{i}", fd.w[after.weights[0]].reshape(-1)))
                self.ops.append(ProgramOp(f"normadd{tag}", OP_NORMADD, args,
                                          {"s_src": s_src}, prev))
                prev = (f"normadd{tag}",)
                i += 3 if scaled else 2
            elif op.kind == "linear" and op.src == ("x",) and nxt is not None and \
                    nxt.kind == "act_mul":
                g = fd.fused_gemvs.get(op)       # Gemma's per-layer input gate
                if g is None or g["epi"] != G.EPI_ACT_MUL:
                    raise Unsupported(f"linear x at {i}: one act * mul GEMV expected")
                epi = HK.EPI_ACT_MUL_SILU if g["act"] == "silu" else HK.EPI_ACT_MUL_GELU
                prev = self._gemv(f"pgate{tag}", g, O("x"), O(g["buf"], g["off"]), epi, prev,
                                  d, fd.bufs[g["buf"]].stride(0), fp32_in=True,
                                  mul=self._seg(g["mul"]))
                i += 2
            elif op.kind == "linear" and op.src != ("x",):
                g = self._linear_gemv(op)
                if g["epi"] != G.EPI_STORE:
                    raise Unsupported(f"linear at {i}: epilogue {g['epi']}")
                src, sx = self._seg(op.src[0])
                prev = self._gemv(f"lin{tag}", g, src, O(g["buf"], g["off"]), HK.EPI_STORE,
                                  prev, sx, fd.bufs[g["buf"]].stride(0))
                i += 1
            elif op.kind == "window_attention":
                prev = self._window_attention(op, tag, prev)
                i += 1
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
        lins = [o for o in hops if o.kind == "linear"]
        if not lins:
            raise Unsupported("lm head without a linear")
        self.vocab = fd.w[lins[0].weights[0] + ".weight"].shape[0]
        if not self.head:
            return
        if len(hops) != 2 or hops[0].kind != "norm" or hops[0].norm not in ("rms_zc", "rms") \
                or hops[1].kind != "linear" or head.segments != 1 or head.mask_answer:
            raise Unsupported("lm head: norm + linear expected (Gemma 4's softcap: head=False)")
        g = fd.fused_gemvs.get(hops[1])
        if g is None or g["epi"] != G.EPI_STORE or g["off"] != 0 or \
                fd.program.segment(head.logits)[0] != g["buf"]:
            raise Unsupported("lm head: one GEMV into the logits buffer expected")
        ls = fd.bufs[g["buf"]].stride(0)
        self._gemv("lm", g, O("hs"), O(g["buf"]), HK.EPI_STORE, ("advance",), d, ls,
                   norm=(hops[0], "hidden", False))
        self.ops.append(ProgramOp("argmax", OP_ARGMAX,
                                  {"logits": O(g["buf"]), "out": O("out"), "phase": O("phase"),
                                   "first": O("first")}, {"mask_col": -1}, ("lm",)))

    def _window_attention(self, op, tag: str, prev) -> tuple:
        """OP_WATTN per (row, head, split) + OP_WMERGE per (row, head) of one layer."""
        fd, O = self.fd, Operand
        la = op.param("attn")
        src = la.source
        kc, vc = fd.kv.k[src], fd.kv.v[src]
        ring = bool(fd.kv.ring[src])
        if ring != (la.window is not None) or (ring and kc.shape[2] > la.window):
            raise Unsupported(f"layer {op.layer}: a window without a ring (or a longer ring)")
        if not (kc.is_contiguous() and vc.is_contiguous()):
            raise Unsupported(f"layer {op.layer}: a strided state")
        self.buffers[f"kc.{src}"], self.buffers[f"vc.{src}"] = kc, vc
        q, _ = self._seg(op.src[0])
        if la.writes:
            k, _ = self._seg(op.src[1])
            v = k if la.k_eq_v else self._seg(op.src[2])[0]
        else:
            k = v = q
        out, _ = self._seg(op.dst[0])
        if any(t.buf != "u" for t in (q, k, v, out)):
            raise Unsupported("window attention operands outside u")
        cos, sin = fd.rotary.of(la)
        key = "_".join(str(x) for x in la.rope)
        self.buffers[f"rot_cos.{key}"], self.buffers[f"rot_sin.{key}"] = cos, sin
        self.eps_seen.add(op.eps)
        qn = self._f(f"wq_norm.{op.layer}", fd.w[op.weights[0] + ".weight"])
        kn = self._f(f"wk_norm.{op.layer}", fd.w[op.weights[1] + ".weight"]) \
            if la.writes else qn
        full = la.window is None
        args = {"q": q, "k": k, "v": v, "out": out, "kc": O(f"kc.{src}"),
                "vc": O(f"vc.{src}"), "q_norm": O(qn), "k_norm": O(kn),
                "cos": O(f"rot_cos.{key}"), "sin": O(f"rot_sin.{key}"),
                "scratch": O("attn_scratch")}
        params = {"layer": op.layer, "writes": la.writes, "ring": ring, "full": full,
                  "slots": kc.shape[2], "hd": la.head_dim}
        self.ops.append(ProgramOp(f"wattn{tag}", OP_WATTN, args, params, prev))
        self.ops.append(ProgramOp(f"wmerge{tag}", OP_WMERGE, {"out": out},
                                  {"layer": op.layer, "full": full, "hd": la.head_dim},
                                  (f"wattn{tag}",)))
        return (f"wmerge{tag}",)

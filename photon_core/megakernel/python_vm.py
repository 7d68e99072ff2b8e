"""The Python twin of the megakernel: executes the same instruction list with torch ops, in
the schedule's order.

Moondream-shaped programs (lowering.py) and the hybrid families' (hybrid_lowering.py: GEMVs
with a zero-centred norm prologue and store / residual / gated epilogues, a Gated DeltaNet
(row, key head) through the op's torch reference on that head's channels, gated attention
per (row, head, key split) and its merge per (row, head); Gemma 4's window attention per
(row, head, key split) and merge, the sandwich norm + add per row). The SM queues are interleaved as the GPU would run them: round after round, each queue whose
head instruction has its counters at their targets runs that instruction and signals; a round
in which no queue can move is a deadlock (raised: the schedule is wrong). Each op reads and
writes the same operands (buffer + element offset + the kernel's row strides) as kernel.py,
so a diff between the two localizes a kernel bug to one op.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops.delta_net_rows import delta_net_rows_reference
from .instructions import (OP_ADVANCE, OP_ARGMAX, OP_ATTN, OP_DELTA, OP_GATTN, OP_GEMV_LM,
                           OP_GEMV_W1, OP_GEMV_W2, OP_GMERGE, OP_HGEMV, OP_NORMADD, OP_WATTN,
                           OP_WMERGE, Instr)


class Deadlock(RuntimeError):
    pass


class PythonVM:
    def __init__(self, compiled, lowering):
        self.c, self.low = compiled, lowering
        self.sh = lowering.shape
        self.bufs = lowering.buffers
        for name, t in self.bufs.items():
            assert t.is_contiguous(), name

    def flat(self, operand) -> torch.Tensor:
        return self.bufs[operand.buf].view(-1)[operand.offset:]

    def rows(self, operand, stride: int, n_rows: int, width: int) -> torch.Tensor:
        f = self.flat(operand)
        return f.as_strided((n_rows, width), (stride, 1))

    def run(self) -> list[Instr]:
        """Execute every queue; returns the instructions in the order they ran."""
        self.heads_done: dict = {}
        queues = self.c.queues()
        counters = [0] * len(self.c.ops)
        heads = [0] * len(queues)
        done: list[Instr] = []
        while len(done) < len(self.c.instrs):
            moved = False
            for p, q in enumerate(queues):
                if heads[p] == len(q):
                    continue
                ins = q[heads[p]]
                if all(counters[w] >= t for w, t in ins.waits):
                    self.execute(ins)
                    counters[ins.signal] += 1
                    heads[p] += 1
                    done.append(ins)
                    moved = True
            if not moved:
                raise Deadlock(f"no queue can move after {len(done)} instructions")
        return done

    # -- the ops ----------------------------------------------------------------------
    def execute(self, ins: Instr) -> None:
        sh, a = self.sh, ins.args
        D, B, dt = sh["D"], sh["B"], self.bufs["hidden"].dtype
        if ins.op in (OP_GEMV_W1, OP_GEMV_W2, OP_GEMV_LM):
            n0, n1 = ins.tile
            k = sh["KW2"] if ins.op == OP_GEMV_W2 else D
            sx = sh["SU"] if ins.op == OP_GEMV_W2 else D
            if "ln_inp" in a:       # the fused LayerNorm of the bucket's rows
                # in the program's own scratch rows (hs), as the kernel: an instruction
                # marked ln_reuse reads what the program's previous one left there
                hs = self.bufs["hs"].view(-1)[ins.sm * B * D:(ins.sm + 1) * B * D].view(B, D)
                if not ins.ln_reuse:
                    xin = self.rows(a["ln_inp"], D, B, D).float()
                    hs.copy_(F.layer_norm(xin, (D,), self.flat(a["ln_gamma"])[:D].float(),
                                          self.flat(a["ln_beta"])[:D].float(), 1e-5).to(dt))
                x = hs.float()
            else:
                x = self.rows(a["inp"], sx, B, k).float()
            w = self.rows(a["w"], k, n1, k)[n0:].float()
            acc = x @ w.T + self.flat(a["bias"])[n0:n1].float()
            if ins.op == OP_GEMV_W2:
                y = self.rows(a["out"], D, B, D)
                y[:, n0:n1] += acc
            elif ins.op == OP_GEMV_LM:
                self.rows(a["out"], sh["LS"], B, n1)[:, n0:n1] = acc.to(dt)
            else:
                n_split, gap = ins.params["n_split"], ins.params["gap"]
                y = self.rows(a["out"], sh["SU"], B, sh["SU"])
                t = acc.to(dt)
                cols = torch.arange(n0, n1)
                lo, hi = cols < n_split, cols >= n_split
                y[:, cols[lo]] = t[:, lo]
                y[:, cols[hi] + gap] = F.gelu(t[:, hi].float(), approximate="tanh").to(dt)
        elif ins.op == OP_HGEMV:
            self._hgemv(ins)
        elif ins.op == OP_DELTA:
            self._delta(ins)
        elif ins.op == OP_GATTN:
            self._gated_attention(ins)
        elif ins.op == OP_GMERGE:
            self._gated_merge(ins)
        elif ins.op == OP_WATTN:
            self._window_attention(ins)
        elif ins.op == OP_WMERGE:
            self._window_merge(ins)
        elif ins.op == OP_NORMADD:
            self._norm_add(ins)
        elif ins.op == OP_ATTN:
            self._attention(ins)
            key = (ins.op_name,) + ins.tile
            self.heads_done[key] = self.heads_done.get(key, 0) + 1
            if self.heads_done[key] == ins.n_sub:     # the last of this (row, head): merge
                self._combine(ins)
        elif ins.op == OP_ADVANCE:
            r = ins.tile[0]
            if self.flat(a["active"])[r] != 0:
                self.flat(a["out_hidden"])[r * D:(r + 1) * D] = \
                    self.flat(a["x"])[r * D:(r + 1) * D].to(dt)
                self.flat(a["out_pos"])[r] += 1
                ph = int(self.flat(a["out_phase"])[r])
                kind = int(self.flat(a["kind"])[r])
                self.flat(a["out_phase"])[r] = self.flat(a["table"])[ph * sh["NK"] + kind]
                self.flat(a["out_first"])[r] = 0
        elif ins.op == OP_ARGMAX:
            r, v = ins.tile[0], sh["V"]
            ls = sh["LS"]
            logits = self.flat(a["logits"])[r * ls:r * ls + v].float().clone()
            if int(self.flat(a["phase"])[r]) == 0 and int(self.flat(a["first"])[r]) == 0 \
                    and ins.params["mask_col"] >= 0:
                logits[ins.params["mask_col"]] = float("-inf")
            self.flat(a["out"])[r * 4 + sh["OUT_COL"]] = logits.argmax()
        else:
            raise ValueError(ins.op)

    def _attention(self, ins: Instr) -> None:
        """Key splits [s0, s1) of one (row, head): their softmax partials (max, sum, weighted
        values) into the scratch, over the keys j <= the row's position (key pw = the new k/v
        from qkv, written into the cache by the split that holds it)."""
        sh, a = self.sh, ins.args
        nh, nkv, hd, half = sh["NH"], sh["NKV"], sh["HD"], sh["HALF"]
        chunk, ns = sh["CHUNK"], sh["NSPLIT"]
        row, h = ins.tile
        s0, s1 = ins.sub
        kvh = h // (nh // nkv)
        pos = int(self.flat(a["pos"])[row])
        pw = min(pos, sh["CAP"] - 1)
        ti = min(pos, sh["N_TABLE"] - 1)
        qkv = self.flat(a["qkv"])[row * sh["SU"]:][:(nh + 2 * nkv) * hd]
        cos = self.bufs["cos"][ti].float()
        sin = self.bufs["sin"][ti].float()

        def rope(x):    # rope.apply_rope's order: rotated pairs interleaved
            x = x.float()
            re, im = x[:half], x[half:2 * half]
            out = x.clone()
            out[0:2 * half:2] = re * cos - im * sin
            out[1:2 * half:2] = im * cos + re * sin
            return out

        def cache(op):      # as_strided's offset counts from the storage's start
            f = self.flat(op)
            return f.as_strided((sh["CAP"], hd), (sh["S_POS"], 1), f.storage_offset()
                                + row * sh["S_ROW"] + kvh * sh["S_HEAD"])

        kc, vc = cache(a["kc"]), cache(a["vc"])
        dt = kc.dtype
        q = rope(qkv[h * hd:(h + 1) * hd]).to(dt).float()
        k_new = rope(qkv[(nh + kvh) * hd:(nh + kvh + 1) * hd]).to(dt)
        v_new = qkv[(nh + nkv + kvh) * hd:(nh + nkv + kvh + 1) * hd]
        if s0 * chunk <= pw < s1 * chunk and h % (nh // nkv) == 0:
            kc[pw] = k_new
            vc[pw] = v_new.to(dt)
        scale = hd ** -0.5
        m_, l_, acc_ = self.bufs["sc_m"], self.bufs["sc_l"], self.bufs["sc_acc"]
        for sp in range(s0, s1):
            j0, j1 = sp * chunk, min((sp + 1) * chunk, pw + 1)
            idx = (row * nh + h) * ns + sp
            if j1 <= j0:              # the split holds no key of this row
                m_[idx], l_[idx] = float("-inf"), 0.0
                acc_[idx * hd:(idx + 1) * hd] = 0.0
                continue
            keys = kc[j0:j1].float().clone()
            vals = vc[j0:j1].float().clone()
            if j1 == pw + 1:          # the new key / value from registers
                keys[-1], vals[-1] = k_new.float(), v_new.float()
            sc = keys @ q * scale
            m = sc.max()
            p = torch.exp(sc - m)
            m_[idx], l_[idx] = m, p.sum()
            acc_[idx * hd:(idx + 1) * hd] = p @ vals

    def _combine(self, ins: Instr) -> None:
        """decode_attention._merge: the splits' partials of one (row, head) -> its output."""
        sh, a = self.sh, ins.args
        nh, hd, ns = sh["NH"], sh["HD"], sh["NSPLIT"]
        row, h = ins.tile
        base = (row * nh + h) * ns
        m = self.bufs["sc_m"][base:base + ns]
        l = self.bufs["sc_l"][base:base + ns]
        acc = self.bufs["sc_acc"][base * hd:(base + ns) * hd].view(ns, hd)
        mx = m.max()
        wt = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(m - mx))
        num, den = torch.zeros_like(acc[0]), torch.zeros_like(l[0])
        for s in range(ns):         # in split order, as the kernel's ORDERED merge
            num, den = num + acc[s] * wt[s], den + l[s] * wt[s]
        o = num / den
        out = self.flat(a["out"])[row * sh["SU"] + h * hd:][:hd]
        out.copy_(o.to(out.dtype))
        assert not math.isnan(float(out.float().sum()))

    # -- the hybrid families' ops (hybrid_lowering.py) -----------------------------------
    def _hgemv(self, ins: Instr) -> None:
        """GEMV rows [n0, n1): the zero-centred RMSNorm of x / hidden into the program's
        scratch rows first (unless ln_reuse), then store / fp32 residual add / act(gate) * up
        of (gate, up) row pairs (hybrid_kernel's EPI codes)."""
        from .hybrid_kernel import (EPI_ACT_MUL_GELU, EPI_ACT_MUL_SILU, EPI_GATED_GELU,
                                    EPI_RESIDUAL, EPI_STORE)
        sh, a, pr = self.sh, ins.args, ins.params
        D, B, dt = sh["D"], sh["B"], self.bufs["hidden"].dtype
        n0, n1 = ins.tile
        k = pr["k"]
        if "ln_inp" in a:
            hs = self.bufs["hs"].view(-1)[ins.sm * B * D:(ins.sm + 1) * B * D].view(B, D)
            if not ins.ln_reuse:
                xin = self.rows(a["ln_inp"], D, B, D).float()
                w = self.flat(a["ln_gamma"])[:D].float()
                if not pr["ln_in_f32"] & 2:       # zero-centred: (1 + w); plain RMSNorm: w
                    w = 1.0 + w
                rstd = 1.0 / torch.sqrt(xin.pow(2).mean(-1, keepdim=True) + self.low.eps)
                hs.copy_((xin * rstd * w).to(dt))
            x = hs.float()
        else:       # (the fp32 x rounded to the weights' dtype as the kernel loads it)
            x = self.rows(a["inp"], pr["sx"], B, k).to(dt).float()
        acc = x @ self.rows(a["w"], k, n1, k)[n0:].float().T
        epi = pr["epi"]
        if epi == EPI_RESIDUAL:
            self.rows(a["out"], pr["sy"], B, n1)[:, n0:n1] += acc
        elif epi == EPI_STORE:
            self.rows(a["out"], pr["sy"], B, n1)[:, n0:n1] = acc.to(dt)
        elif epi in (EPI_ACT_MUL_GELU, EPI_ACT_MUL_SILU):
            t = acc.to(dt).float()
            mul = self.rows(a["mul"], pr["s_mul"], B, n1)[:, n0:n1].float()
            act = F.gelu(t, approximate="tanh") if epi == EPI_ACT_MUL_GELU else F.silu(t)
            self.rows(a["out"], pr["sy"], B, n1)[:, n0:n1] = (act * mul).to(dt)
        else:
            t = acc.to(dt).float()
            g, u = t[:, 0::2], t[:, 1::2]
            act = F.gelu(g, approximate="tanh") if epi == EPI_GATED_GELU else F.silu(g)
            self.rows(a["out"], pr["sy"], B, n1 // 2)[:, n0 // 2:n1 // 2] = (act * u).to(dt)

    def _delta(self, ins: Instr) -> None:
        """Key head j of row r: delta_net_rows_reference over that head's channels (q, k, its
        value heads' v), gates, states and z, written back in place."""
        sh, a = self.sh, ins.args
        r, j = ins.tile
        hk, hv, dk, dv = sh["HK"], sh["HV"], sh["DK"], sh["DV"]
        g = hv // hk
        su = sh["SU"]

        def seg(op, width):
            return self.flat(op)[r * su:r * su + width]
        qkv = seg(a["qkv"], 2 * hk * dk + hv * dv)
        ch = torch.cat([torch.arange(j * dk, (j + 1) * dk),
                        torch.arange((hk + j) * dk, (hk + j + 1) * dk),
                        torch.arange(2 * hk * dk + j * g * dv, 2 * hk * dk + (j + 1) * g * dv)])
        heads = slice(j * g, (j + 1) * g)
        cstate = self.bufs[a["conv_state"].buf][r]
        state = self.bufs[a["state"].buf][r]
        cs = cstate[ch][None].clone()
        st = state[heads][None].clone()
        active = self.bufs["active"][r:r + 1].bool()
        out = delta_net_rows_reference(
            qkv[ch][None], seg(a["z"], hv * dv)[j * g * dv:(j + 1) * g * dv][None],
            seg(a["b_in"], hv)[heads][None], seg(a["a_in"], hv)[heads][None],
            self.bufs[a["conv_w"].buf][ch], cs, self.bufs[a["a_log"].buf][heads],
            self.bufs[a["dt_bias"].buf][heads], self.bufs[a["norm_w"].buf], st,
            (1, g, dk, dv), self.low.eps, active)
        cstate[ch] = cs[0]
        state[heads] = st[0]
        seg(a["out"], hv * dv)[j * g * dv:(j + 1) * g * dv] = out[0]

    def _gated_attention(self, ins: Instr) -> None:
        """Key split sp of query head h of row r: q / k zero-centred norms + rotate-half rotary
        at pos + offset; its span of the L = min(pos + 1, CAP) positions (the kernel's cut),
        the cache's before L-1 and the new k / v at L-1; the softmax partials (max, sum,
        weighted values) into the scratch. The group's first head's split 0 writes k / v
        into the cache slot."""
        sh, a = self.sh, ins.args
        r, h = ins.tile
        sp = ins.sub[0]
        nh, nkv, hd, rd, ns = sh["NH"], sh["NKV"], sh["HD"], sh["R"], sh["NSPLIT"]
        rep, su, cap, bs = nh // nkv, sh["SU"], sh["CAP"], sh["BS"]
        kvh = h // rep
        dt = self.bufs["hidden"].dtype
        pos = int(self.flat(a["pos"])[r])
        rp = min(max(pos + int(self.flat(a["pos_offset"])[r]), 0), sh["NTAB"] - 1)
        cos, sin = self.bufs["cos"][rp].float(), self.bufs["sin"][rp].float()

        def norm_rope(x, w):
            x = x.float()
            y = (x * torch.rsqrt(x.pow(2).mean() + self.low.eps) * (1.0 + w.float())).to(dt)
            y = y.float()
            half = rd // 2
            rot = torch.cat([-y[half:rd], y[:half]])
            out = y.clone()
            out[:rd] = y[:rd] * cos + rot * sin
            return out.to(dt)
        row = self.flat(a["qg"])[r * su:]
        q = norm_rope(row[h * 2 * hd:h * 2 * hd + hd], self.bufs[a["q_norm"].buf])
        kn = norm_rope(self.flat(a["k"])[r * su + kvh * hd:][:hd], self.bufs[a["k_norm"].buf])
        vn = self.flat(a["v"])[r * su + kvh * hd:][:hd]
        kc = self.bufs[a["kc"].buf][r, kvh]
        vc = self.bufs[a["vc"].buf][r, kvh]
        n = min(pos + 1, cap)
        span = -(-(-(-n // ns)) // bs) * bs
        lo, hi = sp * span, min(sp * span + span, n)
        keys = [kc[lo:min(hi, n - 1)].float()]
        vals = [vc[lo:min(hi, n - 1)].float()]
        if lo <= n - 1 < hi:
            keys.append(kn.to(kc.dtype).float()[None])
            vals.append(vn.to(vc.dtype).float()[None])
        keys, vals = torch.cat(keys), torch.cat(vals)
        if h % rep == 0 and sp == 0 and bool(self.bufs["active"][r]):
            slot = min(pos, cap - 1)
            kc[slot], vc[slot] = kn.to(kc.dtype), vn.to(vc.dtype)
        i = (r * nh + h) * ns + sp
        self._store_partial(i, keys, vals, q.float() * hd ** -0.5, hd)

    def _gated_merge(self, ins: Instr) -> None:
        """(row, head): the splits' partials merged (empty ones weigh 0), times
        sigmoid(gate), into the output segment."""
        sh, a = self.sh, ins.args
        r, h = ins.tile
        nh, hd, ns, su = sh["NH"], sh["HD"], sh["NSPLIT"], sh["SU"]
        o = self._merged((r * nh + h) * ns, ns, hd, hd)
        gate = self.flat(a["qg"])[r * su + h * 2 * hd + hd:][:hd].float()
        self.flat(a["out"])[r * su + h * hd:][:hd] = (o * torch.sigmoid(gate)).to(
            self.bufs["hidden"].dtype)

    def _store_partial(self, i: int, keys, vals, q, stride: int) -> None:
        """Softmax partial i of the hybrid attention scratch (max, sum, weighted values at
        columns [i * stride, + D)) of pre-scaled q over keys / values [n, D] (n = 0: empty)."""
        m_, l_, acc_ = self.bufs["attn_m"], self.bufs["attn_l"], self.bufs["attn_acc"]
        D = vals.shape[1]
        if keys.shape[0] == 0:
            m_[i], l_[i] = float("-inf"), 0.0
            acc_[i * stride:i * stride + D] = 0.0
            return
        sc = keys @ q
        m = sc.max()
        e = torch.exp(sc - m)
        m_[i], l_[i] = m, e.sum()
        acc_[i * stride:i * stride + D] = e @ vals

    def _merged(self, base: int, ns: int, stride: int, D: int) -> torch.Tensor:
        """The attention output [D] from the partials base .. base + ns - 1 (empty ones
        weigh 0)."""
        m = self.bufs["attn_m"][base:base + ns]
        l = self.bufs["attn_l"][base:base + ns]
        acc = self.bufs["attn_acc"][base * stride:(base + ns) * stride].view(ns, stride)[:, :D]
        wt = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(m - m.max()))
        return (acc * wt[:, None]).sum(0) / (l * wt).sum()

    # -- Gemma 4's ops ---------------------------------------------------------------------
    def _norm_add(self, ins: Instr) -> None:
        """Row r: x += RMSNorm(src) * w, then x *= the layer scalar when given."""
        sh, a = self.sh, ins.args
        r, D = ins.tile[0], sh["D"]
        s = self.flat(a["src"])[r * ins.params["s_src"]:][:D].float()
        x = self.flat(a["x"])[r * D:(r + 1) * D]
        y = x.float() + s / torch.sqrt(s.pow(2).mean() + self.low.eps) * \
            self.flat(a["w"])[:D].float()
        if "scale" in a:
            y = y * self.flat(a["scale"])[0].float()
        x.copy_(y.to(x.dtype))

    def _window_attention(self, ins: Instr) -> None:
        """Key split sp of (row, head) of a window layer: hybrid_kernel._wattn's cut of the
        valid slots (a ring's <= p, or 0 .. p of the capacity), the new slot from the normed
        and rotated k / scale-free v on a writing layer (its group's first head's split 0
        stores them), every slot from the cache on a KV-shared one; partials into the
        scratch."""
        sh, a, pr = self.sh, ins.args, ins.params
        r, h = ins.tile
        sp = ins.sub[0]
        D = pr["hd"]
        nkv = sh["NKV_F"] if pr["full"] else sh["NKV_S"]
        nh, ns_, su, hdm = sh["NH"], sh["NSPLIT"], sh["SU"], sh["HDM"]
        bs = sh["BSW_F"] if pr["full"] else sh["BSW_S"]
        rep = nh // nkv
        kvh = h // rep
        dt = self.bufs["hidden"].dtype
        p = min(int(self.bufs["pos"][r]), sh["CAP"] - 1)
        cos = self.flat(a["cos"])[p * D:(p + 1) * D].float()
        sin = self.flat(a["sin"])[p * D:(p + 1) * D].float()

        def norm_rot(x, w, rotate=True):
            x = x.float()
            y = x / torch.sqrt(x.pow(2).mean() + self.low.eps)
            if w is not None:
                y = y * w.float()
            if rotate:
                y = y * cos + torch.cat([-y[D // 2:], y[:D // 2]]) * sin
            return y.to(dt)
        q = norm_rot(self.flat(a["q"])[r * su + h * D:][:D], self.flat(a["q_norm"])[:D])
        n_slots = pr["slots"]
        kc = self.bufs[a["kc"].buf][r, kvh]
        vc = self.bufs[a["vc"].buf][r, kvh]
        slot = p % n_slots if pr["ring"] else p
        n = min(p + 1, n_slots)
        span = -(-(-(-n // ns_)) // bs) * bs
        lo, hi = sp * span, min(sp * span + span, n)
        idx = [j for j in range(lo, hi) if not (pr["writes"] and j == slot)]
        keys = [kc[idx].float()]
        vals = [vc[idx].float()]
        if pr["writes"]:
            kn = norm_rot(self.flat(a["k"])[r * su + kvh * D:][:D], self.flat(a["k_norm"])[:D])
            vn = norm_rot(self.flat(a["v"])[r * su + kvh * D:][:D], None, rotate=False)
            if h % rep == 0 and sp == 0 and bool(self.bufs["active"][r]):
                kc[slot], vc[slot] = kn.to(kc.dtype), vn.to(vc.dtype)
            if lo <= slot < hi:
                keys.append(kn.to(kc.dtype).float()[None])
                vals.append(vn.to(vc.dtype).float()[None])
        keys, vals = torch.cat(keys), torch.cat(vals)
        i = (r * nh + h) * ns_ + sp
        self._store_partial(i, keys, vals, q.float() * self.low.window_scale, hdm)

    def _window_merge(self, ins: Instr) -> None:
        sh, a = self.sh, ins.args
        r, h = ins.tile
        D, nh, ns_, hdm = ins.params["hd"], sh["NH"], sh["NSPLIT"], sh["HDM"]
        o = self._merged((r * nh + h) * ns_, ns_, hdm, D)
        self.flat(a["out"])[r * sh["SU"] + h * D:][:D] = o.to(self.bufs["hidden"].dtype)

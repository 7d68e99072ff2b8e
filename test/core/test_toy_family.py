"""The plugin boundary: a second, toy model family defined only in this test - a 2-layer
Llama-style decoder (RMSNorm, fused qkv without bias, full rotary, GQA, SwiGLU MLP, untied lm
head) with a text-only skill - runs through the runtime's eager and fused backends (state
cache rows, prompt prefill, graph-runner pieces, feedback, row advance) and through
FastEngine itself (its FastFamily view: prefix state, prompts, TextTask protocol; pipelined
decoding, batches, zombies, the long-prompt prefill), nothing in photon_core changed for it,
and matches its own reference: greedy tokens, and the hidden states to fp32 rounding. A
second toy program (defined here too) takes the per-layer attention path: a sliding layer as
a ring, a global layer of its own head size and RoPE, a KV-shared layer, scaled-token
feedback, a soft-capped head, through the same runtime files."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from photon_core.engine import Capabilities, EngineOptions
from photon_core.fast.cuda_graph_runner import CudaGraphRunner
from photon_core.fast.decode_step import StepState, lm_greedy
from photon_core.fast.graphed_prefill import GraphedPrefill
from photon_core.fast.static_kv_cache import StaticKVCache
from photon_core.ops.rope import apply_rope, rope_angles
from photon_core.program import (AttentionSpec, Feedback, Head, LayerState, Program,
                                 ProgramBuilder, StepSpec)

DIM, LAYERS, NH, NKV, HD, FF, VOCAB, EPS = 64, 2, 4, 2, 16, 128, 96, 1e-6


class ToyWeights(dict):
    @property
    def device(self):
        return self["tok.wte"].device

    @property
    def dtype(self):
        return self["tok.wte"].dtype


def toy_weights(seed=0) -> ToyWeights:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s
    w = ToyWeights({"tok.wte": r(VOCAB, DIM, s=1.0), "final.weight": 1 + r(DIM, s=0.1),
                    "lm_head.weight": r(VOCAB, DIM)})
    for i in range(LAYERS):
        p = f"l.{i}"
        w.update({f"{p}.ln1.weight": 1 + r(DIM, s=0.1), f"{p}.ln2.weight": 1 + r(DIM, s=0.1),
                  f"{p}.attn.qkv.weight": r((NH + 2 * NKV) * HD, DIM),
                  f"{p}.attn.o.weight": r(DIM, NH * HD),
                  f"{p}.mlp.gate.weight": r(FF, DIM), f"{p}.mlp.up.weight": r(FF, DIM),
                  f"{p}.mlp.down.weight": r(DIM, FF)})
    return w


# -- the family: its step program, written once ---------------------------------------------
def toy_program() -> Program:
    b = ProgramBuilder()
    for i in range(LAYERS):
        p = f"l.{i}"
        b.norm("x", "h", p + ".ln1", kind="rms", eps=EPS)
        b.linear("h", ["qkv"], [p + ".attn.qkv"])
        b.attention("qkv", "a", layer=i)
        b.residual(["a"], [p + ".attn.o"])
        b.norm("x", "h", p + ".ln2", kind="rms", eps=EPS)
        b.linear("h", ["gate", "up"], [p + ".mlp.gate", p + ".mlp.up"])   # one GEMV fused
        b.act_mul("gate", "up", "m", "silu")
        b.residual(["m"], [p + ".mlp.down"])
    lm = ProgramBuilder()
    lm.norm("hidden", "h", "final", kind="rms", eps=EPS)
    lm.linear("h", ["logits"], ["lm_head"])
    return Program(
        dim=DIM,
        buffers=(("h", (("h", DIM),)),
                 ("u", (("qkv", (NH + 2 * NKV) * HD), ("a", NH * HD), ("gate", FF),
                        ("up", FF), ("m", FF))),
                 ("logits", (("logits", VOCAB),))),
        ops=b.build(), attention=AttentionSpec(NH, NKV, HD, rot_dim=HD),
        state=tuple(LayerState("kv", i) for i in range(LAYERS)),
        heads=(("lm", Head(lm.build(), "logits", col=0)),),
        feedback=Feedback("token", (("wte", "tok.wte"),)), vocab=VOCAB)


STOP, MAX_CONTEXT = 12, 200   # STOP: a token the seed-0 toy picks mid-answer for some prompts


class ToyFamily:
    """The toy family's runtime view (photon_core/fast/fast_family.py: FastFamily): its step
    program (one phase: text, which feeds back its token), prompts (one token per
    character), the prefix state of an "image" (a list of prefix token ids) and the
    TextTask protocol."""

    def __init__(self, model):
        self.model, self.weights = model, model.weights
        self.spec = StepSpec(toy_program(), phase_next=((0,),), answer_id=None)
        self.device, self.dtype = self.weights.device, self.weights.dtype
        self.max_context = MAX_CONTEXT
        self.make_encoder = lambda use_graphs: None
        self.make_batch_encoder = lambda *a, **k: None    # whole images, one by one
        self.encode_image = model.encode_image

    def prefix(self, enc):
        if enc.model_id != self.model.model_id:
            raise ValueError("this prefix was made by a different model")
        return enc

    def prompt(self, task, enc) -> list[int]:
        return toy_prompt(task)

    def count_prompt_tokens(self, task) -> int:
        return len(toy_prompt(task))

    def task_protocol(self, task, ignore_eos, room):
        from photon_core.fast.fast_family import TextTask
        return TextTask(task, (STOP,), task.max_tokens, ignore_eos)

    def decode(self, ids) -> str:
        return "".join(chr(65 + i % 26) for i in ids)

    def prefill_long(self, kv, row, start, prompt, enc):
        return None                      # the runtime's generic (eager backend) prefill


class ToyModel:
    """The toy family's reference engine, as far as the runtime needs it."""
    model_id = "toy"
    capabilities = Capabilities("toy", "the toy family", frozenset({"query"}))

    def __init__(self, weights):
        self.weights = weights

    def fast_family(self) -> ToyFamily:
        return ToyFamily(self)

    def encode_image(self, image):
        """image: the prefix token ids -> PrefixState (their k/v, by the reference)."""
        from photon_core.engine import PrefixState
        if isinstance(image, PrefixState):
            return image
        _, kv = reference_hidden(self.weights, list(image), return_kv=True)
        return PrefixState(model_id=self.model_id, kv=kv)


def toy_prompt(task) -> list[int]:
    return [ord(c) % VOCAB for c in task.question]


# -- the family's own reference: plain eager torch over the whole sequence -------------------
def rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(w.dtype)


def reference_hidden(w, ids: list[int], return_kv: bool = False):
    """Last-layer hidden states [T, DIM] of the token sequence (no cache, causal); with
    return_kv also the k/v of every layer [LAYERS, 2, 1, NKV, T, HD]."""
    T = len(ids)
    x = F.embedding(torch.tensor(ids), w["tok.wte"])
    cos, sin = rope_angles(torch.arange(T), HD)
    kvs = []
    for i in range(LAYERS):
        p = f"l.{i}"
        qkv = F.linear(rms(x, w[p + ".ln1.weight"]), w[p + ".attn.qkv.weight"])
        q, k, v = qkv.split([NH * HD, NKV * HD, NKV * HD], dim=-1)
        q = apply_rope(q.view(T, NH, HD).transpose(0, 1)[None], cos, sin)
        k = apply_rope(k.view(T, NKV, HD).transpose(0, 1)[None], cos, sin)
        v = v.view(T, NKV, HD).transpose(0, 1)[None]
        kvs.append(torch.stack([k, v]))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(a[0].transpose(0, 1).reshape(T, NH * HD), w[p + ".attn.o.weight"])
        h = rms(x, w[p + ".ln2.weight"])
        m = F.silu(F.linear(h, w[p + ".mlp.gate.weight"])) * F.linear(h, w[p + ".mlp.up.weight"])
        x = x + F.linear(m, w[p + ".mlp.down.weight"])
    return (x, torch.stack(kvs)) if return_kv else x


def reference_generate(w, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids = list(prompt)
    for _ in range(n):
        h = reference_hidden(w, ids)[-1]
        ids.append(int(F.linear(rms(h, w["final.weight"]), w["lm_head.weight"]).argmax()))
    return ids[len(prompt):], reference_hidden(w, ids[:-1])[-1]


# -- the runtime, unchanged --------------------------------------------------------------------
def runtime_generate(model, prompts: list[list[int]], n: int, fused: str):
    rows, cap = 4, 32
    kv = StaticKVCache.for_program(toy_program(), rows, cap, "cpu", torch.float32)
    st = StepState(model, rows, kv, EngineOptions(fused=fused))
    assert (st.fused is not None) == (fused == "on")
    prefill = GraphedPrefill(st, use_graphs=False)
    runner = CudaGraphRunner(st, rows, use_graphs=False)
    assert runner.pieces == ("lm", "lm_sample", "forward")
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):       # rows at different positions
            last = prefill.run(row, 0, prompt).clone()
            st.set_row(row, last, len(prompt), 0, 0, 0.0, 1.0)
        st.active[:len(prompts)] = True
        b = runner.bucket(len(prompts))
        tokens = [[] for _ in prompts]
        for step in range(n):
            runner.run("lm", b)
            for r in range(len(prompts)):
                tokens[r].append(int(st.out[r, 0]))
            if step < n - 1:
                runner.run("forward", b)
    return tokens, st.hidden[:len(prompts)].clone()


PROMPTS = [[3, 17, 42, 5, 9], [11, 2, 60, 7, 33, 81, 20, 4, 50, 13, 1]]


@pytest.mark.parametrize("fused", ["off", "on"])
def test_toy_family_runs_on_the_runtime_and_matches_its_reference(fused):
    if fused == "on":
        pytest.importorskip("triton")
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("interpreted Triton kernels on CPU tensors (TRITON_INTERPRET=1)")
    w = toy_weights()
    n = 6
    got, hidden = runtime_generate(ToyModel(w), PROMPTS, n, fused)
    for r, prompt in enumerate(PROMPTS):
        ref_tokens, ref_hidden = reference_generate(w, prompt, n)
        assert got[r] == ref_tokens, (r, got[r], ref_tokens)
        err = (hidden[r] - ref_hidden).abs().max().item()
        assert err <= 1e-4 * (1 + ref_hidden.abs().max().item()), err


def test_state_cache_holds_what_the_program_declares():
    """A program's state (k/v layers and recurrent layers) sizes the state cache, and a
    PrefixState of any length with recurrent states loads into a row."""
    import dataclasses

    from photon_core.engine import PrefixState

    prog = dataclasses.replace(toy_program(), state=(LayerState("kv", 0), LayerState(
        "recurrent", 1, (NKV, HD, HD)), LayerState("kv", 2)))
    cache = StaticKVCache.for_program(prog, rows=3, capacity=40, device="cpu",
                                      dtype=torch.float32)
    assert cache.data.shape == (2, 2, 3, NKV, 40, HD)
    assert [t.shape for t in cache.recurrent] == [(3, NKV, HD, HD)]
    for t in (7, 23):                                   # a variable number of prefix tokens
        kv = torch.randn(2, 2, 1, NKV, t, HD)
        rec = (torch.randn(NKV, HD, HD),)
        start = cache.load_prefix(1, PrefixState(model_id="toy", kv=kv, recurrent=rec))
        assert start == t and torch.equal(cache.data[:, :, 1, :, :t], kv[:, :, 0])
        assert torch.equal(cache.recurrent[0][1], rec[0])
    with pytest.raises(ValueError, match="recurrent"):
        cache.load_prefix(0, PrefixState(model_id="toy", kv=kv))
    with pytest.raises(ValueError, match="does not fit"):
        cache.load_prefix(0, PrefixState(model_id="toy", kv=torch.zeros(2, 2, 1, NKV, 41, HD),
                                         recurrent=rec))


# -- the toy family through FastEngine itself ---------------------------------------------------
def reference_run(w, prefix: list[int], task) -> tuple[str, int, str]:
    """The toy's reference task loop: greedy tokens after prefix + prompt; STOP ends it
    ("stop"), max_tokens ends it ("length") -> (answer, tokens, finish_reason)."""
    ids, out = list(prefix) + toy_prompt(task), []
    while True:
        h = reference_hidden(w, ids)[-1]
        tok = int(F.linear(rms(h, w["final.weight"]), w["lm_head.weight"]).argmax())
        if tok == STOP:
            reason = "stop"
            break
        out.append(tok)
        if len(out) >= task.max_tokens:
            reason = "length"
            break
        ids.append(tok)
    return "".join(chr(65 + i % 26) for i in out), len(out), reason


FAST_TASKS = ["abc", "hello there", "what is it", "zz", "a" * 150]   # the last: > 128 tokens


@pytest.mark.parametrize("fused", ["off", "on"])
def test_toy_family_runs_through_fast_engine(fused):
    from photon_core.fast import FastEngine
    from photon_core.task import Task

    if fused == "on":
        pytest.importorskip("triton")
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("interpreted Triton kernels on CPU tensors (TRITON_INTERPRET=1)")
    w = toy_weights()
    model = ToyModel(w)
    prefixes = [[5, 9, 14, 3, 22, 1, 40], [61, 2, 8]]
    tasks = [Task("query", question=q, max_tokens=n)
             for q, n in zip(FAST_TASKS, (6, 9, 4, 7, 3))]
    want = {(p, q.question): reference_run(w, prefixes[p], q) for p in range(2) for q in tasks}
    assert {r for _, _, r in want.values()} == {"stop", "length"}   # both endings happen
    fe = FastEngine(model, max_batch=4, fused=fused)
    assert (fe.state.fused is not None) == (fused == "on")
    encs = [fe.encode_image(p) for p in prefixes]

    def check(p, task, res):
        assert (res.output["answer"], res.tokens, res.finish_reason) == want[(p, task.question)]
    # (interpreted kernels are slow: the fused backend gets a subset)
    singles = tasks if fused == "off" else [tasks[0], tasks[2], tasks[4]]
    for p, enc in enumerate(encs if fused == "off" else encs[:1]):   # the pipelined loop
        for t in singles:
            check(p, t, fe.run(enc, t))
    for batch in ((2, 4) if fused == "off" else (2,)):   # mixed lengths in a batch: zombies
        group = [(k % 2, tasks[(k + batch) % len(tasks)]) for k in range(batch)]
        for (p, t), res in zip(group, fe.run_batch([(encs[p], t) for p, t in group])):
            check(p, t, res)
    fe.close()


# -- a second toy: per-layer attention over rings (the runtime's window_attention op) --------
# layer 0: sliding (window 6, a ring), 4 x 16 heads, 2 k/v heads; layer 1: global, 2 x 32
# heads, 1 k/v head, half the pairs rotated at theta 1e6; layer 2: KV-shared (reads layer
# 0's ring). Scaled token embeddings, plain adds, a soft-capped lm head. Its reference below
# recomputes the whole sequence without a cache (a mask for the window).
WIN = 6
WLAYERS = (dict(nh=4, nkv=2, hd=16, theta=1e4, frac=1.0, window=WIN, source=0),
           dict(nh=2, nkv=1, hd=32, theta=1e6, frac=0.5, window=None, source=1),
           dict(nh=4, nkv=2, hd=16, theta=1e4, frac=1.0, window=WIN, source=0))
CAP = 5.0


def window_weights(seed=1) -> ToyWeights:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s
    w = ToyWeights({"tok.wte": r(VOCAB, DIM, s=1.0), "final.weight": 1 + r(DIM, s=0.1),
                    "lm_head.weight": r(VOCAB, DIM)})
    for i, L in enumerate(WLAYERS):
        p, qd, kd = f"l.{i}", L["nh"] * L["hd"], L["nkv"] * L["hd"]
        w.update({f"{p}.ln1.weight": 1 + r(DIM, s=0.1), f"{p}.q.weight": r(qd, DIM),
                  f"{p}.qn.weight": 1 + r(L["hd"], s=0.1),
                  f"{p}.kn.weight": 1 + r(L["hd"], s=0.1), f"{p}.o.weight": r(DIM, qd),
                  f"{p}.ln2.weight": 1 + r(DIM, s=0.1), f"{p}.up.weight": r(FF, DIM),
                  f"{p}.gate.weight": r(FF, DIM), f"{p}.down.weight": r(DIM, FF)})
        if L["source"] == i:
            w.update({f"{p}.k.weight": r(kd, DIM), f"{p}.v.weight": r(kd, DIM)})
    return w


def window_program() -> Program:
    from photon_core.program import LayerAttention
    b = ProgramBuilder()
    segs = {}
    for i, L in enumerate(WLAYERS):
        p, t = f"l.{i}", "s" if L["window"] else "f"
        la = LayerAttention(L["nh"], L["nkv"], L["hd"], L["theta"], L["frac"],
                            window=L["window"], source=L["source"], writes=L["source"] == i)
        segs.setdefault(t, L)
        b.norm("x", "h", p + ".ln1", kind="rms", eps=EPS)
        names = ["q", "k", "v"] if la.writes else ["q"]
        b.linear("h", [n + t for n in names], [f"{p}.{n}" for n in names])
        b.window_attention("q" + t, "k" + t, "v" + t, "a" + t, p + ".qn", p + ".kn", i, la,
                           eps=EPS)
        b.linear("a" + t, ["o"], [p + ".o"])
        b.add("o")
        b.norm("x", "h", p + ".ln2", kind="rms", eps=EPS)
        b.linear("h", ["gate", "up"], [p + ".gate", p + ".up"])
        b.act_mul("gate", "up", "m", "gelu_tanh")
        b.residual(["m"], [p + ".down"])
    lm = ProgramBuilder()
    lm.norm("hidden", "h", "final", kind="rms", eps=EPS)
    lm.linear("h", ["logits"], ["lm_head"])
    lm.softcap("logits", "logits", CAP)
    u = []
    for t, L in segs.items():
        u += [("q" + t, L["nh"] * L["hd"]), ("k" + t, L["nkv"] * L["hd"]),
              ("v" + t, L["nkv"] * L["hd"]), ("a" + t, L["nh"] * L["hd"])]
    state = tuple(LayerState("ring", i, (L["nkv"], WIN, L["hd"])) if L["window"]
                  else LayerState("kv", i, (L["nkv"], L["hd"]))
                  for i, L in enumerate(WLAYERS) if L["source"] == i)
    return Program(
        dim=DIM, buffers=(("h", (("h", DIM), ("o", DIM))),
                          ("u", tuple(u) + (("gate", FF), ("up", FF), ("m", FF))),
                          ("logits", (("logits", VOCAB),))),
        ops=b.build(), attention=AttentionSpec(4, 2, 16, rot_dim=16), state=state,
        heads=(("lm", Head(lm.build(), "logits", col=0)),),
        feedback=Feedback("scaled_token", (("wte", "tok.wte"),),
                          params=(("scale", DIM ** 0.5),)), vocab=VOCAB)


def _rotate(x, pos, hd, theta, frac):
    n = int(frac * hd // 2)
    f = torch.cat([1.0 / theta ** (torch.arange(0, 2 * n, 2).float() / hd),
                   torch.zeros(hd // 2 - n)])
    ang = pos.float()[:, None] * f[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def window_reference_logits(w, ids: list[int]) -> torch.Tensor:
    """The last token's logits, the whole sequence recomputed (no cache)."""
    T = len(ids)
    pos = torch.arange(T)
    x = w["tok.wte"][torch.tensor(ids)] * torch.tensor(DIM ** 0.5)
    kv = {}
    for i, L in enumerate(WLAYERS):
        p, hd = f"l.{i}", L["hd"]
        h = rms(x, w[p + ".ln1.weight"])
        q = _rotate(rms(F.linear(h, w[p + ".q.weight"]).view(T, -1, hd), w[p + ".qn.weight"]),
                    pos, hd, L["theta"], L["frac"])
        if L["source"] == i:
            k = rms(F.linear(h, w[p + ".k.weight"]).view(T, -1, hd), w[p + ".kn.weight"])
            v = F.linear(h, w[p + ".v.weight"]).view(T, -1, hd)
            v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
            kv[i] = (_rotate(k, pos, hd, L["theta"], L["frac"]), v)
        k, v = kv[L["source"]]
        rep = L["nh"] // L["nkv"]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        seen = pos[None, :] <= pos[:, None]
        if L["window"]:
            seen = seen & (pos[None, :] > pos[:, None] - L["window"])
        s = torch.einsum("thd,shd->hts", q, k).masked_fill(~seen[None], float("-inf"))
        a = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, -1)
        x = x + F.linear(a, w[p + ".o.weight"])
        h = rms(x, w[p + ".ln2.weight"])
        m = F.gelu(F.linear(h, w[p + ".gate.weight"]), approximate="tanh") * \
            F.linear(h, w[p + ".up.weight"])
        x = x + F.linear(m, w[p + ".down.weight"])
    lg = F.linear(rms(x[-1], w["final.weight"]), w["lm_head.weight"])
    return torch.tanh(lg / CAP) * CAP


@pytest.mark.parametrize("fused", ["off", "on"])
def test_window_attention_toy_on_the_runtime(fused):
    """A second family's per-layer attention (ring, global with its own head size and
    RoPE, KV-shared), scaled-token feedback and soft-capped head through the runtime's
    state cache, padded prompt prefill (the rings wrap inside one bucket) and decode steps:
    its reference's greedy tokens, and its logits to fp32 rounding."""
    if fused == "on":
        pytest.importorskip("triton")
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("interpreted Triton kernels on CPU tensors (TRITON_INTERPRET=1)")
    w = window_weights()
    spec = StepSpec(window_program(), phase_next=((0,),), answer_id=None)
    st = StepState.of_spec(spec, w, 2, 40, EngineOptions(fused=fused))
    assert st.kv.k[0].shape == (2, 2, WIN, 16) and st.kv.k[1].shape == (2, 1, 40, 32)
    assert 2 not in st.kv.k
    prefill = GraphedPrefill(st, use_graphs=False)
    prompts, n = [[3, 17, 42, 5, 9, 70, 8, 1, 44, 23, 61], [11, 2, 60]], 12
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):     # 11 tokens: bucket 16, 5 of padding
            st.set_row(row, prefill.run(row, 0, prompt).clone(), len(prompt), 0, 0, 0.0, 1.0)
        st.active[:2] = True
        toks, logits = [[], []], [[], []]
        for step in range(n):
            lg = st.backend.head_logits("lm", st.hidden[:2]).float().clone()
            lm_greedy(st, 2)
            for r in range(2):
                toks[r].append(int(st.out[r, 0]))
                logits[r].append(lg[r])
            st.backend.forward(st, 2, st.kv.capacity)
    for r, prompt in enumerate(prompts):
        ids = list(prompt)
        for s in range(n):
            want = window_reference_logits(w, ids)
            torch.testing.assert_close(logits[r][s], want, atol=2e-4, rtol=1e-4)
            assert toks[r][s] == int(want.argmax())
            ids.append(toks[r][s])
    assert len(prompts[0]) + n > 2 * WIN                    # the ring wrapped, twice

"""Gemma 4's decode step as a step program (models/gemma4/program.py) through the runtime's
eager and fused backends (fast/eager_backend.py, fast/fused_backend.py, with the
window_attention op of fast/window_state_ops.py over fast/static_kv_cache.py's per-layer
rings), driven by the runtime's own step pieces (fast/decode_step.py lm_greedy and
forward) over a state cache of two rows at different positions: one text-only prompt, one
image prefix (the reference engine's encode_image) + a question. Both must match the Gemma
reference engine: the logits of the prefill's last token and of 16 greedy steps, and the 17
greedy tokens. The tiny model's sliding window is 8: every context here is longer, so the
ring state wraps; layers 4 and 5 are KV-shared (one sliding, one global), global layers have
wider heads and proportional RoPE, per-layer embeddings, double-wide MLPs, soft-capping."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from photon_core.engine import EngineOptions
from photon_core.fast import decode_step as ds
from photon_core.models.gemma4 import load_model, make_test_model, text
from photon_core.models.gemma4.kv_cache import KVCache
from photon_core.models.gemma4.program import layer_attentions, step_program
from photon_core.program import StepSpec

STEPS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = make_test_model(tmp_path_factory.mktemp("g4p"), seed=3)
    return load_model(str(ckpt), max_soft_tokens=70)


@pytest.fixture(scope="module")
def enc(model):
    img = np.random.default_rng(11).integers(0, 256, (36, 30, 3), dtype=np.uint8)
    return model.encode_image(img)


def text_ids(model) -> list[int]:
    ids = [model.config.text.bos_id] + model.prompter.tok.encode(
        "Describe this image in detail. What color is the cup?",
        add_special_tokens=False).ids
    assert 8 < len(ids) <= 16          # longer than the window, one fused prefill pass
    return ids


def reference_after_prefix(model, enc, tail: list[int], steps: int):
    """The reference engine's greedy loop after an encoded image prefix."""
    cache = KVCache(model.config.text, enc.length + len(tail) + steps, model.device,
                    model.dtype)
    cache.load_prefix(enc.cache, enc.length)
    out, toks = [], []
    with torch.inference_mode():
        h = model.forward_ids(torch.tensor(tail), enc.length, cache)
        pos = enc.length + len(tail)
        for s in range(steps + 1):
            lg = text.logits(model.weights, model.config.text, h[-1])
            out.append(lg.float())
            toks.append(int(lg.argmax()))
            if s == steps:
                break
            h = model.forward_ids(torch.tensor([toks[-1]]), pos, cache)
            pos += 1
    return torch.stack(out), toks


def make_state(model, rows: int, capacity: int, fused: bool = False, spec=None):
    """The runtime's StepState over a state cache of the program's declared state."""
    return ds.StepState.of_spec(spec or model.step_spec(), model.weights, rows, capacity,
                                EngineOptions(fused="on" if fused else "off"))


def prefill(st, ids, row: int, start: int, fused: bool = False):
    """ids at positions start.. of `row` through a backend's prefill -> hidden [T, dim]."""
    return st.prefill_tokens(row, start, torch.tensor(ids),
                             backend=st.fused if fused else st.eager)


def set_row(st, row, hidden, pos):
    st.set_row(row, hidden, pos, 0, 0, 0.0, 1.0)


def program_generate(model, enc, rows_input, steps: int, fused: bool, chunks=None):
    """rows_input: per row (prefix or None, prompt ids). -> per row (logits, tokens)."""
    spec = model.step_spec()
    cap = 128
    assert all((0 if p is None else p.length) + len(i) + steps <= cap for p, i in rows_input)
    st = make_state(model, 2, cap, fused, spec)
    logits = [[] for _ in rows_input]
    toks = [[] for _ in rows_input]
    with torch.inference_mode():
        for row, (prefix, ids) in enumerate(rows_input):
            start = 0 if prefix is None else st.kv.load_prefix(
                row, model.fast_family().prefix(prefix))
            parts = chunks or [len(ids)]
            at = 0
            for n in parts:                  # the prompt in chunks (ring wraps inside one)
                h = prefill(st, ids[at:at + n], row, start + at, fused)
                at += n
            set_row(st, row, h[-1], start + len(ids))
        b = len(rows_input)
        st.active[:b] = True
        for s in range(steps + 1):
            lg = st.backend.head_logits("lm", st.hidden[:b]).float().clone()
            ds.lm_greedy(st, b)
            for r in range(b):
                logits[r].append(lg[r])
                toks[r].append(int(st.out[r, 0]))
            if s < steps:
                ds.forward(st, b)
    return [(torch.stack(lg), t) for lg, t in zip(logits, toks)] + [st]


def check(got, ref, tol):
    (g_logits, g_toks), (r_logits, r_toks) = got, ref
    assert g_toks == r_toks
    err = (g_logits - r_logits).abs().max().item()
    assert err <= tol, err


@pytest.fixture(scope="module")
def refs(model, enc):
    """The reference engine's greedy runs: text-only, and image prefix + question."""
    ids = text_ids(model)
    tail = model.prompter.task_tail("query", "What color is the cup?")
    assert enc.length > model.config.text.sliding_window
    ref_text = model.greedy(ids, STEPS)
    ref_image = reference_after_prefix(model, enc, tail, STEPS)
    assert ref_text[1] != ref_image[1]
    return ids, tail, ref_text, ref_image


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_program_matches_the_reference_text_and_image(model, enc, refs, fused):
    if fused:
        pytest.importorskip("triton")
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("interpreted Triton kernels on CPU tensors (TRITON_INTERPRET=1)")
    ids, tail, ref_text, ref_image = refs
    got = program_generate(model, enc, [(None, ids), (enc, tail)], STEPS, fused)
    if fused:   # what ran outside the kernels: only the per-layer projection (K = 8 < 16)
        st = got[2]
        assert {w[0].rsplit(".", 1)[-1] for w in st.fused.torch_linears} == \
            {"per_layer_projection"}
        assert st.fused.fused_norm_adds == 3 * model.config.text.n_layers
    check(got[0], ref_text, 2e-4)
    check(got[1], ref_image, 2e-4)


def test_chunked_prefill_equals_one_pass(model, enc):
    """The ring keeps the positions before a chunk: prefilling in chunks that wrap the
    window (5 + 7 tokens, window 8) gives the one-pass result."""
    ids = text_ids(model)
    one = program_generate(model, enc, [(None, ids)], 3, fused=False)[0]
    two = program_generate(model, enc, [(None, ids)], 3, fused=False,
                           chunks=[5, len(ids) - 5])[0]
    assert one[1] == two[1]
    torch.testing.assert_close(one[0], two[0], atol=1e-5, rtol=1e-5)


def test_state_is_rings_for_sliding_layers_and_full_for_global(model):
    cfg = model.config.text
    prog = step_program(cfg)
    kinds = {s.layer: (s.kind, s.shape) for s in prog.state}
    W = cfg.sliding_window
    assert kinds == {0: ("ring", (2, W, 16)), 1: ("ring", (2, W, 16)), 2: ("kv", (2, 32)),
                     3: ("ring", (2, W, 16))}               # layers 4, 5 KV-shared: no state
    assert [la.source for la in layer_attentions(prog)] == [0, 1, 2, 3, 3, 2]
    assert [la.writes for la in layer_attentions(prog)] == [True] * 4 + [False] * 2
    st = make_state(model, 2, 96, spec=StepSpec(prog, ((0,),)))
    assert st.kv.k[0].shape == (2, 2, W, 16) and st.kv.k[2].shape == (2, 2, 96, 32)


def test_keys_equal_values_variant(tmp_path):
    """attention_k_eq_v: global layers take v from the raw k (no v_proj), through the program."""
    m = load_model(str(make_test_model(tmp_path, seed=5, text={"attention_k_eq_v": True})))
    assert "language_model.layers.2.self_attn.v_proj.weight" not in m.weights
    assert layer_attentions(m.step_spec().program)[2].k_eq_v
    ids = text_ids(m)
    check(program_generate(m, None, [(None, ids)], STEPS, fused=False)[0],
          m.greedy(ids, STEPS), 2e-4)


def test_a_reused_row_ignores_the_previous_task_state(model):
    """A row that served a longer context (full ring, k/v far beyond) then takes a short
    prompt: the stale slots are never read (the ring's s <= pos rule, the global mask)."""
    ids = text_ids(model)
    short = ids[:5]
    st = make_state(model, 1, 64)
    with torch.inference_mode():
        prefill(st, ids + ids + ids, 0, 0)                          # 39 positions of junk
        h = prefill(st, short, 0, 0)
        set_row(st, 0, h[-1], len(short))
        st.active[0] = True
        toks, logits = [], []
        for s in range(STEPS + 1):
            logits.append(st.backend.head_logits("lm", st.hidden[:1])[0].float().clone())
            ds.lm_greedy(st, 1)
            toks.append(int(st.out[0, 0]))
            if s < STEPS:
                ds.forward(st, 1)
    check((torch.stack(logits), toks), model.greedy(short, STEPS), 2e-4)

"""Shared steps of the engine tests (test/core): run (encoded image, task) pairs to the end
through an engine's batch stepping, compare two runs, skip the fused backend where its
Triton kernels cannot run, and cancel a run mid-flight while its step is in flight (the
zombie row it leaves until the next commit)."""
from __future__ import annotations

import os

import pytest
import torch


def run_to_end(fe, pairs, ignore_eos: bool = False) -> list:
    """Start every (encoded image, task) pair, step them as one batch until all finish, then
    drain (every launched step committed): the runs."""
    runs = [fe.start(e, t, ignore_eos=ignore_eos) for e, t in pairs]
    while any(fe.step_batch(runs)):
        pass
    fe.drain()
    return runs


def results_and_text(fe, pairs, ignore_eos: bool = False) -> list:
    """run_to_end's runs as (TaskResult, streamed text) pairs."""
    return [(r.result(), r.text_so_far) for r in run_to_end(fe, pairs, ignore_eos)]


def same_run(a, b) -> bool:
    """Two (TaskResult, streamed text) pairs with the same output, tokens, finish reason and
    text."""
    (ra, ta), (rb, tb) = a, b
    return (ra.output, ra.tokens, ra.finish_reason, ta) == (rb.output, rb.tokens,
                                                            rb.finish_reason, tb)


def fused_ok(fused: str) -> None:
    """Skip a fused="on" case unless its Triton kernels run interpreted on CPU tensors."""
    if fused == "on":
        pytest.importorskip("triton")
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("interpreted Triton kernels on CPU tensors (TRITON_INTERPRET=1)")


def cancel_mid_flight(fe, a, b, steps: int = 5) -> int:
    """Step runs a and b `steps` times, cancel a ("deadline") while its last step is in
    flight: a is finished but its row stays held by that step (a zombie) until the next
    step commits it, which frees the row. Returns the row."""
    for _ in range(steps):
        fe.step_batch([a, b])
    row = a.row
    a.cancel("deadline")
    assert a.finished and fe.rows.owner[row] is a          # its launched step still holds it
    fe.step_batch([a, b])                                  # commits that step: zombie released
    assert fe.rows.owner[row] is None
    return row


def fused_pass(model, kv: int, monkeypatch, switches: dict, b: int = 2, **options) -> tuple:
    """One fused decoder pass over the same random rows (fresh state, positions 5 and 9) with
    fused_backend's module switches set as given (and EngineOptions fields `options`):
    (x, {buffer: rows}, the backend)."""
    from photon_core.fast import FastEngine
    from photon_core.fast import fused_backend as fb_mod
    for name, on in switches.items():
        monkeypatch.setattr(fb_mod, name, on)
    fe = FastEngine(model, max_batch=b, kv_capacity=kv, fused="on", **options)
    f = fe.state.fused
    g = torch.Generator().manual_seed(0)
    f.x[:b] = torch.randn(b, f.x.shape[1], generator=g)
    pos = torch.tensor([5, 9][:b])
    x = f.decoder(pos, b, None, torch.ones(b, dtype=torch.bool), kv).clone()
    bufs = {k: v[:b].clone() for k, v in f.bufs.items()}
    fe.close()
    return x, bufs, f


def pdl_changes_no_bits(model, kv: int, monkeypatch) -> None:
    """fused_pass without and with EngineOptions.pdl (the kernels' PDL code shapes; their
    griddepcontrol instructions exist on a Hopper GPU only): the same bits in the residual,
    every buffer and every row state."""
    outs = []
    for pdl in (False, True):
        x, bufs, f = fused_pass(model, kv, monkeypatch, {}, pdl=pdl)
        assert f.pdl is pdl
        cache = [t.clone() for t in (*f.kv.k.values(), *f.kv.v.values())]
        outs.append((x, bufs, {k: v.clone() for k, v in f.kv.states.items()}, cache))
    (x0, b0, s0, c0), (x1, b1, s1, c1) = outs
    assert torch.equal(x0, x1) and all(torch.equal(a, c) for a, c in zip(c0, c1))
    for k in b0:
        assert torch.equal(b0[k], b1[k]), k
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k


def fused_pattern_bits(model, kv: int, monkeypatch, b: int = 2) -> list:
    """fused_pass with the fused backend's lowering patterns (fused_backend.NORM_CHAIN,
    EPILOGUE_FUSION) on, then off: [(x, {buffer: rows}, (chained norms, gated GEMVs,
    launches)), ...] - the patterns must change no bit."""
    out = []
    for on in (True, False):
        x, bufs, f = fused_pass(model, kv, monkeypatch, dict(NORM_CHAIN=on, EPILOGUE_FUSION=on),
                                b)
        out.append((x, bufs, (f.chained_norms, f.gated_gemvs, len(f.lowered))))
    return out


def graphed_encodes(fe, model, shapes, seed: int = 7, layouts: int | None = None) -> list:
    """Frames of these shapes through FastEngine.encode_image (a graph per layout: the first
    frame of a layout captures it, a later one replays) and the model's reference
    encode_image: [(fast, reference), ...]; checks `layouts` graphs (default: one per
    distinct shape)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    frames = [rng.integers(0, 256, s, dtype=np.uint8) for s in shapes]
    encs = [fe.encode_image(f) for f in frames]
    want = len(set(shapes)) if layouts is None else layouts
    assert len(fe.encoder.entries) == want and fe.encoder.capture_ms > 0
    return [(enc, model.encode_image(f)) for f, enc in zip(frames, encs)]


def fast_encode_follows_reference(load, shapes, tensors_of, kv: int = 512) -> dict:
    """FastEngine's default encoder on CUDA ("fast": the model's encode_body_fast in the
    graphed encoder) against the reference encode_image: load(dtype) -> the model;
    tensors_of(encoded image) -> its state tensors (None entries skipped). fp32: every
    tensor within 2e-4 (relative to 1 + its largest value) of the reference encode's; bf16:
    each tensor's error against the fp32 reference encode at most 3x the bf16 reference
    encode's own + 1e-3 of its scale. Returns {"bf16_worst_ratio": ...}."""
    from photon_core.fast import FastEngine
    m32 = load("fp32")
    ref_fe = FastEngine(m32, max_batch=1, kv_capacity=kv, encoder="reference")
    exact = [ref for _, ref in graphed_encodes(ref_fe, m32, shapes)]
    ref_fe.close()
    worst = 0.0
    for dtype in ("fp32", "bf16"):
        m = m32 if dtype == "fp32" else load(dtype)
        fe = FastEngine(m, max_batch=1, kv_capacity=kv)
        assert fe.encoder is not None and fe.encoder.body == m.encode_body_fast
        pairs = graphed_encodes(fe, m, shapes)
        assert all(e.graph is not None for e in fe.encoder.entries.values())
        for (enc, ref), ex in zip(pairs, exact):
            for a, b, c in zip(tensors_of(enc), tensors_of(ref), tensors_of(ex)):
                if a is None:
                    continue
                c = c.float()
                scale = c.abs().max().item()
                e_fast = (a.float() - c).abs().max().item()
                if dtype == "fp32":
                    assert e_fast <= 2e-4 * (1 + scale), e_fast
                else:
                    e_ref = (b.float() - c).abs().max().item()
                    worst = max(worst, e_fast / max(e_ref, 1e-6))
                    assert e_fast <= 3 * e_ref + 1e-3 * scale, (e_fast, e_ref, scale)
        fe.close()
    print(f"bf16: fast / reference encode error, worst tensor: {worst:.2f}")
    return {"bf16_worst_ratio": worst}

"""Gemma 4 on a GPU (skipped without CUDA): the reference engine on CUDA (fp32) gives the
CPU's greedy answer and logits; the Triton kernels (sliding-window decode attention,
RMSNorm) match their references in bf16 on real hardware."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_engine_matches_cpu(tmp_path):
    from photon_core.models.gemma4 import load_model, make_test_model
    from photon_core.task import Task

    path = make_test_model(tmp_path, seed=0)
    img = np.random.default_rng(0).integers(0, 256, (30, 37, 3), dtype=np.uint8)
    runs = []
    for dev in ("cpu", "cuda"):
        m = load_model(str(path), device=dev, max_soft_tokens=70)
        r = m.start(m.encode_image(img), Task("query", question="What color is the cup?",
                                              max_tokens=12), ignore_eos=True, record_logits=True)
        while r.step():
            pass
        runs.append(r)
    assert runs[0].result().output == runs[1].result().output
    torch.testing.assert_close(torch.stack(runs[1].logits), torch.stack(runs[0].logits),
                               atol=3e-3, rtol=1e-3)


@pytest.mark.parametrize("window", [None, 512])
def test_triton_decode_kernel_bf16(window):
    from photon_core.ops.sliding_window_attention import (sliding_window_decode,
                                                          sliding_window_decode_triton)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(8, 256, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 1024, 256, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, 1024, 256, device="cuda", generator=g).bfloat16()
    ref = sliding_window_decode(q.float(), k.float(), v.float(), 900, window, 1.0 / 16)
    out = sliding_window_decode_triton(q, k, v, 900, window, 1.0 / 16)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_triton_rmsnorm_bf16():
    from photon_core.ops.rmsnorm_scaled import rmsnorm_scaled, rmsnorm_scaled_triton
    x = torch.randn(7, 1536, device="cuda").bfloat16()
    w = torch.randn(1536, device="cuda").bfloat16()
    torch.testing.assert_close(rmsnorm_scaled_triton(x, w, 1e-6).float(),
                               rmsnorm_scaled(x, w, 1e-6).float(), atol=3e-2, rtol=2e-2)


def test_per_layer_table_in_host_memory(tmp_path):
    """load_model(ple_on_cpu=True): the per-layer embedding table stays in host memory, every
    other weight on the GPU; answers and logits equal the all-GPU model's (reference engine
    and the step program's prefill in the runtime's eager backend: the scaled-token
    feedback gathers the table's rows on the host); FastEngine refuses such a model."""
    from photon_core.fast import FastEngine
    from photon_core.fast.decode_step import StepState
    from photon_core.models.gemma4 import load_model, make_test_model
    from photon_core.models.gemma4.program import step_program
    from photon_core.models.gemma4.weights import PER_LAYER_TABLE
    from photon_core.program import StepSpec
    from photon_core.task import Task

    path = make_test_model(tmp_path, seed=0)
    img = np.random.default_rng(0).integers(0, 256, (30, 37, 3), dtype=np.uint8)
    outs = []
    for on_cpu in (False, True):
        m = load_model(str(path), device="cuda", max_soft_tokens=70, ple_on_cpu=on_cpu)
        assert m.weights[PER_LAYER_TABLE].device.type == ("cpu" if on_cpu else "cuda")
        assert m.weights["language_model.embed_tokens.weight"].is_cuda
        r = m.start(m.encode_image(img), Task("query", question="What color is the cup?",
                                              max_tokens=12), ignore_eos=True, record_logits=True)
        while r.step():
            pass
        st = StepState.of_spec(StepSpec(step_program(m.config.text), ((0,),)), m.weights, 1,
                               64)
        h = st.prefill_tokens(0, 0, torch.tensor([2, 40, 41, 42]))
        outs.append((r.result().output, torch.stack(r.logits), h))
        if on_cpu:
            with pytest.raises(ValueError, match="per-layer embedding table"):
                FastEngine(m, max_batch=1, kv_capacity=64)
    assert outs[0][0] == outs[1][0]
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1][2], outs[0][2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,ring", [(None, False), (512, True), (512, False)])
def test_rows_decode_kernel_bf16(window, ring):
    """The state cache's batched window attention kernel in bf16 on the GPU."""
    from photon_core.ops.sliding_window_attention import (rows_decode_reference,
                                                          rows_decode_triton)
    g = torch.Generator(device="cuda").manual_seed(1)
    slots = 512 if ring else 1024
    q = torch.randn(3, 8 * 256, device="cuda", generator=g).bfloat16()
    k = torch.randn(4, 1, slots, 256, device="cuda", generator=g).bfloat16()
    v = torch.randn(4, 1, slots, 256, device="cuda", generator=g).bfloat16()
    rows = torch.tensor([2, 0, 3], device="cuda")
    pos = torch.tensor([900, 17, 1000], device="cuda")
    ref = rows_decode_reference(q.float().view(3, 8, 256), k.float(), v.float(), rows, pos,
                                window, ring, 1.0, 1024)
    out = rows_decode_triton(q, k, v, rows, pos, window, ring, 1.0, torch.empty_like(q), 1024)
    torch.testing.assert_close(out.float().view(3, 8, 256), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_program_executors_on_cuda_match_the_reference(tmp_path, fused):
    """The step program through the runtime's backends on the GPU (fp32, the real Triton
    kernels): the reference engine's 16 greedy tokens and logits, a prompt longer than the
    window; and the same decode step captured in a CUDA graph gives the same tokens."""
    from photon_core.engine import EngineOptions
    from photon_core.fast import decode_step as ds
    from photon_core.models.gemma4 import load_model, make_test_model

    m = load_model(str(make_test_model(tmp_path, seed=3)), device="cuda")
    ids = [2] + list(range(40, 53))
    ref_logits, ref_toks = m.greedy(ids, 16)
    for graphed in (False, True):
        st = ds.StepState.of_spec(m.step_spec(), m.weights, 2, 64,
                                  EngineOptions(fused="on" if fused else "off"))
        with torch.inference_mode():
            h = st.prefill_tokens(1, 0, torch.tensor(ids), backend=st.backend)
            st.set_row(1, h[-1], len(ids), 0, 0, 0.0, 1.0)
            st.active[1] = True
            b = 2

            def step():
                ds.lm_greedy(st, b)
                ds.forward(st, b)
            logits, toks = [], []
            g = None
            if graphed:
                g = torch.cuda.CUDAGraph()
                saved = [t.clone() for t in (st.hidden, st.pos, st.out)]
                snap = {k: (st.kv.k[k].clone(), st.kv.v[k].clone()) for k in st.kv.k}
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    step()
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(g):
                    step()
                for t, s in zip((st.hidden, st.pos, st.out), saved):
                    t.copy_(s)
                for k, (kk, vv) in snap.items():
                    st.kv.k[k].copy_(kk)
                    st.kv.v[k].copy_(vv)
            for _ in range(17):
                lg = st.backend.head_logits("lm", st.hidden[:b])[1]
                logits.append(lg.float().cpu().clone())      # the head's buffer is reused
                if g is not None:
                    g.replay()
                else:
                    step()
                toks.append(int(st.out[1, 0]))
        assert toks == ref_toks, (graphed, toks, ref_toks)
        torch.testing.assert_close(torch.stack(logits), ref_logits, atol=2e-3, rtol=1e-3)

"""Gemma 4 reference path at E2B shapes (random bf16 weights), all in one run:

  - copy bandwidth (device to device, read + write) -> the decode bandwidth floor: bytes a
    decode step must read = every text-decoder matrix (q/k/v/o, MLP, PLE gate/projection, the
    per-layer model projection, final norm) + the tied lm_head (embedding table, read once)
    + one row of the per-layer embedding table + the k/v in the window of every k/v layer;
  - our reference decode step (one token, at position ~ image prefix + prompt), CUDA events;
  - transformers' Gemma4ForConditionalGeneration, eager attention, the SAME weights (ours are
    views of its parameters), one-token steps with its DynamicCache at the same position;
  - a 640x480 frame: encode (vision tower + prefix prefill) + query(32 tokens, ignore_eos),
    ours vs transformers generate(min_new_tokens=32) on the same pixels;
  - a bf16 sanity check: our prefill logits vs transformers' on the same prompt;
  - the step program (models/gemma4/program.py) through the runtime's eager and fused
    backends (StepState.of_spec): decode step at batch 1 and 4, eager launches and a CUDA graph, and the fused
    executor's logits vs the eager one's.

E2B shapes (overridable): 35 layers (4 sliding : 1 global), hidden 1536, MLP 6144 (x2 on
the KV-shared layers), 8 heads, 1 k/v head, head 256 / global 512, window 512, PLE 256,
vocab 262144, 20 KV-shared layers; vision 16 x 768, patch 16, 280 soft tokens.

Usage (H200):  PYTHONPATH=. python3 bench/bench_gemma4.py
CPU smoke:     PYTHONPATH=. python3 bench/bench_gemma4.py --smoke
Writes $OUT/bench_gemma4.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import copy_bandwidth, median_ms as timed  # noqa: E402
from photon_core.models.gemma4.config import SLIDING, parse_config  # noqa: E402
from photon_core.models.gemma4.kv_cache import KVCache  # noqa: E402
from photon_core.models.gemma4.model import Gemma4Model  # noqa: E402
from photon_core.models.gemma4.prompt import Prompter  # noqa: E402
from photon_core.models.gemma4.test_model import (CHAT_TEMPLATE, build_test_tokenizer,  # noqa: E402
                                                  random_tensors, tiny_config_dict)
from photon_core.models.gemma4.weights import expected_shapes  # noqa: E402
from photon_core.task import Task  # noqa: E402

QUESTION = "What is in the image?"


def e2b_config(vocab_ids: dict, layers=35, kv_shared=20, kv_heads=1, vocab=262144) -> dict:
    """Gemma 4 E2B's text and vision shapes on the tiny model's config dict (vocab_ids: the
    special token ids of the tokenizer in use)."""
    types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)]
    base = tiny_config_dict(512)
    t = {**base["text_config"], "vocab_size": vocab, "vocab_size_per_layer_input": vocab,
         "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": layers,
         "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": 256,
         "layer_types": types,
         "per_layer_config": {str(i): {"head_dim": 512} for i, ty in enumerate(types)
                              if ty == "full_attention"},
         "sliding_window": 512, "hidden_size_per_layer_input": 256,
         "num_kv_shared_layers": kv_shared, "use_double_wide_mlp": True,
         "max_position_embeddings": 131072}
    v = {**base["vision_config"], "hidden_size": 768, "intermediate_size": 3072,
         "num_hidden_layers": 16, "num_attention_heads": 12, "num_key_value_heads": 12,
         "head_dim": 64, "patch_size": 16, "position_embedding_size": 10240}
    return {**base, "text_config": t, "vision_config": v, **vocab_ids}


def step_bytes(model: Gemma4Model, pos: int) -> int:
    t, w = model.config.text, model.weights
    skip = ("vision_tower.", "embed_vision.", "language_model.embed_tokens_per_layer.")
    n = sum(x.numel() * x.element_size() for k, x in w.items() if not k.startswith(skip))
    ple = w.get("language_model.embed_tokens_per_layer.weight")
    if ple is not None:
        n += ple.shape[1] * ple.element_size()
    esize = torch.empty((), dtype=model.dtype).element_size()
    for i in range(t.first_shared):
        seen = min(pos + 1, t.sliding_window) if t.layer_types[i] == SLIDING else pos + 1
        n += 2 * t.kv_heads_of(i) * seen * t.head_dim_of(i) * esize
    return n



def hf_greedy(hf, ids, pv, pp, tokens: int):
    """transformers' generate of exactly `tokens` greedy tokens for the prompt ids and image
    inputs (pixel values pv, image position ids pp): the baseline the benches time."""
    with torch.inference_mode():
        return hf.generate(input_ids=ids, pixel_values=pv, image_position_ids=pp,
                           max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           pad_token_id=0)

def build(args, device, dtype):
    tok = build_test_tokenizer()
    ids = {k: tiny_config_dict(tok.get_vocab_size())[k] for k in
           ("boi_token_id", "eoi_token_id", "image_token_id", "video_token_id", "boa_token_id",
            "eoa_token_index", "audio_token_id")}
    cfg_dict = tiny_config_dict(tok.get_vocab_size()) if args.smoke else \
        e2b_config(ids, args.layers, args.kv_shared, args.kv_heads)
    cfg = parse_config(cfg_dict)
    hf = None
    if not args.no_hf:
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration
        hcfg = Gemma4Config(**{k: v for k, v in cfg_dict.items()
                               if k not in ("architectures", "model_type", "dtype",
                                            "transformers_version")})
        hcfg._attn_implementation = "eager"
        with torch.device(device):
            hf = Gemma4ForConditionalGeneration._from_config(hcfg, dtype=dtype).eval()
        sd = hf.state_dict()
        weights = {k: sd["model." + k] for k in expected_shapes(cfg)}
        # transformers' init leaves norms/scalars at 1 and the position table at 1: give
        # them (and the matrices) our random values so the outputs are not degenerate
        rnd = random_tensors(expected_shapes(cfg), seed=0) if args.smoke else None
        with torch.no_grad():
            for k, x in weights.items():
                if rnd is not None:
                    x.copy_(rnd[k])
                elif x.dim() >= 2 and "embed" not in k and "position" not in k:
                    x.normal_(0, x.shape[-1] ** -0.5)
                elif k.endswith("layer_scalar"):
                    x.fill_(0.8)
    else:
        weights = {k: x.to(device=device, dtype=dtype)
                   for k, x in random_tensors(expected_shapes(cfg), seed=0).items()}
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_gemma4_tok"
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    prompter = Prompter(folder / "tokenizer.json", CHAT_TEMPLATE, cfg.image_token_id,
                        cfg.text.bos_id, cfg.text.eos_ids)
    return Gemma4Model(cfg, weights, prompter, "bench-gemma4",
                       max_soft_tokens=70 if args.smoke else 280), hf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, fp32")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--kv-shared", type=int, default=20)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "dtype": str(dtype), "smoke": args.smoke}
    model, hf = build(args, device, dtype)
    t = model.config.text
    out["text_params"] = sum(x.numel() for k, x in model.weights.items()
                             if k.startswith("language_model."))

    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    enc = model.encode_image(frame)
    tail = model.prompter.task_tail("query", QUESTION)
    pos = enc.length + len(tail)
    out["prefix_tokens"], out["decode_position"] = enc.length, pos

    # -- decode step: ours vs the bandwidth floor -----------------------------------------
    cache = KVCache(t, pos + 1, device, dtype)
    cache.load_prefix(enc.cache, enc.length)
    tok = torch.tensor([5], device=device)
    with torch.inference_mode():
        model.forward_ids(torch.tensor(tail, device=device), enc.length, cache)

        def ours_step():
            h = model.forward_ids(tok, pos, cache)
            return model_logits(model, h)
        out["ours_step_ms"] = timed(ours_step, device, args.iters)
    nbytes = step_bytes(model, pos)
    out["step_bytes"] = nbytes
    if device.type == "cuda":
        bw = copy_bandwidth(device)
        out["copy_bandwidth_GBs"] = bw / 1e9
        out["floor_ms"] = nbytes / bw * 1e3
        out["ours_vs_floor"] = out["ours_step_ms"] / out["floor_ms"]

    # -- the sliding-window decode op: torch reference vs Triton kernel (E2B head shapes) ---
    if device.type == "cuda":
        from photon_core.ops.sliding_window_attention import (sliding_window_decode,
                                                              sliding_window_decode_triton)
        kv = torch.randn(t.n_kv_heads, 4096, t.head_dim, device=device, dtype=dtype)
        q1 = torch.randn(t.n_heads, t.head_dim, device=device, dtype=dtype)
        for p_, win in ((pos, t.sliding_window), (4000, t.sliding_window), (4000, None)):
            key = f"attn_decode_pos{p_}_win{win}"
            out[key + "_torch_ms"] = timed(lambda: sliding_window_decode(q1, kv, kv, p_, win, 1.0),
                                           device, args.iters)
            out[key + "_triton_ms"] = timed(
                lambda: sliding_window_decode_triton(q1, kv, kv, p_, win, 1.0), device, args.iters)
        # the state cache's form (the program's window_attention): rows at their own
        # positions, sliding layers as a ring of `window` slots vs a masked full-length window
        from photon_core.ops.sliding_window_attention import rows_decode_triton
        for b in (1, 4):
            rows_t = torch.arange(b, device=device)
            pos_t = torch.full((b,), 4000, device=device)
            qb = torch.randn(b, t.n_heads * t.head_dim, device=device, dtype=dtype)
            ob = torch.empty_like(qb)
            ring = torch.randn(b, t.n_kv_heads, t.sliding_window, t.head_dim, device=device,
                               dtype=dtype)
            full = torch.randn(b, t.n_kv_heads, 4096, t.head_dim, device=device, dtype=dtype)
            out[f"attn_rows_b{b}_ring_ms"] = timed(lambda: rows_decode_triton(
                qb, ring, ring, rows_t, pos_t, t.sliding_window, True, 1.0, ob), device,
                args.iters)
            out[f"attn_rows_b{b}_masked_window_ms"] = timed(lambda: rows_decode_triton(
                qb, full, full, rows_t, pos_t, t.sliding_window, False, 1.0, ob, 4096), device,
                args.iters)
            out[f"attn_rows_b{b}_causal_4096_ms"] = timed(lambda: rows_decode_triton(
                qb, full, full, rows_t, pos_t, None, False, 1.0, ob, 4096), device, args.iters)

    # -- the step program (models/gemma4/program.py) through its executors -----------------
    out.update(bench_program(model, enc, tail, device, args))

    # -- transformers eager, same weights, same position ------------------------------------
    if hf is not None:
        from transformers import DynamicCache
        ids = torch.tensor([model.prefix_ids(enc.n_image_tokens) + tail], device=device)
        _, patches, positions, _ = model.image_inputs(frame)
        pv = patches[None].to(device, dtype)
        pp = positions[None].to(device)
        with torch.inference_mode():
            hc = DynamicCache(config=hf.config.get_text_config())
            full = hf(input_ids=ids, pixel_values=pv, image_position_ids=pp, past_key_values=hc,
                      use_cache=True).logits[0, -1].float()
            ours_prefill = model_logits(model, model.forward_ids(
                torch.tensor(tail, device=device), enc.length,
                reload(cache, enc, t, pos + 1, device, dtype)))[-1].float()
            out["prefill_logits_maxabs_diff_vs_hf"] = float((full - ours_prefill).abs().max())
            out["prefill_logits_maxabs"] = float(full.abs().max())
            step_ids = torch.tensor([[5]], device=device)

            def hf_step():        # the cache grows one position per call (~pos .. pos + 23)
                return hf(input_ids=step_ids, past_key_values=hc, use_cache=True).logits
            out["hf_eager_step_ms"] = timed(hf_step, device, args.iters)
        out["ours_vs_hf_step"] = out["ours_step_ms"] / out["hf_eager_step_ms"]

    # -- 640x480: encode + query(32) ---------------------------------------------------------
    def ours_query():
        e = model.encode_image(frame)
        r = model.start(e, Task("query", question=QUESTION, max_tokens=args.tokens), ignore_eos=True)
        while r.step():
            pass
        return r.result()
    res = ours_query()
    t0 = time.perf_counter()
    res = ours_query()
    out["ours_encode_query_ms"] = (time.perf_counter() - t0) * 1e3
    out["ours_encode_query_timings"] = res.timings
    if hf is not None:
        def hf_query():
            return hf_greedy(hf, ids, pv, pp, args.tokens)
        hf_query()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf_query()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out["hf_encode_query_ms"] = (time.perf_counter() - t0) * 1e3
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_gemma4.json").write_text(json.dumps(out, indent=1))


def bench_program(model, enc, tail, device, args) -> dict:
    """The decode step as a step program, through the runtime's eager and fused backends
    (decode_step's lm_greedy + forward), batch 1 and 4, eager launches and one CUDA graph;
    and the fused backend against the eager one from the same state (8 greedy steps)."""
    from photon_core.engine import EngineOptions
    from photon_core.fast import decode_step as ds

    res: dict = {}
    spec = model.step_spec()
    cap = enc.length + len(tail) + 160
    tail_t = torch.tensor(tail, device=device)

    def ready(b, fused):
        st = ds.StepState.of_spec(spec, model.weights, b, cap,
                                  EngineOptions(fused="on" if fused else "off"))
        prefix = model.fast_family().prefix(enc)
        for r in range(b):
            st.kv.load_prefix(r, prefix)
            h = st.prefill_tokens(r, enc.length, tail_t)
            st.set_row(r, h[-1], enc.length + len(tail), 0, 0, 0.0, 1.0)
        st.active[:b] = True
        return st

    modes = [False] + ([True] if device.type == "cuda" else [])
    for fused in modes:
        name = "fused" if fused else "eager"
        for b in (1, 4):
            try:
                with torch.inference_mode():
                    st = ready(b, fused)

                    def step():
                        ds.lm_greedy(st, b)
                        ds.forward(st, b)
                    res[f"program_{name}_b{b}_step_ms"] = timed(step, device, args.iters)
                    if device.type == "cuda":
                        side = torch.cuda.Stream()
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            step()
                            step()
                        torch.cuda.current_stream().wait_stream(side)
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            step()
                        res[f"program_{name}_b{b}_graph_step_ms"] = timed(g.replay, device,
                                                                          args.iters)
            except Exception as e:          # report, keep benchmarking the rest
                res[f"program_{name}_b{b}_error"] = f"{type(e).__name__}: {e}"[:300]
    if len(modes) == 2:
        try:
            with torch.inference_mode():
                runs = []
                for fused in modes:
                    st, lg, toks = ready(1, fused), [], []
                    for _ in range(8):
                        lg.append(st.backend.head_logits("lm", st.hidden[:1]).float().clone())
                        ds.lm_greedy(st, 1)
                        toks.append(int(st.out[0, 0]))
                        ds.forward(st, 1)
                    runs.append((torch.stack(lg), toks))
            res["program_fused_vs_eager_first_logits_maxdiff"] = float(
                (runs[0][0][0] - runs[1][0][0]).abs().max())
            res["program_fused_vs_eager_same_tokens"] = runs[0][1] == runs[1][1]
            res["program_logits_maxabs"] = float(runs[0][0][0].abs().max())
        except Exception as e:
            res["program_fused_vs_eager_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def model_logits(model, h):
    from photon_core.models.gemma4 import text
    return text.logits(model.weights, model.config.text, h)


def reload(cache, enc, t, cap, device, dtype):
    c = KVCache(t, cap, device, dtype)
    c.load_prefix(enc.cache, enc.length)
    return c


if __name__ == "__main__":
    main()

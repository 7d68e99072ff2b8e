"""Is the bf16 gap between our Gemma 4 and transformers' a bug, or bf16 rounding amplified by
a deep random network? (issue 15: bf16 prefill logits at E2B shapes differed by up to 4.45.)

One set of fp32 random weights at E2B shapes (bench_gemma4.build), four forward passes over the
same 640x480 image + question (the whole prefill, logits of every prompt position):
ours fp32, transformers fp32 (eager attention), ours bf16, transformers bf16 (the fp32
weights cast to bf16 on both sides). If ours fp32 == transformers fp32 to rounding and each
implementation's bf16 run is as far from its own fp32 run as the two bf16 runs are from each
other, the gap is bf16 noise (each implementation rounds at different places), not a
difference in the math. --layers truncates the decoder (every 5th layer global, the last
--kv-shared layers reuse k/v) to see how the gap grows with depth.

Usage: PYTHONPATH=. python3 bench/gemma4_bf16_gap.py [--layers 35] [--cpu]
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_gemma4 import QUESTION, build, model_logits, reload  # noqa: E402
from photon_core.models.gemma4.model import Gemma4Model  # noqa: E402
from photon_core.models.gemma4.weights import expected_shapes  # noqa: E402


def prefill_logits(model, hf, frame, device, dtype):
    """Logits of every prompt position after the image prefix: (ours, transformers)."""
    from transformers import DynamicCache
    enc = model.encode_image(frame)
    tail = model.prompter.task_tail("query", QUESTION)
    t = model.config.text
    with torch.inference_mode():
        ours = model_logits(model, model.forward_ids(
            torch.tensor(tail, device=device), enc.length,
            reload(None, enc, t, enc.length + len(tail) + 1, device, dtype))).float()
        ids = torch.tensor([model.prefix_ids(enc.n_image_tokens) + tail], device=device)
        _, patches, positions, _ = model.image_inputs(frame)
        hc = DynamicCache(config=hf.config.get_text_config())
        theirs = hf(input_ids=ids, pixel_values=patches[None].to(device, dtype),
                    image_position_ids=positions[None].to(device), past_key_values=hc,
                    use_cache=True).logits[0, -len(tail):].float()
    return ours, theirs


def dist(a, b):
    d = (a - b).abs()
    return {"max_abs": round(d.max().item(), 4), "mean_abs": round(d.mean().item(), 5),
            "argmax_agree": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--kv-shared", type=int, default=20)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    args.smoke, args.no_hf = False, False
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    torch.manual_seed(0)
    model32, hf32 = build(args, device, torch.float32)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    o32, h32 = prefill_logits(model32, hf32, frame, device, torch.float32)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    sd = hf16.state_dict()
    model16 = Gemma4Model(model32.config, {k: sd["model." + k]
                                           for k in expected_shapes(model32.config)},
                          model32.prompter, "bench-gemma4-bf16", max_soft_tokens=280)
    o16, h16 = prefill_logits(model16, hf16, frame, device, torch.bfloat16)
    out = {"layers": args.layers, "device": str(device), "logit_maxabs_fp32": round(
        h32.abs().max().item(), 3),
        "ours_fp32_vs_hf_fp32": dist(o32, h32),
        "ours_bf16_vs_ours_fp32": dist(o16, o32),
        "hf_bf16_vs_hf_fp32": dist(h16, h32),
        "ours_bf16_vs_hf_bf16": dist(o16, h16)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

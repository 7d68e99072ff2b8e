"""Qwen 3.5 reference-path benchmark at real 0.8B / 2B shapes with random weights (bf16, GPU).

One run measures, so that every ratio is against a same-run baseline:
  - copy bandwidth (device-to-device) -> the decode-step bandwidth floor: bytes per step =
    text decoder weights (lm_head included, input embedding excluded) + DeltaNet states
    (fp32, read + written) + conv states + the k/v read at the measured context, / bandwidth;
  - our decode step (photon_core.models.qwen3_5 decoder, eager PyTorch, one token at a
    context of --ctx tokens) vs transformers' Qwen3_5ForConditionalGeneration eager (one
    cached token step at the same context, same weights);
  - a 640x480 frame: encode (vision tower + image prefix), encode + query(32 tokens forced),
    encode + 150 forced text tokens (~ the JSON of 5 boxes with Qwen's digit-by-digit
    tokenizer; random weights cannot produce real boxes).
Shapes: Qwen3.5-0.8B / -2B as in their published config.json files (text: 24 layers, 3
DeltaNet : 1 full attention, head_dim 256, 16 DeltaNet heads of 128, tied embeddings; check
SHAPES against the real configs when they are at hand). This is the readable reference path:
it is not tuned; the fast path will be measured against the same floor.

Usage (GPU):  PYTHONPATH=. python3 bench/bench_qwen3_5.py [--sizes 0.8b,2b] [--iters 20]
Smoke (CPU):  PYTHONPATH=. python3 bench/bench_qwen3_5.py --smoke
Writes $OUT/bench_qwen3_5.json and .md when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_timing  # noqa: E402
from bench.bench_timing import median_ms  # noqa: E402
from photon_core.models.qwen3_5 import decoder  # noqa: E402
from photon_core.models.qwen3_5.checkpoint import expected_shapes  # noqa: E402
from photon_core.models.qwen3_5.config import Qwen35Config  # noqa: E402
from photon_core.models.qwen3_5.image_processor import ImageProcessorConfig  # noqa: E402
from photon_core.models.qwen3_5.model import Qwen35Model  # noqa: E402
from photon_core.models.qwen3_5.prompts import ChatPrompts  # noqa: E402
from photon_core.models.qwen3_5.state import HybridState  # noqa: E402
from photon_core.models.qwen3_5.test_model import (CHAT_TEMPLATE, SPECIAL_TOKENS,  # noqa: E402
                                                    build_test_tokenizer)
from photon_core.task import Task  # noqa: E402

VISION_REAL = dict(patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                   num_position_embeddings=2304)
SHAPES = {
    "0.8b": dict(text=dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24),
                 vision=dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)),
    "2b": dict(text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24),
               vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16)),
    "tiny": dict(text=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           linear_key_head_dim=16, linear_value_head_dim=8,
                           linear_num_key_heads=2, linear_num_value_heads=4, vocab_size=400,
                           rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                                partial_rotary_factor=0.25,
                                                mrope_section=[2, 1, 1], mrope_interleaved=True)),
                 vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                             num_position_embeddings=64)),
}
TEXT_REAL = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=16, linear_conv_kernel_dim=4, vocab_size=248320,
                 max_position_embeddings=262144,
                 rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                      partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                                      mrope_interleaved=True))
LINES: list[str] = []


def say(s=""):
    print(s, flush=True)
    LINES.append(s)


def timed_ms(fn, device, iters, warmup=2):
    return median_ms(fn, device, iters, warmup)


def copy_bandwidth(device) -> float:
    """bytes/s of a device-to-device copy (read + write); NaN off CUDA."""
    return bench_timing.copy_bandwidth(device, 20, 2) if device.type == "cuda" else float("nan")


def build(size: str, device, dtype, tok):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    text = {**(TEXT_REAL if size != "tiny" else {}), **SHAPES[size]["text"]}
    vision = {**VISION_REAL, **SHAPES[size]["vision"], "out_hidden_size": text["hidden_size"]}
    hf_cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=size != "tiny",
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"])
    hf_cfg.text_config.tie_word_embeddings = size != "tiny"
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3_5ForConditionalGeneration(hf_cfg).to(dtype).eval()
    hf.config._attn_implementation = "eager"
    hf.config.text_config._attn_implementation = "eager"
    cfg = Qwen35Config.from_dict(json.loads(hf_cfg.to_json_string()))
    sd = hf.state_dict()
    want = expected_shapes(cfg)
    weights = {k: sd[k] for k in want}
    weights["lm_head.weight"] = sd["lm_head.weight"] if "lm_head.weight" in sd else \
        sd["model.language_model.embed_tokens.weight"]
    return hf, cfg, weights


def step_bytes(cfg: Qwen35Config, weights: dict, ctx: int) -> int:
    t = cfg.text
    w = sum(v.numel() * v.element_size() for k, v in weights.items()
            if k.startswith("model.language_model.") and "embed_tokens" not in k)
    w += weights["lm_head.weight"].numel() * weights["lm_head.weight"].element_size()
    el = weights["lm_head.weight"].element_size()
    rec = len(t.linear_layers) * t.linear_num_value_heads * t.linear_key_head_dim * \
        t.linear_value_head_dim * 4 * 2
    conv = len(t.linear_layers) * t.conv_dim * (t.linear_conv_kernel_dim - 1) * el * 2
    kv = len(t.full_layers) * 2 * t.num_key_value_heads * t.head_dim * ctx * el
    return w + rec + conv + kv


def bench_size(size, device, dtype, args, bw, tok, prompts, results):
    say(f"\n## Qwen3.5-{size} shapes ({dtype}, {device})")
    hf, cfg, weights = build(size, device, dtype, tok)
    model = Qwen35Model(cfg, weights, prompts, ImageProcessorConfig(), f"random-qwen3.5-{size}")
    n_params = sum(v.numel() for k, v in weights.items() if k != "lm_head.weight" or not cfg.tie_word_embeddings)
    say(f"params {n_params / 1e9:.3f} B")
    ctx = args.ctx
    r = {"size": size, "params": n_params, "ctx": ctx}

    # our decode step at context ctx
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, cfg.text.vocab_size, (ctx,), generator=g).to(device)
    with torch.inference_mode():
        state = HybridState.empty(cfg.text, ctx + args.iters * 4 + 16, device, dtype)
        decoder.forward(weights, cfg.text, decoder.embed(weights, ids),
                        decoder.text_positions(0, ctx, device), state)
        tokid = torch.tensor([11], device=device)

        def ours_step():
            h = decoder.forward(weights, cfg.text, decoder.embed(weights, tokid),
                                decoder.text_positions(state.length, 1, device), state)
            return int(decoder.logits(weights, h[-1]).argmax())
        r["ours_step_ms"] = timed_ms(ours_step, device, args.iters)

        out = hf(input_ids=ids[None], use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        tok_in = torch.tensor([[11]], device=device)

        def hf_step():
            o = hf(input_ids=tok_in, cache=cache, use_cache=True)
            return int(o.logits[0, -1].argmax())
        r["hf_eager_step_ms"] = timed_ms(hf_step, device, args.iters)
    r["step_bytes"] = step_bytes(cfg, weights, ctx)
    r["floor_ms"] = r["step_bytes"] / bw * 1e3 if bw == bw else float("nan")
    say(f"decode step @ctx {ctx}: ours {r['ours_step_ms']:.2f} ms, transformers eager "
        f"{r['hf_eager_step_ms']:.2f} ms, bandwidth floor {r['floor_ms']:.3f} ms "
        f"({r['step_bytes'] / 1e6:.1f} MB/step); ours/floor {r['ours_step_ms'] / r['floor_ms']:.1f}x, "
        f"transformers/ours {r['hf_eager_step_ms'] / r['ours_step_ms']:.2f}x")

    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    enc = model.encode_image(frame)
    r["image_tokens"] = enc.grid[1] * enc.grid[2] // 4
    r["encode_ms"] = timed_ms(lambda: model.encode_image(frame), device, max(2, args.iters // 4), 1)

    def task_ms(n_tokens):
        def go():
            run = model.start(model.encode_image(frame), Task("query", question="What is in the image?",
                                                               max_tokens=n_tokens), ignore_eos=True)
            while run.step():
                pass
            assert run.steps == n_tokens
        return timed_ms(go, device, max(2, args.iters // 4), 1)
    r["encode_query32_ms"] = task_ms(32)
    r["encode_150tok_ms"] = task_ms(150)
    say(f"640x480: {r['image_tokens']} image tokens; encode {r['encode_ms']:.1f} ms; encode + "
        f"query(32) {r['encode_query32_ms']:.1f} ms; encode + 150 tokens (~detect of 5 boxes) "
        f"{r['encode_150tok_ms']:.1f} ms")
    results.append(r)
    del hf, weights, model, state
    if device.type == "cuda":
        torch.cuda.empty_cache()


def add_size_args(ap, ctx_help: str) -> None:
    """--sizes / --iters / --ctx of bench_qwen3_5*.py."""
    ap.add_argument("--sizes", default="0.8b,2b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=512, help=ctx_help)


def device_dtype_sizes(args):
    """--smoke: the CPU in fp32 at tiny shapes; else the GPU in bf16 at --sizes (exits
    without CUDA)."""
    if args.smoke:
        return torch.device("cpu"), torch.float32, ["tiny"]
    if not torch.cuda.is_available():
        sys.exit("no CUDA device; use --smoke for the CPU smoke test")
    return torch.device("cuda"), torch.bfloat16, args.sizes.split(",")


def bench_prompts():
    """-> (the test tokenizer, ChatPrompts over it with the test chat template)."""
    tok = build_test_tokenizer()
    d = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_qwen3_5_tok"
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return tok, ChatPrompts(d / "tokenizer.json", CHAT_TEMPLATE,
                            tok.token_to_id("<|image_pad|>"), tok.token_to_id("<|vision_end|>"))


def write_out(name: str, bw: float, results: list, lines: list[str], default=None) -> None:
    """$OUT/<name>.json ({bandwidth, results}) and $OUT/<name>.md (the printed lines) when OUT
    is set."""
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(json.dumps(
            {"bandwidth": bw, "results": results}, indent=1, default=default))
        Path(out, f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_size_args(ap, "context of the timed decode step")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, fp32, few iterations")
    args = ap.parse_args(argv)
    device, dtype, sizes = device_dtype_sizes(args)
    if args.smoke:
        args.iters, args.ctx = 3, 40
    tok, prompts = bench_prompts()
    bw = copy_bandwidth(device)
    say(f"# bench_qwen3_5 ({device}{', ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''})")
    say(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    results = []
    with torch.inference_mode():
        for size in sizes:
            bench_size(size, device, dtype, args, bw, tok, prompts, results)
    write_out("bench_qwen3_5", bw, results, LINES)
    return results


if __name__ == "__main__":
    main()

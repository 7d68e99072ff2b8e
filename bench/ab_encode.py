"""A/B of a module switch on a family's fast encode (FastEngine.encode_image, encoder "fast",
a CUDA graph per layout), same process (H200): by default the chunked delta rule's fast form
against its reference form (`--toggle photon_core.ops.gated_delta_rule:FAST=0`: Qwen 3.5's
image-prefix pass). Per engine - --rounds pairs built in alternating order (the engine built
first in a process replayed ~1.4 ms faster whichever form it had, session 15) - the graph
replay (CUDA events, min of --iters), the whole encode_image (synced wall, min), the
replay's kernel time and launches (torch profiler), and each state tensor's error against
the reference encode of the same weights in fp32 (the worst tensor of each kind, relative to
that tensor's largest value), beside the bf16 reference encode's own error (FastEngine
encoder "reference": the reference's bits).

Real shapes, random weights (bench_qwen3_5.build, seeded: the fp32 model holds the same
weights as the bf16 one before their rounding).

Usage (H200): PYTHONPATH=. python3 bench/ab_encode.py [--family qwen3.5-0.8b|moondream2] [--iters 5]
              [--rounds 2] [--toggle photon_core.ops.gated_delta_rule:FAST_SCAN=1]
              [--set photon_core.ops.gated_delta_rule:FAST_CHUNK=64]
Writes $OUT/ab_encode.json when OUT is set.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.ab_switch import apply_switches, parse_toggle  # noqa: E402
from bench.out_dir import write_json  # noqa: E402
from bench.probe_encode import kernel_times  # noqa: E402
from bench.bench_timing import call_times  # noqa: E402
from bench.probe_family_encode import encoder_times  # noqa: E402


def qwen_model(size: str, dtype):
    import bench_qwen3_5 as bq
    from photon_core.models.qwen3_5.image_processor import ImageProcessorConfig
    from photon_core.models.qwen3_5.model import Qwen35Model
    tok, prompts = bq.bench_prompts()
    hf, cfg, weights = bq.build(size, torch.device("cuda"), dtype, tok)
    del hf
    return Qwen35Model(cfg, weights, prompts, ImageProcessorConfig(), f"random-qwen3.5-{size}")


def qwen_state(enc) -> dict:
    s = enc.state
    return {"k": [s.k[i][..., :s.length, :] for i in s.k],
            "v": [s.v[i][..., :s.length, :] for i in s.v],
            "conv": list(s.conv.values()), "recurrent": list(s.recurrent.values())}


def moondream_model(dtype):
    from photon_core.models.moondream2.config import MoondreamConfig
    from photon_core.models.moondream2.model import build_random_model
    return build_random_model(MoondreamConfig(), device="cuda", dtype=dtype, seed=0)


def build(family: str, dtype):
    if family == "moondream2":
        return moondream_model(dtype)
    return qwen_model(family.split("-", 1)[1], dtype)


def state_of(family: str, enc) -> dict:
    return {"kv": [enc.kv]} if family == "moondream2" else qwen_state(enc)


def graph_entry(fe, family: str):
    """The encode graph's entry: the family encoder's, or (Moondream 2) the batch encoder's."""
    enc = fe.batch_encoder if family == "moondream2" else fe.encoder
    return next(iter(enc.entries.values()))


def digest(state: dict) -> str:
    import hashlib
    h = hashlib.sha256()
    for kind in sorted(state):
        for t in state[kind]:
            h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def errors(state: dict, exact: dict) -> dict:
    """Per kind: the worst tensor's max |error| / its largest |value| (fp32 exact)."""
    out = {}
    for kind, ts in state.items():
        out[kind] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                        for a, b in zip(ts, exact[kind]))
    return {k: round(v, 5) for k, v in out.items()}


def exact_and_model(family: str, frame):
    """The fp32 encode's state of `frame` (the exact side of every error) and the bf16 model
    of the same seeded weights."""
    m32 = build(family, torch.float32)
    exact = state_of(family, m32.encode_image(frame))
    del m32
    torch.cuda.empty_cache()
    return exact, build(family, torch.bfloat16)


def engine_rounds(model, labels, switch, rounds: int, measure) -> dict:
    """One FastEngine (encoder "fast", megakernel off) per label and round, the labels in ABBA
    order (a later engine of a process replays slower, session 15): switch(label) sets that
    label's form and returns a function that restores the default; measure(fe, label) is the
    engine's record, built under the label's form. {label: [record per round]}."""
    from photon_core.fast import FastEngine
    res = {label: [] for label in labels}
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            restore = switch(label)
            try:
                fe = FastEngine(model, max_batch=1, kv_capacity=2048, megakernel="off",
                                encoder="fast")
                res[label].append(measure(fe, label))
            finally:
                restore()
            fe.close()
    return res


def moondream_encode_rounds(labels, switch, rounds: int = 2) -> dict:
    """The runtime's 9-crop 640x480 encode graph built and captured once per label and round
    (engine_rounds). Per engine: graph replay ms (min of 10, CUDA events) and the k/v error
    vs the fp32 encode."""
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    exact, model = exact_and_model("moondream2", frame)

    def measure(fe, label):
        st = state_of("moondream2", fe.encode_image(frame))
        t = {"replay_ms": round(min(call_times(graph_entry(fe, "moondream2").graph.replay,
                                               "cuda", 10, warmup=0)), 3),
             "error_vs_fp32": errors(st, exact)}
        print(f"encode {label}: {t}", flush=True)
        return t
    return engine_rounds(model, labels, switch, rounds, measure)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3.5-0.8b")
    ap.add_argument("--toggle", action="append", default=[],
                    help="MODULE:NAME=VALUE, the baseline's value (repeatable: all switched "
                         "together; default photon_core.ops.gated_delta_rule:FAST=0)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=VALUE",
                    help="a module switch set for both engines (before the A/B)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1,
                    help="engine pairs, the order alternating (baseline first in round 0)")
    args = ap.parse_args()
    fam = args.family
    if not (fam.startswith("qwen3.5-") or fam == "moondream2"):
        raise SystemExit("wired here: the Qwen 3.5 family and moondream2")
    from photon_core.fast import FastEngine
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    exact, model = exact_and_model(fam, frame)
    ref_fe = FastEngine(model, max_batch=1, kv_capacity=2048, megakernel="off",
                        encoder="reference")
    toggles = [parse_toggle(t) for t in
               (args.toggle or ["photon_core.ops.gated_delta_rule:FAST=0"])]
    out = {"gpu": torch.cuda.get_device_name(), "family": fam, "toggle": args.toggle,
           "reference_form_bf16_error": errors(state_of(fam, ref_fe.encode_image(frame)),
                                               exact)}
    ref_fe.close()
    apply_switches(args.set)
    values = {"baseline": [v for _, _, v in toggles],
              "now": [getattr(mod, attr) for mod, attr, _ in toggles]}

    def switch(label):
        for (mod, attr, _), v in zip(toggles, values[label]):
            setattr(mod, attr, v)
        return lambda: switch("now")

    def measure(fe, label):
        enc = fe.encode_image(frame)                 # captures the layout's graph
        st = state_of(fam, enc)
        err, sha = errors(st, exact), digest(st)
        times = encoder_times(fe, frame, args.iters, 0, label)
        graph = graph_entry(fe, fam).graph
        if fam == "moondream2":      # (its encoder entries are the reference encode's)
            times["replay_ms"] = round(min(call_times(graph.replay, "cuda", args.iters,
                                                        warmup=0)), 2)
        rows = kernel_times(graph.replay)
        res = {**times, "kernel_ms": round(sum(r[1] for r in rows), 3),
               "launches": sum(r[2] for r in rows), "error_vs_fp32": err, "state_sha": sha,
               "top": [(n[:80], round(ms, 3), c) for n, ms, c in rows[:args.top]]}
        print(f"{label} ({values[label]}): replay {res['replay_ms']} ms, encode_image "
              f"{res['encode_ms']} ms, kernels {res['kernel_ms']} ms in {res['launches']} "
              f"launches; error vs fp32 {err}; state sha {sha}", flush=True)
        for n, ms, c in res["top"]:
            print(f"    {ms:8.3f} ms {c:5d} x  {n}")
        return res
    out.update(engine_rounds(model, ["baseline", "now"], switch, args.rounds, measure))
    for label in ("baseline", "now"):
        print(f"{label}: replay ms by round {[r['replay_ms'] for r in out[label]]}, "
              f"min {min(r['replay_ms'] for r in out[label])}")
    print("bf16 reference form's error vs fp32:", out["reference_form_bf16_error"])
    shas = {r["state_sha"] for label in ("baseline", "now") for r in out[label]}
    print("state bitwise the same in every engine:", len(shas) == 1)
    write_json("ab_encode.json", out)


if __name__ == "__main__":
    main()

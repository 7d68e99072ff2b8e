"""A/B of a module switch on whole decode steps, same process (H200) - by default gemv.pick's
rules (`--toggle photon_core.ops.gemv:PICK_RULES=0`): a family's model at real shapes with
random bf16 weights (sweep_gemv_family.build_model), a FastEngine built with the switch at
the --toggle value ("baseline": for PICK_RULES the old DEFAULT / CANDIDATES choice) and one
with the module's own value ("now"), alternating --rounds times; per engine the decode step
(lm + forward graphs, bench_gemma4_fast.graph_step_ms) at each batch size, rows at position
--pos (median of --iters replays), and the step's kernels (one profiled replay,
bench_timing.step_kernels). Moondream 2 has table entries for its shapes, so its step does
not change under the default switch.

Usage (H200): PYTHONPATH=. python3 bench/ab_switch.py [--families qwen3.5-0.8b,gemma4-e2b,moondream2]
                  [--batches 1,8] [--rounds 2] [--iters 20] [--pos 300] [--top 12]
                  [--toggle photon_core.ops.sliding_window_attention:SPLIT_BELOW=0]
                  [--option pdl=1 --toggle none]
                  [--toggle none --option megakernel=auto/w8/s3 --option megakernel=auto/w8/s4]
                  [--toggle photon_core.megakernel.megakernel_backend:SKIP_STOPPED=0 --now 1]
                  [--toggle none --option kv_capacity=768 --floor]
                  [--toggle photon_core.fast.hybrid_rows:rmsnorm_zero_centred_rows_triton=@noop]
                  (the baseline engine's graphs without those launches: a bound, wrong outputs)
--option NAME=VALUE (0 / 1, an int, or a string such as pdl=auto): an EngineOptions field the "now" engine is built with (the baseline keeps
the default, or takes --baseline-option NAME=VALUE); with --toggle none it is the only
difference between the two engines. E.g. PDL's trigger after the GEMV's loop against at its
start, both engines with PDL:
    --toggle photon_core.ops.pdl:LATE_TRIGGER=0 --option pdl=1 --baseline-option pdl=1
--floor (moondream2): each batch's bandwidth floor at --pos from the copy bandwidth of the
same run, and every engine's step against it. Engines hold 1024 positions per row unless
--option kv_capacity=N.
Writes $OUT/ab_switch.json when OUT is set.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.bench_gemma4_fast import graph_step_ms  # noqa: E402
from bench.bench_timing import step_kernels  # noqa: E402
from bench.sweep_gemv_family import build_model  # noqa: E402


def decoder_pass(fe, b: int) -> torch.Tensor:
    """One fused decoder pass over seeded random rows at positions 5, 9, ...: the residual."""
    f = fe.state.fused
    dev = f.x.device
    g = torch.Generator(device=dev).manual_seed(0)
    f.x[:b] = torch.randn(b, f.x.shape[1], generator=g, device=dev)
    pos = 5 + 4 * torch.arange(b, device=dev)
    return f.decoder(pos, b, None, torch.ones(b, dtype=torch.bool, device=dev),
                     fe.kv.capacity).clone()


def _passes(fe, b: int) -> list:
    """Two decoder passes from a zeroed state cache (building an engine captures its graphs,
    which runs steps over the cache); the second continues from the state the first left
    (recurrent rows, k/v)."""
    kv = fe.kv
    for t in (*kv.k.values(), *kv.v.values(), *kv.states.values()):
        t.zero_()
    return [decoder_pass(fe, b) for _ in range(2)]


def same_bits(fe0, fe1, b: int) -> dict:
    """The two engines' decoder passes over the same rows bitwise equal? Split-K's atomics
    add in a varying order, so an engine may differ from itself run to run:
    "baseline_run_to_run" is the baseline's own largest difference between two runs, the
    scale against which "max_abs_diff" reads."""
    p0, p1, p0b = _passes(fe0, b), _passes(fe1, b), _passes(fe0, b)
    return {"equal": [bool(torch.equal(a, c)) for a, c in zip(p0, p1)],
            "max_abs_diff": max(float((a - c).abs().max()) for a, c in zip(p0, p1)),
            "baseline_run_to_run": max(float((a - c).abs().max()) for a, c in zip(p0, p0b))}


def parse_toggle(spec: str):
    """"module:NAME=VALUE" -> (module, NAME, VALUE in the switch's own type: a bool / int
    switch takes an int, a float one a number, anything else the string). ab_encode.py's
    --toggle / --set too. VALUE "@noop" on a function: one that does nothing (a probe, not a
    form to keep: the step without that function's launches - what removing them could
    save at most; its outputs are wrong)."""
    target, _, value = spec.partition("=")
    mod_name, _, attr = target.partition(":")
    mod = importlib.import_module(mod_name)
    cur = getattr(mod, attr)
    if value == "@noop" and callable(cur):
        return mod, attr, lambda *a, **k: None
    if isinstance(cur, (bool, int)):
        return mod, attr, type(cur)(int(value))
    return mod, attr, float(value) if isinstance(cur, float) else value


def apply_switches(specs) -> None:
    """Set each "module:NAME=VALUE" switch (parse_toggle's form) for the rest of the run."""
    for spec in specs:
        mod, attr, value = parse_toggle(spec)
        setattr(mod, attr, value)


def _option(spec: str) -> dict:
    """"NAME=VALUE" -> {NAME: value}: an int for an int field or an unset one (None by
    default: kv_capacity=768 sets the engine's capacity, 1024 otherwise), 0 / 1 -> False /
    True for a bool field or a str one (pdl: bool or "auto"), any other VALUE as the string;
    "" -> {}."""
    if not spec:
        return {}
    from photon_core.engine import EngineOptions
    name, value_s = spec.split("=")
    default = getattr(EngineOptions(), name)
    if not value_s.lstrip("-").isdigit():
        return {name: value_s}
    if default is None or (isinstance(default, int) and not isinstance(default, bool)):
        return {name: int(value_s)}                  # an int field, or one unset (kv_capacity)
    return {name: bool(int(value_s))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="qwen3.5-0.8b,gemma4-e2b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--pos", type=int, default=300)
    ap.add_argument("--top", type=int, default=0, help="print each engine's top kernels (b=1)")
    ap.add_argument("--toggle", default="photon_core.ops.gemv:PICK_RULES=0",
                    help="module:ATTR=int value of the baseline engine, or none")
    ap.add_argument("--now", default=None,
                    help="the toggle's value for the 'now' engine (default: the module's own)")
    ap.add_argument("--option", action="append", default=[],
                    help="NAME=VALUE: an EngineOptions field of the 'now' engine only; given "
                         "again, one more 'now' engine per value (a sweep: --option "
                         "megakernel=auto/w8/s3 --option megakernel=pipe_fma@8x512/w8/s4)")
    ap.add_argument("--floor", action="store_true",
                    help="moondream2: also each batch's bandwidth floor at --pos (decoder "
                         "weights + the rows' k/v at the copy bandwidth measured in this run)")
    ap.add_argument("--baseline-option", default="",
                    help="NAME=VALUE: an EngineOptions field of the baseline engine")
    args = ap.parse_args()
    from photon_core.fast import FastEngine
    batches = [int(b) for b in args.batches.split(",")]
    out = {"gpu": torch.cuda.get_device_name(), "toggle": args.toggle, "families": {}}
    for fam in args.families.split(","):
        model = build_model(fam)
        engines = {}
        mod = attr = keep = None
        if args.toggle != "none":
            mod, attr, value = parse_toggle(args.toggle)
            keep = getattr(mod, attr)
            now = keep if args.now is None else parse_toggle(f"{args.toggle.split('=')[0]}="
                                                              f"{args.now}")[2]
        base_opt = _option(args.baseline_option)
        opts = args.option or [""]
        names = ["now"] if len(opts) == 1 else [f"now {o}" for o in opts]
        for name, o in [("baseline", None), *zip(names, opts)]:
            if mod is not None:
                setattr(mod, attr, value if o is None else now)
            kw = {"megakernel": "off", **(base_opt if o is None else _option(o))}
            kw.setdefault("kv_capacity", 1024)
            engines[name] = FastEngine(model, max_batch=max(batches), **kw)
            st = engines[name].state
            print(f"{fam} {name}: megakernel {'in use' if st.megakernel is not None else 'off'}"
                  f" {getattr(st, 'megakernel_fallback', '')[:300]}", flush=True)
        if mod is not None:
            setattr(mod, attr, keep)
        res = out["families"][fam] = {name: {} for name in engines}
        for b in batches:
            for name in names:
                res[f"same_bits_b{b}" + name[3:]] = sb = same_bits(engines["baseline"],
                                                                   engines[name], b)
                print(f"{fam}: one decoder pass{name[3:]}, b={b}: {sb}", flush=True)
        for rnd in range(args.rounds):
            for name, fe in engines.items():
                for b in batches:
                    ms = graph_step_ms(fe, b, args.pos, torch.device("cuda"), args.iters)
                    res[name].setdefault(str(b), []).append(ms)
                    print(f"{fam} round {rnd} {name} b={b}: {ms:.4f} ms", flush=True)
        for name, fe in engines.items():
            if args.top:
                print(f"{fam} {name} b=1, top kernels:", flush=True)
            res[name]["kernels_b1"] = step_kernels(fe, 1, args.top)
            fe.close()
        if args.floor and fam == "moondream2":
            from bench.bench_decode import copy_bandwidth, decoder_weight_bytes, kv_bytes
            bw = copy_bandwidth()
            wbytes = decoder_weight_bytes(model)
            res["floor_ms"] = {}
            for b in batches:
                fl = res["floor_ms"][str(b)] = (wbytes + kv_bytes(model.config, [args.pos] * b)
                                                ) / bw * 1e3
                print(f"{fam} b={b}: floor {fl:.4f} ms (copy {bw / 1e12:.3f} TB/s); "
                      + ", ".join(f"{name} {min(res[name][str(b)]) / fl:.3f}x"
                                  for name in engines), flush=True)
        for b in batches if args.rounds else ():
            o = min(res["baseline"][str(b)])
            for name in names:
                r = min(res[name][str(b)])
                print(f"{fam} b={b}: baseline {o:.4f} ms -> {name} {r:.4f} ms ({o / r:.2f}x)",
                      flush=True)
        del engines, model
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ab_switch.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

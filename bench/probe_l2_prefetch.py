"""The fused decode step with and without the L2 weight-prefetch stream (ops/l2_prefetch.py,
fast/weight_prefetch.py), same process, same engine (H200): one step (lm + forward pieces)
captured as a CUDA graph plainly and with the prefetcher beside it, for each window size,
graph replay ms (median of --iters, rounds alternating), against the copy-bandwidth time of
the weights the step's GEMVs read; the step's outputs compared bit for bit (the prefetch is
a hint: the same kernels sum the same way) and the counter checked against the recorded
credit (every GEMV program reported).

Usage (GPU): PYTHONPATH=. python3 bench/probe_l2_prefetch.py [--families qwen3.5-0.8b,moondream2]
             [--batches 1,8] [--windows 8,16,32] [--programs 16] [--rounds 2] [--iters 50]
Writes $OUT/probe_l2_prefetch.json when OUT is set.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.bench_timing import call_times, copy_bandwidth  # noqa: E402
from bench.out_dir import write_json  # noqa: E402
from bench.sweep_gemv_family import build_model  # noqa: E402


def outputs_sha(fe) -> str:
    st, h = fe.state, hashlib.sha256()
    tensors = [st.hidden, st.out] + list(st.fused.bufs.values())
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="qwen3.5-0.8b,moondream2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--windows", default="8,16,32", help="MiB ahead of the GEMVs")
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64, help="KiB per prefetch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--pos", type=int, default=300)
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    from photon_core.fast import FastEngine
    from photon_core.fast.cuda_graph_runner import capture_graph
    from photon_core.fast.weight_prefetch import WeightPrefetch
    bw = copy_bandwidth("cuda")
    out = {"gpu": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "families": {}}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for fam in args.families.split(","):
        model = build_model(fam)
        fe = FastEngine(model, max_batch=max(int(b) for b in args.batches.split(",")),
                        kv_capacity=1024, megakernel="off", deterministic=args.deterministic)
        st = fe.state
        st.pos.fill_(args.pos)
        st.active.zero_()
        res = out["families"][fam] = {}
        for b in (int(x) for x in args.batches.split(",")):
            def step(b=b):
                fe.runner.fns["lm"](st, b)
                fe.runner.fns["forward"](st, b)
            step()
            torch.cuda.synchronize()
            forms = {"plain": capture_graph(step)[0]}
            wps = {}
            for w in (int(x) for x in args.windows.split(",")):
                wp = WeightPrefetch("cuda", w << 20, args.programs, args.chunk << 10)
                forms[f"window {w} MiB"] = capture_graph(wp.around(step))[0]
                wp.fill()
                wps[f"window {w} MiB"] = wp
            shas, times = {}, {k: [] for k in forms}
            for name, g in forms.items():
                g.replay()
                torch.cuda.synchronize()
                shas[name] = outputs_sha(fe)
                if name in wps:
                    wp = wps[name]
                    got, want = int(wp.counter.item()), wp.recorder.credit
                    print(f"{fam} b={b} {name}: {len(wp.recorder.segments)} GEMVs, "
                          f"{wp.weight_bytes / 2**20:.1f} MiB, counter {got} / credit {want}",
                          flush=True)
            wbytes = next(iter(wps.values())).weight_bytes if wps else 0
            for _ in range(args.rounds):
                for name, g in forms.items():
                    times[name].append(statistics.median(call_times(g.replay, "cuda",
                                                                    args.iters)))
            floor = wbytes / bw * 1e3
            row = res[str(b)] = {"gemv_weight_MiB": wbytes / 2 ** 20, "floor_ms": floor,
                                 "ms": times, "sha": shas}
            base = min(times["plain"])
            for name in forms:
                ms = min(times[name])
                print(f"{fam} b={b} {name:>16}: {ms:.4f} ms ({base / ms:.3f}x plain, "
                      f"{ms / floor:.2f}x the GEMV weights' copy time {floor:.4f}) rounds "
                      f"{', '.join(f'{t:.4f}' for t in times[name])}; outputs "
                      f"{'same' if shas[name] == shas['plain'] else 'DIFFER'}", flush=True)
            row["same_bits"] = all(s == shas["plain"] for s in shas.values())
        fe.close()
        del fe, model
        torch.cuda.empty_cache()
    write_json("probe_l2_prefetch.json", out)


if __name__ == "__main__":
    main()

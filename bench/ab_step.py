"""A/B of the decode step between two checkouts on one GPU (same run, same process kind):
graph replay ms of one step (lm + forward pieces) at batch 1 and 8, CUDA kernels launched per
batch-1 step, the graphed prompt prefill at T = 8 / 16 tokens (ms, kernels), and encode + detect(5) / encode + query(32) ms, at real Moondream 2 shapes
(random bf16 weights, kv capacity 832).

Usage: python3 bench/ab_step.py TREE [TREE ...]   (each TREE: a checkout's root, e.g. a
`git worktree add /tmp/before 7f56e87` and `.`); every tree is run twice, alternating, in its
own subprocess.
"""
from __future__ import annotations

import json
import subprocess
import sys

CHILD = r'''
import sys, time, json, torch, numpy as np
sys.path.insert(0, sys.argv[1])
from photon_core.fast import FastEngine
from photon_core.moondream.config import MoondreamConfig
from photon_core.moondream.model import build_random_model
from photon_core.task import Task
m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
e = FastEngine(m, max_batch=8, kv_capacity=832)
def cuda_ms(fn, iters=200, warm=10):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters): fn()
    t.record(); torch.cuda.synchronize()
    return s.elapsed_time(t) / iters
e.state.active.zero_()
out = {}
for b in (1, 8):
    out[f"step_ms_b{b}"] = cuda_ms(lambda: (e.runner.run("lm", b), e.runner.run("forward", b)))
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    e.runner.run("lm", 1); e.runner.run("forward", 1); torch.cuda.synchronize()
out["kernels_b1"] = sum(1 for ev in prof.events() if ev.device_type.name == "CUDA")
# the graphed prompt prefill after the 730-token image prefix (row 0, before any run)
for T in (8, 16):
    prompt = list(range(100, 100 + T))
    out[f"prompt_prefill_ms_T{T}"] = cuda_ms(lambda: e.prefill.run(0, m.prefix_len, prompt),
                                             iters=50)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        e.prefill.run(0, m.prefix_len, prompt); torch.cuda.synchronize()
    out[f"prompt_prefill_kernels_T{T}"] = sum(1 for ev in prof.events()
                                              if ev.device_type.name == "CUDA")
frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
for name, t in (("detect5", Task("detect", object="person", max_objects=5)),
                ("query32", Task("query", question="What is in the image?", max_tokens=32))):
    e.run(e.encode_image(frame), t, ignore_eos=True)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(5):
        r = e.run(e.encode_image(frame), t, ignore_eos=True)
    torch.cuda.synchronize()
    out[f"encode_{name}_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    out[f"{name}_output"] = str(r.output)[:60]
print("RESULT", json.dumps(out))
'''


def main(trees: list[str]) -> None:
    for rnd in range(2):
        for tree in trees:
            p = subprocess.run([sys.executable, "-c", CHILD, tree], capture_output=True,
                               text=True, timeout=600)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
            res = json.loads(line[0][7:]) if line else {"error": p.stderr[-2000:]}
            print(json.dumps({"tree": tree, "round": rnd, **res}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])

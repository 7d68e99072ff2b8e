"""Cold start on the GPU: from a fresh process to the first result, real Moondream 2 shapes.

What a robot sees when the node activates: import, load the weights from a local folder,
build the engine (fast path: weight copies for the fused kernels, CUDA-graph capture), the
first encode (a new tiling is captured), the first detect. A random checkpoint of the real
shapes is written first (model.safetensors in the Hugging Face layout, bf16, + config.json +
tokenizer.json); each measurement is a fresh `python` process:

  fast, Triton cache cold   (TRITON_CACHE_DIR empty: every kernel is compiled)
  fast, Triton cache warm   (the same cache again: a restart of the node)
  reference, same folder    (baseline: the eager path, nothing captured or compiled)

The weights file is read from the page cache after the first load (no root to drop it), so
the disk part is not included; the file size is reported. Target in the notes: <= 10 s.

Usage: PYTHONPATH=. python3 bench/bench_cold_start.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import numpy as np, torch
from photon_core import load_engine
from photon_core.task import Task
torch.cuda.init()
t_import = time.perf_counter()
engine = load_engine(sys.argv[1], device="cuda", dtype="bf16", engine=sys.argv[2], progress=False)
torch.cuda.synchronize()
t_load = time.perf_counter()
frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
enc = engine.encode_image(frame)
torch.cuda.synchronize()
t_enc = time.perf_counter()
res = engine.run(enc, Task("detect", object="person", max_objects=5))
torch.cuda.synchronize()
t_first = time.perf_counter()
enc2 = engine.encode_image(frame)
res2 = engine.run(enc2, Task("detect", object="person", max_objects=5))
torch.cuda.synchronize()
t_second = time.perf_counter()
print(json.dumps({"import_cuda_init_s": t_import - t0, "load_build_s": t_load - t_import,
                  "first_encode_s": t_enc - t_load, "first_detect_s": t_first - t_enc,
                  "to_first_result_s": t_first - t0,
                  "steady_encode_detect_ms": (t_second - t_first) * 1e3}))
"""


def child(folder: str, engine: str, env: dict) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, folder, engine], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    d = json.loads(p.stdout.strip().splitlines()[-1])
    d["process_wall_s"] = wall
    return {k: round(v, 3) for k, v in d.items()}


def main() -> None:
    import torch
    from safetensors.torch import save_file

    from photon_core.moondream.config import MoondreamConfig
    from photon_core.moondream.test_model import build_test_tokenizer
    from photon_core.moondream.weights import random_weights

    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d")}
    tmp = Path(tempfile.mkdtemp(prefix="photon_cold_"))
    folder = tmp / "moondream2-random"
    folder.mkdir()
    cfg = MoondreamConfig()
    t0 = time.perf_counter()
    w = random_weights(cfg, "cuda", torch.bfloat16, 0)
    save_file({"model." + k: v.cpu().contiguous() for k, v in w.items()},
              str(folder / "model.safetensors"))
    del w
    torch.cuda.empty_cache()
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    build_test_tokenizer().save(str(folder / "tokenizer.json"))
    out["checkpoint_GB"] = round((folder / "model.safetensors").stat().st_size / 1e9, 2)
    out["checkpoint_write_s"] = round(time.perf_counter() - t0, 1)
    print(f"checkpoint: {out['checkpoint_GB']} GB bf16 in {out['checkpoint_write_s']} s",
          flush=True)

    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    cache = tmp / "triton_cache"
    env_cold = dict(env, TRITON_CACHE_DIR=str(cache))
    out["reference_warmup_read"] = child(str(folder), "reference", env)   # fills the page cache
    out["fast_triton_cold"] = child(str(folder), "fast", env_cold)
    out["fast_triton_warm"] = child(str(folder), "fast", env_cold)
    out["reference"] = child(str(folder), "reference", env)
    for k in ("reference_warmup_read", "fast_triton_cold", "fast_triton_warm", "reference"):
        print(f"{k}: {out[k]}", flush=True)
    od = os.environ.get("OUT")
    if od:
        Path(od).mkdir(parents=True, exist_ok=True)
        (Path(od) / "bench_cold_start.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

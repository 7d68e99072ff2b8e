"""Cost of the overlap crops of one frame (the part of encode_image before the encoder):
the current overlap_crops (global-view resize on a helper thread) vs the same two PIL
resizes one after the other, and overlap_crops_tensor (torch LANCZOS, bit-identical to
PIL) on --device, frame upload included; same run, same frames. Checks that all three give
the same pixels. Prints a markdown table.

    python bench/bench_crops.py [--iters 30] [--device cuda]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from concurrent.futures import Future  # noqa: E402

from photon_core.moondream import crops as crops_mod  # noqa: E402
from photon_core.moondream.crops import overlap_crops, overlap_crops_tensor  # noqa: E402


def serial_crops(image):
    """overlap_crops with the global-view resize done inline (the previous behaviour)."""
    saved = crops_mod._resize_in_background

    def inline(img, h, w):
        f = Future()
        f.set_result(crops_mod._resize(img, h, w))
        return f
    crops_mod._resize_in_background = inline
    try:
        return crops_mod.overlap_crops(image, 378, 14, 4, 12)[0]
    finally:
        crops_mod._resize_in_background = saved


def torch_crops(frame, device):
    """Upload the uint8 frame, make the crops there, wait for the device."""
    crops = overlap_crops_tensor(torch.from_numpy(frame).to(device), 378, 14, 4, 12)[0]
    if crops.is_cuda:
        torch.cuda.synchronize()
    return crops


def ms(fn, frame, iters):
    for _ in range(3):
        fn(frame)
    t = time.perf_counter()
    for _ in range(iters):
        fn(frame)
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cpu", help="device of the torch crops (cpu, cuda)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    dev = args.device
    print(f"cores: {os.cpu_count()}, torch crops on {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.startswith("cuda") else "")
          + f"\n\n| frame | serial ms | overlap_crops ms | ratio | torch ({dev}) ms "
          "| torch first call ms | identical |\n|---|---|---|---|---|---|---|")
    for h, w in ((480, 640), (640, 480), (720, 1280), (1080, 1920)):
        frame = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        t = time.perf_counter()
        first = torch_crops(frame, dev)     # includes the coefficient tables (cached after)
        cold = (time.perf_counter() - t) * 1e3
        a, b = ms(serial_crops, frame, args.iters), ms(lambda f: overlap_crops(f, 378, 14, 4, 12), frame, args.iters)
        c = ms(lambda f: torch_crops(f, dev), frame, args.iters)
        ref = overlap_crops(frame, 378, 14, 4, 12)[0]
        same = (np.array_equal(serial_crops(frame), ref)
                and np.array_equal(first.cpu().numpy(), ref)
                and np.array_equal(torch_crops(frame, dev).cpu().numpy(), ref))
        print(f"| {w}x{h} | {a:.1f} | {b:.1f} | {b / a:.2f} | {c:.2f} | {cold:.1f} | {same} |")


if __name__ == "__main__":
    main()

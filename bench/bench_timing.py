"""Timing shared by the benchmarks (bench_qwen3_5*.py, bench_gemma4.py, probe_fp8_gemm.py):
the median time of a callable on a device, the same as a CUDA graph of calls, and the
device's copy bandwidth (the decode-step floor)."""
from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, device, iters: int = 20, warmup: int = 3) -> float:
    """Median ms of fn() over `iters` calls after `warmup` calls: CUDA events around each call
    on a CUDA device (the host waits for the device after each), perf_counter elsewhere."""
    return statistics.median(call_times(fn, device, iters, warmup))


def call_times(fn, device, iters: int = 20, warmup: int = 3) -> list[float]:
    """ms of each of `iters` calls of fn() after `warmup` calls (median_ms' measurement)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def graph_ms(fn, calls: int = 20, replays: int = 7) -> float:
    """ms per call of fn() on CUDA: a CUDA graph of `calls` back-to-back calls (captured after
    3 warm-up calls on a side stream), the median of `replays` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return statistics.median(ts)


def copy_bandwidth(device, iters: int = 10, warmup: int = 3) -> float:
    """Bytes/s of a 256 MiB device-to-device copy (read + write), median of `iters`."""
    a = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), device, iters, warmup)
    return 2 * a.numel() / (ms / 1e3)


def step_kernels(fe, b, top=0, say=print):
    """CUDA kernels launched by one graph replay of a step (lm + forward) at batch b
    (torch profiler, as bench/ab_step.py); None off CUDA. top > 0: also say the `top`
    kernels by their summed CUDA time in that step (name, launches, us), printed with say."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile
    fe.state.active.zero_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fe.runner.run("lm", b)
        fe.runner.run("forward", b)
        torch.cuda.synchronize()
    evs = [ev for ev in prof.events() if ev.device_type.name == "CUDA"]
    if top:
        per: dict[str, list] = {}
        for ev in evs:
            t = per.setdefault(ev.name[:60], [0, 0.0])
            t[0] += 1
            t[1] += ev.time_range.elapsed_us()
        for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
            say(f"    {us:9.1f} us  {n:4d} x  {name}")
    return len(evs)

"""Where the megakernel's time goes (H200): the same compiled table restricted to one op kind
(dependencies dropped: timing only, the values are garbage), the whole table without waits,
and the whole table; registers / spills of the compiled kernel; and a field-by-field diff of
one step against the fused backend (x, logits, hidden, k/v). Runs in a watchdog subprocess.
Usage: PYTHONPATH=. python3 bench/diag_megakernel.py [--b 1]"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def subset(c, keep, waits=False):
    import torch

    from photon_core.megakernel.instructions import F_WAIT0, F_WAIT1
    rows, q = [], [0]
    k = 0
    for queue in c.queues():
        for ins in queue:
            if keep(ins):
                rows.append(k)
            k += 1
        q.append(len(rows))
    table = c.table[torch.tensor(rows, device=c.table.device)].clone()
    if not waits:
        table[:, F_WAIT0] = -1
        table[:, F_WAIT1] = -1
    return dataclasses.replace(c, table=table, queue=torch.tensor(q, dtype=torch.int32,
                                                                  device=c.table.device),
                               counters=torch.zeros_like(c.counters))


def child(b, smoke=False):
    sys.argv = [sys.argv[0]]
    import bench_megakernel as bm
    from photon_core.megakernel.instructions import OP_NAMES
    from photon_core.megakernel.kernel import launch
    c = bm.Ctx(smoke, 8)
    torch, st, fd = c.torch, c.st, c.fd
    mk = c.mk(b)
    cm = mk.compiled
    c.state_for(b)
    c.fused_step(b, False)
    s0 = c.snap()
    c.fused_step(b, False)
    ref = c.snap() | {"logits": fd.bufs["logits"][:b].clone()}
    c.restore(s0)
    mk.step()
    got = c.snap() | {"logits": fd.bufs["logits"][:b].clone()}
    for f in ("x", "hidden", "logits", "kv", "out", "pos"):
        a, r = got[f], ref[f]
        if f in ("x", "hidden"):
            a, r = a[:b], r[:b]
        d = (a.float() - r.float()).abs()
        print(f"field {f}: max |diff| {d.max().item():.4g}, mean {d.mean().item():.3g}, "
              f"bitwise equal {torch.equal(a, r)}, max |ref| {r.float().abs().max().item():.3g}",
              flush=True)
    if smoke:
        return
    kern = mk.run_kernel()
    print(f"kernel: n_regs {getattr(kern, 'n_regs', '?')} n_spills "
          f"{getattr(kern, 'n_spills', '?')} shared {getattr(kern, 'shared', '?')}", flush=True)
    st.active.zero_()

    def ms(cc, reps=20):
        for _ in range(3):
            launch(cc, mk.low)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            launch(cc, mk.low)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps * 1e3
    print(f"b={b} whole table: {ms(cm):.3f} ms", flush=True)
    print(f"b={b} whole table, no waits: {ms(subset(cm, lambda i: True)):.3f} ms", flush=True)
    for op, name in OP_NAMES.items():
        n = sum(1 for i in cm.instrs if i.op == op)
        if n:
            print(f"b={b} only {name} ({n} instr, no waits): "
                  f"{ms(subset(cm, lambda i, op=op: i.op == op)):.3f} ms", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--smoke", action="store_true", help="CPU tiny model: the field diff only")
    a = ap.parse_args()
    if a.child:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        child(a.b, a.smoke)
    else:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not a.smoke:
            env.pop("TRITON_INTERPRET", None)
        try:
            subprocess.run([sys.executable, __file__, "--child", "--b", str(a.b)]
                           + (["--smoke"] if a.smoke else []), env=env, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"TIMEOUT after {a.timeout} s", flush=True)

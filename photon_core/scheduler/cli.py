"""`photon sim-scheduler`: run the scheduler simulator grid (EDF vs FIFO), print the table."""
from __future__ import annotations

import json
import time


def register(sub) -> None:
    p = sub.add_parser("sim-scheduler", help="scheduler simulator: EDF vs FIFO on camera traces")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of trace per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cameras", default="1,2,4")
    p.add_argument("--fps", default="15,30")
    p.add_argument("--loads", default="0.5,1,2")
    p.add_argument("--policies", default="edf,fifo")
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="engine this much slower than calibrated (drift after start-up)")
    p.add_argument("--png", default=None, help="write the plot here")
    p.add_argument("--json", default=None, help="write the metrics here")
    p.set_defaults(func=run)


def run(args) -> int:
    from .simulator import check_targets, plot, run_grid, table

    t0 = time.time()
    res = run_grid(duration_s=args.duration, seed=args.seed,
                   cameras=tuple(int(x) for x in args.cameras.split(",")),
                   fps=tuple(float(x) for x in args.fps.split(",")),
                   loads=tuple(float(x) for x in args.loads.split(",")),
                   policies=tuple(args.policies.split(",")), slowdown=args.slowdown)
    print(table(res))
    print()
    ok_all = True
    for name, ok, detail in check_targets(res):
        ok_all &= ok
        print(f"- [{'x' if ok else ' '}] {name}: {'met' if ok else 'MISSED'} ({detail})")
    print(f"\n({len(res)} simulations, {time.time() - t0:.1f} s)")
    if args.png:
        plot(res, args.png)
        print(f"plot: {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"trace": r.spec.label, "cameras": r.spec.cameras, "fps": r.spec.fps,
                        "load": r.spec.load, "policy": r.policy, "engine_scale": r.scale,
                        **r.metrics} for r in res], f, indent=1, default=str)
    return 0 if ok_all else 1

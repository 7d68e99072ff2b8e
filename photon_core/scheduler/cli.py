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
    p.add_argument("--set", default="grid", choices=("grid", "multicam", "both"),
                   help="grid: relative costs at load levels (the targets); multicam: the "
                        "multi-camera trace set (1-8 cameras, 5-30 fps) on measured GPU costs")
    p.add_argument("--profile", default="h200", help="cost profile of the multicam set")
    p.add_argument("--encode-batch-gain", type=float, default=None,
                   help="multicam: the engine's encode_batch saves this fraction (default: the "
                        "profile's measured gain; < 0: an engine without encode_batch)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .simulator import check_targets, multicam_table, plot, run_grid, run_multicam, table

    t0 = time.time()
    multi = []
    if getattr(args, "set", "grid") in ("multicam", "both"):
        from .cost_profiles import H200_SOURCE
        multi = run_multicam(duration_s=args.duration, seed=args.seed,
                             policies=tuple(args.policies.split(",")), profile=args.profile,
                             encode_batch_gain=args.encode_batch_gain)
        print(f"multi-camera trace set, {args.profile} costs ({H200_SOURCE}):")
        print(multicam_table(multi))
        print()
        if args.set == "multicam":
            print(f"({len(multi)} simulations, {time.time() - t0:.1f} s)")
            _dump(args, multi)
            return 0
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
    _dump(args, multi + res)
    return 0 if ok_all else 1


def _dump(args, res) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"trace": r.spec.label, "cameras": r.spec.cameras, "fps": r.spec.fps,
                        "load": r.spec.load, "policy": r.policy, "engine_scale": r.scale,
                        **r.metrics} for r in res], f, indent=1, default=str)

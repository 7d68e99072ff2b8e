"""Scheduler simulator benchmark: EDF (latest frame, admission, preemption) vs FIFO on
1/2/4 cameras at 15/30 fps, 0.5x/1x/2x of capacity. Deterministic (virtual clock).

Usage: PYTHONPATH=. python3 bench/sim_scheduler.py [--duration 20] [--seed 0]
           [--png docs/img/scheduler_sim.png] [--json out.json]
Same as `photon sim-scheduler`. Exit status 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from photon_core.scheduler import cli  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="sim_scheduler")
    sub = parser.add_subparsers(dest="command")
    cli.register(sub)
    sys.exit(cli.run(parser.parse_args(["sim-scheduler"] + sys.argv[1:])))

"""Run pytest with module switches set first (the GPU tests with a switch away from its
default, e.g. photon_core.fast.cuda_graph_runner:STAGED_FORWARD=0), in this one process.

Usage: PYTHONPATH=. python3 bench/pytest_with.py MODULE:NAME=VALUE [...] -- PYTEST ARGS
(the switches as ab_switch.parse_toggle reads them: a bool / int switch takes an int).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_switch import apply_switches  # noqa: E402


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    apply_switches(argv[:cut])
    import pytest
    return int(pytest.main(argv[cut + 1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

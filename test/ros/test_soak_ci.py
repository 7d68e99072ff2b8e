"""The CI version of the soak benchmark (bench/bench_soak.py): 60 s of 4 cameras x 30 fps
with mixed periodic tasks and on-demand queries against the real node (tiny model, CPU).
Every request is accounted for, the queue stays bounded, RSS stays flat, every on-demand
call is answered, and the node exits cleanly. Marked `soak` (runs in CI, ~80 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")

from node_helpers import REPO, moondream_available  # noqa: E402
from ros_env import child_env  # noqa: E402

pytestmark = [pytest.mark.soak,
              pytest.mark.skipif(not moondream_available(), reason="no photon_core.moondream")]


def test_soak_60s(tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "bench_soak.py"), "--duration", "60",
                        "--warmup", "5", "--json", str(out)], cwd=REPO, env=child_env(),
                       capture_output=True, text=True, timeout=400)
    assert out.is_file(), p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    t = s["totals"]
    assert p.returncode == 0 and s["passed"], json.dumps({k: s.get(k) for k in (
        "failures", "checks", "totals", "queue", "rss_mib", "on_demand", "node_traceback")},
        indent=1)
    # what the checks mean, spelled out
    # 4 cameras x 30 fps x ~60 s; a frame DDS drops before the node (reliable KEEP_LAST 5 can,
    # on a loaded 2-core machine: 16 of 7800 in one CI run) is counted by the node itself
    # (frames_lost_in_transport: the rmw's message_lost event, sequence gaps) - none silently
    assert t["sent"] > 4 * 30 * 50
    assert t["received"] + t["lost_reported_by_node"] == t["sent"] and t["unexplained"] == 0
    assert t["received"] >= 0.95 * t["sent"]
    assert t["requests"] == (t["answered"] + t["superseded"] + t["skipped"] + t["cancelled"]
                             + t["errored"])
    assert t["answered"] > 0 and s["on_demand"]["no_response"] == 0
    assert s["rss_mib"]["end"] <= s["rss_mib"]["start"] * 1.25 + 64

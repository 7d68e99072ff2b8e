"""The pieces of bench/bench_soak.py that make it runnable on a machine whose commands are
shorter than the soak (the lent GPU machine): GPU memory through nvidia-smi (the node's own
figure, else the device's), and `--wait` following a detached run until it ends. The soak
itself runs in test_soak_ci.py."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("bench_soak", REPO / "bench" / "bench_soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_smi(tmp_path, monkeypatch, apps: str, used: str = "12345\n"):
    """An nvidia-smi on PATH that answers the two queries bench_soak makes."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    f = d / "nvidia-smi"
    f.write_text("#!/bin/sh\ncase \"$*\" in\n"
                 f"  *query-compute-apps*) printf '{apps}' ;;\n"
                 f"  *query-gpu=memory.used*) printf '{used}' ;;\nesac\n")
    f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}:{os.environ['PATH']}")


def test_gpu_memory_of_the_node_else_of_the_device(soak, tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, "111, 500\\n4242, 9000\\n")
    assert soak.gpu_mib(4242) == (9000.0, "process")
    # the node's PID not listed (another PID namespace, a VM): the GPU's memory in use
    assert soak.gpu_mib(7) == (12345.0, "device")
    fake_smi(tmp_path, monkeypatch, "", "garbage\\n")
    assert soak.gpu_mib(7) == (None, "none")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert soak.gpu_mib(7) == (None, "none")


def _sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"],
                            start_new_session=True)


def test_wait_follows_a_detached_run(soak, tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    assert soak.wait_for(run, 1.0, str(out)) == 2                 # nothing started there
    p = _sleeper(60)
    try:
        (run / "soak.pid").write_text(str(p.pid))
        (run / "soak.log").write_text("[soak] t=30s progress\n")
        assert soak.wait_for(run, 0.5, str(out)) == 3             # still running
        assert "t=30s progress" in capsys.readouterr().out
        assert (out / "soak.log").is_file() and not (out / "soak.json").exists()
        summary = {"passed": True, "failures": [], "totals": {"requests": 9, "unaccounted": 0}}
        (run / "soak.json").write_text(json.dumps(summary))
        (run / "node.log").write_text("node\n")
        assert soak.wait_for(run, 30.0, str(out)) == 0            # the summary is the end
        assert "soak PASSED: 9 requests, unaccounted 0" in capsys.readouterr().out
        assert json.loads((out / "soak.json").read_text()) == summary
        assert (out / "node.log").read_text() == "node\n"
        (run / "soak.json").write_text(json.dumps({**summary, "passed": False,
                                                    "failures": ["check failed: x"]}))
        assert soak.wait_for(run, 30.0, "") == 1
    finally:
        p.kill()
        p.wait()
    (run / "soak.json").unlink()
    assert soak.wait_for(run, 30.0, "") == 1                      # ended without a summary
    assert "ended without writing" in capsys.readouterr().out

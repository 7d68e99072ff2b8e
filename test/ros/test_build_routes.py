"""Both install routes give importable interfaces: pip (scikit-build-core, what
scripts/install.sh ran) and colcon (built here from a copy of the sources)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMPORTS = ("from photon_ros.msg import DetectionArray, PointArray, Answer, TaskSpec; "
           "from photon_ros.srv import Query, SetTasks; from photon_ros.action import StreamAnswer; "
           "import photon_ros, photon_core; print(photon_ros.__file__); print(photon_core.__file__)")


def test_pip_route_imports_from_site_packages(tmp_path):
    # Run from an empty folder so the source checkout cannot be what gets imported.
    out = subprocess.run([sys.executable, "-c", IMPORTS], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    ros_file, core_file = out.stdout.split()
    assert "site-packages" in ros_file and "site-packages" in core_file


@pytest.mark.skipif(shutil.which("colcon") is None, reason="colcon not installed")
def test_colcon_build_and_test(tmp_path):
    src = tmp_path / "src" / "photon_ros"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "install", "log", "__pycache__", "*.egg-info", ".pytest_cache"))
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST", "PYTHONPATH": "",
           "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    run = lambda *cmd: subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True,
                                      timeout=600, env=env)
    built = run("colcon", "build", "--event-handlers", "console_direct-",
                "--cmake-args", "-DBUILD_TESTING=ON")
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    tested = run("colcon", "test", "--event-handlers", "console_direct-")
    assert tested.returncode == 0, tested.stdout[-4000:]
    result = run("colcon", "test-result", "--verbose")
    assert result.returncode == 0 and "0 failures" in result.stdout, result.stdout
    # The install space alone (setup.bash, no pip install) gives the interfaces and the code.
    imported = run("bash", "-c", f". install/setup.bash && cd / && python -c '{IMPORTS}'")
    assert imported.returncode == 0, imported.stderr
    assert all(str(tmp_path / "install") in line for line in imported.stdout.split())
    prefix = tmp_path / "install" / "photon_ros"
    assert (prefix / "lib" / "photon_ros" / "perception_node").exists()
    assert (prefix / "bin" / "photon").exists()
    assert (prefix / "share" / "photon_ros" / "launch" / "perception.launch.py").exists()
    assert (prefix / "share" / "photon_ros" / "config" / "perception.yaml").exists()

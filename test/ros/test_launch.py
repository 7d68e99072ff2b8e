"""`ros2 launch` and the ROS 2 command line, for real: runs the launch_testing file
launch_perception.py through the `launch_test` command (one launch of
`perception.launch.py` for all its checks), plus the `--params-file` route of
`ros2 run`-style starts.

The launch system and the `ros2` command are not published as wheels: CI installs them
from ../shared/ros2-cli (scripts/install.sh); any ROS 2 installation has them. Elsewhere
these tests skip and say why.
"""
from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")

from node_helpers import (REPO, child_env, moondream_available, tiny_model_dir,  # noqa: E402
                          write_config)

BIN = Path(sys.executable).parent
# the pip route installs into this environment's prefix; a sourced ROS setup sets it already
os.environ.setdefault("AMENT_PREFIX_PATH", sys.prefix)
HERE = Path(__file__).resolve().parent


def _missing() -> str | None:
    for mod in ("launch_ros", "launch_testing", "ros2cli", "vision_msgs.msg"):
        try:
            __import__(mod)
        except ImportError as e:
            return f"{mod} not importable ({e})"
    for exe in ("ros2", "launch_test"):
        if not (BIN / exe).exists() and shutil.which(exe) is None:
            return f"no `{exe}` command"
    return None


MISSING = _missing()
pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=f"the ROS 2 launch system / command line is "
                       f"not installed ({MISSING}); CI installs it from ../shared/ros2-cli"),
    pytest.mark.skipif(not moondream_available(), reason="photon_core.moondream not importable"),
]

PARAMS = {
    "default_deadline_ms": 30000.0,      # generous: a loaded CI machine calibrates slow
    "cameras": ["front", "rear"],
    "front": {"topic": "/not/this/one", "tasks": ["people", "hands", "scene"],
              "people": {"skill": "detect", "object": "person", "max_objects": 1},
              "hands": {"skill": "point", "object": "hand", "max_objects": 1},
              "scene": {"skill": "caption", "caption_length": "short", "max_tokens": 4,
                        "on_miss": "finish"}},
    "rear": {"topic": "/lt_cam/rear", "tasks": ["people"],
             "people": {"skill": "detect", "object": "person", "max_objects": 1}},
}


def _env(**extra: str) -> dict[str, str]:
    # the checkout's photon_ros/photon_core first (as the other node tests), the installed
    # package for the launch file, the executable and the generated messages
    env = child_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(BIN), env.get("PATH", "")))
    env.setdefault("AMENT_PREFIX_PATH", sys.prefix)
    return env


def _stop_group(p: subprocess.Popen) -> str:
    """SIGINT to `ros2 run` and the node it started (its own process group), then SIGKILL:
    the node must not outlive the test holding our pipe."""
    import signal

    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            return p.communicate(timeout=wait)[0]
        except subprocess.TimeoutExpired:
            continue
    return p.communicate(timeout=10)[0]


def test_installed_launch_file_is_this_checkouts():
    """`ros2 launch photon_ros ...` runs the installed copy: it must be this checkout's."""
    from ament_index_python.packages import get_package_share_directory

    share = Path(get_package_share_directory("photon_ros"))
    for rel in ("launch/perception.launch.py", "config/perception.yaml"):
        assert filecmp.cmp(share / rel, REPO / rel, shallow=False), \
            f"{share / rel} differs from the checkout: re-run scripts/install.sh"


def test_perception_launch_with_the_ros2_command_line(tmp_path_factory, tmp_path):
    model = tiny_model_dir(tmp_path_factory.getbasetemp())
    cfg = write_config(tmp_path / "launch_params.yaml", PARAMS)
    r = subprocess.run([str(BIN / "launch_test"), str(HERE / "launch_perception.py")],
                       env=_env(PHOTON_TEST_MODEL=str(model), PHOTON_TEST_PARAMS=str(cfg),
                                ROS_LOG_DIR=str(tmp_path / "log")),
                       capture_output=True, text=True, timeout=540, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-12000:]
    # launch_test says how many ran; all of them must have
    assert "Ran 5 tests" in out and "Ran 1 test" in out, out[-6000:]


def test_params_file_alone_gives_the_cameras_and_the_log_names_it(tmp_path_factory, tmp_path):
    """`ros2 run photon_ros perception_node --ros-args --params-file my.yaml`: the cameras of
    my.yaml, no "unknown parameters" warning, and the log names my.yaml."""
    model = tiny_model_dir(tmp_path_factory.getbasetemp())
    cfg = write_config(tmp_path / "mine.yaml", {
        "model": str(model), "cameras": ["left"],
        "left": {"topic": "/pf/left", "tasks": ["cups"],
                 "cups": {"skill": "detect", "object": "cup"}}})
    p = subprocess.Popen([str(BIN / "ros2"), "run", "photon_ros", "perception_node", "--ros-args",
                          "--params-file", str(cfg), "-p", "auto_activate:=false",
                          "-r", "__node:=pf_node"],
                         env=_env(ROS_LOG_DIR=str(tmp_path / "log")), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    def ros2(*args: str, want: str) -> subprocess.CompletedProcess:
        # `--no-daemon --spin-time 2`: a node not discovered within 2 s on a loaded machine
        # is "not found" - asked again, up to 6 times
        for _ in range(6):
            r = subprocess.run([str(BIN / "ros2"), *args[:2], "--no-daemon",
                                "--spin-time", "2", *args[2:]], env=_env(),
                               capture_output=True, text=True, timeout=60)
            if want in r.stdout:
                break
        return r
    try:
        r = ros2("lifecycle", "set", "/pf_node", "configure", want="Transitioning successful")
        assert "Transitioning successful" in r.stdout, r.stdout + r.stderr
        r = ros2("param", "get", "/pf_node", "left.topic", want="/pf/left")
        assert "/pf/left" in r.stdout, r.stdout + r.stderr
    finally:
        out = _stop_group(p)
    assert f"configuration from the node's parameters (--params-file {cfg})" in out, out
    assert "left <- /pf/left (1 tasks)" in out, out
    assert "unknown parameters ignored" not in out, out
    assert "perception.yaml" not in out, out

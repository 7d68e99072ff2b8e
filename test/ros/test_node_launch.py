"""launch/perception.launch.py under a real LaunchService. launch_ros is not on PyPI, so this
runs only where ROS 2 is installed (colcon build + source install/setup.bash); elsewhere the
same node and YAML are covered by test_node_dds.py, which starts the node directly."""
from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("rclpy")
pytest.importorskip("launch_ros")

from node_helpers import (Collector, moondream_available, spawn_camera, stop,  # noqa: E402
                          tiny_model_dir, wait_for, write_config)

LAUNCH = Path(__file__).resolve().parents[2] / "launch" / "perception.launch.py"


@pytest.mark.skipif(not moondream_available(), reason="photon_core.moondream not importable")
def test_launch_file_starts_a_working_node(tmp_path_factory, tmp_path):
    from launch import LaunchDescription, LaunchService
    from launch.actions import IncludeLaunchDescription
    from launch.launch_description_sources import PythonLaunchDescriptionSource

    from photon_ros.msg import DetectionArray

    model = tiny_model_dir(tmp_path_factory.getbasetemp())
    cfg = write_config(tmp_path / "launch.yaml", {
        "cameras": ["front"], "front": {"topic": "/not/this/one", "tasks": ["people"],
                                        "people": {"skill": "detect", "object": "person",
                                                   "max_objects": 1}}})
    ld = LaunchDescription([IncludeLaunchDescription(
        PythonLaunchDescriptionSource(str(LAUNCH)),
        launch_arguments={"model": str(model), "params_file": str(cfg),
                          "namespace": "robot1", "camera_topic": "/launch_t/image"}.items())])
    ls = LaunchService(noninteractive=True)
    ls.include_launch_description(ld)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=lambda: loop.run_until_complete(ls.run_async()), daemon=True)
    runner.start()
    col = Collector("photon_test_launch")
    cam = None
    try:
        col.listen(DetectionArray, "/robot1/front/detections")
        cam = spawn_camera("--topic", "/launch_t/image", "--fps", "5", "--wait", "60")
        assert wait_for(lambda: len(col.msgs("/robot1/front/detections")) >= 2, timeout=90)
        assert col.msgs("/robot1/front/detections")[0].camera == "front"
    finally:
        if cam is not None:
            stop(cam)
        col.close()
        ls.shutdown()                     # thread-safe: ends the launch loop
        runner.join(30)

"""launch_testing test of `perception.launch.py` (run by test_launch.py through the
`launch_test` command; by hand: PHOTON_TEST_MODEL=DIR PHOTON_TEST_PARAMS=YAML launch_test
test/ros/launch_perception.py).

One launch for the whole file: the installed launch file (what `ros2 launch photon_ros
perception.launch.py` runs) with model, params_file, namespace, camera_topic and
use_sim_time given. The active tests drive it from outside, as a user would: the `ros2`
command line (lifecycle get/set, topic echo, param get) and a test node that publishes
/clock and camera frames and reads the results.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import unittest

import launch_testing
import launch_testing.actions
import pytest
from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource

NS = "lt"
NODE = f"/{NS}/perception_node"
CAMERA_TOPIC = "/lt_cam/image"          # the camera_topic argument (the YAML says otherwise)
REAR_TOPIC = "/lt_cam/rear"             # the second camera: only in the test's params file
STAMP0 = 1000.0                         # frame stamps; /clock runs CLOCK_AHEAD_S ahead of them
CLOCK_AHEAD_S = 0.25
W, H = 64, 48
TIMEOUT = 120.0
# `ros2 ... --no-daemon` waits this long for discovery on every call (a missed node is
# "not found" and tried again by ros2()); 5 s per call made this file ~100 s
SPIN = "2"


@pytest.mark.launch_test
def generate_test_description():
    launch_file = os.path.join(get_package_share_directory("photon_ros"), "launch",
                               "perception.launch.py")
    return LaunchDescription([
        IncludeLaunchDescription(PythonLaunchDescriptionSource(launch_file), launch_arguments={
            "model": os.environ["PHOTON_TEST_MODEL"],
            "params_file": os.environ["PHOTON_TEST_PARAMS"],
            "namespace": NS, "camera_topic": CAMERA_TOPIC, "use_sim_time": "true"}.items()),
        launch_testing.actions.ReadyToTest(),
    ])


def ros2(*args: str, timeout: float = 60.0, attempts: int = 5) -> subprocess.CompletedProcess:
    """The `ros2` command beside this Python (pass --no-daemon). Discovery of the node can
    take longer than --spin-time on a loaded machine: "Node not found" is tried again."""
    exe = os.path.join(os.path.dirname(sys.executable), "ros2")
    for _ in range(attempts):
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
        if "not found" not in (r.stdout + r.stderr).lower():
            break
        time.sleep(1.0)
    return r


def until(pred, timeout: float = TIMEOUT, period: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(period)
    return pred()


class Drive:
    """Test-side node: /clock and camera frames at 5 Hz (stamps STAMP0 + i * 0.2, /clock
    CLOCK_AHEAD_S ahead), results and diagnostics collected."""

    def __init__(self):
        import numpy as np
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import qos_profile_sensor_data
        from rosgraph_msgs.msg import Clock
        from sensor_msgs.msg import Image
        from vision_msgs.msg import Detection2DArray

        from photon_ros.msg import Answer, DetectionArray, PointArray

        self.np = np
        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx)
        self.node = rclpy.create_node("photon_launch_test", context=self.ctx)
        self.clock_pub = self.node.create_publisher(Clock, "/clock", 10)
        self.cam_pub = self.node.create_publisher(Image, CAMERA_TOPIC, qos_profile_sensor_data)
        self.lock = threading.Lock()
        self.got: dict[str, list] = {}
        self.sent: dict[tuple, str] = {}            # (sec, nanosec) -> frame_id
        for key, typ in (("detections", DetectionArray), ("points", PointArray),
                         ("answer", Answer), ("detections_2d", Detection2DArray),
                         ("points_2d", Detection2DArray)):
            self.node.create_subscription(typ, f"/{NS}/front/{key}",
                                          lambda m, k=key: self._keep(k, m), 50)
        self.node.create_subscription(DiagnosticArray, "/diagnostics",
                                      lambda m: self._keep("diagnostics", m), 50)
        self.i = 0
        self.publishing = True
        self.node.create_timer(0.2, self._tick)
        self.executor = SingleThreadedExecutor(context=self.ctx)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _keep(self, key, msg):
        with self.lock:
            self.got.setdefault(key, []).append(msg)

    def msgs(self, key: str) -> list:
        with self.lock:
            return list(self.got.get(key, []))

    def clear(self) -> None:
        with self.lock:
            self.got.clear()

    def _tick(self):
        from rosgraph_msgs.msg import Clock
        from sensor_msgs.msg import Image

        if not self.publishing:
            return
        t = STAMP0 + self.i * 0.2
        sec, nsec = int(t), int(round((t - int(t)) * 1e9)) % 1_000_000_000
        c = Clock()
        ct = t + CLOCK_AHEAD_S
        c.clock.sec, c.clock.nanosec = int(ct), int(round((ct - int(ct)) * 1e9)) % 1_000_000_000
        self.clock_pub.publish(c)
        y, x = self.np.mgrid[0:H, 0:W]
        rgb = self.np.stack([(x * 4 + self.i) % 256, (y * 4) % 256, (x + y) % 256], 2).astype("uint8")
        msg = Image(height=H, width=W, encoding="rgb8", step=W * 3, data=rgb.tobytes())
        msg.header.stamp.sec, msg.header.stamp.nanosec = sec, nsec
        msg.header.frame_id = f"lt_frame_{self.i}"
        with self.lock:
            self.sent[(sec, nsec)] = msg.header.frame_id
        self.cam_pub.publish(msg)
        self.i += 1

    def node_diag(self) -> dict | None:
        for arr in reversed(self.msgs("diagnostics")):
            for s in arr.status:
                if s.name == f"{NODE}: node":
                    return {kv.key: kv.value for kv in s.values}
        return None

    def close(self):
        import rclpy
        self.executor.shutdown()
        self.thread.join(5)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.ctx)


class TestPerceptionLaunch(unittest.TestCase):
    """Methods run in name order: test_1_... first."""

    @classmethod
    def setUpClass(cls):
        cls.drive = Drive()

    @classmethod
    def tearDownClass(cls):
        cls.drive.close()

    def test_1_node_comes_up_active(self):
        def active():
            r = ros2("lifecycle", "get", "--no-daemon", "--spin-time", SPIN, NODE)
            return r.returncode == 0 and r.stdout.startswith("active")
        self.assertTrue(until(active, timeout=180, period=1.0),
                        ros2("lifecycle", "get", "--no-daemon", NODE).stdout)

    def test_2_results_carry_the_frame_header_and_sim_time(self):
        d = self.drive
        self.assertTrue(until(lambda: d.msgs("detections") and d.msgs("points")
                              and d.msgs("answer")), "no results from the launched node")
        for key in ("detections", "points", "answer", "detections_2d", "points_2d"):
            self.assertTrue(until(lambda: d.msgs(key), timeout=30), f"nothing on {key}")
            for m in d.msgs(key):
                stamp = (m.header.stamp.sec, m.header.stamp.nanosec)
                self.assertIn(stamp, d.sent, f"{key}: a stamp no frame had: {stamp}")
                self.assertEqual(m.header.frame_id, d.sent[stamp], key)
        for m in d.msgs("detections") + d.msgs("points") + d.msgs("answer"):
            self.assertEqual(m.camera, "front")
            # use_sim_time: latency on /clock (CLOCK_AHEAD_S after the frame, + at most a
            # few frame periods while the result is made); the wall clock would give ~1e12 ms
            self.assertGreater(m.timing.latency_ms, 0.0)
            self.assertLess(m.timing.latency_ms, 3000.0, m.timing)
        v = d.msgs("detections_2d")[-1]
        for det in v.detections:
            self.assertEqual(det.results[0].hypothesis.class_id, "person")

    def test_3_arguments_took_effect(self):
        for name, want in (("use_sim_time", "True"), ("camera_topic", CAMERA_TOPIC),
                           ("rear.topic", REAR_TOPIC)):
            r = ros2("param", "get", "--no-daemon", "--spin-time", SPIN, NODE, name)
            self.assertIn(want, r.stdout, (name, r.stdout, r.stderr))
        # the params file's second camera is subscribed; the YAML's own front topic is not
        def rear_subscribed():
            r = ros2("topic", "info", "--no-daemon", "--spin-time", SPIN, REAR_TOPIC)
            return "Subscription count: 1" in r.stdout and r
        self.assertTrue(until(rear_subscribed, timeout=60, period=1.0),
                        ros2("topic", "info", "--no-daemon", REAR_TOPIC).stdout)
        r = ros2("topic", "info", "--no-daemon", "--spin-time", SPIN, "/not/this/one")
        self.assertNotIn("Subscription count: 1", r.stdout)

    def test_4_topic_echo_of_each_result_type(self):
        # the five echoes at once (each is a process of its own; one after the other they
        # took ~30 s, mostly start-up)
        exe = os.path.join(os.path.dirname(sys.executable), "ros2")
        echoes = {topic: subprocess.Popen(
            [exe, "topic", "echo", "--once", "--no-daemon", "--timeout", "60",
             f"/{NS}/front/{topic}", typ], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
            for topic, typ in (("detections", "photon_ros/msg/DetectionArray"),
                               ("points", "photon_ros/msg/PointArray"),
                               ("answer", "photon_ros/msg/Answer"),
                               ("detections_2d", "vision_msgs/msg/Detection2DArray"),
                               ("points_2d", "vision_msgs/msg/Detection2DArray"))}
        try:
            for topic, p in echoes.items():
                out, err = p.communicate(timeout=90)
                self.assertEqual(p.returncode, 0, (topic, out[-2000:], err[-2000:]))
                self.assertIn("frame_id: lt_frame_", out, (topic, out[-2000:]))
        finally:
            for p in echoes.values():
                if p.poll() is None:
                    p.kill()
                    p.communicate()

    def test_5_lifecycle_set_frees_the_model_and_activate_serves_again(self):
        d = self.drive
        r = ros2("lifecycle", "set", "--no-daemon", "--spin-time", SPIN, NODE, "deactivate",
                 timeout=90)
        self.assertIn("Transitioning successful", r.stdout, r.stdout + r.stderr)
        self.assertTrue(until(lambda: (d.node_diag() or {}).get("model_loaded") == "false",
                              timeout=30), d.node_diag())
        self.assertEqual(d.node_diag().get("state"), "inactive")
        time.sleep(1.0)                    # results of frames in flight may still come in
        d.clear()
        time.sleep(2.0)
        self.assertEqual(d.msgs("detections"), [], "inactive, yet detections were published")
        r = ros2("lifecycle", "set", "--no-daemon", "--spin-time", SPIN, NODE, "activate",
                 timeout=180)
        self.assertIn("Transitioning successful", r.stdout, r.stdout + r.stderr)
        self.assertTrue(until(lambda: d.msgs("detections")), "no results after activate")
        # the first report after the transition (one published during it - state still
        # "inactive", the model loaded but its load not yet counted while the heap is frozen -
        # can be the newest for a while: session 43's CI)
        diag = until(lambda: (x := d.node_diag() or {}).get("state") == "active"
                     and x.get("model_loaded") == "true" and x, timeout=30)
        self.assertTrue(diag, d.node_diag())
        self.assertEqual(diag.get("model_loads"), "2", diag)


@launch_testing.post_shutdown_test()
class TestAfterShutdown(unittest.TestCase):
    def test_clean_exit_and_log(self, proc_output, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info, allowable_exit_codes=[0, -2, -15])
        text = "".join(o.text.decode(errors="replace") for o in proc_output)
        self.assertNotIn("Traceback", text)
        # the log names the params file it was given; none of its cameras is "unknown"
        self.assertIn(f"configuration from {os.environ['PHOTON_TEST_PARAMS']}", text)
        self.assertNotIn("unknown parameters ignored", text)

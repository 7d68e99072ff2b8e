"""Shared helpers for the perception node tests: the tiny test model, YAML configs, starting
the node as its own process (`python -m photon_ros.perception_node`), and a test-side
rclpy node that collects results and diagnostics."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from ros_env import HERE, child_env, settle_new_client, stop, wait_for  # noqa: F401

REPO = HERE.parents[1]
_MODEL_LOCK = threading.Lock()


def moondream_available() -> bool:
    try:
        import photon_core.moondream  # noqa: F401
        return True
    except ImportError:
        return False


def tiny_model_dir(base: Path) -> Path:
    """`photon make-test-model moondream2 DIR --fast` once per test session (cached)."""
    out = base / "moondream2-test"
    with _MODEL_LOCK:
        if not (out / "model.safetensors").is_file():
            subprocess.run([sys.executable, "-m", "photon_core.cli", "make-test-model", "moondream2",
                            str(out), "--fast"], check=True, cwd=REPO, env=child_env(),
                           capture_output=True, timeout=120)
    return out


def write_config(path: Path, params: dict) -> Path:
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}, sort_keys=False))
    return path


@contextlib.contextmanager
def unit_node(name: str, params: dict):
    """A PerceptionNode in this process on its own rclpy context, configured from `params`
    (not activated: no model), its cameras set up; destroyed and its context shut down
    after."""
    import rclpy

    from photon_ros import perception_node as pn
    from photon_ros.task_config import config_from_params

    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = pn.PerceptionNode(name, context=ctx)
    try:
        node.config = config_from_params(params)
        node.cameras.reset(params["cameras"])
        yield node
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)


def spawn_node(*ros_args: str, name: str | None = None) -> subprocess.Popen:
    """Start the perception node in its own process; `ros_args` like "-p", "model:=DIR"."""
    args = [sys.executable, "-m", "photon_ros.perception_node", "--ros-args", *ros_args]
    if name:
        args += ["-r", f"__node:={name}"]
    return subprocess.Popen(args, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def spawn_camera(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "node_camera.py"), *args], cwd=REPO,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def stamp_of(msg) -> float:
    return msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9


def diag_values(arr, name_suffix: str) -> dict[str, str] | None:
    for s in arr.status:
        if s.name.endswith(name_suffix):
            return {kv.key: kv.value for kv in s.values}
    return None


class Collector:
    """A test-side node that records everything it is subscribed to, spun on its own thread."""

    def __init__(self, name: str = "photon_test_checker"):
        import rclpy
        from rclpy.executors import MultiThreadedExecutor

        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx)
        self.node = rclpy.create_node(name, context=self.ctx)
        self.executor = MultiThreadedExecutor(num_threads=2, context=self.ctx)
        self.executor.add_node(self.node)
        self.lock = threading.Lock()
        self.got: dict[str, list] = {}
        self.subs: dict = {}
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()

    def listen(self, msg_type, topic: str, key: str | None = None, qos=50) -> str:
        key = key or topic

        def cb(msg, key=key):
            with self.lock:
                self.got.setdefault(key, []).append(msg)
        self.subs[key] = self.node.create_subscription(msg_type, topic, cb, qos)
        return key

    def matched(self, *keys: str) -> bool:
        """Every listed subscription matched to at least one publisher (DDS discovery done:
        a reliable, volatile subscription gets only what is published after it matched)."""
        return all(self.subs[k].get_publisher_count() >= 1 for k in keys)

    def msgs(self, key: str) -> list:
        with self.lock:
            return list(self.got.get(key, []))

    def clear(self, key: str | None = None) -> None:
        with self.lock:
            if key is None:
                self.got.clear()
            else:
                self.got.pop(key, None)

    def call(self, client, request, timeout: float = 30.0):
        assert client.wait_for_service(timeout_sec=30), f"service {client.srv_name} not found"
        settle_new_client(client)
        future = client.call_async(request)
        assert wait_for(future.done, timeout=timeout), "no response"
        return future.result()

    def wait_future(self, future, timeout: float = 30.0):
        assert wait_for(future.done, timeout=timeout), "future not done"
        return future.result()

    def close(self) -> None:
        import rclpy
        self.executor.shutdown()
        self._thread.join(5)
        self.node.destroy_node()
        rclpy.shutdown(context=self.ctx)

"""Helpers for tests that run real rclpy nodes in separate processes over loopback DDS."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child ROS process: loopback-only discovery, same domain."""
    env = dict(os.environ)
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def spawn(script: str, *args: str, **env: str) -> subprocess.Popen:
    """Start `python <script> args...` from this folder as a separate process."""
    return subprocess.Popen([sys.executable, str(HERE / script), *args], env=child_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> str:
    """Stop a child (SIGINT, then kill) and return what it printed."""
    if proc.poll() is None:
        proc.send_signal(2)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    out, _ = proc.communicate()
    return out or ""


def wait_for(pred, timeout: float = 20.0, spin=None, period: float = 0.05) -> bool:
    """Poll pred() (spinning `spin()` in between) until true or timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        if spin is not None:
            spin()
        else:
            time.sleep(period)
    return pred()


_SETTLED: set = set()


def settle_new_client(client, pause_s: float = 0.5) -> None:
    """Before a service / action client's first request: a pause for discovery. Seeing the
    server (wait_for_service / service_is_ready / server_is_ready) means the client found the
    server's request reader; the server may not yet have matched the client's response reader,
    and then its response is dropped ("failed to send response (timeout)"; twice in five
    loaded 2-core CI runs, on a lifecycle transition and on a Query call). A request cannot
    simply be retried (a lifecycle transition is not idempotent), so the first one waits."""
    if id(client) not in _SETTLED:
        time.sleep(pause_s)
        _SETTLED.add(id(client))

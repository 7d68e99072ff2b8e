"""Soak: the perception node under steady load for a long time, every request accounted for.

    python bench/bench_soak.py [--duration 600] [--cameras 4] [--fps 30] [--model DIR]
        [--device cpu|cuda] [--query-hz 1] [--on-miss finish|cancel] [--json out.json]

The node runs as its own process (`python -m photon_ros.perception_node`), as on a robot.
This process publishes --cameras camera streams (rgb8 --width x --height, reliable QoS) at
--fps each, calls the node's on-demand Query service at --query-hz (detect / point / query /
caption in turn, on the cameras in turn), and samples once a second:
  - the node's RSS (/proc/PID/status) and, on CUDA, its GPU memory (nvidia-smi),
  - the scheduler's queue (diagnostics: scheduler.waiting / scheduler.running).
Tasks per camera (mixed): detect every frame, point every 3rd, caption every 15th, query at
0.5 Hz. Without --model a tiny random Moondream 2 (make-test-model --fast) runs on the CPU.

At the end the cameras stop, the node drains, and the node's own per-camera counters
(diagnostics) must add up, per camera:
    tasks_submitted == answered (results published) + superseded + skipped + cancelled +
    deadline_cancelled + errored
and every frame the node received either was converted (or counted as a bad frame). Sent vs
received shows what DDS dropped before the node (reliable QoS keep-last: 0 expected).
Also checked: every on-demand call got a response, the queue stayed bounded, the RSS at the
end is within 25% + 64 MiB of the RSS after warm-up, the node exits cleanly on SIGINT.
Exit status 0 when all checks pass, 1 otherwise; the summary is printed as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"   # before rclpy.init(): loopback only
os.environ.setdefault("ROS_DOMAIN_ID", str(random.randint(1, 101)))
os.environ.setdefault("ROS_LOG_DIR", tempfile.mkdtemp(prefix="photon-soak-roslog-"))

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

SKILLS = ("detect", "point", "query", "caption")


def node_config(args) -> dict:
    cams = [f"c{i}" for i in range(args.cameras)]
    params = {"default_deadline_ms": args.deadline_ms, "default_on_miss": args.on_miss,
              "on_demand_deadline_ms": 5000.0, "max_batch": 4, "device": args.device,
              "cameras": cams}
    for c in cams:
        params[c] = {"topic": f"/soak/{c}/image", "qos_reliable": True, "qos_depth": 5,
                     "tasks": ["people", "hands", "scene", "ask"],
                     "people": {"skill": "detect", "object": "person", "max_objects": 3},
                     "hands": {"skill": "point", "object": "hand", "every_n": 3, "max_objects": 2},
                     "scene": {"skill": "caption", "caption_length": "short", "every_n": 15,
                               "max_tokens": 8},
                     "ask": {"skill": "query", "question": "Is anyone there?", "hz": 0.5,
                             "max_tokens": 6}}
    return params


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def gpu_mib(pid: int) -> float | None:
    """The node's GPU memory (nvidia-smi), None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return 0.0 if out else None


class Diagnostics:
    """The newest node and camera diagnostics of the node under test."""

    def __init__(self, node, node_name: str):
        from diagnostic_msgs.msg import DiagnosticArray

        self.lock = threading.Lock()
        self.node_vals: dict = {}
        self.cams: dict[str, dict] = {}
        self.stamp = 0.0
        prefix = f"/{node_name}: "

        def cb(arr):
            with self.lock:
                for s in arr.status:
                    if not s.name.startswith(prefix):
                        continue
                    vals = {kv.key: kv.value for kv in s.values}
                    what = s.name[len(prefix):]
                    if what == "node":
                        self.node_vals = vals
                    elif what.startswith("camera "):
                        self.cams[what[len("camera "):]] = vals
                self.stamp = time.monotonic()
        node.create_subscription(DiagnosticArray, "/diagnostics", cb, 10)

    def snapshot(self) -> tuple[dict, dict, float]:
        with self.lock:
            return dict(self.node_vals), {k: dict(v) for k, v in self.cams.items()}, self.stamp


def account(cams: dict, sent: dict) -> dict:
    """Per camera: requests in == answered + superseded + skipped + cancelled +
    deadline_cancelled (detect/point cut at the deadline) + errored."""
    out = {}
    for name, v in sorted(cams.items()):
        g = {k: int(float(v.get(k, 0) or 0)) for k in (
            "frames_in", "tasks_submitted", "results_published", "superseded", "skipped",
            "cancelled", "deadline_cancelled", "errors", "error.engine", "stale_frames",
            "deadline_misses")}
        bad_frames = sum(int(float(x)) for k, x in v.items()
                         if k.startswith("error.") and k != "error.engine")
        outcomes = (g["results_published"] + g["superseded"] + g["skipped"] + g["cancelled"]
                    + g["deadline_cancelled"] + g["error.engine"])
        out[name] = {"sent": sent.get(name, 0), "received": g["frames_in"],
                     "transport_dropped": sent.get(name, 0) - g["frames_in"],
                     "bad_frames": bad_frames, "stale_frames": g["stale_frames"],
                     "requests": g["tasks_submitted"], "answered": g["results_published"],
                     "superseded": g["superseded"], "skipped": g["skipped"],
                     "cancelled": g["cancelled"],
                     "deadline_cancelled": g["deadline_cancelled"], "errored": g["error.engine"],
                     "deadline_misses": g["deadline_misses"],
                     "unaccounted": g["tasks_submitted"] - outcomes}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before RSS start is taken")
    ap.add_argument("--cameras", type=int, default=4)
    ap.add_argument("--fps", type=float, default=30.0, help="per camera")
    ap.add_argument("--width", type=int, default=160)
    ap.add_argument("--height", type=int, default=120)
    ap.add_argument("--model", default="", help="model folder (default: a tiny test model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--deadline-ms", type=float, default=2000.0, help="periodic task deadline")
    ap.add_argument("--on-miss", default="finish", choices=["finish", "cancel"],
                    help="what a started periodic task does past its deadline")
    ap.add_argument("--query-hz", type=float, default=1.0, help="on-demand Query calls per second")
    ap.add_argument("--max-queue", type=int, default=0,
                    help="fail when scheduler.waiting exceeds this (default: 4 per camera + 8)")
    ap.add_argument("--json", default="", help="write the summary here too")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="photon-soak-"))

    import rclpy
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image

    from photon_ros.srv import Query

    model = args.model
    if not model:
        model = str(tmp / "model")
        subprocess.run([sys.executable, "-m", "photon_core.cli", "make-test-model", "moondream2",
                        model, "--fast"], check=True, cwd=REPO, capture_output=True)
    cfg = tmp / "soak.yaml"
    cfg.write_text(yaml.safe_dump({"/**": {"ros__parameters": node_config(args)}}))
    node_name = "soak_node"
    log = open(tmp / "node.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "photon_ros.perception_node", "--ros-args",
                             "-p", f"model:={model}", "-p", f"params_file:={cfg}",
                             "-r", f"__node:={node_name}"], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rclpy.init()
    me = rclpy.create_node("photon_soak_driver")
    diag = Diagnostics(me, node_name)
    ex = MultiThreadedExecutor(num_threads=3)
    ex.add_node(me)
    spin = threading.Thread(target=ex.spin, daemon=True)
    spin.start()
    qos = QoSProfile(depth=5, reliability=ReliabilityPolicy.RELIABLE)
    names = [f"c{i}" for i in range(args.cameras)]
    pubs = {c: me.create_publisher(Image, f"/soak/{c}/image", qos) for c in names}
    client = me.create_client(Query, f"/{node_name}/query")
    summary: dict = {"args": vars(args), "checks": {}}
    failures: list[str] = []
    try:
        if not client.wait_for_service(timeout_sec=120):
            raise RuntimeError("the node's query service did not appear")
        end = time.monotonic() + 60
        while any(p.get_subscription_count() == 0 for p in pubs.values()) and time.monotonic() < end:
            time.sleep(0.1)
        rng = np.random.default_rng(0)
        frames = [rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8).tobytes()
                  for _ in range(8)]
        sent = {c: 0 for c in names}
        calls = {"sent": 0, "success": 0, "failed": 0, "no_response": 0}
        fail_reasons: dict[str, int] = {}
        pending: list = []
        samples = []
        t_start = time.monotonic()
        t_next = t_start
        t_query = t_start + args.warmup
        t_sample = t_start
        rss_start = None
        period = 1.0 / args.fps
        i = 0
        while time.monotonic() - t_start < args.warmup + args.duration:
            now_wall = time.time()
            for c in names:
                msg = Image(height=args.height, width=args.width, encoding="rgb8",
                            step=args.width * 3)
                msg.data = frames[(i + hash(c)) % len(frames)]
                msg.header.stamp.sec, msg.header.stamp.nanosec = int(now_wall), int((now_wall % 1) * 1e9)
                msg.header.frame_id = f"{c}_optical"
                pubs[c].publish(msg)
                sent[c] += 1
            i += 1
            now = time.monotonic()
            if args.query_hz > 0 and now >= t_query:
                t_query += 1.0 / args.query_hz
                k = calls["sent"]
                skill = SKILLS[k % len(SKILLS)]
                req = Query.Request(camera=names[k % len(names)], skill=skill, object="person",
                                    question="What is here?", caption_length="short",
                                    max_objects=2, max_tokens=6, deadline_ms=3000.0)
                pending.append((client.call_async(req), now))
                calls["sent"] += 1
            still = []
            for fut, t0 in pending:
                if fut.done():
                    r = fut.result()
                    if r is not None and r.success:
                        calls["success"] += 1
                    else:
                        calls["failed"] += 1
                        why = (r.message if r is not None else "no result")[:60]
                        fail_reasons[why] = fail_reasons.get(why, 0) + 1
                elif now - t0 > 20.0:
                    calls["no_response"] += 1
                else:
                    still.append((fut, t0))
            pending = still
            if now >= t_sample:
                t_sample += 1.0
                nv, _, _ = diag.snapshot()
                s = {"t": round(now - t_start, 1), "rss_mib": rss_mib(proc.pid),
                     "waiting": int(float(nv.get("scheduler.waiting", 0) or 0)),
                     "running": int(float(nv.get("scheduler.running", 0) or 0))}
                if args.device.startswith("cuda"):
                    s["gpu_mib"] = gpu_mib(proc.pid)
                samples.append(s)
                if rss_start is None and now - t_start >= args.warmup:
                    rss_start = s["rss_mib"]
                if proc.poll() is not None:
                    raise RuntimeError(f"the node exited (rc {proc.returncode}) during the soak")
            t_next += period
            time.sleep(max(0.0, t_next - time.monotonic()))
        # drain: cameras stopped; wait for open calls, then for the counters to settle
        end = time.monotonic() + 60
        while pending and time.monotonic() < end:
            time.sleep(0.1)
            done = [(f, t) for f, t in pending if f.done()]
            for f, _ in done:
                r = f.result()
                calls["success" if r is not None and r.success else "failed"] += 1
            pending = [(f, t) for f, t in pending if not f.done()]
        calls["no_response"] += len(pending)
        t_drain = time.monotonic()
        last, stable_since = None, time.monotonic()
        while time.monotonic() - t_drain < 60:
            time.sleep(1.0)
            nv, cams, stamp = diag.snapshot()
            key = (json.dumps(cams, sort_keys=True), nv.get("scheduler.waiting"),
                   nv.get("scheduler.running"))
            if key != last:
                last, stable_since = key, time.monotonic()
            elif (time.monotonic() - stable_since > 2.5 and nv.get("scheduler.waiting") == "0"
                  and nv.get("scheduler.running") == "0"):
                break
        nv, cams, _ = diag.snapshot()
        acc = account(cams, sent)
        rss = [s["rss_mib"] for s in samples if s["rss_mib"] == s["rss_mib"]]
        rss_end = rss_mib(proc.pid)
        waiting_max = max((s["waiting"] for s in samples), default=0)
        max_queue = args.max_queue or 4 * args.cameras + 8
        summary.update({
            "wall_s": round(time.monotonic() - t_start, 1), "cameras": acc,
            "totals": {k: sum(a[k] for a in acc.values()) for k in (
                "sent", "received", "transport_dropped", "bad_frames", "requests", "answered",
                "superseded", "skipped", "cancelled", "deadline_cancelled", "errored",
                "unaccounted", "deadline_misses")},
            "on_demand": {**calls, "fail_reasons": fail_reasons},
            "queue": {"waiting_max": waiting_max,
                      "running_max": max((s["running"] for s in samples), default=0),
                      "waiting_end": int(float(nv.get("scheduler.waiting", 0) or 0))},
            "rss_mib": {"start": rss_start, "end": rss_end, "peak": max(rss, default=None)},
            "node": {k: v for k, v in nv.items() if not k.startswith("scheduler.")
                     or k in ("scheduler.done", "scheduler.submitted")},
        })
        if args.device.startswith("cuda"):
            g = [s.get("gpu_mib") for s in samples if s.get("gpu_mib") is not None]
            summary["gpu_mib"] = {"start": g[min(len(g) - 1, int(args.warmup))] if g else None,
                                  "end": g[-1] if g else None, "peak": max(g, default=None)}
        t = summary["totals"]
        checks = summary["checks"]
        checks["requests_accounted"] = t["unaccounted"] == 0 and t["requests"] > 0
        checks["answers_flowing"] = t["answered"] > 0
        checks["frames_received"] = t["received"] > 0 and t["bad_frames"] == 0
        checks["on_demand_all_answered"] = calls["no_response"] == 0
        checks["queue_bounded"] = waiting_max <= max_queue and summary["queue"]["waiting_end"] == 0
        checks["rss_flat"] = bool(rss_start) and rss_end <= rss_start * 1.25 + 64
        if "gpu_mib" in summary and summary["gpu_mib"]["start"]:
            gm = summary["gpu_mib"]
            checks["gpu_memory_flat"] = gm["end"] <= gm["start"] * 1.10 + 256
        checks["node_alive"] = proc.poll() is None
    except Exception as e:  # noqa: BLE001 - reported in the summary, exit 1
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        ex.shutdown()
        me.destroy_node()
        rclpy.try_shutdown()
        if proc.poll() is None:
            proc.send_signal(2)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        out = log.read()
        log.close()
    summary["checks"]["clean_exit"] = proc.returncode == 0 and "Traceback" not in out
    summary["node_exit_code"] = proc.returncode
    if "Traceback" in out:
        summary["node_traceback"] = out[out.index("Traceback"):][:3000]
    failures += [f"check failed: {k}" for k, ok in summary["checks"].items() if not ok]
    summary["failures"] = failures
    summary["passed"] = not failures
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

"""Perception node overhead on CPU: publish-to-result latency minus engine time.

    python bench/bench_node_overhead.py [--model DIR] [--fps 30] [--seconds 10] [--json out.json]

The node runs as its own process (`python -m photon_ros.perception_node`) with one camera
and one task (detect, max_objects 1). This process publishes 640x480 rgb8 frames stamped
with the current time at --fps over DDS loopback, and receives the DetectionArray results.
For each result:
    e2e_ms      = receive time here - source stamp (both the system clock)
    engine_ms   = the result's timing.engine_ms (image encode + prefill + decode, in the engine)
    overhead_ms = e2e_ms - engine_ms: DDS both ways, conversion, scheduling hand-offs,
                  message building, and any wait behind the previous frame (queue)
    node_ms     = timing.latency_ms - engine_ms - queue_ms: inside the node only (stamp to
                  publish on the node clock, minus engine and queue), i.e. DDS in + conversion
                  + hand-off + message building.
Without --model a tiny random Moondream 2 (`photon make-test-model moondream2 --fast`) is
used, so the engine time is small and the node's own cost is what shows.
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
os.environ.setdefault("ROS_LOG_DIR", tempfile.mkdtemp(prefix="photon-bench-roslog-"))

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import yaml  # noqa: E402


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


SHM_PROFILE = """<?xml version="1.0" encoding="UTF-8" ?>
<dds xmlns="http://www.eprosima.com"><profiles>
  <transport_descriptors>
    <transport_descriptor><transport_id>shm_big</transport_id><type>SHM</type>
      <segment_size>{size}</segment_size><maxMessageSize>{size}</maxMessageSize>
    </transport_descriptor>
    <transport_descriptor><transport_id>udp_loopback</transport_id><type>UDPv4</type>
      <interfaceWhiteList><address>127.0.0.1</address></interfaceWhiteList>
    </transport_descriptor>
  </transport_descriptors>
  <participant profile_name="photon_big_shm" is_default_profile="true"><rtps>
    <userTransports><transport_id>shm_big</transport_id><transport_id>udp_loopback</transport_id></userTransports>
    <useBuiltinTransports>false</useBuiltinTransports>
  </rtps></participant>
</profiles></dds>
"""


def write_shm_profile(path: Path, size: int) -> Path:
    """A FastDDS profile with a shared-memory segment big enough for raw camera frames (UDP
    restricted to 127.0.0.1)."""
    path.write_text(SHM_PROFILE.format(size=size))
    return path


def publish_frames(pub, args, t_warm: float) -> list[float]:
    """Publish 640x480 rgb8 frames stamped with the current time at --fps; returns the stamps
    of the frames after the warm-up."""
    from sensor_msgs.msg import Image

    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8).tobytes()
              for _ in range(4)]
    period = 1.0 / args.fps
    t_start = time.monotonic()
    t_next = t_start
    sent: list[float] = []
    i = 0
    while time.monotonic() - t_start < t_warm + args.seconds:
        msg = Image(height=args.height, width=args.width, encoding="rgb8", step=args.width * 3)
        msg.data = frames[i % len(frames)]
        now = time.time()
        msg.header.stamp.sec, msg.header.stamp.nanosec = int(now), int((now % 1) * 1e9)
        msg.header.frame_id = "bench_optical"
        pub.publish(msg)
        if time.monotonic() - t_start >= t_warm:
            sent.append(now)
        i += 1
        t_next += period
        time.sleep(max(0.0, t_next - time.monotonic()))
    time.sleep(1.0)
    return sent


def echo_role(qos_name: str) -> int:
    """The DDS floor: a bare rclpy process (SingleThreadedExecutor) answering each frame with
    a small message carrying its header: no conversion, no engine."""
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import Image
    from std_msgs.msg import Header

    rclpy.init()
    node = rclpy.create_node("photon_bench_echo")
    pub = node.create_publisher(Header, "/photon_bench/echo", 100)
    qos = qos_profile_sensor_data if qos_name == "best_effort" else QoSProfile(
        depth=1, reliability=ReliabilityPolicy.RELIABLE)
    node.create_subscription(Image, "/photon_bench/image", lambda m: pub.publish(m.header), qos)
    try:
        rclpy.spin(node)
    except (KeyboardInterrupt, Exception):  # noqa: BLE001 - SIGINT / shutdown ends it
        pass
    rclpy.try_shutdown()
    return 0


def measure_floor(me, pub, args) -> list[float]:
    """Same frames and QoS to the bare echo process: echo receive time - stamp (ms)."""
    from std_msgs.msg import Header

    got: list[tuple[float, float]] = []
    lock = threading.Lock()

    def on_echo(h):
        now = time.time()
        with lock:
            got.append((h.stamp.sec + h.stamp.nanosec * 1e-9, now))
    sub = me.create_subscription(Header, "/photon_bench/echo", on_echo, 100)
    echo = subprocess.Popen([sys.executable, __file__, "--echo-role", args.qos], cwd=REPO)
    try:
        end = time.monotonic() + 60
        while (me.count_publishers("/photon_bench/echo") == 0 or pub.get_subscription_count() == 0) \
                and time.monotonic() < end:
            time.sleep(0.1)
        sent = publish_frames(pub, args, 1.0)
    finally:
        echo.send_signal(2)
        try:
            echo.wait(10)
        except subprocess.TimeoutExpired:
            echo.kill()
        me.destroy_subscription(sub)
    t0 = sent[0] if sent else float("inf")
    with lock:
        return [(r - st) * 1e3 for st, r in got if st >= t0 - 1e-6]


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def stats(xs) -> dict:
    return {"p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99)}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--echo-role":
        return echo_role(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model folder (default: a tiny test model)")
    ap.add_argument("--fps", type=float, default=30.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--json", default="", help="write the summary here")
    ap.add_argument("--qos", default="best_effort", choices=["best_effort", "reliable"],
                    help="camera QoS (the node's default is sensor data = best effort)")
    ap.add_argument("--shm-segment-mb", type=int, default=16,
                    help="FastDDS shared-memory segment size for all processes (0 = FastDDS "
                         "default, 512 KiB: a 640x480 rgb8 frame then goes as UDP fragments "
                         "and best effort loses most frames)")
    ap.add_argument("--no-floor", action="store_true", help="skip the DDS floor measurement")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="photon-bench-"))
    if args.shm_segment_mb:
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(write_shm_profile(
            tmp / "fastdds_shm.xml", args.shm_segment_mb << 20))

    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import Image

    from photon_ros.msg import DetectionArray

    model = args.model
    if not model:
        model = str(tmp / "model")
        subprocess.run([sys.executable, "-m", "photon_core.cli", "make-test-model", "moondream2",
                        model, "--fast"], check=True, cwd=REPO, capture_output=True)
    cfg = tmp / "bench.yaml"
    cfg.write_text(yaml.safe_dump({"/**": {"ros__parameters": {
        "default_deadline_ms": 1000.0, "cameras": ["bench"],
        "bench": {"topic": "/photon_bench/image", "tasks": ["people"],
                  "qos_reliable": args.qos == "reliable", "qos_depth": 1,
                  "people": {"skill": "detect", "object": "person", "max_objects": 1}}}}}))
    node = subprocess.Popen([sys.executable, "-m", "photon_ros.perception_node", "--ros-args",
                             "-p", f"model:={model}", "-p", f"params_file:={cfg}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rclpy.init()
    me = rclpy.create_node("photon_bench")
    results: list[tuple] = []
    lock = threading.Lock()

    def on_result(msg: DetectionArray) -> None:
        now = time.time()
        st = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
        with lock:
            results.append((st, (now - st) * 1e3, msg.timing.engine_ms, msg.timing.queue_ms,
                            msg.timing.latency_ms))
    me.create_subscription(DetectionArray, "/bench/detections", on_result, 100)
    qos = qos_profile_sensor_data if args.qos == "best_effort" else QoSProfile(
        depth=1, reliability=ReliabilityPolicy.RELIABLE)
    pub = me.create_publisher(Image, "/photon_bench/image", qos)
    ex = SingleThreadedExecutor()
    ex.add_node(me)
    spin = threading.Thread(target=ex.spin, daemon=True)
    spin.start()
    floor: list[float] = []
    try:
        end = time.monotonic() + 90
        while (pub.get_subscription_count() == 0 or me.count_publishers("/bench/detections") == 0) \
                and time.monotonic() < end:
            if node.poll() is not None:
                raise SystemExit(f"node exited:\n{node.stdout.read()}")
            time.sleep(0.1)
        sent = publish_frames(pub, args, args.warmup)
        t_measure = sent[0] if sent else float("inf")
        with lock:
            rows = [r for r in results if r[0] >= t_measure - 1e-6]
        node.send_signal(2)
        node.wait(15)
        if not args.no_floor:
            floor = measure_floor(me, pub, args)
    finally:
        ex.shutdown()
        spin.join(5)
        me.destroy_node()
        rclpy.try_shutdown()
        if node.poll() is None:
            node.kill()
    if not rows:
        print(f"no results ({len(results)} in all); node said:\n{node.stdout.read()}",
              file=sys.stderr)
        return 1
    e2e = np.array([r[1] for r in rows])
    eng = np.array([r[2] for r in rows])
    que = np.array([r[3] for r in rows])
    lat = np.array([r[4] for r in rows])
    over = e2e - eng
    summary = {
        "frames_sent": len(sent), "results": len(rows), "fps": args.fps,
        "image": f"{args.width}x{args.height} rgb8", "qos": args.qos,
        "shm_segment_mb": args.shm_segment_mb,
        "model": "tiny test model" if not args.model else model,
        "e2e_ms": stats(e2e), "engine_ms": stats(eng), "queue_ms": stats(que),
        "overhead_ms": stats(over),
        "node_only_ms": stats(lat - eng - que),
        "dds_floor_ms": {**stats(floor), "n": len(floor)},
        "overhead_minus_floor_p50_ms": pct(over, 50) - pct(floor, 50),
        "target_overhead_p50_ms": 2.0,
    }
    summary["pass"] = summary["overhead_ms"]["p50"] <= 2.0
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

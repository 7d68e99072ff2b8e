"""Soak: the perception node under steady load for a long time, every request accounted for.

    python bench/bench_soak.py [--duration 600] [--cameras 4] [--fps 30] [--model DIR]
        [--device cpu|cuda] [--dtype fp32|bf16] [--width 160 --height 120] [--query-hz 1]
        [--on-miss finish|cancel] [--json out.json] [--run-dir DIR] [--progress-s 30]

Detached (a machine where one command may run for less than the soak, e.g. the lent GPU
machine): `--detach --run-dir DIR ...` starts the same soak in a new process session (setsid)
and returns at once; DIR gets soak.pid, soak.log (progress lines, then the summary), soak.json
(the summary, written last), node.log and samples.jsonl. `--wait DIR [--timeout S]
[--copy-to OUT]` follows soak.log until soak.json appears or the soak's process is gone (or S
seconds pass: exit 3, run it again), copies the files to OUT and exits with the soak's status.

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
received shows what DDS dropped before the node; the node counts those itself
(`frames_lost_in_transport` in its camera diagnostics: gaps in the publisher's sequence
numbers and the rmw's message_lost event), so per camera
    sent == received + lost_reported_by_node + unexplained
(unexplained: frames the node cannot see were lost, e.g. before the first frame it took).
Also checked: every on-demand call got a response, the queue stayed bounded, the RSS at the
end is within 25% + 64 MiB of the RSS after warm-up, on CUDA the GPU memory at the end within
10% + 256 MiB of that after warm-up (the node's own figure from nvidia-smi, else the GPU's
memory in use: `gpu_mib.source`), the node exits cleanly on SIGINT.
Exit status 0 when all checks pass, 1 otherwise; the summary is printed as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
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
              "dtype": args.dtype, "publish_vision_msgs": args.vision_msgs == "on",
              "cameras": cams}
    for c in cams:
        params[c] = {"topic": f"/soak/{c}/image", "qos_reliable": True, "qos_depth": 5,
                     "width": args.width, "height": args.height,   # encodes prepared ahead
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


def gpu_mib(pid: int) -> tuple[float | None, str]:
    """The node's GPU memory in MiB (nvidia-smi) and where the figure comes from: "process"
    (the node's own entry), "device" (the whole GPU's memory in use: where nvidia-smi lists no
    processes or other PIDs, e.g. inside a VM or container) or "none" (no nvidia-smi)."""
    def smi(*q):
        try:
            return subprocess.run(["nvidia-smi", *q, "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
    out = smi("--query-compute-apps=pid,used_memory")
    if out is None:
        return None, "none"
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            try:
                return float(parts[1]), "process"
            except ValueError:
                break
    dev = smi("--query-gpu=memory.used")
    try:
        return float(dev.split()[0]), "device"
    except (AttributeError, IndexError, ValueError):
        return None, "none"


class GpuSampler:
    """gpu_mib(pid) once a second in a thread of its own (nvidia-smi takes tens of ms: the
    camera loop must not wait for it)."""

    def __init__(self, pid: int, period: float = 1.0):
        self.pid, self.period = pid, period
        self.value: tuple[float | None, str] = (None, "none")
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            self.value = gpu_mib(self.pid)
            self.stop_event.wait(self.period)

    def latest(self) -> tuple[float | None, str]:
        return self.value

    def stop(self) -> None:
        self.stop_event.set()


def keep_sample(s: dict, gpu, samples: list, samples_file) -> None:
    """One per-second sample: the GPU memory added (when sampled), kept, and appended to the
    samples file (flushed: a killed soak keeps what it had)."""
    if gpu is not None:
        s["gpu_mib"], s["gpu_src"] = gpu.latest()
    samples.append(s)
    if samples_file is not None:
        samples_file.write(json.dumps(s) + "\n")
        samples_file.flush()


def progress_line(sample: dict, sent: dict, cams: dict, calls: dict) -> str:
    """One line of where the soak stands (the node's counters, summed over cameras)."""
    tot = {k: sum(int(float(v.get(k, 0) or 0)) for v in cams.values())
           for k in ("frames_in", "tasks_submitted", "results_published", "superseded",
                     "skipped", "errors", "frames_lost_in_transport")}
    gpu = f", gpu {sample['gpu_mib']:.0f} MiB" if sample.get("gpu_mib") is not None else ""
    return (f"t={sample['t']:.0f}s sent {sum(sent.values())} received {tot['frames_in']} "
            f"(lost before the node {tot['frames_lost_in_transport']}); "
            f"requests {tot['tasks_submitted']} = answered {tot['results_published']} + "
            f"superseded {tot['superseded']} + skipped {tot['skipped']} + ...; errors "
            f"{tot['errors']}; queue {sample['waiting']} waiting / {sample['running']} running; "
            f"rss {sample['rss_mib']:.0f} MiB{gpu}; on-demand {calls['success']}/{calls['sent']} ok")


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
            "deadline_misses", "frames_lost_in_transport", "transport.rmw_message_lost")}
        bad_frames = sum(int(float(x)) for k, x in v.items()
                         if k.startswith("error.") and k != "error.engine")
        outcomes = (g["results_published"] + g["superseded"] + g["skipped"] + g["cancelled"]
                    + g["deadline_cancelled"] + g["error.engine"])
        out[name] = {"sent": sent.get(name, 0), "received": g["frames_in"],
                     "transport_dropped": sent.get(name, 0) - g["frames_in"],
                     # the node's own count of those (sequence gaps, rmw message_lost)
                     "lost_reported_by_node": g["frames_lost_in_transport"],
                     "rmw_message_lost": g["transport.rmw_message_lost"],
                     "unexplained": (sent.get(name, 0) - g["frames_in"]
                                     - g["frames_lost_in_transport"]),
                     "bad_frames": bad_frames, "stale_frames": g["stale_frames"],
                     "requests": g["tasks_submitted"], "answered": g["results_published"],
                     "superseded": g["superseded"], "skipped": g["skipped"],
                     "cancelled": g["cancelled"],
                     "deadline_cancelled": g["deadline_cancelled"], "errored": g["error.engine"],
                     "deadline_misses": g["deadline_misses"],
                     "unaccounted": g["tasks_submitted"] - outcomes}
    return out


def parse_args(argv=None) -> argparse.Namespace:
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
    ap.add_argument("--dtype", default="", help="the node's dtype (default: bf16 on cuda, fp32 "
                    "on cpu)")
    ap.add_argument("--vision-msgs", default="auto", choices=["auto", "on", "off"],
                    help="publish_vision_msgs of the node (auto: on where vision_msgs imports)")
    ap.add_argument("--fastdds-profile", default="auto",
                    help="FASTDDS_DEFAULT_PROFILES_FILE for this process and the node (auto: "
                         "config/fastdds_large_images.xml when a frame is over 512 KiB, as "
                         "README.md advises for raw camera frames; 'none': FastDDS defaults)")
    ap.add_argument("--deadline-ms", type=float, default=2000.0, help="periodic task deadline")
    ap.add_argument("--on-miss", default="finish", choices=["finish", "cancel"],
                    help="what a started periodic task does past its deadline")
    ap.add_argument("--query-hz", type=float, default=1.0, help="on-demand Query calls per second")
    ap.add_argument("--max-queue", type=int, default=0,
                    help="fail when scheduler.waiting exceeds this (default: 4 per camera + 8)")
    ap.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds for the node to load the model and become active")
    ap.add_argument("--progress-s", type=float, default=0.0,
                    help="print a progress line every this many seconds (0: none; default 30 "
                         "with --run-dir)")
    ap.add_argument("--in-process", action="store_true",
                    help="no node process and no DDS: drive the node's live pipeline from this "
                         "process (same load, same accounting; the messages must be built)")
    ap.add_argument("--json", default="", help="write the summary here too")
    ap.add_argument("--run-dir", default="", help="write soak.json, node.log, samples.jsonl here")
    ap.add_argument("--detach", action="store_true",
                    help="start the soak in a new process session (needs --run-dir) and return")
    ap.add_argument("--wait", default="", metavar="RUN_DIR",
                    help="follow a detached soak in RUN_DIR until it ends (no soak is started)")
    ap.add_argument("--timeout", type=float, default=570.0,
                    help="with --wait: give up after this many seconds (exit 3)")
    ap.add_argument("--copy-to", default="", help="with --wait: copy the run's files here")
    args = ap.parse_args(argv)
    if not args.dtype:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    if args.vision_msgs == "auto":
        import importlib.util
        args.vision_msgs = "on" if importlib.util.find_spec("vision_msgs") else "off"
    if args.fastdds_profile == "auto":
        big = args.width * args.height * 3 > 512 * 1024
        args.fastdds_profile = (os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE")
                                or (str(REPO / "config" / "fastdds_large_images.xml") if big
                                    else "none"))
    if args.detach and not args.run_dir:
        ap.error("--detach needs --run-dir")
    if args.run_dir and not args.progress_s:
        args.progress_s = 30.0
    return args


RUN_FILES = ("soak.json", "soak.log", "node.log", "samples.jsonl")


def detach(argv: list[str], run_dir: Path) -> int:
    """Start this soak (argv without --detach) in a new process session; return at once."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES + ("soak.pid",):
        (run_dir / name).unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *[a for a in argv if a != "--detach"]]
    with open(run_dir / "soak.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (run_dir / "soak.pid").write_text(str(proc.pid))
    print(f"soak started in its own session: pid {proc.pid}, files in {run_dir} "
          f"(follow: python bench/bench_soak.py --wait {run_dir})", flush=True)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:                                         # a zombie has exited
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def wait_for(run_dir: Path, timeout: float, copy_to: str) -> int:
    """Follow RUN_DIR/soak.log until soak.json is written or the soak's process is gone; copy
    the run's files to copy_to. Exit 0 / 1 as the soak's checks, 3 while it still runs."""
    pid_file, log, out = run_dir / "soak.pid", run_dir / "soak.log", run_dir / "soak.json"
    if not pid_file.is_file():
        print(f"no detached soak in {run_dir} (no soak.pid)", file=sys.stderr)
        return 2
    pid = int(pid_file.read_text().strip())
    timeout = max(timeout, 1.0)
    t0, pos, state = time.monotonic(), 0, "running"
    while True:
        if log.is_file():
            with open(log, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        if state != "running":
            break
        if out.is_file() or not _alive(pid):
            state = "ended"
            time.sleep(1.0)                      # the last lines of the log
            continue
        if time.monotonic() - t0 > timeout:
            state = "timeout"
            continue
        time.sleep(2.0)
    if copy_to:
        Path(copy_to).mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:
            if (run_dir / name).is_file():
                shutil.copy(run_dir / name, Path(copy_to) / name)
    if state == "timeout":
        print(f"\n[wait] the soak (pid {pid}) is still running after {timeout:.0f} s: run "
              f"--wait again", flush=True)
        return 3
    if not out.is_file():
        print(f"\n[wait] the soak (pid {pid}) ended without writing {out}: see soak.log",
              flush=True)
        return 1
    s = json.loads(out.read_text())
    t = s.get("totals", {})
    print(f"\n[wait] soak {'PASSED' if s.get('passed') else 'FAILED'}: "
          f"{t.get('requests')} requests, unaccounted {t.get('unaccounted')}, "
          f"failures {s.get('failures')}", flush=True)
    return 0 if s.get("passed") else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.wait:
        return wait_for(Path(args.wait), args.timeout, args.copy_to)
    if args.detach:
        return detach(argv, Path(args.run_dir).resolve())
    return soak_in_process(args) if args.in_process else soak(args)


def fill_summary(summary: dict, args, acc: dict, calls: dict, fail_reasons: dict,
                 samples: list, rss_start, rss_end, nv: dict, gpu) -> None:
    """Totals, queue, memory and the checks (both modes). nv: the node's (or in-process
    scheduler's) values, "scheduler.waiting" etc. as strings."""
    rss = [s["rss_mib"] for s in samples if s["rss_mib"] == s["rss_mib"]]
    waiting_max = max((s["waiting"] for s in samples), default=0)
    max_queue = args.max_queue or 4 * args.cameras + 8
    summary.update({
        "cameras": acc,
        "totals": {k: sum(a[k] for a in acc.values()) for k in (
            "sent", "received", "transport_dropped", "lost_reported_by_node",
            "rmw_message_lost", "unexplained", "bad_frames", "requests", "answered",
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
    if gpu is not None:
        g = [s.get("gpu_mib") for s in samples if s.get("gpu_mib") is not None]
        g_end = gpu.latest()[0]                      # after the drain
        g_end = g_end if g_end is not None else (g[-1] if g else None)
        summary["gpu_mib"] = {"start": g[min(len(g) - 1, int(args.warmup))] if g else None,
                              "end": g_end, "peak": max(g + [g_end or 0], default=None),
                              "source": sorted({s.get("gpu_src") for s in samples
                                                if s.get("gpu_mib") is not None})}
    t = summary["totals"]
    summary["frame_accounting"] = {
        name: accounting_line(a) for name, a in [*sorted(acc.items()), ("total", t)]}
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


def accounting_line(a: dict) -> str:
    """sent = received + lost_reported_by_node + unexplained (one camera or the totals)."""
    return (f"sent {a['sent']} = received {a['received']} + lost_reported_by_node "
            f"{a['lost_reported_by_node']} (rmw message_lost {a['rmw_message_lost']}) + "
            f"unexplained {a['unexplained']}")


def say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def soak(args) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="photon-soak-"))
    run_dir = Path(args.run_dir) if args.run_dir else tmp
    run_dir.mkdir(parents=True, exist_ok=True)

    if args.fastdds_profile != "none":     # read when rclpy makes its participant: set first
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = args.fastdds_profile
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
    log = open(run_dir / "node.log", "w+")
    samples_file = open(run_dir / "samples.jsonl", "w") if args.run_dir else None
    say(f"model {model} on {args.device}/{args.dtype}, {args.cameras} cameras x {args.fps:g} fps "
        f"{args.width}x{args.height}, {args.duration:g} s (+{args.warmup:g} s warm-up), "
        f"vision_msgs {args.vision_msgs}, FastDDS profile {args.fastdds_profile}, files in "
        f"{run_dir}")
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
    gpu = GpuSampler(proc.pid) if args.device.startswith("cuda") else None
    try:
        say(f"node pid {proc.pid}: waiting for it to load the model and become active "
            f"(up to {args.startup_timeout:g} s)")
        t_up, t_active = time.monotonic(), None
        while not client.wait_for_service(timeout_sec=1.0):   # the services exist once active
            if proc.poll() is not None:
                raise RuntimeError(f"the node exited (rc {proc.returncode}) before it was active")
            if time.monotonic() - t_up > args.startup_timeout:
                raise RuntimeError(f"the node was not active after {args.startup_timeout:g} s")
            if t_active is None and "]: active: model" in (run_dir / "node.log").read_text():
                t_active = time.monotonic()
                say("the node says it is active (node.log); waiting for its services over DDS")
            if t_active is not None and time.monotonic() - t_active > 60:
                raise RuntimeError("the node is active (node.log) but its query service is not "
                                   "visible over DDS after 60 s: discovery between processes "
                                   "fails on this machine; --in-process runs the same load "
                                   "without DDS")
        summary["startup_s"] = round(time.monotonic() - t_up, 1)
        say(f"node active after {summary['startup_s']} s; load starts")
        end = time.monotonic() + 60
        while any(p.get_subscription_count() == 0 for p in pubs.values()) and time.monotonic() < end:
            time.sleep(0.1)
        rng = np.random.default_rng(0)
        frames = [rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8).tobytes()
                  for _ in range(8)]
        msgs = {}                      # the messages made once: only the header changes
        for c in names:
            msgs[c] = []
            for data in frames:
                msg = Image(height=args.height, width=args.width, encoding="rgb8",
                            step=args.width * 3)
                msg.data = data
                msg.header.frame_id = f"{c}_optical"
                msgs[c].append(msg)
        offset = {c: k * 3 for k, c in enumerate(names)}
        sent = {c: 0 for c in names}
        calls = {"sent": 0, "success": 0, "failed": 0, "no_response": 0}
        fail_reasons: dict[str, int] = {}
        pending: list = []
        samples = []
        t_start = time.monotonic()
        t_next = t_start
        t_query = t_start + args.warmup
        t_sample = t_start
        t_progress = t_start + (args.progress_s or float("inf"))
        rss_start = None
        period = 1.0 / args.fps
        i = 0
        while time.monotonic() - t_start < args.warmup + args.duration:
            now_wall = time.time()
            for c in names:
                msg = msgs[c][(i + offset[c]) % len(frames)]
                msg.header.stamp.sec, msg.header.stamp.nanosec = int(now_wall), int((now_wall % 1) * 1e9)
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
                keep_sample(s, gpu, samples, samples_file)
                if rss_start is None and now - t_start >= args.warmup:
                    rss_start = s["rss_mib"]
                if now >= t_progress:
                    t_progress += args.progress_s
                    say(progress_line(s, sent, diag.snapshot()[1], calls))
                if proc.poll() is not None:
                    raise RuntimeError(f"the node exited (rc {proc.returncode}) during the soak")
            t_next += period
            time.sleep(max(0.0, t_next - time.monotonic()))
        say(f"load done after {time.monotonic() - t_start:.0f} s: cameras stopped, draining")
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
            # the counters only (rates and ages in the diagnostics move on after the load)
            key = (json.dumps(account(cams, sent), sort_keys=True), nv.get("scheduler.waiting"),
                   nv.get("scheduler.running"))
            if key != last:
                last, stable_since = key, time.monotonic()
            elif (time.monotonic() - stable_since > 2.5 and nv.get("scheduler.waiting") == "0"
                  and nv.get("scheduler.running") == "0"):
                break
        summary["drain_s"] = round(time.monotonic() - t_drain, 1)
        summary["wall_s"] = round(time.monotonic() - t_start, 1)
        nv, cams, _ = diag.snapshot()
        acc = account(cams, sent)
        fill_summary(summary, args, acc, calls, fail_reasons, samples, rss_start,
                     rss_mib(proc.pid), nv, gpu)
        summary["checks"]["node_alive"] = proc.poll() is None
    except Exception as e:  # noqa: BLE001 - reported in the summary, exit 1
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        if gpu is not None:
            gpu.stop()
        if samples_file is not None:
            samples_file.close()
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
    if failures or not all(summary["checks"].values()):
        summary["node_log_tail"] = out[-3000:]
    return finish(summary, failures, args, run_dir)


def finish(summary: dict, failures: list, args, run_dir: Path) -> int:
    """Verdict, the summary printed and written (soak.json last), exit status."""
    failures += [f"check failed: {k}" for k, ok in summary["checks"].items() if not ok]
    summary["failures"] = failures
    summary["passed"] = not failures
    text = json.dumps(summary, indent=1, default=str)
    print(text, flush=True)
    for name, line in summary.get("frame_accounting", {}).items():
        say(f"frames {name}: {line}")
    if args.json:
        Path(args.json).write_text(text)
    if args.run_dir:                       # written last: `--wait` takes it as the end
        tmp_json = run_dir / "soak.json.part"
        tmp_json.write_text(text)
        tmp_json.replace(run_dir / "soak.json")
    say(f"{'PASSED' if not failures else 'FAILED'} {failures or ''}")
    return 0 if not failures else 1


def soak_in_process(args) -> int:
    """--in-process: the node's live pipeline (photon_ros.live_pipeline: model, prepared
    encodes, calibration, threaded deadline scheduler, task cadence) driven from this process:
    frames handed over as arrays, on-demand requests on each camera's latest frame, outcomes
    counted as the node counts them (photon_ros.cameras.Cameras.on_outcome). No DDS, no
    rclpy.init; the generated messages must still import (the pipeline builds result
    messages), so this needs the same build (scripts/install.sh or gpu_ros_env.sh)."""
    from collections import Counter
    from functools import partial

    from photon_core.scheduler import ON_DEMAND, TaskSpec
    from photon_ros.live_pipeline import STALE, build_live_pipeline
    from photon_ros.task_config import config_from_params, make_task

    tmp = Path(tempfile.mkdtemp(prefix="photon-soak-"))
    run_dir = Path(args.run_dir) if args.run_dir else tmp
    run_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        model = str(tmp / "model")
        subprocess.run([sys.executable, "-m", "photon_core.cli", "make-test-model", "moondream2",
                        model, "--fast"], check=True, cwd=REPO, capture_output=True)
    samples_file = open(run_dir / "samples.jsonl", "w") if args.run_dir else None
    say(f"IN-PROCESS: model {model} on {args.device}/{args.dtype}, {args.cameras} cameras x "
        f"{args.fps:g} fps {args.width}x{args.height}, {args.duration:g} s (+{args.warmup:g} s "
        f"warm-up), files in {run_dir}")
    summary: dict = {"args": vars(args), "mode": "in-process", "checks": {}}
    failures: list[str] = []
    names = [f"c{i}" for i in range(args.cameras)]
    counts = {c: Counter() for c in names}
    lock = threading.Lock()

    def on_outcome(cam: str, o) -> None:          # the node's mapping of a periodic outcome
        status = str(o.status)
        with lock:
            c = counts[cam]
            c["deadline_misses"] += bool(o.missed_deadline)
            if status == "done" or (status == "deadline" and o.result is not None
                                    and o.result.task.skill in ("query", "caption")):
                c["results_published"] += 1
            elif status in ("superseded", "skipped", "cancelled"):
                c[status] += 1
            elif status == "deadline":
                c["deadline_cancelled"] += 1
            else:
                c["errors"] += 1
                c["error.engine" if status == "error" else f"error.status_{status}"] += 1

    gpu = GpuSampler(os.getpid()) if args.device.startswith("cuda") else None
    live = None
    try:
        cfg = config_from_params({**node_config(args), "model": model})
        t_up = time.monotonic()
        live = build_live_pipeline(cfg)
        summary["startup_s"] = round(time.monotonic() - t_up, 1)
        say(f"pipeline built (model loaded, encodes prepared, calibrated) in "
            f"{summary['startup_s']} s; load starts")
        caps = live.engine.capabilities
        rng = np.random.default_rng(0)
        frames = [rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8)
                  for _ in range(8)]
        offset = {c: k * 3 for k, c in enumerate(names)}
        sent = {c: 0 for c in names}
        latest: dict = {}
        calls = {"sent": 0, "success": 0, "failed": 0, "no_response": 0}
        fail_reasons: dict[str, int] = {}
        pending: list = []
        samples: list = []
        t_start = time.monotonic()
        t_next, t_query, t_sample = t_start, t_start + args.warmup, t_start
        t_progress = t_start + (args.progress_s or float("inf"))
        rss_start, period, i = None, 1.0 / args.fps, 0

        def metrics() -> dict:
            m = live.scheduler.metrics()
            return {f"scheduler.{k}": str(v) for k, v in m.items()}

        while time.monotonic() - t_start < args.warmup + args.duration:
            stamp = time.time()
            for c in names:
                rgb = frames[(i + offset[c]) % len(frames)]
                sent[c] += 1
                arrival = time.monotonic()
                ticket = live.accept(c, stamp)
                with lock:
                    counts[c]["frames_in"] += 1
                if ticket.event == STALE:
                    with lock:
                        counts[c]["stale_frames"] += 1
                    continue
                latest[c] = (rgb, ticket.key, arrival)
                if ticket.due:
                    n = live.submit(c, ticket, rgb, arrival, on_result=partial(on_outcome, c))
                    with lock:
                        counts[c]["tasks_submitted"] += n
            i += 1
            now = time.monotonic()
            if args.query_hz > 0 and now >= t_query:
                t_query += 1.0 / args.query_hz
                k = calls["sent"]
                cam = names[k % len(names)]
                d = {"skill": SKILLS[k % len(SKILLS)], "object": "person",
                     "question": "What is here?", "caption_length": "short", "max_objects": 2,
                     "max_tokens": 6}
                box, done = {}, threading.Event()

                def on_result(o, box=box, done=done):
                    box["o"] = o
                    done.set()
                rgb, key, arrival = latest[cam]
                task = make_task("on_demand", d, cfg, "request", caps=caps).to_task()
                live.scheduler.submit_frame(
                    cam, key, live.encode_input(cam, rgb),
                    [TaskSpec("on_demand", task, 3.0 + max(0.0, now - arrival), "cancel")],
                    kind=ON_DEMAND, on_result=on_result, capture_time=arrival)
                pending.append((done, box, now))
                calls["sent"] += 1
            still = []
            for done, box, t0 in pending:
                if done.is_set():
                    st = str(box["o"].status)
                    calls["success" if st == "done" else "failed"] += 1
                    if st != "done":
                        fail_reasons[st] = fail_reasons.get(st, 0) + 1
                elif now - t0 > 20.0:
                    calls["no_response"] += 1
                else:
                    still.append((done, box, t0))
            pending = still
            if now >= t_sample:
                t_sample += 1.0
                m = live.scheduler.metrics()
                smp = {"t": round(now - t_start, 1), "rss_mib": rss_mib(os.getpid()),
                       "waiting": int(m.get("waiting", 0)), "running": int(m.get("running", 0))}
                keep_sample(smp, gpu, samples, samples_file)
                if rss_start is None and now - t_start >= args.warmup:
                    rss_start = smp["rss_mib"]
                if now >= t_progress:
                    t_progress += args.progress_s
                    with lock:
                        cams = {c: dict(v) for c, v in counts.items()}
                    say(progress_line(smp, sent, cams, calls))
                err = getattr(live.scheduler, "error", None)
                if err is not None:
                    raise RuntimeError(f"the scheduler thread died: {err!r}")
            t_next += period
            time.sleep(max(0.0, t_next - time.monotonic()))
        say(f"load done after {time.monotonic() - t_start:.0f} s: cameras stopped, draining")
        t_drain = time.monotonic()
        last, stable_since = None, t_drain
        while time.monotonic() - t_drain < 60:
            time.sleep(0.5)
            for done, box, t0 in list(pending):
                if done.is_set():
                    st = str(box["o"].status)
                    calls["success" if st == "done" else "failed"] += 1
                    pending.remove((done, box, t0))
            with lock:
                key = json.dumps({c: dict(v) for c, v in counts.items()}, sort_keys=True)
            m = live.scheduler.metrics()
            if key != last:
                last, stable_since = key, time.monotonic()
            elif (not pending and time.monotonic() - stable_since > 2.5
                  and m.get("waiting") == 0 and m.get("running") == 0):
                break
        calls["no_response"] += len(pending)
        summary["drain_s"] = round(time.monotonic() - t_drain, 1)
        summary["wall_s"] = round(time.monotonic() - t_start, 1)
        with lock:
            cams = {c: {k: str(v) for k, v in cnt.items()} for c, cnt in counts.items()}
        acc = account(cams, sent)
        fill_summary(summary, args, acc, calls, fail_reasons, samples, rss_start,
                     rss_mib(os.getpid()), metrics(), gpu)
        summary["checks"]["scheduler_alive"] = getattr(live.scheduler, "error", None) is None
    except Exception as e:  # noqa: BLE001 - reported in the summary, exit 1
        import traceback
        failures.append(f"{type(e).__name__}: {e}")
        summary["traceback"] = traceback.format_exc()[-3000:]
    finally:
        if gpu is not None:
            gpu.stop()
        if samples_file is not None:
            samples_file.close()
        if live is not None:
            live.stop()
    return finish(summary, failures, args, run_dir)


if __name__ == "__main__":
    sys.exit(main())

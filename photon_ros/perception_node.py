"""The photon_ros perception node: camera topics in, vision-language results out.

    python -m photon_ros.perception_node --ros-args -p model:=DIR [-p params_file:=YAML]
    ros2 run photon_ros perception_node --ros-args --params-file config/perception.yaml -p model:=DIR

A lifecycle node (configure: parameters + YAML validated, model path checked; activate:
model loaded, scheduler started, topics/services/action created; deactivate: all of that
dropped and the model freed; cleanup/shutdown) that configures and activates itself unless
`auto_activate:=false`. See docs/architecture.md, "Perception node", for topics and parameters.

Threads: image callbacks run on the spinning thread (InlineGroupExecutor) and only convert
the image and submit work; the engine runs on the scheduler's thread
(photon_core.scheduler.ThreadedScheduler), which also delivers results (publishing from it
is safe in rclpy). Services and the action wait for their outcome on pool threads
(reentrant group), never holding up images.
"""
from __future__ import annotations

import collections
import gc
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.executors import (ConditionReachedException, ExternalShutdownException,
                             MultiThreadedExecutor, ShutdownException, TimeoutException)
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn
from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy,
                       qos_profile_sensor_data)
from sensor_msgs.msg import CompressedImage, Image

from photon_ros.action import StreamAnswer
from photon_ros.image_conversion import (ImageConversionError, compressed_to_rgb, image_to_rgb,
                                         rgb_to_image_msg)
from photon_ros.msg import Answer, DetectionArray, PointArray
from photon_ros.pipeline import JUMP_BACK_S, PerceptionPipeline
from photon_ros.result_messages import build_answer, ResultTiming, stamp_to_s, to_vision_msgs
from photon_ros.srv import Query, SetTasks
from photon_ros.task_config import (NODE_DEFAULTS, ConfigError, PerceptionConfig,
                                    config_from_params, flatten, make_task, params_from_file,
                                    tasks_from_specs)

NODE_NAME = "perception_node"
STALE_INPUT_S = 3.0       # diagnostics warn when an active camera sent nothing for this long
LOG_EVERY_S = 2.0         # throttle for repeated bad-input warnings (per camera and reason)


def default_params_file() -> str:
    """config/perception.yaml of the installed package (ament index, then sys.prefix),
    else of the source checkout; "" when none exists."""
    candidates = []
    try:
        from ament_index_python.packages import get_package_share_directory
        candidates.append(Path(get_package_share_directory("photon_ros")) / "config" / "perception.yaml")
    except Exception:  # noqa: BLE001 - not installed through ament / index missing
        pass
    candidates.append(Path(sys.prefix) / "share" / "photon_ros" / "config" / "perception.yaml")
    candidates.append(Path(__file__).resolve().parents[1] / "config" / "perception.yaml")
    for c in candidates:
        if c.is_file():
            return str(c)
    return ""


# -- per-camera statistics ------------------------------------------------------------------------
class CameraStats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.in_times: collections.deque = collections.deque(maxlen=600)
        self.proc_times: collections.deque = collections.deque(maxlen=600)
        self.latencies: collections.deque = collections.deque(maxlen=1000)
        self.last_input: float | None = None
        self.last_processed_key = None

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def frame_in(self, t: float) -> None:
        with self.lock:
            self.counts["frames_in"] += 1
            self.in_times.append(t)
            self.last_input = t

    def published(self, key, latency_ms: float, t: float) -> None:
        with self.lock:
            self.counts["results_published"] += 1
            if math.isfinite(latency_ms) and latency_ms >= 0:
                self.latencies.append(latency_ms)
            else:
                self.counts["negative_latency"] += 1
            if key != self.last_processed_key:
                self.last_processed_key = key
                self.counts["frames_processed"] += 1
                self.proc_times.append(t)

    def reset_window(self) -> None:
        with self.lock:
            self.latencies.clear()
            self.last_processed_key = None

    @staticmethod
    def _rate(times, now: float, window: float = 5.0) -> float:
        recent = [t for t in times if now - t <= window]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0], 1e-6)
        return len(recent) / max(span, min(window, span))

    def snapshot(self, now: float) -> dict:
        with self.lock:
            lat = sorted(self.latencies)
            return {
                "counts": dict(self.counts),
                "input_fps": self._rate(self.in_times, now),
                "processed_fps": self._rate(self.proc_times, now),
                "latency_p50_ms": float(np.percentile(lat, 50)) if lat else float("nan"),
                "latency_p99_ms": float(np.percentile(lat, 99)) if lat else float("nan"),
                "since_input_s": (now - self.last_input) if self.last_input is not None else None,
            }


@dataclass
class LatestFrame:
    header: Any
    image: np.ndarray
    key: tuple
    arrival: float


class CameraState:
    def __init__(self, name: str):
        self.name = name
        self.stats = CameraStats()
        self.sub = None
        self.sub_sig: tuple | None = None
        self.pubs: dict[str, Any] = {}
        self.frame_index = 0
        self.epoch = 0
        self.last_stamp: float | None = None
        self.latest: LatestFrame | None = None
        self.recent: collections.OrderedDict = collections.OrderedDict()   # key -> image
        self.lock = threading.Lock()


class PerceptionNode(LifecycleNode):
    def __init__(self, node_name: str = NODE_NAME, **kw):
        kw.setdefault("automatically_declare_parameters_from_overrides", True)
        super().__init__(node_name, **kw)
        for name, default in (("params_file", ""), ("config", ""), ("auto_activate", True)):
            if not self.has_parameter(name):
                self.declare_parameter(name, default)
        self._cfg: PerceptionConfig | None = None
        self._pending_cfg: PerceptionConfig | None = None
        self._file_declared: list[str] = []
        self._active = False
        self._model = None
        self._engine = None
        self._sched = None
        self.pipeline: PerceptionPipeline | None = None
        self._cams: dict[str, CameraState] = {}
        self._cams_lock = threading.RLock()
        self._node_counts: collections.Counter = collections.Counter()
        self._log_last: dict[tuple, list] = {}
        self._own_services: list = []
        self._action = None
        self._warned_types: set = set()
        self._img_group = self.image_group = MutuallyExclusiveCallbackGroup()
        self._srv_group = ReentrantCallbackGroup()
        self._diag_group = MutuallyExclusiveCallbackGroup()
        self._steady = Clock(clock_type=ClockType.STEADY_TIME)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._diag_timer = self.create_timer(1.0, self._publish_diagnostics,
                                             callback_group=self._diag_group, clock=self._steady)
        self.add_on_set_parameters_callback(self._validate_params)
        self.add_post_set_parameters_callback(self._apply_params)

    # -- logging -------------------------------------------------------------------------------
    def _warn_throttled(self, key: tuple, text: str) -> None:
        now = time.monotonic()
        entry = self._log_last.setdefault(key, [0.0, 0])
        if now - entry[0] >= LOG_EVERY_S:
            more = f" ({entry[1]} more like it since the last report)" if entry[1] else ""
            self.get_logger().warning(text + more)
            entry[0], entry[1] = now, 0
        else:
            entry[1] += 1

    def callback_failed(self, exc: BaseException) -> None:
        """An exception escaped a callback (the executor's on_error): log it, count it, keep
        serving."""
        import traceback

        self._node_counts["callback_errors"] += 1
        self._node_counts[f"callback_error.{type(exc).__name__}"] += 1
        key = ("node", "callback", type(exc).__name__)
        entry = self._log_last.setdefault(key, [0.0, 0])
        if time.monotonic() - entry[0] >= LOG_EVERY_S:
            entry[0] = time.monotonic()
            self.get_logger().error("a callback failed (the node keeps serving):\n" + "".join(
                traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())

    # -- configuration -------------------------------------------------------------------------------
    def _params_file(self) -> str:
        path = (self.get_parameter("params_file").value or self.get_parameter("config").value or "")
        return str(path) if path else default_params_file()

    def _current_params(self) -> dict[str, Any]:
        return {name: p.value for name, p in self._parameters.items()}

    def _read_config(self) -> PerceptionConfig:
        """Declare what the YAML defines (overrides given with -p / --params-file win) and
        build the validated configuration from the node's parameters."""
        path = self._params_file()
        file_params = flatten(params_from_file(path, self.get_name())) if path else {}
        wanted = {**NODE_DEFAULTS, **file_params}
        for name, value in wanted.items():
            if self.has_parameter(name) or value is None:
                continue
            if isinstance(value, list) and not value:
                continue                     # an empty list has no parameter type
            self.declare_parameter(name, value, ParameterDescriptor(dynamic_typing=True))
            self._file_declared.append(name)
        if path:
            self.get_logger().info(f"configuration from {path}")
        cfg = config_from_params(self._current_params())
        # Every key of every configured camera and task becomes a parameter (0 / "" = the
        # node default), so `ros2 param set front.people.every_n 3` works for keys the YAML
        # left out.
        unset = {"every_n": 1, "hz": 0.0, "deadline_ms": 0.0, "on_miss": "", "max_objects": 0,
                 "max_tokens": 0, "object": "", "question": "", "caption_length": "normal"}
        for cam in cfg.cameras:
            keys = {f"{cam.name}.type": cam.type, f"{cam.name}.qos_reliable": cam.qos_reliable,
                    f"{cam.name}.qos_depth": cam.qos_depth}
            for t in cam.tasks:
                keys.update({f"{cam.name}.{t.name}.{k}": v for k, v in unset.items()})
            for name, value in keys.items():
                if not self.has_parameter(name):
                    self.declare_parameter(name, value, ParameterDescriptor(dynamic_typing=True))
                    self._file_declared.append(name)
        return cfg

    def _validate_params(self, params) -> SetParametersResult:
        if self._cfg is None:
            return SetParametersResult(successful=True)
        changed = {p.name: p.value for p in params}
        try:
            cfg = config_from_params({**self._current_params(), **changed})
        except ConfigError as e:
            self._node_counts["rejected_parameter_updates"] += 1
            self.get_logger().warning(f"parameter update rejected: {e}")
            return SetParametersResult(successful=False, reason=str(e))
        self._pending_cfg = cfg
        return SetParametersResult(successful=True)

    def _apply_params(self, params) -> None:
        cfg, self._pending_cfg = self._pending_cfg, None
        if cfg is None or self._cfg is None:
            return
        self._set_config(cfg)
        self.get_logger().info("configuration updated from parameters: "
                               + ", ".join(p.name for p in params))

    def _set_config(self, cfg: PerceptionConfig) -> None:
        """Swap the configuration at once; resubscribe cameras whose input changed."""
        with self._cams_lock:
            self._cfg = cfg
            if self.pipeline is not None:
                self.pipeline.set_config(cfg)
            if self._active:
                self._sync_cameras()

    # -- lifecycle -------------------------------------------------------------------------------
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        try:
            cfg = self._read_config()
        except (ConfigError, ValueError) as e:
            self._node_counts["configure_failures"] += 1
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        problem = self._check_model(cfg)
        if problem:
            self._node_counts["configure_failures"] += 1
            self.get_logger().error(f"configure failed: {problem}")
            return TransitionCallbackReturn.FAILURE
        if not cfg.cameras:
            self.get_logger().warning("no cameras configured: only services and the action work "
                                      "once cameras are added by parameters")
        if cfg.extra:
            self.get_logger().warning(f"unknown parameters ignored: {', '.join(sorted(cfg.extra))}")
        self._cfg = cfg
        self.pipeline = PerceptionPipeline(cfg, None, model_id="")
        with self._cams_lock:
            self._cams = {c.name: CameraState(c.name) for c in cfg.cameras}
        self.get_logger().info(
            f"configured: model {cfg.model!r} on {cfg.device}/{cfg.dtype} ({cfg.engine} engine), cameras "
            + ", ".join(f"{c.name} <- {c.topic} ({len(c.tasks)} tasks)" for c in cfg.cameras))
        return TransitionCallbackReturn.SUCCESS

    @staticmethod
    def _check_model(cfg: PerceptionConfig) -> str:
        m = cfg.model.strip()
        if not m:
            return "parameter 'model' is empty: give a model folder or a Hugging Face id"
        p = Path(m).expanduser()
        if p.exists():
            return "" if p.is_dir() or p.is_file() else f"model path {m!r} is not a file or folder"
        looks_local = m.startswith(("/", ".", "~")) or m.count("/") != 1
        if looks_local:
            return f"model path {m!r} does not exist"
        return ""          # "org/name": a Hugging Face id, resolved at activate

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        cfg = self._cfg
        try:
            self._start_engine(cfg)
        except Exception as e:  # noqa: BLE001 - a clear message, then back to inactive
            self._node_counts["activate_failures"] += 1
            self.get_logger().error(f"activate failed: cannot load model {cfg.model!r}: "
                                    f"{type(e).__name__}: {e}")
            self._stop_engine()
            return TransitionCallbackReturn.FAILURE
        self._own_services = [
            self.create_service(Query, "~/query", self._on_query, callback_group=self._srv_group),
            self.create_service(SetTasks, "~/set_tasks", self._on_set_tasks,
                                callback_group=self._srv_group)]
        self._action = ActionServer(self, StreamAnswer, "~/stream_answer", self._on_stream,
                                    goal_callback=lambda g: GoalResponse.ACCEPT,
                                    cancel_callback=lambda g: CancelResponse.ACCEPT,
                                    callback_group=self._srv_group)
        with self._cams_lock:
            self._active = True
            self._sync_cameras()
        self.get_logger().info(f"active: model {self._model.model_id} loaded")
        return TransitionCallbackReturn.SUCCESS

    def _start_engine(self, cfg: PerceptionConfig) -> None:
        from photon_core import load_engine
        from photon_core.scheduler import CostModel, Scheduler, ThreadedScheduler

        from photon_ros.engine_adapter import HookedEngine

        t0 = time.monotonic()
        model = load_engine(cfg.model, device=cfg.device, dtype=cfg.dtype, engine=cfg.engine,
                            max_batch=cfg.max_batch, deterministic=cfg.deterministic,
                            progress=False)
        engine = HookedEngine(model, cfg.debug_ignore_eos, cfg.debug_step_delay_ms)
        sizes = tuple(b for b in (1, 2, 4, 8) if b <= cfg.max_batch) or (1,)
        cost = CostModel.calibrate(engine, batch_sizes=sizes)
        self._sched = ThreadedScheduler(Scheduler(engine, cost, max_batch=cfg.max_batch))
        self.pipeline = PerceptionPipeline(cfg, model)
        self._model, self._engine = model, engine
        self._node_counts["model_loads"] += 1
        self.get_logger().info(f"model loaded and calibrated in {time.monotonic() - t0:.1f} s")

    def _stop_engine(self) -> None:
        if self._sched is not None:
            self._sched.stop(drain=False)
        self._sched = None
        self._engine = None
        self._model = None
        if self.pipeline is not None:
            self.pipeline.model = None
        gc.collect()
        dev = str(self._cfg.device if self._cfg else "cpu")
        if dev.startswith("cuda"):
            try:
                import torch
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self._teardown_active()
        self.get_logger().info("inactive: subscriptions dropped, model freed")
        return TransitionCallbackReturn.SUCCESS

    def _teardown_active(self) -> None:
        with self._cams_lock:
            self._active = False
            for st in self._cams.values():
                if st.sub is not None:
                    self.destroy_subscription(st.sub)
                    st.sub, st.sub_sig = None, None
        self._stop_engine()          # open requests end (cancelled) before publishers go
        with self._cams_lock:
            for st in self._cams.values():
                for pub in st.pubs.values():
                    self.destroy_publisher(pub)
                st.pubs.clear()
                st.latest = None
                st.recent.clear()
        for srv in self._own_services:
            self.destroy_service(srv)
        self._own_services = []
        if self._action is not None:
            self._action.destroy()
            self._action = None

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        self._cfg = None
        self.pipeline = None
        with self._cams_lock:
            self._cams = {}
        for name in self._file_declared:
            if self.has_parameter(name):
                self.undeclare_parameter(name)
        self._file_declared = []
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        if self._active or self._sched is not None:
            self._teardown_active()
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: State) -> TransitionCallbackReturn:
        self.get_logger().error("error during a transition: dropping everything")
        self._teardown_active()
        return TransitionCallbackReturn.SUCCESS

    # -- cameras -------------------------------------------------------------------------------
    def _sync_cameras(self) -> None:
        """Make subscriptions and publishers match the configuration (active only)."""
        cfg = self._cfg
        names = set(cfg.camera_names)
        for name in list(self._cams):
            if name not in names:
                st = self._cams.pop(name)
                if st.sub is not None:
                    self.destroy_subscription(st.sub)
                for pub in st.pubs.values():
                    self.destroy_publisher(pub)
        for cam in cfg.cameras:
            st = self._cams.setdefault(cam.name, CameraState(cam.name))
            sig = (cam.topic, cam.type, cam.qos_reliable, cam.qos_depth)
            if st.sub is not None and st.sub_sig != sig:
                self.destroy_subscription(st.sub)
                st.sub = None
            if st.sub is None:
                if cam.qos_reliable:
                    qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=cam.qos_depth,
                                     reliability=ReliabilityPolicy.RELIABLE,
                                     durability=DurabilityPolicy.VOLATILE)
                else:
                    qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=cam.qos_depth,
                                     reliability=qos_profile_sensor_data.reliability,
                                     durability=DurabilityPolicy.VOLATILE)
                msg_type = CompressedImage if cam.type == "compressed" else Image
                events = SubscriptionEventCallbacks(
                    incompatible_qos=partial(self._on_incompatible_qos, cam.name))
                st.sub = self.create_subscription(
                    msg_type, cam.topic, partial(self._on_image, cam.name), qos,
                    callback_group=self._img_group, event_callbacks=events)
                st.sub_sig = sig
                self.get_logger().info(
                    f"camera {cam.name}: {cam.topic} ({cam.type}, "
                    f"{'reliable' if cam.qos_reliable else 'best effort'}, depth {cam.qos_depth})")
            if not st.pubs:
                st.pubs = {
                    "detections": self.create_publisher(DetectionArray, f"{cam.name}/detections", 10),
                    "points": self.create_publisher(PointArray, f"{cam.name}/points", 10),
                    "answer": self.create_publisher(Answer, f"{cam.name}/answer", 10),
                }
                if cfg.annotate:
                    st.pubs["annotated"] = self.create_publisher(Image, f"{cam.name}/annotated", 2)
                if cfg.publish_vision_msgs:
                    try:
                        from vision_msgs.msg import Detection2DArray
                        st.pubs["vision"] = self.create_publisher(
                            Detection2DArray, f"{cam.name}/detections_2d", 10)
                    except ImportError:
                        self.get_logger().warning("publish_vision_msgs is set but vision_msgs is "
                                                  "not installed: not publishing Detection2DArray")

    def _on_incompatible_qos(self, camera: str, info) -> None:
        st = self._cams.get(camera)
        if st is not None:
            st.stats.count("qos_incompatible")
        cam = self._cfg.camera(camera) if self._cfg else None
        ours = "reliable" if cam and cam.qos_reliable else "best effort"
        self._warn_throttled(
            (camera, "qos"), f"camera {camera}: a publisher on {cam.topic if cam else '?'} offers "
            f"QoS incompatible with our subscription ({ours}, volatile); last policy: "
            f"{getattr(info, 'last_policy_kind', '?')}. No frames will arrive from it: set "
            f"{camera}.qos_reliable:=false (sensor data QoS) or change the publisher.")

    def _check_topics(self) -> None:
        """Warn about publishers on a camera topic with another message type or QoS that
        cannot reach us (checked with the diagnostics, ~1 Hz)."""
        if not self._active or self._cfg is None:
            return
        for cam in self._cfg.cameras:
            want = "sensor_msgs/msg/CompressedImage" if cam.type == "compressed" else "sensor_msgs/msg/Image"
            try:
                infos = self.get_publishers_info_by_topic(cam.topic)
            except Exception:  # noqa: BLE001
                continue
            for info in infos:
                if info.topic_type != want and (cam.name, info.topic_type) not in self._warned_types:
                    self._warned_types.add((cam.name, info.topic_type))
                    self._cams[cam.name].stats.count("type_mismatch")
                    self.get_logger().warning(
                        f"camera {cam.name}: {info.node_name} publishes {info.topic_type} on "
                        f"{cam.topic}, but the camera is configured as type {cam.type} ({want})")
                if cam.qos_reliable and info.qos_profile.reliability == ReliabilityPolicy.BEST_EFFORT:
                    self._on_incompatible_qos(cam.name, None)

    def _on_image(self, camera: str, msg) -> None:
        # local references: a lifecycle transition on a pool thread may drop them meanwhile
        st = self._cams.get(camera)
        cfg, sched, pipeline = self._cfg, self._sched, self.pipeline
        if st is None or cfg is None or not self._active or sched is None or pipeline is None:
            return
        arrival = time.monotonic()
        stats = st.stats
        stats.frame_in(arrival)
        try:
            if isinstance(msg, CompressedImage):
                rgb = compressed_to_rgb(msg, cfg.max_pixels)
            else:
                rgb = image_to_rgb(msg, cfg.max_pixels)
        except ImageConversionError as e:
            stats.count("errors")
            stats.count(f"error.{e.reason}")
            self._warn_throttled((camera, e.reason), f"camera {camera}: frame dropped: {e}")
            return
        except Exception as e:  # noqa: BLE001 - never let one frame stop the node
            stats.count("errors")
            stats.count("error.conversion_failed")
            self._warn_throttled((camera, "conversion"), f"camera {camera}: frame dropped: "
                                 f"{type(e).__name__}: {e}")
            return
        stamp_s = stamp_to_s(msg.header.stamp)
        with st.lock:
            if st.last_stamp is not None and stamp_s < st.last_stamp - JUMP_BACK_S:
                st.epoch += 1
                st.frame_index = 0
                pipeline.cadence.reset(camera)
                stats.count("clock_jumps_back")
                stats.reset_window()
                self._warn_throttled(
                    (camera, "jump"), f"camera {camera}: source stamps jumped back by "
                    f"{st.last_stamp - stamp_s:.3f} s (bag loop or camera restart): state reset")
            elif st.last_stamp is not None and stamp_s <= st.last_stamp:
                stats.count("stale_frames")      # reordered or repeated stamp: not newer
                self._warn_throttled((camera, "stale"), f"camera {camera}: frame with stamp "
                                     f"{stamp_s:.6f} not newer than {st.last_stamp:.6f}: dropped")
                return
            st.last_stamp = stamp_s
            index = st.frame_index
            st.frame_index += 1
            key = (st.epoch, stamp_s)
            st.latest = LatestFrame(msg.header, rgb, key, arrival)
            try:
                due = pipeline.due_tasks(camera, index, stamp_s)
            except ValueError:
                return
            if due and "annotated" in st.pubs:
                st.recent[key] = rgb
                while len(st.recent) > 8:
                    st.recent.popitem(last=False)
        if not due:
            return
        from photon_core.scheduler import PERIODIC, TaskSpec as SchedSpec

        h, w = rgb.shape[:2]
        specs = [SchedSpec(t.name, t.to_task(), t.deadline_ms / 1e3, t.on_miss) for t in due]
        stats.count("tasks_submitted", len(specs))
        sched.submit_frame(camera, key, rgb, specs, kind=PERIODIC,
                           on_result=partial(self._on_outcome, camera, msg.header, key, w, h),
                           capture_time=arrival)

    def _now_s(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _on_outcome(self, camera: str, header, key, w: int, h: int, outcome) -> None:
        """Scheduler thread: one periodic task request ended."""
        st = self._cams.get(camera)
        if st is None:
            return
        stats = st.stats
        status = str(outcome.status)
        if outcome.missed_deadline:
            stats.count("deadline_misses")
        if status == "done" or (status == "deadline" and outcome.result is not None
                                and outcome.result.task.skill in ("query", "caption")):
            self._publish_result(st, outcome, header, key, w, h)
        elif status == "superseded":
            stats.count("superseded")
        elif status == "skipped":
            stats.count("skipped")
        elif status == "cancelled":
            stats.count("cancelled")
        elif status == "error":
            stats.count("errors")
            stats.count("error.engine")
            self._warn_throttled((camera, "engine"), f"camera {camera}: task "
                                 f"{outcome.task_name} failed: {outcome.error}")

    def _publish_result(self, st: CameraState, outcome, header, key, w: int, h: int) -> None:
        pipeline = self.pipeline
        if pipeline is None or not st.pubs:
            return
        res = outcome.result
        stamp_s = stamp_to_s(header.stamp)
        engine_ms = outcome.engine_ms + outcome.timings.get("encode_ms", 0.0)
        latency_ms = (self._now_s() - stamp_s) * 1e3
        msg = pipeline.message_for(st.name, outcome.task_name, res, header, w, h,
                                   engine_ms=engine_ms, queue_ms=outcome.queue_ms,
                                   latency_ms=latency_ms)
        kind = {"detect": "detections", "point": "points"}.get(res.task.skill, "answer")
        pub = st.pubs.get(kind)
        if pub is None:
            return
        msg.timing.latency_ms = (self._now_s() - stamp_s) * 1e3
        pub.publish(msg)
        st.stats.published(key, msg.timing.latency_ms, time.monotonic())
        if kind == "detections" and "vision" in st.pubs:
            vm = to_vision_msgs(msg)
            if vm is not None:
                st.pubs["vision"].publish(vm)
        ann = st.pubs.get("annotated")
        if ann is not None and kind != "answer" and ann.get_subscription_count() > 0:
            image = st.recent.get(key)
            if image is not None:
                ann.publish(rgb_to_image_msg(annotate(image, msg), header))

    # -- services and action -----------------------------------------------------------------------------
    def _on_demand(self, camera: str, d: dict, deadline_ms: float, stream=None, cancelled=None):
        """Validate and submit an on-demand task against the latest frame of `camera`.
        Returns (task_config, frame, event, box) or raises ValueError with the reason."""
        cfg, sched, engine = self._cfg, self._sched, self._engine
        if not self._active or sched is None or engine is None or cfg is None:
            raise ValueError("the node is not active")
        st = self._cams.get(camera)
        if st is None:
            raise ValueError(f"unknown camera {camera!r}; cameras: "
                             f"{', '.join(cfg.camera_names) or 'none'}")
        frame = st.latest
        if frame is None:
            raise ValueError(f"no frame received yet from camera {camera!r}")
        deadline_ms = float(deadline_ms) or cfg.on_demand_deadline_ms
        if not math.isfinite(deadline_ms) or deadline_ms < 0:
            raise ValueError(f"deadline_ms must be >= 0, got {deadline_ms}")
        tc = make_task("on_demand", d, cfg, "request")
        from photon_core.scheduler import ON_DEMAND, TaskSpec as SchedSpec

        task = tc.to_task()
        done, box = threading.Event(), {}

        def on_result(outcome):
            box["outcome"] = outcome
            done.set()
        if stream is not None or cancelled is not None:
            engine.hook(task, stream=stream, cancelled=cancelled)
        self._node_counts["on_demand_requests"] += 1
        # The frame's own key: while periodic tasks of this frame are open in the scheduler,
        # the request shares their frame and its image encoding. Deadlines count from the
        # frame's capture time there, so the frame's age is added: this deadline still counts
        # from the request.
        age_s = max(0.0, time.monotonic() - frame.arrival)
        sched.submit_frame(camera, frame.key, frame.image,
                           [SchedSpec("on_demand", task, deadline_ms / 1e3 + age_s, "cancel")],
                           kind=ON_DEMAND, on_result=on_result, capture_time=frame.arrival)
        return tc, task, frame, done, box, deadline_ms

    def _invalid_request(self, what: str, reason: str) -> None:
        self._node_counts["invalid_requests"] += 1
        self._warn_throttled(("node", what), f"{what} refused: {reason}")

    def _on_query(self, req: Query.Request, res: Query.Response) -> Query.Response:
        d = {"skill": req.skill, "object": req.object, "question": req.question,
             "caption_length": req.caption_length, "max_objects": req.max_objects,
             "max_tokens": req.max_tokens}
        try:
            tc, task, frame, done, box, deadline_ms = self._on_demand(req.camera, d, req.deadline_ms)
        except ValueError as e:
            self._invalid_request("query", str(e))
            res.success, res.message = False, str(e)
            return res
        if not done.wait(deadline_ms / 1e3 + 10.0):
            res.success, res.message = False, f"no result within {deadline_ms:.0f} ms + 10 s"
            return res
        o = box["outcome"]
        status = str(o.status)
        kind = {"detect": "detections", "point": "points"}.get(tc.skill, "answer")
        res.result_type = kind
        if o.result is not None and self.pipeline is not None:
            h, w = frame.image.shape[:2]
            stamp_s = stamp_to_s(frame.header.stamp)
            msg = self.pipeline.message_for(
                req.camera, "on_demand", o.result, frame.header, w, h,
                engine_ms=o.engine_ms + o.timings.get("encode_ms", 0.0), queue_ms=o.queue_ms,
                latency_ms=(self._now_s() - stamp_s) * 1e3)
            setattr(res, kind, msg)
        if status == "done":
            res.success, res.message = True, ""
        elif status == "deadline":
            res.success, res.message = False, f"deadline of {deadline_ms:.0f} ms passed (partial result)"
        elif status == "skipped":
            res.success, res.message = False, (f"cannot finish within the deadline of "
                                               f"{deadline_ms:.0f} ms (admission control)")
        else:
            res.success, res.message = False, f"{status}: {o.error}".rstrip(": ")
        return res

    def _on_set_tasks(self, req: SetTasks.Request, res: SetTasks.Response) -> SetTasks.Response:
        cfg = self._cfg
        try:
            if cfg is None:
                raise ValueError("the node is not configured")
            if req.camera not in cfg.camera_names:
                raise ValueError(f"unknown camera {req.camera!r}; cameras: "
                                 f"{', '.join(cfg.camera_names) or 'none'}")
            tasks = tasks_from_specs(req.tasks, cfg, req.camera)
            new = cfg.with_tasks(req.camera, tasks)
        except ValueError as e:
            self._invalid_request("set_tasks", str(e))
            res.success, res.message = False, str(e)
            return res
        self._set_config(new)
        res.success = True
        res.message = f"{len(tasks)} tasks for {req.camera}: " + ", ".join(
            f"{t.name} ({t.skill})" for t in tasks)
        self.get_logger().info(f"set_tasks: {res.message}")
        return res

    def _on_stream(self, goal_handle):
        req = goal_handle.request
        deltas: queue.Queue = queue.Queue()
        cancel = threading.Event()
        d = {"skill": req.skill, "question": req.question, "caption_length": req.caption_length,
             "max_tokens": req.max_tokens}
        try:
            if req.skill not in ("query", "caption"):
                raise ValueError(f"stream_answer runs query or caption, not {req.skill!r}")
            tc, task, frame, done, box, deadline_ms = self._on_demand(
                req.camera, d, req.deadline_ms, stream=lambda t, n: deltas.put((t, n)),
                cancelled=cancel.is_set)
        except ValueError as e:
            self._invalid_request("stream_answer", str(e))
            goal_handle.abort()
            return StreamAnswer.Result(success=False, message=str(e))
        text = ""
        limit = time.monotonic() + deadline_ms / 1e3 + 10.0
        while True:
            if goal_handle.is_cancel_requested:
                cancel.set()
            if time.monotonic() > limit:
                cancel.set()
            try:
                delta, steps = deltas.get(timeout=0.02)
            except queue.Empty:
                if done.is_set() and deltas.empty():
                    break
                continue
            text += delta
            goal_handle.publish_feedback(StreamAnswer.Feedback(partial_text=text, delta=delta,
                                                               tokens=steps))
        if self._engine is not None:
            self._engine.unhook(task)
        o = box["outcome"]
        status = str(o.status)
        h, w = frame.image.shape[:2]
        answer = Answer()
        if o.result is not None:
            stamp_s = stamp_to_s(frame.header.stamp)
            answer = build_answer(o.result, frame.header, req.camera, "on_demand",
                                  self.pipeline.model_id if self.pipeline else "",
                                  ResultTiming(o.engine_ms + o.timings.get("encode_ms", 0.0),
                                               o.queue_ms, (self._now_s() - stamp_s) * 1e3))
        elif status == "cancelled":
            answer.finish_reason = Answer.FINISH_CANCELLED
        if goal_handle.is_cancel_requested:
            if status != "done" or not answer.finish_reason:
                answer.finish_reason = Answer.FINISH_CANCELLED
            goal_handle.canceled()
            return StreamAnswer.Result(success=False, message="cancelled", answer=answer)
        if status == "done" and answer.finish_reason in (Answer.FINISH_STOP, Answer.FINISH_LENGTH):
            goal_handle.succeed()
            return StreamAnswer.Result(success=True, message="", answer=answer)
        if status == "done":          # stopped by our own time limit
            status = "deadline"
        goal_handle.abort()
        msg = {"deadline": f"deadline of {deadline_ms:.0f} ms passed (partial answer)",
               "skipped": f"cannot finish within the deadline of {deadline_ms:.0f} ms"}.get(
                   status, f"{status}: {o.error}".rstrip(": "))
        return StreamAnswer.Result(success=False, message=msg, answer=answer)

    # -- diagnostics -------------------------------------------------------------------------------
    def _publish_diagnostics(self) -> None:
        try:
            self._check_topics()
        except Exception as e:  # noqa: BLE001
            self.get_logger().debug(f"topic check failed: {e}")
        now = time.monotonic()
        arr = DiagnosticArray()
        arr.header.stamp = self.get_clock().now().to_msg()
        name = self.get_fully_qualified_name()
        node = DiagnosticStatus(name=f"{name}: node", hardware_id=name)
        state = "active" if self._active else ("inactive" if self._cfg is not None else "unconfigured")
        values = {"state": state, "model": self._cfg.model if self._cfg else "",
                  "model_loaded": str(self._model is not None).lower(),
                  **{k: str(v) for k, v in sorted(self._node_counts.items())}}
        if self._sched is not None:
            try:
                m = self._sched.metrics()
                for k in ("submitted", "done", "late", "superseded", "skipped", "deadline_misses",
                          "errors", "waiting", "running"):
                    values[f"scheduler.{k}"] = str(m.get(k, ""))
            except Exception:  # noqa: BLE001
                pass
        node.level = DiagnosticStatus.OK
        node.message = state
        node.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
        arr.status.append(node)
        with self._cams_lock:
            cams = list(self._cams.values())
        for st in cams:
            snap = st.stats.snapshot(now)
            c = snap["counts"]
            topic = ""
            if self._cfg is not None:
                try:
                    topic = self._cfg.camera(st.name).topic
                except KeyError:
                    pass
            s = DiagnosticStatus(name=f"{name}: camera {st.name}", hardware_id=topic)
            vals = {"input_fps": f"{snap['input_fps']:.2f}",
                    "processed_fps": f"{snap['processed_fps']:.2f}",
                    "latency_p50_ms": f"{snap['latency_p50_ms']:.2f}",
                    "latency_p99_ms": f"{snap['latency_p99_ms']:.2f}"}
            for k in ("frames_in", "frames_processed", "results_published", "tasks_submitted",
                      "superseded", "skipped", "deadline_misses", "cancelled", "errors",
                      "clock_jumps_back", "stale_frames", "qos_incompatible"):
                vals[k] = str(c.get(k, 0))
            vals.update({k: str(v) for k, v in sorted(c.items()) if k.startswith("error.")})
            s.values = [KeyValue(key=k, value=v) for k, v in vals.items()]
            problems = []
            if self._active and snap["since_input_s"] is not None and snap["since_input_s"] > STALE_INPUT_S:
                problems.append(f"no frames for {snap['since_input_s']:.0f} s")
            elif self._active and snap["since_input_s"] is None:
                problems.append("no frames yet")
            if c.get("qos_incompatible"):
                problems.append("incompatible QoS publisher")
            if c.get("errors"):
                problems.append(f"{c['errors']} bad frames/errors")
            s.level = DiagnosticStatus.WARN if problems else DiagnosticStatus.OK
            s.message = "; ".join(problems) or "ok"
            arr.status.append(s)
        self._diag_pub.publish(arr)


class InlineGroupExecutor(MultiThreadedExecutor):
    """A MultiThreadedExecutor that runs the callbacks of one callback group on the spinning
    thread itself instead of handing them to the pool. The node's image callbacks are short
    (convert, submit) and per frame; the pool hand-off cost ~2 ms per 640x480 frame (measured,
    see docs/benchmarks.md). Services, the action and timers still run in the pool, so a
    service waiting for its result never holds up images.

    An exception escaping a callback is handed to `on_error` (logged and counted by the node)
    instead of ending spin(): one bad request or parameter update must not stop the node.
    Without `on_error` it propagates, as in rclpy's executors."""

    def __init__(self, inline_group, num_threads: int = 4, on_error=None, **kw):
        super().__init__(num_threads, **kw)
        # relies on MultiThreadedExecutor internals (rclpy Jazzy/Kilted); elsewhere: plain pool
        self.inline_group = inline_group if (hasattr(self, "_executor") and
                                             hasattr(self, "_futures")) else None
        self.on_error = on_error

    def _failed(self, exc: BaseException) -> None:
        if self.on_error is None or isinstance(exc, (ExternalShutdownException, ShutdownException)):
            raise exc
        self.on_error(exc)

    def _spin_once_impl(self, timeout_sec=None, wait_condition=lambda: False) -> None:
        if self.inline_group is None:
            return super()._spin_once_impl(timeout_sec, wait_condition)
        try:
            handler, entity, node = self.wait_for_ready_callbacks(timeout_sec, None, wait_condition)
        except (ExternalShutdownException, ShutdownException, TimeoutException,
                ConditionReachedException):
            return
        if getattr(entity, "callback_group", None) is self.inline_group:
            handler()
            exc = handler.exception()
            if exc is not None:
                self._failed(exc)
            return
        self._executor.submit(handler)
        self._futures.append(handler)
        for future in self._futures[:]:
            if future.done():
                self._futures.remove(future)
                exc = future.exception()
                if exc is not None:
                    self._failed(exc)


def annotate(image: np.ndarray, msg) -> np.ndarray:
    """A copy of `image` (RGB) with the boxes/points of `msg` drawn on it (cv2)."""
    import cv2

    out = np.ascontiguousarray(image).copy()
    color = (255, 64, 0)
    if isinstance(msg, DetectionArray):
        for d in msg.detections:
            x0, y0 = int(d.bbox.center_x - d.bbox.size_x / 2), int(d.bbox.center_y - d.bbox.size_y / 2)
            x1, y1 = int(d.bbox.center_x + d.bbox.size_x / 2), int(d.bbox.center_y + d.bbox.size_y / 2)
            cv2.rectangle(out, (x0, y0), (x1, y1), color, 2)
            cv2.putText(out, d.label, (x0, max(12, y0 - 4)), cv2.FONT_HERSHEY_SIMPLEX, 0.5, color, 1)
    elif isinstance(msg, PointArray):
        for p in msg.points:
            cv2.circle(out, (int(p.x), int(p.y)), 5, color, -1)
    return out


def main(args: list[str] | None = None) -> None:
    rclpy.init(args=args)
    node = PerceptionNode()
    executor = InlineGroupExecutor(node.image_group, num_threads=6, on_error=node.callback_failed)
    executor.add_node(node)
    try:
        if node.get_parameter("auto_activate").value:
            node.trigger_configure()
            if node._cfg is not None:
                node.trigger_activate()
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        try:
            node._teardown_active()
        except Exception:  # noqa: BLE001
            pass
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()

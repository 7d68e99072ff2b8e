"""The node's cameras: subscriptions and result publishers kept in step with the
configuration, frame intake (convert, number, submit the due tasks) and publishing the
results the scheduler delivers.

Image callbacks run on the spinning thread and only convert and submit; results arrive on
the scheduler's thread (publishing from it is safe in rclpy).
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import numpy as np
from rclpy.event_handler import SubscriptionEventCallbacks, UnsupportedEventTypeError
from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy,
                       qos_profile_sensor_data)
from sensor_msgs.msg import CompressedImage, Image

from photon_ros import image_conversion
from photon_ros.annotate import annotate
from photon_ros.camera_stats import WINDOW_S, CameraStats
from photon_ros.live_pipeline import JUMP, STALE
from photon_ros.msg import Answer, DetectionArray, PointArray
from photon_ros.result_messages import (RESULT_TYPES, points_to_vision_msgs, stamp_to_s,
                                        to_vision_msgs, vision_msgs_missing)
from photon_ros.transport_loss import loss_problem


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
        self.latest: LatestFrame | None = None
        self.recent: collections.OrderedDict = collections.OrderedDict()   # key -> image
        self.lock = threading.Lock()
        self.loss_warned = float("-inf")       # last transport-loss WARN (cameras._warn_loss)


def camera_qos(reliable: bool, depth: int) -> QoSProfile:
    reliability = ReliabilityPolicy.RELIABLE if reliable else qos_profile_sensor_data.reliability
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=depth, reliability=reliability,
                      durability=DurabilityPolicy.VOLATILE)


class Cameras:
    """Per-camera state of a node. `node` provides: config (PerceptionConfig | None), live
    (LivePipeline | None), active (bool), image_group, warn_throttled(key, text), now_s()."""

    def __init__(self, node):
        self.node = node
        self.states: dict[str, CameraState] = {}
        self.lock = threading.RLock()
        self._warned_types: set = set()
        self._said_vision = False

    # -- configuration -------------------------------------------------------------------
    def reset(self, names: list[str]) -> None:
        with self.lock:
            self.states = {n: CameraState(n) for n in names}

    def get(self, name: str) -> CameraState | None:
        return self.states.get(name)

    def all(self) -> list[CameraState]:
        with self.lock:
            return list(self.states.values())

    def sync(self) -> None:
        """Make subscriptions and publishers match the configuration (active only)."""
        node, cfg = self.node, self.node.config
        with self.lock:
            for name in [n for n in self.states if n not in set(cfg.camera_names)]:
                st = self.states.pop(name)
                if st.sub is not None:
                    node.destroy_subscription(st.sub)
                for pub in st.pubs.values():
                    node.destroy_publisher(pub)
            for cam in cfg.cameras:
                st = self.states.setdefault(cam.name, CameraState(cam.name))
                sig = (cam.topic, cam.type, cam.qos_reliable, cam.qos_depth)
                if st.sub is not None and st.sub_sig != sig:
                    node.destroy_subscription(st.sub)
                    st.sub = None
                if st.sub is None:
                    st.stats.transport.restart()
                    st.sub = self._subscribe(cam)
                    st.sub_sig = sig
                    node.get_logger().info(
                        f"camera {cam.name}: {cam.topic} ({cam.type}, "
                        f"{'reliable' if cam.qos_reliable else 'best effort'}, depth {cam.qos_depth})")
                if not st.pubs:
                    st.pubs = self._publishers(cam.name, cfg)

    def _subscribe(self, cam):
        """The camera's subscription; its callback gets the message info (publication
        sequence numbers: frames lost before the node) and the rmw's message_lost and
        incompatible_qos events are counted."""
        node = self.node
        args = (CompressedImage if cam.type == "compressed" else Image, cam.topic,
                partial(self.on_image_info, cam.name), camera_qos(cam.qos_reliable, cam.qos_depth))
        incompatible = partial(self._on_incompatible_qos, cam.name)
        try:
            events = SubscriptionEventCallbacks(
                incompatible_qos=incompatible, message_lost=partial(self._on_message_lost, cam.name))
            return node.create_subscription(*args, callback_group=node.image_group,
                                            event_callbacks=events)
        except UnsupportedEventTypeError:       # an rmw without message_lost: sequences only
            node.get_logger().info(f"camera {cam.name}: the rmw has no message_lost event; frames "
                                   "lost before the node are counted from sequence gaps only")
            return node.create_subscription(
                *args, callback_group=node.image_group,
                event_callbacks=SubscriptionEventCallbacks(incompatible_qos=incompatible))

    def _publishers(self, camera: str, cfg) -> dict[str, Any]:
        node = self.node
        pubs = {"detections": node.create_publisher(DetectionArray, f"{camera}/detections", 10),
                "points": node.create_publisher(PointArray, f"{camera}/points", 10),
                "answer": node.create_publisher(Answer, f"{camera}/answer", 10)}
        if cfg.annotate:
            pubs["annotated"] = node.create_publisher(Image, f"{camera}/annotated", 2)
        if cfg.publish_vision_msgs:
            why = vision_msgs_missing()
            if why is None:
                from vision_msgs.msg import Detection2DArray
                pubs["detections_2d"] = node.create_publisher(Detection2DArray,
                                                              f"{camera}/detections_2d", 10)
                pubs["points_2d"] = node.create_publisher(Detection2DArray,
                                                          f"{camera}/points_2d", 10)
            elif not self._said_vision:
                self._said_vision = True
                node.get_logger().warning(
                    f"vision_msgs output is off: vision_msgs is not importable ({why}); no "
                    "<camera>/detections_2d, <camera>/points_2d. Install ros-$ROS_DISTRO-vision-msgs "
                    "or set publish_vision_msgs:=false to silence this.")
        return pubs

    def drop_all(self, publishers: bool) -> None:
        """Deactivate: subscriptions first; publishers (after the engine stopped) when asked."""
        node = self.node
        with self.lock:
            for st in self.states.values():
                if st.sub is not None:
                    node.destroy_subscription(st.sub)
                    st.sub, st.sub_sig = None, None
                if publishers:
                    for pub in st.pubs.values():
                        node.destroy_publisher(pub)
                    st.pubs.clear()
                    st.latest = None
                    st.recent.clear()

    # -- input checks --------------------------------------------------------------------
    def _on_incompatible_qos(self, camera: str, info) -> None:
        st = self.states.get(camera)
        if st is not None:
            st.stats.count("qos_incompatible")
        cfg = self.node.config
        try:
            cam = cfg.camera(camera) if cfg else None
        except KeyError:
            cam = None
        ours = "reliable" if cam and cam.qos_reliable else "best effort"
        self.node.warn_throttled(
            (camera, "qos"), f"camera {camera}: a publisher on {cam.topic if cam else '?'} offers "
            f"QoS incompatible with our subscription ({ours}, volatile); last policy: "
            f"{getattr(info, 'last_policy_kind', '?')}. No frames will arrive from it: set "
            f"{camera}.qos_reliable:=false (sensor data QoS) or change the publisher.")

    def check_topics(self) -> None:
        """Warn about publishers on a camera topic with another message type or QoS that
        cannot reach us (called with the diagnostics, ~1 Hz)."""
        cfg = self.node.config
        if not self.node.active or cfg is None:
            return
        for cam in cfg.cameras:
            want = "sensor_msgs/msg/CompressedImage" if cam.type == "compressed" else "sensor_msgs/msg/Image"
            try:
                infos = self.node.get_publishers_info_by_topic(cam.topic)
            except Exception:  # noqa: BLE001
                continue
            for info in infos:
                if info.topic_type != want and (cam.name, info.topic_type) not in self._warned_types:
                    self._warned_types.add((cam.name, info.topic_type))
                    st = self.states.get(cam.name)
                    if st is not None:
                        st.stats.count("type_mismatch")
                    self.node.get_logger().warning(
                        f"camera {cam.name}: {info.node_name} publishes {info.topic_type} on "
                        f"{cam.topic}, but the camera is configured as type {cam.type} ({want})")
                if cam.qos_reliable and info.qos_profile.reliability == ReliabilityPolicy.BEST_EFFORT:
                    self._on_incompatible_qos(cam.name, None)

    # -- frames lost before the node ----------------------------------------------------------
    def _on_message_lost(self, camera: str, info) -> None:
        st = self.states.get(camera)
        if st is not None:
            st.stats.transport.on_rmw_lost(int(getattr(info, "total_count_change", 0) or 0),
                                           time.monotonic())
            self._warn_loss(st)

    def _warn_loss(self, st: CameraState) -> None:
        """Log (throttled) when the losses of the last window are high: the diagnostics show
        the same text as the camera's WARN."""
        now = time.monotonic()
        if now - st.loss_warned < 1.0:           # warned just now: spare the window scan
            return
        w = st.stats.loss_window(now)
        text = loss_problem(w, w["received"], WINDOW_S)
        if text is not None:
            st.loss_warned = now
            total = st.stats.transport.totals()["frames_lost_in_transport"]
            self.node.warn_throttled((st.name, "transport_loss"),
                                     f"camera {st.name}: {text} ({total} in all)")

    # -- intake ----------------------------------------------------------------------------
    def on_image_info(self, camera: str, msg, info) -> None:
        """The subscription's callback (message + MessageInfo): count frames the publisher
        sent that never arrived (publication sequence gaps), then take the frame."""
        st = self.states.get(camera)
        if st is not None and st.stats.transport.on_message(info, time.monotonic()) > 0:
            self._warn_loss(st)
        self.on_image(camera, msg)

    def on_image(self, camera: str, msg) -> None:
        node = self.node
        # local references: a lifecycle transition on a pool thread may drop them meanwhile
        st, cfg, live = self.states.get(camera), node.config, node.live
        if st is None or cfg is None or not node.active or live is None:
            return
        arrival = time.monotonic()
        stats = st.stats
        stats.frame_in(arrival)
        try:
            if isinstance(msg, CompressedImage):
                rgb = image_conversion.compressed_to_rgb(msg, cfg.max_pixels)
            else:
                rgb = image_conversion.image_to_rgb(msg, cfg.max_pixels)
        except image_conversion.ImageConversionError as e:
            stats.count("errors")
            stats.count(f"error.{e.reason}")
            node.warn_throttled((camera, e.reason), f"camera {camera}: frame dropped: {e}")
            return
        except Exception as e:  # noqa: BLE001 - never let one frame stop the node
            stats.count("errors")
            stats.count("error.conversion_failed")
            node.warn_throttled((camera, "conversion"), f"camera {camera}: frame dropped: "
                                f"{type(e).__name__}: {e}")
            return
        stamp_s = stamp_to_s(msg.header.stamp)
        with st.lock:
            try:
                ticket = live.accept(camera, stamp_s)
            except ValueError:                       # camera removed meanwhile
                return
            if ticket.event == STALE:
                stats.count("stale_frames")          # reordered or repeated stamp: not newer
                node.warn_throttled((camera, "stale"), f"camera {camera}: frame with stamp "
                                    f"{stamp_s:.6f} not newer than {ticket.last_stamp_s:.6f}: dropped")
                return
            if ticket.event == JUMP:
                stats.count("clock_jumps_back")
                stats.reset_window()
                node.warn_throttled(
                    (camera, "jump"), f"camera {camera}: source stamps jumped back by "
                    f"{ticket.jumped_s:.3f} s (bag loop or camera restart): state reset")
            st.latest = LatestFrame(msg.header, rgb, ticket.key, arrival)
            if ticket.due and "annotated" in st.pubs:
                st.recent[ticket.key] = rgb
                while len(st.recent) > 8:
                    st.recent.popitem(last=False)
        if not ticket.due:
            return
        h, w = rgb.shape[:2]
        n = live.submit(camera, ticket, rgb, arrival,
                        on_result=partial(self.on_outcome, camera, msg.header, ticket.key, w, h))
        stats.count("tasks_submitted", n)

    # -- results ---------------------------------------------------------------------------
    def on_outcome(self, camera: str, header, key, w: int, h: int, outcome) -> None:
        """Scheduler thread: one periodic task request ended."""
        st = self.states.get(camera)
        if st is None:
            return
        stats = st.stats
        status = str(outcome.status)
        if outcome.missed_deadline:
            stats.count("deadline_misses")
        if status == "done" or (status == "deadline" and outcome.result is not None
                                and outcome.result.task.skill in ("query", "caption")):
            try:
                self.publish(st, outcome, header, key, w, h)
            except Exception:
                if self.node.context.ok():
                    raise                      # the scheduler logs it (on_result failed)
                # SIGTERM / Ctrl-C: the ROS context ended while a run was finishing; its
                # publishers are gone - counted, not a traceback
                stats.count("unpublished_at_shutdown")
        elif status in ("superseded", "skipped", "cancelled"):
            stats.count(status)
        elif status == "deadline":            # detect/point cut at the deadline: nothing published
            stats.count("deadline_cancelled")
        elif status == "error":
            stats.count("errors")
            stats.count("error.engine")
            self.node.warn_throttled((camera, "engine"), f"camera {camera}: task "
                                     f"{outcome.task_name} failed: {outcome.error}")

    def publish(self, st: CameraState, outcome, header, key, w: int, h: int) -> None:
        live = self.node.live
        if live is None or not st.pubs:
            return
        res = outcome.result
        stamp_s = stamp_to_s(header.stamp)
        msg = live.pipeline.message_for(
            st.name, outcome.task_name, res, header, w, h,
            engine_ms=outcome.engine_ms + outcome.timings.get("encode_ms", 0.0),
            queue_ms=outcome.queue_ms, latency_ms=(self.node.now_s() - stamp_s) * 1e3)
        kind = RESULT_TYPES[res.task.skill]
        pub = st.pubs.get(kind)
        if pub is None:
            return
        msg.timing.latency_ms = (self.node.now_s() - stamp_s) * 1e3
        pub.publish(msg)
        st.stats.published(key, msg.timing.latency_ms, time.monotonic())
        convert: Callable | None = {"detections": to_vision_msgs,
                                    "points": points_to_vision_msgs}.get(kind)
        vpub = st.pubs.get(f"{kind}_2d")
        if convert is not None and vpub is not None:
            vpub.publish(convert(msg))
        ann = st.pubs.get("annotated")
        if ann is not None and kind != "answer" and ann.get_subscription_count() > 0:
            image = st.recent.get(key)
            if image is not None:
                ann.publish(image_conversion.rgb_to_image_msg(annotate(image, msg), header))

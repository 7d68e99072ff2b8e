"""The photon_ros perception node: camera topics in, vision-language results out.

    ros2 launch photon_ros perception.launch.py model:=DIR [params_file:=my.yaml]
    ros2 run photon_ros perception_node --ros-args --params-file my.yaml -p model:=DIR
    python -m photon_ros.perception_node --ros-args -p model:=DIR [-p params_file:=YAML]

A lifecycle node (configure: parameters + YAML validated, model path checked; activate:
model loaded, scheduler started, topics/services/action created; deactivate: all of that
dropped and the model freed; cleanup/shutdown) that configures and activates itself unless
`auto_activate:=false`. See docs/architecture.md, "Perception node", for topics and parameters.

The pieces, one file each: node_parameters (where cameras and tasks come from, live
updates), live_pipeline (model + calibration + scheduler + frame numbering, shared with
`photon replay --mode realtime`), cameras (subscriptions, frame intake, result publishing),
on_demand (services and the action), diagnostics, executor (image callbacks inline).
"""
from __future__ import annotations

import collections
import gc
import sys
import time
import traceback
from pathlib import Path

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.executors import ExternalShutdownException
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn

from photon_core.heap_freeze import freeze_heap, thaw_heap
from photon_ros.cameras import Cameras
from photon_ros.diagnostics import publish_diagnostics
from photon_ros.executor import InlineGroupExecutor
from photon_ros.live_pipeline import LivePipeline, build_live_pipeline
from photon_ros.node_parameters import NodeParameters, params_files_in_args
from photon_ros.on_demand import OnDemand
from photon_ros.task_config import ConfigError, PerceptionConfig, config_from_params, restrict

NODE_NAME = "perception_node"
LOG_EVERY_S = 2.0         # throttle for repeated bad-input warnings (per camera and reason)


class PerceptionNode(LifecycleNode):
    def __init__(self, node_name: str = NODE_NAME, params_files=(), **kw):
        kw.setdefault("automatically_declare_parameters_from_overrides", True)
        super().__init__(node_name, **kw)
        self.config: PerceptionConfig | None = None
        self.live: LivePipeline | None = None
        # what the model's family serves (photon_core.engine.Capabilities), from configure on
        self.capabilities = None
        self.active = False
        self.counts: collections.Counter = collections.Counter()
        self._log_last: dict[tuple, list] = {}
        self.image_group = MutuallyExclusiveCallbackGroup()
        self.params = NodeParameters(self, lambda cfg, names: self.set_config(cfg),
                                     params_files, self.counts)
        self.cameras = Cameras(self)
        self.on_demand = OnDemand(self, ReentrantCallbackGroup())
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._diag_timer = self.create_timer(
            1.0, lambda: publish_diagnostics(self), callback_group=MutuallyExclusiveCallbackGroup(),
            clock=Clock(clock_type=ClockType.STEADY_TIME))

    # -- logging -------------------------------------------------------------------------------
    def warn_throttled(self, key: tuple, text: str) -> None:
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
        self.counts["callback_errors"] += 1
        self.counts[f"callback_error.{type(exc).__name__}"] += 1
        entry = self._log_last.setdefault(("node", "callback", type(exc).__name__), [0.0, 0])
        if time.monotonic() - entry[0] >= LOG_EVERY_S:
            entry[0] = time.monotonic()
            self.get_logger().error("a callback failed (the node keeps serving):\n" + "".join(
                traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())

    def now_s(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def set_config(self, cfg: PerceptionConfig) -> None:
        """Swap the configuration at once (parameter update, SetTasks); resubscribe cameras
        whose input changed."""
        with self.cameras.lock:
            self.config = cfg
            if self.live is not None:
                self.live.set_config(cfg)
            if self.active:
                self.cameras.sync()

    # -- lifecycle -------------------------------------------------------------------------------
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        try:
            cfg = self.params.read()
        except (ConfigError, ValueError) as e:
            self.counts["configure_failures"] += 1
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        self.get_logger().info(f"configuration from {self.params.source}")
        problem = check_model(cfg)
        if problem:
            self.counts["configure_failures"] += 1
            self.get_logger().error(f"configure failed: {problem}")
            return TransitionCallbackReturn.FAILURE
        try:
            from photon_core.models import capabilities
            caps = capabilities(cfg.model)
        except ValueError as e:          # a model_type no family serves
            self.counts["configure_failures"] += 1
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        cfg = self._restrict(cfg, caps)
        if not cfg.cameras:
            self.get_logger().warning("no cameras configured: only services and the action work "
                                      "once cameras are added by parameters")
        if cfg.extra:
            self.get_logger().warning(f"unknown parameters ignored: {', '.join(sorted(cfg.extra))}")
        self.config = cfg
        self.params.configured = True
        self.cameras.reset(cfg.camera_names)
        self.get_logger().info(
            f"configured: model {cfg.model!r} on {cfg.device}/{cfg.dtype} ({cfg.engine} engine), "
            "cameras " + (", ".join(f"{c.name} <- {c.topic} ({len(c.tasks)} tasks)"
                                    for c in cfg.cameras) or "none"))
        return TransitionCallbackReturn.SUCCESS

    def _restrict(self, cfg: PerceptionConfig, caps) -> PerceptionConfig:
        """Refuse what the model's family does not serve (its message in the log, counted
        `refused_tasks`); the node serves the rest."""
        cfg = restrict(cfg, caps)
        self.capabilities = self.params.capabilities = caps
        for r in cfg.refused:
            self.counts["refused_tasks" if r.task else "refused_settings"] += 1
            self.get_logger().error(f"{r} ({r.outcome})")
        return cfg

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        cfg = self.config
        t0 = time.monotonic()
        try:
            self.live = build_live_pipeline(cfg)
        except Exception as e:  # noqa: BLE001 - a clear message, then back to inactive
            self.counts["activate_failures"] += 1
            self.get_logger().error(f"activate failed: cannot load model {cfg.model!r}: "
                                    f"{type(e).__name__}: {e}")
            self._free_model()
            return TransitionCallbackReturn.FAILURE
        # the loaded objects out of full collections (photon_core/heap_freeze.py: a 166 ms
        # pause with Moondream 2 loaded, at a moment Python picks); a gauge in diagnostics,
        # set before model_loads counts this load
        self.counts["heap_frozen_objects"] = freeze_heap()
        self.counts["model_loads"] += 1
        self.get_logger().info(f"model loaded and calibrated in {time.monotonic() - t0:.1f} s "
                               f"({self.counts['heap_frozen_objects']} objects frozen)")
        caps = self.live.engine.capabilities
        if caps != self.capabilities:    # e.g. a Hugging Face id whose config.json was not
            try:                         # readable at configure: the loaded model decides
                cfg = self._restrict(config_from_params(self.params.values()), caps)
            except ConfigError as e:
                self.get_logger().error(f"activate: {e}")
            else:
                self.config = cfg
                self.live.set_config(cfg)
        self.on_demand.start()
        with self.cameras.lock:
            self.active = True
            self.cameras.sync()
        self.get_logger().info(f"active: model {self.live.model.model_id} loaded")
        return TransitionCallbackReturn.SUCCESS

    def _free_model(self) -> None:
        thaw_heap()                  # the model's cycles collectable again (the gauge at 0
        self.counts["heap_frozen_objects"] = 0      # before model_loaded says false)
        live, self.live = self.live, None
        if live is not None:
            live.stop()
        gc.collect()
        if str(self.config.device if self.config else "cpu").startswith("cuda"):
            try:
                import torch
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    def teardown_active(self) -> None:
        with self.cameras.lock:
            self.active = False
        self.cameras.drop_all(publishers=False)
        self._free_model()           # open requests end (cancelled) before publishers go
        self.cameras.drop_all(publishers=True)
        self.on_demand.stop()

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self.teardown_active()
        self.get_logger().info("inactive: subscriptions dropped, model freed")
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        self.config = None
        self.cameras.reset([])
        self.params.forget()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        if self.active or self.live is not None:
            self.teardown_active()
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: State) -> TransitionCallbackReturn:
        self.get_logger().error("error during a transition: dropping everything")
        self.teardown_active()
        return TransitionCallbackReturn.SUCCESS


def check_model(cfg: PerceptionConfig) -> str:
    """Why `cfg.model` cannot be loaded, as far as configure can tell ("" = fine)."""
    m = cfg.model.strip()
    if not m:
        return "parameter 'model' is empty: give a model folder or a Hugging Face id"
    p = Path(m).expanduser()
    if p.exists():
        return "" if p.is_dir() or p.is_file() else f"model path {m!r} is not a file or folder"
    if m.startswith(("/", ".", "~")) or m.count("/") != 1:
        return f"model path {m!r} does not exist"
    return ""          # "org/name": a Hugging Face id, resolved at activate


def main(args: list[str] | None = None) -> None:
    argv = sys.argv if args is None else args
    rclpy.init(args=argv)
    node = PerceptionNode(params_files=params_files_in_args(argv))
    executor = InlineGroupExecutor(node.image_group, num_threads=6, on_error=node.callback_failed)
    executor.add_node(node)
    try:
        if node.get_parameter("auto_activate").value:
            node.trigger_configure()
            if node.config is not None:
                node.trigger_activate()
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        try:
            node.teardown_active()
        except Exception:  # noqa: BLE001
            pass
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()

"""The node's parameters -> its PerceptionConfig: where the cameras and tasks come from, the
parameters declared for them, and live updates (`ros2 param set`) validated as a whole.

Where the configuration comes from (the log line names it):
1. `params_file` (alias `config`) given as a parameter: that YAML is read; every value of it
   not already given with `-p` / `--params-file` becomes a parameter (those win).
2. else, when the node's own parameters define `cameras` (`--params-file my.yaml`, as
   `ros2 run`/`ros2 launch` users pass it, or `-p cameras:=...`): those parameters alone.
3. else: config/perception.yaml of the installed package (the example file).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult

from photon_ros.task_config import (NODE_DEFAULTS, ConfigError, PerceptionConfig,
                                    config_from_params, flatten, new_refusals, params_from_file,
                                    restrict)

# Every key of every configured camera and task becomes a parameter (0 / "" = the node
# default), so `ros2 param set front.people.every_n 3` works for keys the YAML left out.
_TASK_UNSET = {"every_n": 1, "hz": 0.0, "deadline_ms": 0.0, "on_miss": "", "max_objects": 0,
               "max_tokens": 0, "object": "", "question": "", "caption_length": "normal"}


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


def params_files_in_args(args: Sequence[str] | None) -> list[str]:
    """The `--params-file PATH` arguments inside the `--ros-args` sections of a command line
    (rclpy applies them but does not say which files they were)."""
    files, in_ros = [], False
    args = list(args or [])
    for i, a in enumerate(args):
        if a == "--ros-args":
            in_ros = True
        elif a == "--":
            in_ros = False
        elif in_ros and a == "--params-file" and i + 1 < len(args):
            files.append(args[i + 1])
    return files


class NodeParameters:
    """Binds a node's parameters to its configuration. `on_change(cfg, names)` is called after
    an accepted update (while the node is configured)."""

    def __init__(self, node, on_change: Callable[[PerceptionConfig, list[str]], None],
                 params_files: Sequence[str] = (), counts=None):
        self.node = node
        self.on_change = on_change
        self.params_files = list(params_files)       # the --params-file arguments given
        self.counts = counts if counts is not None else {}
        self.configured = False
        # what the model's family serves (photon_core.engine.Capabilities; the node sets it at
        # configure): an update adding a task it does not serve is rejected with its message
        self.capabilities = None
        self.source = ""                              # what the log names
        self._declared: list[str] = []
        self._pending: PerceptionConfig | None = None
        for name, default in (("params_file", ""), ("config", ""), ("auto_activate", True)):
            if not node.has_parameter(name):
                node.declare_parameter(name, default)
        node.add_on_set_parameters_callback(self._validate)
        node.add_post_set_parameters_callback(self._apply)

    def values(self) -> dict[str, Any]:
        return {name: p.value for name, p in self.node._parameters.items()}

    def _declare(self, name: str, value: Any) -> None:
        if self.node.has_parameter(name) or value is None:
            return
        if isinstance(value, list) and not value:
            return                                    # an empty list has no parameter type
        self.node.declare_parameter(name, value, ParameterDescriptor(dynamic_typing=True))
        self._declared.append(name)

    def _source_file(self) -> tuple[str, str]:
        """(file to read or "", description for the log)."""
        given = [f for f in self.params_files if f]
        args = f" (--params-file {', '.join(given)})" if given else ""
        explicit = self.node.get_parameter("params_file").value or \
            self.node.get_parameter("config").value or ""
        if explicit:
            return str(explicit), f"{explicit}" + (f" and the node's parameters{args}" if given else "")
        if self.node.has_parameter("cameras"):
            return "", f"the node's parameters{args or ' (-p)'}"
        path = default_params_file()
        if not path:
            return "", f"the node's parameters{args} (no cameras: no params file given and " \
                       "no installed config/perception.yaml)"
        return path, (f"{path} (the installed example: give yours with --params-file or "
                      f"-p params_file:=)" + (f" and the node's parameters{args}" if given else ""))

    def read(self) -> PerceptionConfig:
        """Declare what the source file defines (values given to the node win) and build the
        validated configuration from the node's parameters."""
        path, self.source = self._source_file()
        file_params = flatten(params_from_file(path, self.node.get_name())) if path else {}
        for name, value in {**NODE_DEFAULTS, **file_params}.items():
            self._declare(name, value)
        cfg = config_from_params(self.values())
        for cam in cfg.cameras:
            keys = {f"{cam.name}.type": cam.type, f"{cam.name}.qos_reliable": cam.qos_reliable,
                    f"{cam.name}.qos_depth": cam.qos_depth, f"{cam.name}.crops": cam.crops,
                    f"{cam.name}.width": cam.width, f"{cam.name}.height": cam.height}
            for t in cam.tasks:
                keys.update({f"{cam.name}.{t.name}.{k}": v for k, v in _TASK_UNSET.items()})
            for name, value in keys.items():
                self._declare(name, value)
        return cfg

    def forget(self) -> None:
        """Cleanup: undeclare what `read` declared (a new configure reads the file again)."""
        self.configured = False
        for name in self._declared:
            if self.node.has_parameter(name):
                self.node.undeclare_parameter(name)
        self._declared = []

    def _validate(self, params) -> SetParametersResult:
        if not self.configured:
            return SetParametersResult(successful=True)
        changed = {p.name: p.value for p in params}
        try:
            cfg = restrict(config_from_params({**self.values(), **changed}), self.capabilities)
            fresh = new_refusals(self.node.config, cfg)
            if fresh:
                raise ConfigError("; ".join(str(r) for r in fresh))
        except ConfigError as e:
            self.counts["rejected_parameter_updates"] += 1
            self.node.get_logger().warning(f"parameter update rejected: {e}")
            return SetParametersResult(successful=False, reason=str(e))
        self._pending = cfg
        return SetParametersResult(successful=True)

    def _apply(self, params) -> None:
        cfg, self._pending = self._pending, None
        if cfg is None or not self.configured:
            return
        names = [p.name for p in params]
        self.on_change(cfg, names)
        self.node.get_logger().info("configuration updated from parameters: " + ", ".join(names))

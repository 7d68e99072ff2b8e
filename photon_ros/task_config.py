"""The perception configuration: cameras, their periodic tasks, and node-wide defaults.

One file format, the ROS 2 parameters file (config/perception.yaml):

    /**:
      ros__parameters:
        model: ""                  # node-wide settings (see NODE_DEFAULTS)
        default_deadline_ms: 500.0
        cameras: ["front"]         # camera names, in order
        front:
          topic: /camera/image_raw
          type: image              # image | compressed
          qos_reliable: false      # false: sensor-data QoS (best effort)
          qos_depth: 1
          crops: overlap           # overlap (all crops) | overlap:N (at most N local crops) | global (one crop: faster, less detail) | adaptive (the scheduler steps down to cheaper modes under overload)
          width: 640               # optional: the frames' size, so encodes are prepared ahead
          height: 480
          tasks: ["people", "scene"]
          people: {skill: detect, object: person, every_n: 1}
          scene: {skill: caption, caption_length: short, every_n: 30, deadline_ms: 3000.0}

Every value is an ordinary ROS parameter (`front.people.object`), so `-p`, launch files and
`ros2 param set` all reach it. `load_config(path)` reads the file directly (offline replay);
the node builds the same flat dict from its parameters and calls `config_from_params`.
SetTasks requests are validated by `tasks_from_specs` with the same rules.
Everything returns plain frozen dataclasses; problems raise ConfigError naming the entry.

What the model serves (photon_core.engine.Capabilities: the family's skills and crop modes,
known from the checkpoint's config.json before loading) is applied by `restrict`: a task of a
skill the family does not serve, or a camera's crops mode it does not serve, is refused with
the family's own message (`PerceptionConfig.refused`) and the rest is served; `make_task` /
`tasks_from_specs` with `caps` refuse such a request outright (Query, SetTasks).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from photon_core import ENGINES
from photon_core.encode_request import CROP_MODES, MAX_CROP_BUDGET, parse_crops
from photon_core.scheduler.crop_ladder import LADDER
from photon_core.task import (CAPTION_LENGTHS, cut_message, DEFAULT_MAX_OBJECTS, DEFAULT_MAX_TOKENS,
                              MAX_OBJECTS_LIMIT, MAX_QUESTION_CHARS, MAX_TOKENS_LIMIT, SKILLS,
                              Task, TaskError)

# a camera's crops setting that lets the scheduler pick its mode among LADDER (the node
# hands its frames over as crop_ladder.AdaptiveCrops)
ADAPTIVE = "adaptive"

CAMERA_TYPES = ("image", "compressed")
ON_MISS = ("finish", "cancel")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")

# Node-wide parameters and their defaults (also declared by the node).
NODE_DEFAULTS: dict[str, Any] = {
    "model": "",
    "device": "cpu",
    "dtype": "fp32",
    "engine": "auto",              # auto (fast path on CUDA) | reference | fast
    "deterministic": False,        # fast path: same bits every run (no split-K atomics)
    "megakernel": "auto",          # fast path, batch 1: auto (on on Hopper) | off | on | a variant (EngineOptions)
    "max_batch": 4,
    "annotate": False,
    "publish_vision_msgs": True,   # vision_msgs/Detection2DArray too, where importable
    "default_deadline_ms": 500.0,
    "on_demand_deadline_ms": 5000.0,
    "default_on_miss": "cancel",
    "default_max_objects": DEFAULT_MAX_OBJECTS,   # the limits live in photon_core.task
    "default_max_tokens": DEFAULT_MAX_TOKENS,
    "max_question_chars": MAX_QUESTION_CHARS,
    "max_pixels": 40_000_000,
    "camera_topic": "",            # single-camera override of the first camera's topic
    # test/benchmark hooks (off by default): text tasks run to max_tokens; every decode
    # step takes at least this long (simulates a slower engine on small test models)
    "debug_ignore_eos": False,
    "debug_step_delay_ms": 0.0,
}
CAMERA_KEYS = ("topic", "type", "qos_reliable", "qos_depth", "crops", "width", "height",
               "tasks")
TASK_KEYS = ("skill", "object", "question", "caption_length", "every_n", "hz", "deadline_ms",
             "on_miss", "max_objects", "max_tokens")


class ConfigError(ValueError):
    """A configuration (file, parameters or SetTasks request) that cannot be used. The
    message stays short (values quoted in it are cut), whatever a caller sent."""

    def __init__(self, message: str):
        super().__init__(cut_message(message))


@dataclass(frozen=True)
class TaskConfig:
    name: str
    skill: str
    object: str = ""
    question: str = ""
    caption_length: str = "normal"
    every_n: int = 1              # run on every Nth frame (1 = every frame) ...
    hz: float = 0.0               # ... or at most this often (source stamps); 0 = off
    deadline_ms: float = 500.0    # relative to the frame's arrival
    on_miss: str = "cancel"       # finish | cancel (what a started task does past its deadline)
    max_objects: int = DEFAULT_MAX_OBJECTS
    max_tokens: int = DEFAULT_MAX_TOKENS

    @property
    def target(self) -> str:
        return self.to_task().target

    def to_task(self) -> Task:
        """The photon_core.Task this entry runs (already validated)."""
        return Task(self.skill, object=self.object, question=self.question,
                    caption_length=self.caption_length, max_objects=self.max_objects,
                    max_tokens=self.max_tokens)


@dataclass(frozen=True)
class CameraConfig:
    name: str
    topic: str
    type: str = "image"
    qos_reliable: bool = False
    qos_depth: int = 1
    # encode crop mode (photon_core/encode_request.py), or ADAPTIVE: the scheduler's crop
    # ladder picks it (photon_core/scheduler/crop_ladder.py)
    crops: str = "overlap"
    width: int = 0                # the frames' size where known (0: unknown): encode graphs
    height: int = 0               # are prepared for it at activation (fast path)
    tasks: tuple[TaskConfig, ...] = ()

    def task(self, name: str) -> TaskConfig:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass(frozen=True)
class PerceptionConfig:
    cameras: tuple[CameraConfig, ...] = ()
    model: str = ""
    device: str = "cpu"
    dtype: str = "fp32"
    engine: str = "auto"
    deterministic: bool = False
    megakernel: str = "auto"
    max_batch: int = 4
    annotate: bool = False
    publish_vision_msgs: bool = True
    default_deadline_ms: float = 500.0
    on_demand_deadline_ms: float = 5000.0
    default_on_miss: str = "cancel"
    default_max_objects: int = DEFAULT_MAX_OBJECTS
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_question_chars: int = MAX_QUESTION_CHARS
    max_pixels: int = 40_000_000
    debug_ignore_eos: bool = False
    debug_step_delay_ms: float = 0.0
    extra: dict = field(default_factory=dict, compare=False)   # unrecognised keys (warned)
    # what `restrict` refused for the model (Refusal: camera, task or "" for the camera's
    # crops, the family's message); the tasks / settings above are what is served
    refused: tuple = field(default=(), compare=False)

    def camera(self, name: str) -> CameraConfig:
        for c in self.cameras:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def camera_names(self) -> list[str]:
        return [c.name for c in self.cameras]

    def with_tasks(self, camera: str, tasks: Iterable[TaskConfig]) -> "PerceptionConfig":
        """A copy with one camera's task list replaced (validated as a whole)."""
        cam = self.camera(camera)
        tasks = tuple(tasks)
        _check_unique([t.name for t in tasks], f"camera {camera!r}: task")
        cams = tuple(replace(c, tasks=tasks) if c is cam else c for c in self.cameras)
        return replace(self, cameras=cams)


@dataclass(frozen=True)
class Refusal:
    """A task (or, with task "", a camera's crops mode) the model's family does not serve."""
    camera: str
    task: str
    message: str

    @property
    def where(self) -> str:
        return f"{self.camera}.{self.task}" if self.task else f"{self.camera}.crops"

    def __str__(self) -> str:
        return f"{self.where} refused: {self.message}"

    @property
    def outcome(self) -> str:
        """What is served instead (for the log)."""
        return "the other tasks are served" if self.task else \
            f"camera {self.camera} is served with crops 'overlap'"


def restrict(cfg: PerceptionConfig, caps: Any) -> PerceptionConfig:
    """`cfg` with what the model's family (photon_core.engine.Capabilities) does not serve
    taken out: such tasks are dropped and such a camera's crops mode falls back to "overlap",
    each listed in `refused` with the family's message. caps None: cfg unchanged."""
    if caps is None:
        return cfg
    refused, cams = [], []
    for c in cfg.cameras:
        keep = []
        for t in c.tasks:
            why = caps.skill_refusal(t.skill)
            if why:
                refused.append(Refusal(c.name, t.name, why))
            else:
                keep.append(t)
        crops = c.crops
        if crops != ADAPTIVE:
            why = caps.crops_refusal(crops)
        elif not all(caps.serves_crops(m) for m in LADDER):
            why = (f"{caps.name} does not support crops 'adaptive' (stepping between "
                   f"{', '.join(LADDER)}): it encodes the whole image")
        else:
            why = ""
        if why:
            refused.append(Refusal(c.name, "", why))
            crops = "overlap"
        cams.append(replace(c, tasks=tuple(keep), crops=crops))
    return replace(cfg, cameras=tuple(cams), refused=tuple(refused))


def new_refusals(old: PerceptionConfig | None, new: PerceptionConfig) -> list[Refusal]:
    """Refusals of `new` that `old` did not have already (a parameter update introducing
    an unsupported task is rejected; one refused at configure stays refused, quietly)."""
    before = {(r.camera, r.task, r.message) for r in (old.refused if old is not None else ())}
    return [r for r in new.refused if (r.camera, r.task, r.message) not in before]


# -- parsing ---------------------------------------------------------------------------------
def _as_bool(v: Any, where: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise ConfigError(f"{where}: expected true/false, got {v!r}")


def _as_int(v: Any, where: str, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and
                                                                   not v.is_integer()):
        raise ConfigError(f"{where}: expected an integer, got {v!r}")
    v = int(v)
    if lo is not None and v < lo:
        raise ConfigError(f"{where}: must be >= {lo}, got {v}")
    return v


def _as_float(v: Any, where: str, lo: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}: expected a number, got {v!r}")
    v = float(v)
    if lo is not None and v < lo:
        raise ConfigError(f"{where}: must be >= {lo}, got {v}")
    return v


MAX_PIXELS_LIMIT = 16384 * 16384   # max_pixels may not be raised past this (nor set to 0)
MAX_STRING_CHARS = 4096     # any string parameter (model path, topic, ...)
MAX_NAME_CHARS = 64         # camera and task names (they become parts of topic names)


def _as_str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{where}: expected a string, got {_short(v)}")
    if len(v) > MAX_STRING_CHARS:
        raise ConfigError(f"{where}: {len(v)} characters; the limit is {MAX_STRING_CHARS}")
    return v


def _short(v: Any) -> str:
    """repr(v), cut to 80 characters (error messages stay one readable line)."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > MAX_NAME_CHARS:
        raise ConfigError(f"{what} name {_short(name)} is not valid: use letters, digits and _, "
                          f"starting with a letter, at most {MAX_NAME_CHARS} characters (it "
                          "becomes part of topic names)")
    return name


def _check_topic(topic: str, where: str) -> None:
    """A topic name rclpy will accept (else the subscription fails only at activate or, for
    a parameter update, inside the parameter service)."""
    try:
        from rclpy.exceptions import InvalidTopicNameException
        from rclpy.validate_topic_name import validate_topic_name
    except ImportError:                          # offline tools without rclpy: a cheap check
        if not re.match(r"^[~/A-Za-z_{][A-Za-z0-9_/{}~]*$", topic) or "//" in topic \
                or (topic.endswith("/") and topic != "/"):
            raise ConfigError(f"{where}: {topic!r} is not a valid ROS topic name") from None
        return
    try:
        validate_topic_name(topic)
    except InvalidTopicNameException as e:
        reason = str(e).splitlines()[0].replace("Invalid topic name: ", "").rstrip(":")
        raise ConfigError(f"{where}: {topic!r} is not a valid ROS topic name ({reason})") from None


def _check_unique(names: list[str], what: str) -> None:
    seen = set()
    for n in names:
        if n in seen:
            raise ConfigError(f"{what} {n!r} is defined twice")
        seen.add(n)


def make_task(name: str, d: Mapping[str, Any], defaults: PerceptionConfig,
              where: str | None = None, caps: Any = None) -> TaskConfig:
    """One task entry (dict with TASK_KEYS) -> validated TaskConfig. 0 / empty = default.
    caps (photon_core.engine.Capabilities): a skill the model's family does not serve is
    refused with its message."""
    where = where or f"task {name!r}"
    _check_name(name, f"{where}:")
    unknown = sorted(set(d) - set(TASK_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; expected "
                          f"{', '.join(TASK_KEYS)}")
    skill = _as_str(d.get("skill", ""), f"{where}.skill").strip()
    if skill not in SKILLS:
        raise ConfigError(f"{where}: unknown skill {skill!r}; expected one of {', '.join(SKILLS)}")
    why = caps.skill_refusal(skill) if caps is not None else ""
    if why:
        raise ConfigError(f"{where}: {why}")
    every_n = _as_int(d.get("every_n", 0), f"{where}.every_n", 0)
    hz = _as_float(d.get("hz", 0.0), f"{where}.hz", 0.0)
    if every_n > 1 and hz > 0:
        raise ConfigError(f"{where}: set either every_n ({every_n}) or hz ({hz}), not both")
    deadline = _as_float(d.get("deadline_ms", 0.0), f"{where}.deadline_ms", 0.0)
    on_miss = _as_str(d.get("on_miss", "") or defaults.default_on_miss, f"{where}.on_miss")
    if on_miss not in ON_MISS:
        raise ConfigError(f"{where}: on_miss must be one of {', '.join(ON_MISS)}, got {on_miss!r}")
    max_objects = _as_int(d.get("max_objects", 0), f"{where}.max_objects", 0)
    max_tokens = _as_int(d.get("max_tokens", 0), f"{where}.max_tokens", 0)
    cfg = TaskConfig(
        name=name, skill=skill,
        object=_as_str(d.get("object", ""), f"{where}.object"),
        question=_as_str(d.get("question", ""), f"{where}.question"),
        caption_length=_as_str(d.get("caption_length", "") or "normal", f"{where}.caption_length"),
        every_n=max(1, every_n), hz=hz,
        deadline_ms=deadline or defaults.default_deadline_ms, on_miss=on_miss,
        max_objects=max_objects or defaults.default_max_objects,
        max_tokens=max_tokens or defaults.default_max_tokens)
    if skill == "caption" and cfg.caption_length not in CAPTION_LENGTHS:
        raise ConfigError(f"{where}: caption_length must be one of {', '.join(CAPTION_LENGTHS)}, "
                          f"got {cfg.caption_length!r}")
    try:
        cfg.to_task().validate(defaults.max_question_chars)
    except TaskError as e:
        raise ConfigError(f"{where}: {e}") from None
    return cfg


def tasks_from_specs(specs: Iterable[Any], defaults: PerceptionConfig,
                     camera: str = "", caps: Any = None) -> tuple[TaskConfig, ...]:
    """photon_ros/TaskSpec messages (SetTasks) -> validated TaskConfigs (all or nothing;
    caps: the model's family, see make_task)."""
    out = []
    for i, s in enumerate(specs):
        where = f"tasks[{i}] ({s.name!r})"
        d = {k: getattr(s, k) for k in TASK_KEYS}
        out.append(make_task(s.name, d, defaults, where, caps))
    _check_unique([t.name for t in out], f"camera {camera!r}: task" if camera else "task")
    return tuple(out)


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"front.topic": x} -> {"front": {"topic": x}} (dicts pass through)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = str(key).split(".")
        d = out
        for p in parts[:-1]:
            nxt = d.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"parameter {key!r} conflicts with {'.'.join(parts[:-1])!r}")
            d = nxt
        if isinstance(value, dict):
            d.setdefault(parts[-1], {}).update(_nest(value))
        else:
            d[parts[-1]] = value
    return out


def config_from_params(params: Mapping[str, Any]) -> PerceptionConfig:
    """Parameters (flat "front.people.skill" keys or nested dicts) -> PerceptionConfig."""
    p = _nest(params)
    kw: dict[str, Any] = {}
    for key, default in NODE_DEFAULTS.items():
        if key == "camera_topic" or key not in p:
            continue
        v = p[key]
        if key == "megakernel" and isinstance(v, bool):     # YAML on / off
            v = "on" if v else "off"
        if isinstance(default, bool):
            kw[key] = _as_bool(v, key)
        elif isinstance(default, int):
            kw[key] = _as_int(v, key, 0)
        elif isinstance(default, float):
            kw[key] = _as_float(v, key, 0.0)
        else:
            kw[key] = _as_str(v, key)
    if kw.get("default_on_miss", "cancel") not in ON_MISS:
        raise ConfigError(f"default_on_miss must be one of {', '.join(ON_MISS)}")
    if kw.get("engine", "auto") not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {kw['engine']!r}")
    if kw.get("megakernel", "auto") not in ("auto", "off"):
        from photon_core.engine import EngineOptions
        try:       # "on" | a megakernel_step.Variant string (the engine's own check)
            EngineOptions(megakernel=kw["megakernel"])
        except ValueError as e:
            raise ConfigError(f"megakernel: {e}") from None
    if not 1 <= kw.get("max_batch", 4) <= 8:
        raise ConfigError(f"max_batch must be in 1..8, got {kw['max_batch']}")
    for key, hi in (("default_max_objects", MAX_OBJECTS_LIMIT),
                    ("default_max_tokens", MAX_TOKENS_LIMIT),
                    ("max_question_chars", MAX_QUESTION_CHARS),
                    ("max_pixels", MAX_PIXELS_LIMIT)):
        if key in kw and not 1 <= kw[key] <= hi:
            raise ConfigError(f"{key} must be in 1..{hi}, got {kw[key]}")
    if kw.get("default_deadline_ms", 1.0) <= 0 or kw.get("on_demand_deadline_ms", 1.0) <= 0:
        raise ConfigError("default deadlines must be > 0 ms")
    defaults = PerceptionConfig(**kw)

    names = p.get("cameras", [])
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"cameras: expected a list of camera names, got {names!r}")
    names = [n for n in names if n]
    _check_unique(names, "camera")
    cameras = []
    for i, name in enumerate(names):
        _check_name(name, "camera")
        c = p.get(name)
        if not isinstance(c, dict):
            raise ConfigError(f"camera {name!r} is listed in cameras but has no settings "
                              f"({name}.topic, {name}.tasks, ...)")
        where = f"camera {name!r}"
        topic = _as_str(c.get("topic", ""), f"{where}.topic").strip()
        topic_param = f"{where}.topic"
        if i == 0 and p.get("camera_topic"):
            topic = _as_str(p["camera_topic"], "camera_topic").strip()
            topic_param = "camera_topic"
        if not topic:
            raise ConfigError(f"{where}: topic is empty")
        _check_topic(topic, topic_param)
        ctype = _as_str(c.get("type", "image"), f"{where}.type")
        if ctype not in CAMERA_TYPES:
            raise ConfigError(f"{where}: type must be one of {', '.join(CAMERA_TYPES)}, got {ctype!r}")
        task_names = c.get("tasks", [])
        if isinstance(task_names, str):
            task_names = [task_names]
        if not isinstance(task_names, (list, tuple)):
            raise ConfigError(f"{where}.tasks: expected a list of task names, got {task_names!r}")
        task_names = [t for t in task_names if t]
        _check_unique(task_names, f"{where}: task")
        tasks = []
        for t in task_names:
            d = c.get(t)
            if not isinstance(d, dict):
                raise ConfigError(f"{where}: task {t!r} is listed in tasks but not defined "
                                  f"({name}.{t}.skill, ...)")
            tasks.append(make_task(t, d, defaults, f"{where} task {t!r}"))
        crops = _as_str(c.get("crops", "") or "overlap", f"{where}.crops").strip()
        try:
            if crops != ADAPTIVE:
                parse_crops(crops)
        except ValueError:
            raise ConfigError(f"{where}: crops must be one of {', '.join(CROP_MODES)}, "
                              f"{ADAPTIVE} (N: at most N local crops, 1-{MAX_CROP_BUDGET}), got "
                              f"{_short(crops)}") from None
        width = _as_int(c.get("width", 0), f"{where}.width", 0)
        height = _as_int(c.get("height", 0), f"{where}.height", 0)
        if (width == 0) != (height == 0):
            raise ConfigError(f"{where}: give both width and height (the frames' size) or "
                              f"neither, got {width}x{height}")
        if width * height > MAX_PIXELS_LIMIT:
            raise ConfigError(f"{where}: {width}x{height} is larger than any frame served")
        cameras.append(CameraConfig(
            name=name, topic=topic, type=ctype,
            qos_reliable=_as_bool(c.get("qos_reliable", False), f"{where}.qos_reliable"),
            qos_depth=_as_int(c.get("qos_depth", 1), f"{where}.qos_depth", 1),
            crops=crops, width=width, height=height, tasks=tuple(tasks)))
    extra = {k: v for k, v in p.items()
             if k not in NODE_DEFAULTS and k != "cameras" and k not in names
             and k not in ("use_sim_time", "auto_activate", "params_file", "config",
                           "start_type_description_service", "qos_overrides")}
    return replace(defaults, cameras=tuple(cameras), extra=extra)


def params_from_file(path: str | Path, node_name: str | None = None) -> dict[str, Any]:
    """The ros__parameters of a ROS 2 parameters file: `/**` first, then the entry named
    `node_name` (or, without a name, every other entry) on top."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if "ros__parameters" in doc:
        return dict(doc["ros__parameters"] or {})
    merged: dict[str, Any] = {}
    keys = sorted(doc, key=lambda k: k != "/**")
    for key in keys:
        entry = doc[key]
        bare = str(key).lstrip("/").split("/")[-1]
        if key != "/**" and node_name is not None and bare != node_name:
            continue
        if not isinstance(entry, dict) or "ros__parameters" not in entry:
            raise ConfigError(f"{path}: entry {key!r} has no ros__parameters")
        merged = {**merged, **_nest(entry["ros__parameters"] or {})}
    return merged


def load_config(path: str | Path, node_name: str | None = None,
                overrides: Mapping[str, Any] | None = None) -> PerceptionConfig:
    """Read and validate config/perception.yaml (ROS 2 parameters file format)."""
    params = params_from_file(path, node_name)
    if overrides:
        params = {**params, **_nest(overrides)}
    try:
        return config_from_params(params)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"front": {"topic": x}} -> {"front.topic": x} (the form ROS parameters take)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out

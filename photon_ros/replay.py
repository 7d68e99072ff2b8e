"""`photon replay IN_BAG --params config/perception.yaml --out OUT_BAG [--mode offline|realtime]`

Reads the camera topics of a rosbag2 bag (mcap or sqlite3), runs the node's task
configuration on them and writes every result message (DetectionArray, PointArray, Answer,
with the source image header) into a new bag (mcap by default) that `ros2 bag play` and
Foxglove open. Camera topics are found from the configuration (`<camera>.topic`), or given
with `--camera NAME=TOPIC`.

offline (default): every frame, every due task, run to the end through
  `PerceptionPipeline.process_frame` (the node's synchronous path). Deterministic: the same
  bag in gives the same output bag, byte for byte on CPU; each result is logged at its
  source frame's recorded time. For that the wall-clock timing fields (engine_ms, queue_ms,
  latency_ms) are written as 0 by default; the measured latencies still go to the printed
  summary. `--measured-timing` writes the measurements into the results instead (then the
  bag differs run to run in those three fields only).
realtime: frames arrive at their recorded timing and the deadline scheduler
  (photon_core.scheduler: calibrated cost model, latest frame wins, admission, on_miss)
  decides what runs, as in the node (the same `live_pipeline.build_live_pipeline`: HookedEngine,
  calibration, scheduler, frame sequencing; the same task specs and publishing
  rules). The scheduler's clock is the recording's timeline driven by the wall clock: engine
  work takes its real time (x --rate: with --rate 4 frames arrive 4x faster, i.e. the engine
  looks 4x slower), idle time until the next frame is skipped. Each result is logged at its
  frame's recorded time + its latency (recording timeline). Drops (superseded, skipped,
  deadline-cancelled, engine errors, stale frames) are counted. Timing fields are measured
  (`--zero-timing` writes them as 0).

Both modes write a summary: `replay_summary.json` inside the output bag folder and one
diagnostic_msgs/DiagnosticArray on /photon/replay/summary at the end of the bag.
A damaged input bag (truncated, corrupt) stops the replay with a clear error; everything
written until then stays in a properly closed output bag (exit status 3).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .bag_io import (COMPRESSED_IMAGE, IMAGE, BagError, BagReader, BagWriter, canonical_cdr,
                     deserialize, msgtype_of, serialize)
from .cli import parse_pairs
from .deferred_interrupt import DeferredInterrupt
from .progress import progress_bar
from .task_config import restrict

SUMMARY_TOPIC = "/photon/replay/summary"
SUMMARY_SIDECAR = "replay_summary.json"
MODES = ("offline", "realtime")
EXIT_BAG_DAMAGED = 3


RESULT_KIND = {"detect": "detections", "point": "points", "query": "answer", "caption": "answer"}


def result_topic(camera: str, skill: str, namespace: str = "") -> str:
    """The node's topic for a result: `<camera>/detections|points|answer`, relative to the
    node namespace (every task of a camera shares its skill's topic; TaskInfo says which)."""
    ns = "/" + namespace.strip("/") if namespace.strip("/") else ""
    return f"{ns}/{camera}/{RESULT_KIND[skill]}"


@dataclass
class CameraInput:
    name: str
    topic: str
    msgtype: str


@dataclass
class ReplayStats:
    mode: str
    in_bag: str
    out_bag: str
    model_id: str = ""
    frames: int = 0                  # camera messages read
    frames_processed: int = 0        # frames with at least one due task run
    results: int = 0
    per_task: Counter = field(default_factory=Counter)        # "camera/task" -> results
    latency_ms: dict = field(default_factory=lambda: defaultdict(list))   # "camera/task" -> [ms]
    drops: Counter = field(default_factory=Counter)           # reason -> count
    scheduler: dict = field(default_factory=dict)
    clock_jumps: int = 0
    late: int = 0                    # realtime: results published after their deadline
    error: str | None = None
    warning: str | None = None
    refused: list = field(default_factory=list)   # tasks the model's family does not serve
    wall_s: float = 0.0
    rate: float = 1.0
    timing_zeroed: bool = False      # the result messages' timing fields were written as 0

    @property
    def dropped(self) -> int:
        return sum(self.drops.values())

    def to_json(self) -> dict:
        def pct(xs, q):
            import numpy as np
            return round(float(np.percentile(xs, q)), 3) if xs else None
        lat = {k: {"n": len(v), "p50": pct(v, 50), "p99": pct(v, 99)}
               for k, v in sorted(self.latency_ms.items())}
        allv = [x for v in self.latency_ms.values() for x in v]
        return {"mode": self.mode, "in_bag": self.in_bag, "out_bag": self.out_bag,
                "model_id": self.model_id, "frames": self.frames,
                "frames_processed": self.frames_processed, "results": self.results,
                "per_task": dict(sorted(self.per_task.items())), "latency_ms": lat,
                "latency_ms_all": {"n": len(allv), "p50": pct(allv, 50), "p99": pct(allv, 99)},
                "dropped": self.dropped, "drops": dict(sorted(self.drops.items())),
                "scheduler": self.scheduler, "clock_jumps_back": self.clock_jumps,
                "late_results": self.late,
                "rate": self.rate, "timing_zeroed": self.timing_zeroed, "error": self.error,
                "warning": self.warning, "refused": list(self.refused),
                "wall_s": round(self.wall_s, 3)}


def find_cameras(config, bag_topics: dict[str, str], overrides: dict[str, str] | None = None
                 ) -> list[CameraInput]:
    """The configured cameras whose topics the bag has (type checked)."""
    overrides = overrides or {}
    for name in overrides:
        try:
            config.camera(name)
        except KeyError:
            raise BagError(f"--camera {name}=...: no camera {name!r} in the configuration "
                           f"(cameras: {', '.join(config.camera_names) or 'none'})") from None
    cams, missing = [], []
    for c in config.cameras:
        topic = overrides.get(c.name, c.topic)
        if topic not in bag_topics:
            missing.append(f"{c.name} ({topic})")
            continue
        ty = bag_topics[topic]
        if ty not in (IMAGE, COMPRESSED_IMAGE):
            raise BagError(f"camera {c.name!r}: topic {topic!r} in the bag has type {ty!r}; "
                           f"replay reads {IMAGE} or {COMPRESSED_IMAGE}")
        cams.append(CameraInput(c.name, topic, ty))
    if not cams:
        have = ", ".join(f"{t} [{ty}]" for t, ty in sorted(bag_topics.items())) or "nothing"
        raise BagError(f"none of the configured camera topics is in the bag "
                       f"(configured: {', '.join(missing) or 'no cameras'}; the bag has: {have}); "
                       f"map one with --camera NAME=TOPIC")
    return cams


def _read_frame(m, copy_images, max_pixels: int, stats):
    """One camera message -> (image msg, RGB array, stamp ns), or None (counted as a drop)
    when it cannot be converted. Copies the raw message into the output bag when asked."""
    from .image_conversion import ImageConversionError

    if copy_images is not None:
        copy_images.write_raw(m.topic, m.msgtype, m.raw, m.log_time_ns)
    img_msg = deserialize(m.raw, m.msgtype)
    try:
        rgb = _to_rgb(img_msg, m.msgtype, max_pixels)
    except ImageConversionError as e:
        stats.drops[f"image_{e.reason}"] += 1
        return None
    return img_msg, rgb, img_msg.header.stamp.sec * 1_000_000_000 + img_msg.header.stamp.nanosec


def _to_rgb(msg, msgtype: str, max_pixels: int):
    from .image_conversion import compressed_to_rgb, image_to_rgb

    if msgtype == COMPRESSED_IMAGE:
        return compressed_to_rgb(msg, max_pixels=max_pixels)
    return image_to_rgb(msg, max_pixels=max_pixels)


def _stamp_s(header) -> float:
    return header.stamp.sec + header.stamp.nanosec * 1e-9


class _ResultSink:
    """Writes result messages, keeps the stats, zeroes timing when asked."""

    def __init__(self, writer: BagWriter, stats: ReplayStats, zero_timing: bool,
                 namespace: str = ""):
        self.w, self.stats, self.zero, self.ns = writer, stats, zero_timing, namespace

    def write(self, camera: str, msg: Any, log_time_ns: int) -> None:
        key = f"{camera}/{msg.task.name}"
        self.stats.per_task[key] += 1
        self.stats.latency_ms[key].append(float(msg.timing.latency_ms))
        if self.zero:
            msg.timing.engine_ms = msg.timing.queue_ms = msg.timing.latency_ms = 0.0
        self.w.write(result_topic(camera, msg.task.skill, self.ns), msg, log_time_ns)
        self.stats.results += 1


def _frame_ticket(accept, camera: str, stamp_s: float, stats: ReplayStats):
    """Number a frame as the node does (`accept`: live_pipeline's FrameSequencer.next or
    LivePipeline.accept): a clock jump back is counted, a stale frame is dropped (None)."""
    from .live_pipeline import JUMP, STALE

    ticket = accept(camera, stamp_s)
    if ticket.event == STALE:
        stats.drops["stale_frames"] += 1
        return None
    if ticket.event == JUMP:
        stats.clock_jumps += 1
    return ticket


# -- offline ---------------------------------------------------------------------------
def _offline(reader: BagReader, cams: list[CameraInput], pipeline, sink: _ResultSink,
             stats: ReplayStats, max_pixels: int, bar, max_frames: int | None,
             copy_images: BagWriter | None, interrupt: DeferredInterrupt) -> None:
    from .live_pipeline import FrameSequencer

    by_topic = {c.topic: c for c in cams}
    frames = FrameSequencer(on_jump=pipeline.cadence.reset)
    for m in reader.messages(list(by_topic)):
        interrupt.check()
        if max_frames is not None and stats.frames >= max_frames:
            break
        cam = by_topic[m.topic]
        stats.frames += 1
        if bar is not None:
            bar.update(1)
        frame = _read_frame(m, copy_images, max_pixels, stats)
        if frame is None:
            continue
        img_msg, rgb, stamp_ns = frame
        ticket = _frame_ticket(frames.next, cam.name, stamp_ns / 1e9, stats)
        if ticket is None:
            continue
        t0 = time.perf_counter()
        try:
            out = pipeline.process_frame(cam.name, img_msg.header, rgb, ticket.index)
        except Exception as e:  # noqa: BLE001 - counted, reported, replay goes on
            stats.drops["engine_error"] += 1
            stats.warning = (f"engine error on {cam.name} frame {ticket.index}: "
                             f"{type(e).__name__}: {e}")
            continue
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        if out:
            stats.frames_processed += 1
        for msg in out:
            # the synchronous path publishes a frame's results together once it is done:
            # stamp -> recorded arrival, plus the processing time
            msg.timing.latency_ms = (m.log_time_ns - stamp_ns) / 1e6 + elapsed_ms
            sink.write(cam.name, msg, m.log_time_ns)


# -- realtime --------------------------------------------------------------------------
class SkipIdleClock:
    """The recording's timeline, driven by the wall clock: engine work takes the time it
    really takes (times `scale`: with scale 4 the engine looks 4x slower, i.e. the frames
    arrive 4x faster), waiting for the next recorded frame takes none."""

    def __init__(self, scale: float = 1.0):
        self._t0 = time.perf_counter()
        self._skipped = 0.0
        self.scale = float(scale)

    def now(self) -> float:
        return (time.perf_counter() - self._t0) * self.scale + self._skipped

    def skip_to(self, t: float) -> None:
        now = self.now()
        if t > now:
            self._skipped += t - now


def _realtime(reader: BagReader, cams: list[CameraInput], pipeline, model, config,
              sink: _ResultSink, stats: ReplayStats, max_pixels: int, bar, rate: float,
              max_frames: int | None, copy_images: BagWriter | None,
              interrupt: DeferredInterrupt, calibrate: bool = True) -> None:
    from photon_core.scheduler.request import Status

    from .live_pipeline import build_live_pipeline

    clock = SkipIdleClock(rate)
    by_topic = {c.topic: c for c in cams}
    frames: dict[tuple, tuple] = {}     # (camera, key) -> header, w, h, log_ns, arrival
    status_names = {Status.SUPERSEDED: "superseded", Status.SKIPPED: "skipped",
                    Status.DEADLINE: "deadline", Status.ERROR: "engine_error",
                    Status.CANCELLED: "cancelled"}

    def on_result(o) -> None:
        header, w, h, log_ns, arrival, stamp_ns = frames[(o.stream, o.stamp)]
        partial = (o.status is Status.DEADLINE and o.result is not None
                   and o.result.task.skill in ("query", "caption"))
        if (o.status is Status.DONE or partial) and o.result is not None:
            # as the node: published when done (a cut-short answer at its deadline too);
            # the result's bag time is its frame's recorded arrival + the time it took
            t_ns = log_ns + int((o.end_time - arrival) * 1e9)
            enc = float(o.timings.get("encode_ms", 0.0))
            msg = live.pipeline.message_for(o.stream, o.task_name, o.result, header, w, h,
                                            engine_ms=o.engine_ms + enc, queue_ms=o.queue_ms,
                                            latency_ms=(t_ns - stamp_ns) / 1e6)
            sink.write(o.stream, msg, t_ns)
        if o.status is not Status.DONE:
            stats.drops[status_names.get(o.status, str(o.status))] += 1
        if o.missed_deadline and o.status is Status.DONE:
            stats.late += 1

    # the node's live pipeline (HookedEngine, calibration, scheduler, frame sequencing), on
    # the recording's clock and stepped here instead of on a thread
    live = build_live_pipeline(config, model, clock=clock, threaded=False, calibrate=calibrate,
                               on_result=on_result, model_id=pipeline.model_id)
    sched = live.scheduler
    it = reader.messages(list(by_topic))
    t_first: int | None = None
    clock_origin = clock.now()

    def next_frame():
        nonlocal t_first
        if max_frames is not None and stats.frames >= max_frames:
            return None
        m = next(it, None)
        if m is None:
            return None
        stats.frames += 1
        if t_first is None:
            t_first = m.log_time_ns
        return m, clock_origin + (m.log_time_ns - t_first) / 1e9

    def submit(m, arrival: float) -> None:
        cam = by_topic[m.topic]
        if bar is not None:
            bar.update(1)
        frame = _read_frame(m, copy_images, max_pixels, stats)
        if frame is None:
            return
        img_msg, rgb, stamp_ns = frame
        ticket = _frame_ticket(live.accept, cam.name, stamp_ns / 1e9, stats)
        if ticket is None or not ticket.due:
            return
        stats.frames_processed += 1
        h, w = rgb.shape[:2]
        frames[(cam.name, ticket.key)] = (img_msg.header, w, h, m.log_time_ns, arrival, stamp_ns)
        live.submit(cam.name, ticket, rgb, arrival)

    pending = next_frame()
    while pending is not None or sched.has_work():
        interrupt.check()
        now = clock.now()
        while pending is not None and pending[1] <= now:
            submit(*pending)
            pending = next_frame()
        if sched.has_work():
            sched.step()
        elif pending is not None:
            clock.skip_to(pending[1])
    stats.scheduler = sched.metrics()


# -- driver ----------------------------------------------------------------------------
def _summary_msg(stats: ReplayStats):
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

    j = stats.to_json()
    kv = [KeyValue(key=k, value=str(j[k])) for k in
          ("mode", "model_id", "frames", "frames_processed", "results", "dropped", "rate", "error")]
    kv += [KeyValue(key=f"drops.{k}", value=str(v)) for k, v in j["drops"].items()]
    kv += [KeyValue(key=f"results.{k}", value=str(v)) for k, v in j["per_task"].items()]
    level = DiagnosticStatus.ERROR if stats.error else \
        DiagnosticStatus.WARN if stats.dropped else DiagnosticStatus.OK
    st = DiagnosticStatus(level=level, name="photon replay", hardware_id=stats.model_id,
                          message=stats.error or f"{stats.results} results, {stats.dropped} dropped",
                          values=kv)
    return DiagnosticArray(status=[st])


def replay(in_bag, out_bag, config, model, *, mode: str = "offline", model_id: str | None = None,
           camera_topics: dict[str, str] | None = None, rate: float = 1.0,
           zero_timing: bool | None = None, storage: str = "mcap", overwrite: bool = False,
           progress: bool = False, max_frames: int | None = None, with_images: bool = False,
           calibrate: bool = True, namespace: str = "",
           log: Callable[[str], None] | None = None) -> ReplayStats:
    """Replay `in_bag` through `config` + `model` into `out_bag`; returns the stats.
    A damaged input bag ends the replay early with stats.error set (results kept).
    zero_timing: write the timing fields as 0; None (default) = offline yes (byte-for-byte
    reproducible output), realtime no."""
    from .pipeline import PerceptionPipeline

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if zero_timing is None:
        zero_timing = mode == "offline"
    log = log or (lambda s: print(s, file=sys.stderr))
    # what the model's family does not serve (e.g. Gemma 4: detect, point) is refused with
    # its message, as the node does; the other tasks are replayed
    config = restrict(config, model.capabilities if model is not None else None)
    pipeline = PerceptionPipeline(config, model, model_id=model_id)
    stats = ReplayStats(mode, str(in_bag), str(out_bag), model_id=pipeline.model_id, rate=rate,
                        timing_zeroed=bool(zero_timing), refused=[str(r) for r in config.refused])
    for r in config.refused:
        log(f"photon replay: {r} ({r.outcome})")
    t0 = time.perf_counter()
    with BagReader(in_bag) as reader:
        if reader.warning:
            stats.warning = reader.warning
            log(f"photon replay: warning: {reader.warning}")
        cams = find_cameras(config, reader.topics, camera_topics)
        total = reader.topic_count([c.topic for c in cams])
        if max_frames is not None:
            total = min(total, max_frames)
        with BagWriter(out_bag, storage=storage, overwrite=overwrite) as writer:
            sink = _ResultSink(writer, stats, zero_timing, namespace)
            bar = progress_bar(total, progress, f"replay {mode}", "frame")
            try:
                # a signal is taken between frames (see deferred_interrupt), the output bag
                # then closes as "interrupted"
                with DeferredInterrupt() as interrupt:
                    if mode == "offline":
                        _offline(reader, cams, pipeline, sink, stats, config.max_pixels, bar,
                                 max_frames, writer if with_images else None, interrupt)
                    else:
                        _realtime(reader, cams, pipeline, model, config, sink, stats,
                                  config.max_pixels, bar, rate, max_frames,
                                  writer if with_images else None, interrupt,
                                  calibrate=calibrate)
            except BagError as e:
                stats.error = str(e)
            except KeyboardInterrupt:
                stats.error = "interrupted"
            finally:
                if bar is not None:
                    bar.close()
                stats.wall_s = time.perf_counter() - t0
                end_ns = (reader.last_time_ns or 0) + 1
                try:
                    summ = _summary_msg(stats)
                    writer.write_raw(SUMMARY_TOPIC, msgtype_of(summ),
                                     canonical_cdr(serialize(summ), msgtype_of(summ)), end_ns)
                except Exception as e:  # noqa: BLE001 - the results matter more
                    log(f"photon replay: summary message not written: {e}")
    sj = stats.to_json()
    if zero_timing:      # the sidecar must be reproducible too
        sj.pop("wall_s")
        sj["latency_ms"] = sj["latency_ms_all"] = "not recorded (timing fields zeroed)"
        sj["scheduler"] = {}
    Path(out_bag, SUMMARY_SIDECAR).write_text(json.dumps(sj, indent=1, default=str) + "\n")
    return stats


def load_model_for(spec: str, device: str = "cpu", dtype: str = "fp32", engine: str = "auto",
                   deterministic: bool = False, megakernel: str = "auto"):
    from photon_core import load_engine
    from photon_core.engine import EngineOptions

    return load_engine(spec, device=device, dtype=dtype, engine=engine,
                       deterministic=deterministic, progress=sys.stderr.isatty(),
                       options=EngineOptions(megakernel=megakernel))


def print_summary(stats: ReplayStats, out=None) -> None:
    out = out or sys.stdout
    j = stats.to_json()
    print(f"replay ({j['mode']}): {j['frames']} frames, {j['results']} results, "
          f"{j['dropped']} dropped, {j['wall_s']:.1f} s; model {j['model_id']}", file=out)
    for k, n in j["per_task"].items():
        lat = j["latency_ms"].get(k, {})
        print(f"  {k}: {n} results, latency p50 {lat.get('p50')} ms, p99 {lat.get('p99')} ms",
              file=out)
    if j["drops"]:
        print("  drops: " + ", ".join(f"{k} {v}" for k, v in j["drops"].items()), file=out)
    print(f"  result bag: {j['out_bag']}", file=out)
    if j["timing_zeroed"]:
        print("  (timing fields in the result bag written as 0 for byte-for-byte reproducible "
              "output; latencies above are this run's measurements; --measured-timing "
              "records them in the bag)", file=out)


# -- command line ----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bag", help="input rosbag2 (folder, .mcap or .db3)")
    p.add_argument("--params", required=True, help="node parameters file (config/perception.yaml)")
    p.add_argument("--out", required=True, help="output bag folder")
    p.add_argument("--mode", choices=MODES, default="offline")
    p.add_argument("--model", default=None, help="model folder or hub id (default: the params file's)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--engine", default=None, choices=["auto", "reference", "fast"],
                   help="default: the params file's (auto = GPU fast path on CUDA)")
    p.add_argument("--camera", action="append", default=[], metavar="NAME=TOPIC",
                   help="read camera NAME from TOPIC instead of its configured topic")
    p.add_argument("--rate", type=float, default=1.0,
                   help="realtime: playback speed factor (>1: frames arrive faster, i.e. the "
                        "engine looks that much slower; latencies are on the recording's timeline)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--zero-timing", dest="timing", action="store_const", const="zero",
                   help="write the timing fields as 0 (the offline default: byte-for-byte "
                        "reproducible output)")
    g.add_argument("--measured-timing", dest="timing", action="store_const", const="measured",
                   help="write the measured timing (the realtime default); offline output "
                        "then differs run to run in engine_ms/queue_ms/latency_ms")
    p.add_argument("--namespace", default="", help="the node's namespace (result topics "
                   "are <namespace>/<camera>/detections|points|answer)")
    p.add_argument("--storage", choices=["mcap", "sqlite3"], default="mcap")
    p.add_argument("--with-images", action="store_true", help="copy the camera topics too")
    p.add_argument("--max-frames", type=int, default=None)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def main(args) -> int:
    from dataclasses import replace

    from .task_config import load_config

    config = load_config(args.params)
    config = replace(config, device=args.device or config.device,
                     dtype=args.dtype or config.dtype, engine=args.engine or config.engine)
    spec = args.model or config.model
    if not spec:
        raise ValueError("no model: pass --model PATH_OR_ID or set `model` in the params file")
    cams = parse_pairs(args.camera, "=", "--camera", "NAME=TOPIC")
    # offline output is meant to repeat byte for byte: on the GPU fast path that needs the
    # deterministic GEMVs (no split-K atomics); realtime follows the params file
    model = load_model_for(spec, config.device, config.dtype, config.engine,
                           deterministic=args.mode == "offline" or config.deterministic,
                           megakernel=config.megakernel)
    stats = replay(args.bag, args.out, config, model, mode=args.mode, camera_topics=cams,
                   rate=args.rate, zero_timing={"zero": True, "measured": False}.get(args.timing),
                   storage=args.storage,
                   overwrite=args.overwrite, progress=not args.no_progress and sys.stderr.isatty(),
                   max_frames=args.max_frames, with_images=args.with_images,
                   namespace=args.namespace)
    print_summary(stats)
    if stats.error:
        print(f"photon replay: error: {stats.error}; the {stats.results} results written "
              f"before it are in {args.out}", file=sys.stderr)
        return EXIT_BAG_DAMAGED
    return 0

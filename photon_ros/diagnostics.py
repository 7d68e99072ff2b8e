"""The node's /diagnostics: one status for the node (lifecycle state, model, counters,
scheduler metrics) and one per camera (rates, latency percentiles, drop counters, problems)."""
from __future__ import annotations

import time

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from photon_core.scheduler.crop_ladder import LADDER
from photon_ros.camera_stats import WINDOW_S
from photon_ros.task_config import ADAPTIVE
from photon_ros.transport_loss import loss_problem

STALE_INPUT_S = 3.0       # a camera warns when active and it sent nothing for this long
# tasks_submitted = results_published + superseded + skipped + cancelled + deadline_cancelled
#                   + error.engine + unpublished_at_shutdown (+ the ones still open)
CAMERA_COUNTERS = ("frames_in", "frames_processed", "results_published", "tasks_submitted",
                   "superseded", "skipped", "deadline_misses", "cancelled", "deadline_cancelled",
                   "errors", "clock_jumps_back", "stale_frames", "qos_incompatible",
                   # results that ended after the ROS context did (shutdown by a signal)
                   "unpublished_at_shutdown",
                   # frames the publishers sent that never reached the callback (transport_loss.py)
                   "frames_lost_in_transport", "transport.sequence_gaps",
                   "transport.rmw_message_lost", "transport.no_sequence_number",
                   "transport.duplicates")
SCHEDULER_KEYS = ("submitted", "done", "late", "superseded", "skipped", "deadline_misses",
                  "errors", "waiting", "running")


# engine fallbacks (FastEngine.fallbacks) that turn the node's status to WARN: the engine
# serves, slower than it could (a megakernel fallback is reported, not warned: it is the
# normal case for a family without a megakernel lowering)
WARN_FALLBACKS = {"encoder_capture_errors": "encode layouts without a CUDA graph",
                  "prefill_capture_errors": "prompt buckets without a CUDA graph",
                  "encoder_eager_encodes": "frames encoded without a graph (more frame "
                                           "layouts than the encoder keeps graphs for)"}


def node_status(name: str, state: str, model: str, model_loaded: bool, counts: dict,
                scheduler=None, engine=None) -> DiagnosticStatus:
    values = {"state": state, "model": model, "model_loaded": str(model_loaded).lower(),
              **{k: str(v) for k, v in sorted(counts.items())}}
    if scheduler is not None:
        try:
            m = scheduler.metrics()
            for k in SCHEDULER_KEYS:
                values[f"scheduler.{k}"] = str(m.get(k, ""))
        except Exception:  # noqa: BLE001 - the scheduler may be stopping
            pass
    problems = []
    fallbacks = getattr(engine, "fallbacks", None)
    if fallbacks is not None:
        try:
            for k, v in fallbacks().items():
                values[f"engine.{k}"] = str(v)
                if k in WARN_FALLBACKS and v:
                    problems.append(f"engine: {v} {WARN_FALLBACKS[k]}")
        except Exception:  # noqa: BLE001 - the engine may be closing
            pass
    return DiagnosticStatus(name=f"{name}: node", hardware_id=name,
                            level=DiagnosticStatus.WARN if problems else DiagnosticStatus.OK,
                            message="; ".join([state] + problems),
                            values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])


def _fmt(v) -> str:
    return "none" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def camera_status(name: str, camera: str, topic: str, snap: dict, active: bool,
                  health=None, crops: str = "", cheaper_crops: tuple = ()) -> DiagnosticStatus:
    """`health`: the scheduler's StreamHealth of this camera (stream_health()[camera]) or
    None (no scheduler, or it has not seen the camera yet). `crops`: the camera's crop mode
    ("" = the family has none); `cheaper_crops`: the cheaper modes its family serves, named
    in the message when the scheduler cannot meet the camera's deadlines."""
    c = snap["counts"]
    vals = {"input_fps": f"{snap['input_fps']:.2f}",
            "processed_fps": f"{snap['processed_fps']:.2f}",
            "latency_p50_ms": f"{snap['latency_p50_ms']:.2f}",
            "latency_p99_ms": f"{snap['latency_p99_ms']:.2f}"}
    vals.update({k: str(c.get(k, 0)) for k in CAMERA_COUNTERS})
    vals.update({k: str(v) for k, v in sorted(c.items()) if k.startswith("error.")})
    problems = []
    if active and snap["since_input_s"] is not None and snap["since_input_s"] > STALE_INPUT_S:
        problems.append(f"no frames for {snap['since_input_s']:.0f} s")
    elif active and snap["since_input_s"] is None:
        problems.append("no frames yet")
    if c.get("qos_incompatible"):
        problems.append("incompatible QoS publisher")
    w = snap.get("transport_window")
    lost = loss_problem(w, w["received"], WINDOW_S) if w else None
    if lost is not None:
        problems.append(lost)
    if c.get("errors"):
        problems.append(f"{c['errors']} bad frames/errors")
    if health is not None:
        for k in ("result_rate_hz", "skipped_frac", "since_last_result_s"):
            vals[f"scheduler.{k}"] = _fmt(getattr(health, k, None))
        vals["scheduler.health"] = str(health.level)
        if active and health.level == "warn":
            problems.append(f"scheduler: {health.reason}")
            if cheaper_crops and health.skipped_frac > 0:
                problems.append(f"crops {crops}: a cheaper mode encodes faster "
                                f"({' or '.join(cheaper_crops)})")
    if crops:
        vals["crops"] = crops
    return DiagnosticStatus(name=f"{name}: camera {camera}", hardware_id=topic,
                            level=DiagnosticStatus.WARN if problems else DiagnosticStatus.OK,
                            message="; ".join(problems) or "ok",
                            values=[KeyValue(key=k, value=v) for k, v in vals.items()])


def crop_advice(caps, crops: str, ladder=None) -> tuple[str, tuple]:
    """(the camera's crop mode, or "" for a family without crop modes - "adaptive" with the
    scheduler's current mode, `ladder`: its CropLadder -; the cheaper modes the family
    serves: for the full "overlap", a budget of 4 local crops and the global view; none for
    an adaptive camera, which steps down by itself)."""
    if caps is None or not caps.serves_crops("global"):
        return "", ()
    if crops == ADAPTIVE:
        level = min(getattr(ladder, "level", 0), len(LADDER) - 1)
        return f"{ADAPTIVE} (now {LADDER[level]})", ()
    cheaper = LADDER[1:] if crops == LADDER[0] else \
        LADDER[-1:] if crops.startswith("overlap:") else ()
    return crops, cheaper


def publish_diagnostics(node) -> None:
    """Timer callback (~1 Hz) of the perception node."""
    try:
        node.cameras.check_topics()
    except Exception as e:  # noqa: BLE001
        node.get_logger().debug(f"topic check failed: {e}")
    now = time.monotonic()
    cfg, live = node.config, node.live
    name = node.get_fully_qualified_name()
    state = "active" if node.active else ("inactive" if cfg is not None else "unconfigured")
    arr = DiagnosticArray()
    arr.header.stamp = node.get_clock().now().to_msg()
    arr.status.append(node_status(name, state, cfg.model if cfg else "",
                                  live is not None and live.model is not None, dict(node.counts),
                                  live.scheduler if live is not None else None,
                                  live.model if live is not None else None))
    health = {}
    if live is not None and live.scheduler is not None:
        try:
            health = live.scheduler.stream_health()
        except Exception as e:  # noqa: BLE001 - the scheduler may be stopping
            node.get_logger().debug(f"stream health failed: {e}")
    caps = getattr(live.model, "capabilities", None) if live is not None else None
    ladder = getattr(live.scheduler, "crop_ladder", None) if live is not None else None
    for st in node.cameras.all():
        topic, crops = "", ""
        if cfg is not None:
            try:
                topic, crops = cfg.camera(st.name).topic, cfg.camera(st.name).crops
            except KeyError:
                pass
        arr.status.append(camera_status(name, st.name, topic, st.stats.snapshot(now), node.active,
                                        health.get(st.name), *crop_advice(caps, crops, ladder)))
    node.diag_pub.publish(arr)

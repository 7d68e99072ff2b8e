"""`photon demo [--model PATH_OR_ID]`: the README's main job, end to end on one machine.

1. writes the synthetic sample bag (640x480 camera, moving car/person/ball) into OUT/sample_bag;
2. loads the model: the given folder or Hugging Face id (real Moondream 2 weights), else
   the params file's `model`, else a tiny random test model written into OUT/test_model
   (said plainly: its answers are meaningless, only the plumbing is real);
3. replays the bag offline through the node's pipeline with config/perception.yaml into
   OUT/results (an mcap rosbag2 bag of DetectionArray / PointArray / Answer);
4. writes the report (OUT/report, photon_ros.demo_report: messages per result topic, per-task
   results and latency, annotated frames, latency histogram, detections over time) and
   prints a short summary: results per task, latency p50/p99, where everything is.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_OUT = "out/demo"
TINY_NOTE = ("TINY RANDOM TEST MODEL: no usable Moondream 2 weights, so the results below "
             "come from random weights. Their boxes, points and captions are MEANINGLESS; only "
             "the plumbing (bag -> pipeline -> result bag -> report) is real. Pass "
             "--model /path/to/moondream2 or --model vikhyatk/moondream2 for real results.")


def default_params() -> Path | None:
    """config/perception.yaml of the checkout, else of the installed share folder."""
    cands = [Path(__file__).resolve().parent.parent / "config" / "perception.yaml",
             Path(sys.prefix) / "share" / "photon_ros" / "config" / "perception.yaml"]
    return next((p for p in cands if p.is_file()), None)


def load_demo_model(spec: str | None, out: Path, device: str, dtype: str, say):
    """-> (model, is_tiny). A given model that cannot be loaded falls back to the tiny one,
    loudly. A given folder that holds a random test model (make-test-model) counts as tiny."""
    from photon_core import load_model

    if spec:
        say(f"loading model {spec} ...")
        try:
            m = load_model(spec, device=device, dtype=dtype, progress=sys.stderr.isatty())
            return m, bool(getattr(m, "test_model_note", None))
        except Exception as e:  # noqa: BLE001 - missing folder, no network, bad files
            say(f"could not load model {spec!r}: {type(e).__name__}: {e}")
            say("falling back to the tiny random test model")
    from photon_core.moondream.test_model import make_test_model

    tiny = out / "test_model"
    if not (tiny / "model.safetensors").is_file():
        make_test_model(tiny, seed=0, fast=True)
    return load_model(str(tiny), device="cpu", dtype="fp32", progress=False), True


def run_demo(out=DEFAULT_OUT, model: str | None = None, params=None, seconds: float = 4.0,
             fps: float = 2.0, device: str = "cpu", dtype: str = "fp32",
             progress: bool | None = None, stream=None) -> dict:
    from .demo_report import write_demo_report
    from .replay import replay
    from .sample_bag import make_sample_bag
    from .task_config import load_config

    stream = stream or sys.stdout

    def say(s: str) -> None:
        print(s, file=stream, flush=True)

    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = Path(params) if params else default_params()
    if params is None:
        raise ValueError("config/perception.yaml not found; pass --params")
    config = load_config(params)

    bag = out / "sample_bag"
    info = make_sample_bag(bag, seconds=seconds, fps=fps, topics=[config.cameras[0].topic]
                           if config.cameras else ["/camera/image_raw"], overwrite=True)
    say(f"sample bag: {bag} ({info['frames']} frames {info['size']} at {fps:g} fps on "
        f"{', '.join(info['topics'])})")

    m, tiny = load_demo_model(model or config.model or None, out, device, dtype, say)
    if tiny:
        say("")
        import textwrap

        say("!" * 78)
        for line in textwrap.wrap(TINY_NOTE, 76):
            say("! " + line)
        say("!" * 78)
        say("")
    say(f"model: {m.model_id}{' (tiny random test model)' if tiny else ''}")

    results = out / "results"
    # measured timing in the bag: the report's latency histogram shows this machine's
    stats = replay(bag, results, config, m, mode="offline", overwrite=True, zero_timing=False,
                   progress=sys.stderr.isatty() if progress is None else progress,
                   log=lambda s: say(s))
    j = stats.to_json()
    report = write_demo_report(out / "report", results, bag, j, TINY_NOTE if tiny else None,
                               params)
    say("")
    say(f"replayed {j['frames']} frames offline through the pipeline of {params} in "
        f"{j['wall_s']:.1f} s: {j['results']} results")
    for k, n in j["per_task"].items():
        lat = j["latency_ms"].get(k, {})
        say(f"  {k:<24} {n:>4} results   latency p50 {lat.get('p50', 0):8.1f} ms   "
            f"p99 {lat.get('p99', 0):8.1f} ms")
    a = j["latency_ms_all"]
    if a["n"]:
        say(f"  {'all':<24} {a['n']:>4} results   latency p50 {a['p50']:8.1f} ms   "
            f"p99 {a['p99']:8.1f} ms")
    if j["drops"]:
        say("  dropped: " + ", ".join(f"{k} {v}" for k, v in j["drops"].items()))
    if stats.error:
        say(f"  ERROR: {stats.error}")
    say("")
    say(f"result bag: {results}  (mcap rosbag2: ros2 bag play / Foxglove)")
    say(f"report:     {report['markdown']}  ({len(report['frames'])} annotated frames, "
        "latency_hist.png, detections_over_time.png)")
    say(f"summary:    {results / 'replay_summary.json'}")
    say("next: photon replay BAG --params config/perception.yaml --out NEW --model ...; "
        f"photon diff {results} NEW")
    if tiny:
        say("(tiny random test model: the numbers above measure plumbing, not perception)")
    say(f"demo done in {time.perf_counter() - t0:.1f} s")
    return {"results": str(results), "report": report, "stats": j, "tiny_model": tiny,
            "sample_bag": str(bag)}


# -- command line ----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Moondream 2 folder or Hugging Face id (default: a tiny random test model)")
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder")
    p.add_argument("--params", default=None, help="node parameters (default config/perception.yaml)")
    p.add_argument("--seconds", type=float, default=4.0, help="sample bag length")
    p.add_argument("--fps", type=float, default=2.0, help="sample bag frame rate")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="weights and compute precision")


def main(args) -> int:
    res = run_demo(args.out, model=args.model, params=args.params, seconds=args.seconds,
                   fps=args.fps, device=args.device, dtype=args.dtype)
    return 1 if res["stats"]["error"] else 0

"""A deterministic simulator that drives the real Scheduler (and the FIFO baseline, the
same loop with another policy) on a virtual clock.

- `SimEngine` implements the engine protocol; encode, prefill and each decode step advance
  the virtual clock by what a "true" CostModel says (with seeded jitter). How many decode
  steps a task takes is part of the frame (`SimImage.steps`), so both policies face exactly
  the same work.
- `TraceSpec`/`make_trace`: cameras at a frame rate, each frame asking a mix of periodic
  tasks; scenes change slowly (object counts hold for ~2 s, with flicker); on-demand
  queries arrive at random on the latest frame of a random camera.
- Load: the engine's speed is set so the offered work is `load` x its capacity, capacity
  counted optimistically (every decode step in a full batch of max_batch), so the real
  overload is at least the nominal one.
- `simulate` -> `SimResult` with the metrics; `table`/`plot` format them.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from photon_core.encode_request import EncodeRequest
from photon_core.task import FINISH_LENGTH, FINISH_STOP, Task, TaskResult

from .clock import VirtualClock
from .cost_model import CostModel, encode_key
from .cost_profiles import PROFILES
from .crop_ladder import AdaptiveCrops
from .fifo import fifo_policy
from .request import ON_DEMAND, ON_MISS_CANCEL, ON_MISS_FINISH, PERIODIC, Outcome, Status, TaskSpec
from .scheduler import Policy, Scheduler

# What the engine "really" costs in the simulator, before scaling to a load level
# (GPU fast-path-like numbers for Moondream 2; only the ratios matter after scaling).
TRUE_COST = CostModel(encode_base_ms=1.0, encode_per_crop_ms=1.5, prefill_base_ms=1.5,
                      prefill_per_token_ms=0.02, decode_step_ms={1: 3.0, 2: 3.2, 4: 3.6, 8: 4.6},
                      ema=0.0)
IMAGE_SHAPE = (378, 672)          # 3 crops


# ---------------------------------------------------------------- the simulated engine
@dataclass(frozen=True)
class SimImage:
    shape: tuple[int, int]
    steps: tuple[tuple[str, int], ...] = ()    # task target -> decode steps it will take
    crops: str = "overlap"                     # crop mode (cost_model.encode_key): "global" = 1 crop

    def steps_for(self, task: Task) -> int:
        for k, v in self.steps:
            if k == task.target:
                return max(1, min(v, task.max_tokens))
        return task.max_tokens


@dataclass
class SimEnc:
    image: SimImage
    n_crops: int


class SimRun:
    def __init__(self, engine: "SimEngine", enc: SimEnc, task: Task):
        self.engine, self.task = engine, task
        self.total = enc.image.steps_for(task)
        self.steps = 0
        self.finished = False
        self.reason = ""
        engine.open_runs.add(self)

    def _close(self, reason: str) -> None:
        self.finished, self.reason = True, reason
        self.engine.open_runs.discard(self)

    def step(self) -> bool:
        return self.engine.step_batch([self])[0]

    def cancel(self, reason: str) -> None:
        if not self.finished:
            self._close(reason)

    def result(self) -> TaskResult:
        if not self.finished:
            raise RuntimeError("result() of a run still going")
        return TaskResult(self.task, {"sim_steps": self.steps}, self.reason, tokens=self.steps)


class SimEngine:
    """Engine protocol on a virtual clock."""

    model_id = "sim"
    max_runs: int | None = None

    def __init__(self, clock: VirtualClock, cost: CostModel, jitter: float = 0.05, seed: int = 0):
        self.clock, self.cost, self.jitter = clock, cost, jitter
        self.rng = random.Random(seed)
        self.open_runs: set[SimRun] = set()
        self.calls = {"encode": 0, "start": 0, "step_batch": 0}

    def _spend(self, ms: float) -> None:
        j = math.exp(self.rng.gauss(0.0, self.jitter)) if self.jitter else 1.0
        self.clock.advance(ms * j / 1e3)

    def count_prompt_tokens(self, task: Task) -> int:
        text = task.target if task.skill != "caption" else ""
        return 8 + (len(text) + 3) // 4

    def encode_image(self, image: SimImage) -> SimEnc:
        self.calls["encode"] += 1
        self._spend(self.cost.encode_ms(image))
        return self._enc(image)

    def _enc(self, image) -> SimEnc:
        """A SimImage or an EncodeRequest of one (an adaptive stream's frame: its crop mode
        in the request) -> its SimEnc."""
        sim = image.image if isinstance(image, EncodeRequest) else image
        return SimEnc(sim, self.cost._crops(encode_key(image)))

    def start(self, enc: SimEnc, task: Task) -> SimRun:
        self.calls["start"] += 1
        self._spend(self.cost.prefill_ms(self.count_prompt_tokens(task)))
        return SimRun(self, enc, task)

    def step_batch(self, runs: list[SimRun]) -> list[bool]:
        if not runs:
            return []
        if len(runs) > 8:
            raise RuntimeError(f"batch of {len(runs)} > 8")
        for r in runs:
            if r.finished:
                raise RuntimeError("stepping a finished or cancelled run")
        self.calls["step_batch"] += 1
        self._spend(self.cost.step_ms(len(runs)))
        out = []
        for r in runs:
            r.steps += 1
            if r.steps >= r.total:
                r._close(FINISH_STOP if r.total < r.task.max_tokens else FINISH_LENGTH)
            out.append(not r.finished)
        return out


class BatchEncodeSimEngine(SimEngine):
    """SimEngine with `encode_batch`: one call for n frames costs (1 - gain x (n-1)/n) x the
    frames one by one (a hypothetical engine: the batched encode is not measured yet)."""

    def __init__(self, *a, gain: float = 0.3, **kw):
        super().__init__(*a, **kw)
        self.gain = gain

    def encode_batch(self, images: list) -> list[SimEnc]:
        n = len(images)
        self.calls["encode"] += n
        self.calls.setdefault("encode_batch", 0)
        self.calls["encode_batch"] += 1
        f = 1.0 - self.gain * (n - 1) / n
        self._spend(f * sum(self.cost.encode_ms(im) for im in images))
        return [self._enc(im) for im in images]


# ---------------------------------------------------------------- traces
@dataclass(frozen=True)
class PeriodicTask:
    name: str
    task: Task
    objects: float = 0.0          # mean objects in the scene (detect/point)
    per_object: int = 0           # decode steps per object; steps = per_object * n + 1
    #                               (n < max_objects: the step that finds no more), or
    #                               per_object * max_objects (the budget ends the task)
    fixed_steps: tuple[int, int] = (0, 0)   # query: steps uniform in this range
    on_miss: str = ON_MISS_CANCEL

    def mean_steps(self) -> float:
        """Expected decode steps: region_steps over the Poisson object counts the trace
        draws (capped at max_objects, as the task is), or the query's range's middle."""
        if self.per_object:
            cap = self.task.max_objects
            below = [math.exp(-self.objects) * self.objects ** n / math.factorial(n)
                     for n in range(cap)]
            return sum(p * region_steps(self, n) for n, p in enumerate(below)) + \
                max(0.0, 1.0 - sum(below)) * region_steps(self, cap)
        return sum(self.fixed_steps) / 2


def region_steps(pt: PeriodicTask, n: int) -> int:
    """Decode steps of a detect / point task on a scene of n objects: per_object per object
    found, then one that finds no more - none after the max_objects-th object."""
    if n >= pt.task.max_objects:
        return pt.per_object * pt.task.max_objects
    return pt.per_object * n + 1


# The mix: a camera with k tasks runs the first k. Fewer tasks per camera with more cameras
# keeps the number of (stream, task) keys at 8 for every trace.
TASK_MIX = (
    PeriodicTask("person", Task("detect", object="person"), objects=1.5, per_object=3),
    PeriodicTask("path_clear", Task("query", question="Is the path ahead clear? Answer yes or no.",
                                    max_tokens=8), fixed_steps=(2, 3), on_miss=ON_MISS_FINISH),
    PeriodicTask("handle", Task("point", object="door handle"), objects=1.0, per_object=2),
    PeriodicTask("obstacle", Task("detect", object="obstacle"), objects=2.0, per_object=3),
    PeriodicTask("cup", Task("detect", object="cup"), objects=1.0, per_object=3),
    PeriodicTask("button", Task("point", object="elevator button"), objects=0.5, per_object=2),
    PeriodicTask("door_open", Task("query", question="Is the door open?", max_tokens=8),
                 fixed_steps=(2, 3), on_miss=ON_MISS_FINISH),
    PeriodicTask("chair", Task("detect", object="chair"), objects=1.5, per_object=3),
)
# bench_live.py's task: detect("person", max 5 objects) on a busy scene (~16 decode steps)
PERSON5 = PeriodicTask("person5", Task("detect", object="person", max_objects=5), objects=5.0,
                       per_object=3)
NAMED_TASKS = {pt.name: pt for pt in TASK_MIX + (PERSON5,)}
ON_DEMAND_TASK = PeriodicTask("ask", Task("query", question="What is on the table?", max_tokens=48),
                              fixed_steps=(10, 30), on_miss=ON_MISS_FINISH)
ON_DEMAND_DEADLINE_S = 1.0


@dataclass(frozen=True)
class TraceSpec:
    cameras: int = 1
    fps: float = 30.0
    load: float = 1.0                 # offered work / capacity
    duration_s: float = 10.0
    tasks_per_camera: int | None = None   # default 8 // cameras
    deadline_periods: float = 2.0     # periodic deadline, in frame periods after capture
    on_demand_rate: float = 0.5       # queries per second, all cameras together
    scene_hold_s: float = 2.0         # mean time an object count holds
    flicker: float = 0.1              # per-frame chance the count is off by one
    image_shape: tuple[int, int] = IMAGE_SHAPE
    max_batch: int = 4
    jitter: float = 0.05
    slowdown: float = 1.0             # engine this much slower after calibration (drift)
    seed: int = 0
    # Real costs instead of a load level: "h200" = cost_profiles.h200_moondream2 (measured),
    # unscaled; the load is then whatever the cameras offer. None: relative costs scaled to `load`.
    profile: str | None = None
    deadline_s: float | None = None   # periodic deadline in seconds (overrides deadline_periods)
    task_names: tuple[str, ...] | None = None   # tasks of every camera, by name (NAMED_TASKS)
    encode_batch_gain: float | None = None      # engine with encode_batch (BatchEncodeSimEngine)
    crops: str = "overlap"            # every camera's crop mode ("global": 1 crop per frame)
    # adaptive crops (crop_ladder.py): every periodic frame an AdaptiveCrops over these modes
    # (best first; the default 378 x 672 frames have 3 / 2 / 1 crops with the one below)
    crop_modes: tuple = ()
    even_phases: bool = False         # cameras evenly spread over a frame period (bench_live.py)

    @property
    def period(self) -> float:
        return 1.0 / self.fps

    @property
    def tasks(self) -> tuple[PeriodicTask, ...]:
        if self.task_names:
            return tuple(NAMED_TASKS[n] for n in self.task_names)
        k = self.tasks_per_camera or max(1, 8 // self.cameras)
        return TASK_MIX[:k]

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else self.deadline_periods * self.period

    @property
    def label(self) -> str:
        if self.profile:
            names = "+".join(self.task_names) if self.task_names else f"{len(self.tasks)} tasks"
            crops = ("" if self.crops == "overlap" else f" {self.crops} crops") + \
                (" even phases" if self.even_phases else "")
            h, w = self.image_shape
            return (f"{self.cameras}cam@{self.fps:g}fps {w}x{h}{crops} {names} "
                    f"{1e3 * self.deadline:g}ms [{self.profile}]")
        return f"{self.cameras}cam@{self.fps:g}fps x{self.load:g}"


@dataclass
class Event:
    t: float
    stream: str
    stamp: float
    image: SimImage
    kind: str
    tasks: list[TaskSpec]


def _poisson(rng: random.Random, lam: float) -> int:
    l, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= l:
            return k
        k += 1


def make_trace(spec: TraceSpec, t0: float = 0.0) -> list[Event]:
    rng = random.Random(spec.seed)
    P = spec.period
    events: list[Event] = []
    last_frame: dict[str, list[tuple[float, SimImage]]] = {}
    for c in range(spec.cameras):
        stream = f"cam{c}"
        phase = rng.uniform(0, P)                   # (drawn anyway: same trace otherwise)
        if spec.even_phases:                        # bench_live.py: camera c at c x P / cameras
            phase = c * P / spec.cameras
        scene = {pt.name: (0.0, 0) for pt in spec.tasks}     # name -> (valid until, count)
        frames = last_frame.setdefault(stream, [])
        k = 0
        while (t := phase + k * P) < spec.duration_s:
            steps = []
            for pt in spec.tasks:
                if pt.per_object:
                    until, n = scene[pt.name]
                    if t >= until:
                        n = _poisson(rng, pt.objects)
                        scene[pt.name] = (t + rng.expovariate(1 / spec.scene_hold_s), n)
                    if rng.random() < spec.flicker:
                        n = max(0, n + rng.choice((-1, 1)))
                    steps.append((pt.task.target, region_steps(pt, n)))
                else:
                    steps.append((pt.task.target, rng.randint(*pt.fixed_steps)))
            od = ON_DEMAND_TASK              # what the answer to an on-demand question costs
            steps.append((od.task.target, rng.randint(*od.fixed_steps)))
            img = SimImage(spec.image_shape, tuple(steps), spec.crops)
            specs = [TaskSpec(pt.name, pt.task, spec.deadline, pt.on_miss) for pt in spec.tasks]
            if spec.crop_modes:
                img = AdaptiveCrops(img, spec.crop_modes)
            events.append(Event(t0 + t, stream, round(t, 9), img, PERIODIC, specs))
            frames.append((t, img))
            k += 1
    # on-demand questions, on the latest frame of a random camera
    t = rng.expovariate(spec.on_demand_rate) if spec.on_demand_rate > 0 else spec.duration_s
    od = ON_DEMAND_TASK
    while t < spec.duration_s:
        stream = f"cam{rng.randrange(spec.cameras)}"
        prior = [f for f in last_frame[stream] if f[0] <= t]
        if prior:
            ft, img = prior[-1]
            events.append(Event(t0 + t, stream, round(ft, 9), img, ON_DEMAND,
                                [TaskSpec(od.name, od.task, ON_DEMAND_DEADLINE_S, od.on_miss)]))
        t += rng.expovariate(spec.on_demand_rate)
    events.sort(key=lambda e: (e.t, e.stream, e.kind))
    return events


def offered_ms_per_s(spec: TraceSpec, cost: CostModel) -> float:
    """Engine milliseconds of work per second offered by the trace, every decode step
    counted at full-batch efficiency (the optimistic capacity)."""
    b = spec.max_batch
    tok_ms = cost.step_ms(b) / b
    per_frame = cost.encode_ms(SimImage(spec.image_shape, crops=spec.crops)) + sum(
        cost.prefill_ms(8 + (len(pt.task.target) + 3) // 4) + pt.mean_steps() * tok_ms
        for pt in spec.tasks)
    od = ON_DEMAND_TASK
    on_demand = spec.on_demand_rate * (cost.prefill_ms(8 + (len(od.task.target) + 3) // 4)
                                       + od.mean_steps() * tok_ms)
    return spec.cameras * spec.fps * per_frame + on_demand


# ---------------------------------------------------------------- running + metrics
@dataclass
class SimResult:
    spec: TraceSpec
    policy: str
    outcomes: list[Outcome]
    scale: float
    sched_metrics: dict
    engine_open_runs: int
    frames_left: int
    metrics: dict = field(default_factory=dict)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))
    return xs[i]


def compute_metrics(outcomes: list[Outcome], spec: TraceSpec) -> dict:
    P = spec.period
    per = [o for o in outcomes if o.kind == PERIODIC]
    od = [o for o in outcomes if o.kind == ON_DEMAND]
    started = [o for o in outcomes if o.start_time is not None and o.status is not Status.ERROR]
    # task probes (Scheduler._task_probe) are started although admission refused them, to
    # measure a task's cost: counted apart, not as admission's misses
    admitted = [o for o in started if not o.probe]
    probes = [o for o in started if o.probe]
    # superseded while running is not a miss: it was replaced by a fresher answer
    judged = [o for o in admitted if o.status is not Status.SUPERSEDED]
    misses = [o for o in judged if o.missed_deadline]
    done = [o for o in per if o.status is Status.DONE]
    ages = [o.age_s for o in done]
    # freshness invariant: results of a (stream, task) never go back in time
    newest: dict[tuple, float] = {}
    stale = 0
    for o in sorted((o for o in per if o.status is Status.DONE), key=lambda o: o.end_time):
        k = (o.stream, o.task_name)
        if k in newest and not o.stamp > newest[k]:
            stale += 1
        newest[k] = max(newest.get(k, o.stamp), o.stamp)
    on_time = [o for o in outcomes if o.status is Status.DONE and not o.missed_deadline]
    od_ok = [o for o in od if o.status is Status.DONE and not o.missed_deadline]
    # per camera: periodic requests answered on time (fraction of its requests)
    cams: dict[str, list[int]] = {}
    for o in per:
        c = cams.setdefault(o.stream, [0, 0])
        c[1] += 1
        c[0] += o.status is Status.DONE and not o.missed_deadline
    cam_on_time = {k: v[0] / v[1] for k, v in sorted(cams.items()) if v[1]}
    rates = list(cam_on_time.values())
    count = lambda st: sum(o.status is st for o in per)  # noqa: E731
    return {
        "requests": len(per), "on_demand": len(od), "admitted": len(admitted),
        "miss_rate": len(misses) / len(judged) if judged else 0.0,
        "misses": len(misses),
        "probes": len(probes), "probe_misses": sum(bool(o.missed_deadline) for o in probes),
        "answered": len(done) / len(per) if per else float("nan"),
        "age_p50": _pct(ages, 50) / P, "age_p99": _pct(ages, 99) / P,
        "age_max": (max(ages) / P) if ages else float("nan"),
        "goodput": len(on_time) / spec.duration_s,
        "on_demand_ok": len(od_ok) / len(od) if od else float("nan"),
        "on_demand_p99_ms": _pct([o.end_time - o.submit_time for o in od if o.status is Status.DONE], 99) * 1e3,
        "superseded": count(Status.SUPERSEDED), "skipped": count(Status.SKIPPED),
        "deadline_cancelled": count(Status.DEADLINE), "errors": sum(o.status is Status.ERROR for o in outcomes),
        "stale": stale,
        "on_time": len([o for o in on_time if o.kind == PERIODIC]) / len(per) if per else float("nan"),
        "cam_on_time": cam_on_time,
        # fairness: the least served camera's on-time fraction / the best one's
        "fair_min_max": (min(rates) / max(rates)) if rates and max(rates) > 0 else float("nan"),
    }


def simulate(spec: TraceSpec, policy: str | Policy = "edf", base_cost: CostModel = TRUE_COST,
             calibrate: bool = True, **sched_kw) -> SimResult:
    """Run one trace through a Scheduler (sched_kw: e.g. tokens=TokenEstimator(k=1))."""
    clock = VirtualClock()
    if spec.profile:                         # measured costs, as they are
        base_cost, scale = PROFILES[spec.profile](), 1.0
    else:
        scale = spec.load * 1000.0 / offered_ms_per_s(spec, base_cost)
    truth = base_cost.scaled(scale)
    truth.ema = 0.0
    if spec.encode_batch_gain is not None:
        engine = BatchEncodeSimEngine(clock, truth, jitter=spec.jitter, seed=spec.seed + 1,
                                      gain=spec.encode_batch_gain)
    else:
        engine = SimEngine(clock, truth, jitter=spec.jitter, seed=spec.seed + 1)
    if calibrate:
        cost = CostModel.calibrate(engine, clock, make_image=lambda h, w: SimImage((h, w)),
                                   batch_sizes=tuple(b for b in (1, 2, 4, 8) if b <= max(spec.max_batch, 2)))
    else:
        cost = truth.scaled(1.0)
    if spec.slowdown != 1.0:                 # the engine drifts after start-up calibration
        engine.cost = truth.scaled(spec.slowdown)
        engine.cost.ema = 0.0
    if isinstance(policy, str):
        pol = fifo_policy(spec.max_batch) if policy == "fifo" else Policy(name=policy, max_batch=spec.max_batch)
    else:
        pol = policy
    outcomes: list[Outcome] = []
    sched = Scheduler(engine, cost, clock=clock, policy=pol, on_result=outcomes.append, **sched_kw)
    t0 = clock.now()
    events = make_trace(spec, t0)
    i = 0
    while i < len(events) or sched.has_work():
        now = clock.now()
        while i < len(events) and events[i].t <= now:
            e = events[i]
            sched.submit_frame(e.stream, e.stamp, e.image, e.tasks, kind=e.kind, capture_time=e.t)
            i += 1
        if sched.has_work():
            sched.step()
            until = sched.idle_until()            # work held (fairness): skip to the next event
            if until is not None:
                clock.advance_to(min(until, events[i].t) if i < len(events) else until)
        elif i < len(events):
            clock.advance_to(events[i].t)
    for o in outcomes:                       # report times relative to the trace start
        for a in ("capture_time", "submit_time", "end_time", "deadline"):
            setattr(o, a, getattr(o, a) - t0)
        if o.start_time is not None:
            o.start_time -= t0
    res = SimResult(spec, pol.name, outcomes, scale, sched.metrics(), len(engine.open_runs),
                    len(sched.frames))
    res.metrics = compute_metrics(outcomes, spec)
    bs = res.sched_metrics.get("batch_sizes") or {}
    n = sum(bs.values())
    res.metrics["mean_batch"] = sum(k * v for k, v in bs.items()) / n if n else float("nan")
    res.metrics["offered_load"] = offered_ms_per_s(spec, truth) / 1000.0
    sm = res.sched_metrics
    calls = sm.get("encode_calls") or 0
    res.metrics["mean_encode_batch"] = sm["encodes"] / calls if calls else float("nan")
    span_ms = 1e3 * max(1e-9, clock.now() - t0)
    res.metrics["busy"] = {k: v / span_ms for k, v in sm.get("engine_ms", {}).items()}
    return res


# ---------------------------------------------------------------- reporting
GRID_CAMERAS = (1, 2, 4)
GRID_FPS = (15.0, 30.0)
GRID_LOADS = (0.5, 1.0, 2.0)


def run_grid(duration_s: float = 20.0, seed: int = 0, policies=("edf", "fifo"),
             cameras=GRID_CAMERAS, fps=GRID_FPS, loads=GRID_LOADS, **spec_kw) -> list[SimResult]:
    out = []
    for c in cameras:
        for f in fps:
            for ld in loads:
                spec = TraceSpec(cameras=c, fps=f, load=ld, duration_s=duration_s, seed=seed, **spec_kw)
                for p in policies:
                    out.append(simulate(spec, p))
    return out


# The multi-camera trace set (issue 13): 1-8 cameras, 5-30 fps, mixed tasks and on-demand
# questions (0.5/s, 1 s deadline), on the costs measured on the H200 (cost_profiles.py).
# (cameras, fps, tasks of each camera, periodic deadline s[, crops, (height, width)]);
# default frames IMAGE_SHAPE with full crops; bench_live.py's rows use its 640x480 frames.
VGA = (480, 640)
MULTICAM_SET = (
    (1, 30.0, ("person", "path_clear"), 0.100),
    (2, 15.0, ("person5",), 0.100),
    (2, 30.0, ("person", "handle"), 0.100),
    (4, 15.0, ("person5",), 0.100),
    (4, 15.0, ("person5",), 0.100, "overlap", VGA),   # bench_live.py --preset issue13 row 1
    (4, 15.0, ("person5",), 0.100, "global", VGA),    # ... with --crops global
    (4, 15.0, ("person5",), 0.100, "overlap", VGA, "even"),   # ... its cameras' phases
    (4, 15.0, ("person5",), 0.100, "global", VGA, "even"),
    (4, 15.0, ("person", "obstacle"), 0.150),
    (4, 30.0, ("person",), 0.100),
    (6, 10.0, ("person", "path_clear", "handle"), 0.200),
    (8, 5.0, ("person", "obstacle", "cup", "door_open"), 0.300),
    (8, 10.0, ("person5",), 0.150),
    (8, 10.0, ("person5",), 0.150, "overlap", VGA),   # bench_live.py --preset issue13 row 2
    (8, 10.0, ("person5",), 0.150, "global", VGA),
    (8, 10.0, ("person5",), 0.150, "overlap", VGA, "even"),
    (8, 10.0, ("person5",), 0.150, "global", VGA, "even"),
    (8, 30.0, ("person",), 0.100),
)


def run_multicam(duration_s: float = 20.0, seed: int = 0, policies=("edf", "fifo"),
                 profile: str = "h200", max_batch: int = 4,
                 encode_batch_gain: float | None = None, rows=None,
                 policy_kw: dict | None = None) -> list[SimResult]:
    """encode_batch_gain None: the profile's (cost_profiles.ENCODE_BATCH_GAIN; the engine has
    encode_batch), < 0: an engine without encode_batch. rows: a subset of MULTICAM_SET.
    policy_kw: Policy fields for the edf rows (A/B of a policy setting)."""
    from .cost_profiles import ENCODE_BATCH_GAIN
    if encode_batch_gain is None:
        encode_batch_gain = ENCODE_BATCH_GAIN.get(profile)
    elif encode_batch_gain < 0:
        encode_batch_gain = None
    out = []
    for row in (rows or MULTICAM_SET):
        cams, fps, names, dl = row[:4]
        crops, shape = (row[4], row[5]) if len(row) > 4 else ("overlap", IMAGE_SHAPE)
        spec = TraceSpec(cameras=cams, fps=fps, duration_s=duration_s, seed=seed, profile=profile,
                         deadline_s=dl, task_names=names, max_batch=max_batch,
                         encode_batch_gain=encode_batch_gain, crops=crops, image_shape=shape,
                         even_phases=len(row) > 6 and row[6] == "even")
        for p in policies:
            if p == "edf" and policy_kw:
                out.append(simulate(spec, Policy(name="edf", max_batch=max_batch, **policy_kw)))
                continue
            out.append(simulate(spec, p))
    return out


def multicam_table(results: list[SimResult]) -> str:
    hdr = ("| trace | offered load | policy | on time % | per camera on time % | fairness min/max "
           "| mean decode batch | mean encode batch | engine busy % (encode / prefill / decode) "
           "| skipped / superseded | miss % (admitted) | task probes (missed) | age p99 (periods) "
           "| on-demand on time % |")
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in results:
        m = r.metrics
        cams = " / ".join(f"{100 * v:.0f}" for v in m["cam_on_time"].values())
        b = m.get("busy", {})
        busy = (f"{100 * sum(b.values()):.0f} ({100 * b.get('encode', 0):.0f} / "
                f"{100 * b.get('prefill', 0):.0f} / {100 * b.get('decode', 0):.0f})")
        lines.append(
            f"| {r.spec.label} | {m['offered_load']:.2f} | {r.policy} | {100 * m['on_time']:.1f} | {cams} "
            f"| {m['fair_min_max']:.2f} | {m['mean_batch']:.2f} | {m.get('mean_encode_batch', float('nan')):.2f} "
            f"| {busy} | {m['skipped']} / {m['superseded']} | {100 * m['miss_rate']:.2f} "
            f"| {m['probes']} ({m['probe_misses']}) | {m['age_p99']:.2f} | {100 * m['on_demand_ok']:.0f} |")
    return "\n".join(lines)


def table(results: list[SimResult]) -> str:
    hdr = ("| trace | load | policy | miss % (admitted) | answered % | age p50 | age p99 | age max "
           "| goodput /s | on-demand on time % | superseded | skipped | stale | cam fairness min/max "
           "| mean batch | task probes (missed) |")
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in results:
        m, s = r.metrics, r.spec
        lines.append(
            f"| {s.cameras} cam @ {s.fps:g} fps | {s.load:g}x | {r.policy} | {100 * m['miss_rate']:.2f} "
            f"| {100 * m['answered']:.1f} | {m['age_p50']:.2f} | {m['age_p99']:.2f} | {m['age_max']:.1f} "
            f"| {m['goodput']:.1f} | {100 * m['on_demand_ok']:.0f} | {m['superseded']} | {m['skipped']} "
            f"| {m['stale']} | {m['fair_min_max']:.2f} | {m['mean_batch']:.2f} "
            f"| {m['probes']} ({m['probe_misses']}) |")
    return "\n".join(lines)


def plot(results: list[SimResult], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r.spec.label for r in results}, key=lambda l: next(
        (r.spec.cameras, r.spec.fps, r.spec.load) for r in results if r.spec.label == l))
    pols = sorted({r.policy for r in results})
    get = {(r.spec.label, r.policy): r.metrics for r in results}
    panels = [("miss_rate", "deadline misses among admitted (%)", 100, False),
              ("answered", "periodic requests answered (%)", 100, False),
              ("age_p99", "p99 frame age at result (frame periods)", 1, True),
              ("goodput", "goodput (on-time results / s)", 1, False)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 12), sharex=True)
    x = range(len(labels))
    w = 0.8 / len(pols)
    for ax, (key, title, mul, log) in zip(axes, panels):
        for j, p in enumerate(pols):
            ys = [get.get((l, p), {}).get(key, float("nan")) * mul for l in labels]
            ax.bar([i + j * w for i in x], ys, w, label=p)
        if key == "age_p99":
            ax.axhline(2.0, color="k", ls="--", lw=0.8, label="target 2 periods")
        if key == "miss_rate":
            ax.axhline(1.0, color="k", ls="--", lw=0.8, label="target 1%")
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    axes[-1].set_xticks([i + w * (len(pols) - 1) / 2 for i in x])
    axes[-1].set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_targets(results: list[SimResult]) -> list[tuple[str, bool, str]]:
    """The issue's targets, checked on the EDF rows (FIFO rows are the contrast)."""
    out = []
    over = [r for r in results if r.policy == "edf" and r.spec.load >= 2.0]
    light = [r for r in results if r.policy == "edf" and r.spec.load <= 0.5]
    if over:
        w = max(over, key=lambda r: r.metrics["miss_rate"])
        out.append(("2x: <= 1% deadline misses among admitted work",
                    w.metrics["miss_rate"] <= 0.01, f"worst {100 * w.metrics['miss_rate']:.2f}% ({w.spec.label})"))
        st = sum(r.metrics["stale"] for r in over)
        out.append(("2x: no result for a frame older than an answered newer one", st == 0,
                    f"{st} stale results"))
        w = max(over, key=lambda r: r.metrics["age_p99"])
        out.append(("2x: p99 frame age at result <= 2 frame periods", w.metrics["age_p99"] <= 2.0,
                    f"worst {w.metrics['age_p99']:.2f} periods ({w.spec.label})"))
        multi = [r for r in over if r.spec.cameras > 1]
        if multi:
            w = min(multi, key=lambda r: r.metrics["fair_min_max"])
            out.append(("2x: no camera below 80 % of the best camera's on-time rate",
                        w.metrics["fair_min_max"] >= 0.8,
                        f"worst min/max {w.metrics['fair_min_max']:.2f} ({w.spec.label})"))
    if light:
        w = min(light, key=lambda r: r.metrics["answered"])
        out.append(("0.5x: every frame answered", w.metrics["answered"] == 1.0,
                    f"lowest {100 * w.metrics['answered']:.2f}% ({w.spec.label})"))
        n = sum(r.metrics["misses"] for r in light)
        out.append(("0.5x: no deadline misses", n == 0, f"{n} misses"))
    return out

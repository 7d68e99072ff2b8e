"""What work costs: vision encode per crop (and one encode call of n frames, learned),
prefill per token, one decode step per batch size (learned per batch size), and how many
decode steps a task will take. Calibrated at start-up by timing the
engine (`CostModel.calibrate`), or built from numbers; corrected online from what the
scheduler observes."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from photon_core.encode_request import parse_crops
from photon_core.task import Task

from .engine import count_prompt_tokens, crop_counter, encoded_crops, engine_capacity, step_batch


def image_shape(image: Any) -> tuple[int, int] | None:
    """(height, width) of a numpy array, PIL image or anything with .shape; else None."""
    shape = getattr(image, "shape", None)
    if shape is not None and len(shape) >= 2:
        return int(shape[0]), int(shape[1])
    size = getattr(image, "size", None)
    if isinstance(size, tuple) and len(size) == 2:
        return int(size[1]), int(size[0])
    return None


def crop_mode(image: Any) -> str:
    """The crop mode a frame is encoded with: an EncodeRequest's (or anything's with a
    `crops` string, e.g. the simulator's SimImage), else "overlap" (the engine's default)."""
    crops = getattr(image, "crops", None)
    return crops if isinstance(crops, str) and crops else "overlap"


def crop_budget_of(mode: str) -> int | None:
    """N of an "overlap:N" crop mode; None for any other mode (e.g. "global")."""
    try:
        return parse_crops(mode)[1]
    except ValueError:
        return None


def encode_key(image: Any):
    """The encode cost key of an image: its (height, width); a frame encoded with crops other
    than "overlap" (a global-crop camera: EncodeRequest(crops="global"), a crop budget
    "overlap:N") adds the mode, so two cameras of one size but different crop modes are
    costed (and probed) apart."""
    shape = image_shape(image)
    mode = crop_mode(image)
    if mode != "overlap" and shape is not None:
        return (*shape, mode)
    return shape


def crop_modes(images: list) -> str:
    """The crop modes of a batched encode's frames, e.g. "overlap", "global",
    "global+overlap": a batched encode's gain is learned per such mix."""
    return "+".join(sorted({crop_mode(im) for im in images}))


def moondream_crops(shape: tuple[int, int] | None, crop: int = 378, max_crops: int = 12) -> int:
    """Crops the Moondream 2 vision encoder sees: one global crop, plus local crops tiling
    the image when it is bigger than one crop (capped). An estimate: only the scale matters."""
    if shape is None:
        return 1
    h, w = shape
    if max(h, w) <= crop:
        return 1
    return 1 + min(max_crops, math.ceil(h / crop) * math.ceil(w / crop))


# Online correction (CostModel._toward): measured / predicted ratios are clamped to
# MIN_RATIO..MAX_RATIO; a measurement far cheaper than believed moves a factor FAST_RATE of
# the way at once.
MIN_RATIO = 0.01
MAX_RATIO = 5.0
FAST_RATE = 0.5


@dataclass
class CostModel:
    """Milliseconds. decode_step_ms maps batch size -> one step of that many runs."""

    encode_base_ms: float = 5.0
    encode_per_crop_ms: float = 10.0
    prefill_base_ms: float = 2.0
    prefill_per_token_ms: float = 0.1
    decode_step_ms: dict[int, float] = field(default_factory=lambda: {1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0})
    crops: Callable[[tuple[int, int] | None], int] = moondream_crops
    # the engine's own count of a frame's crops (engine.crop_count(height, width, mode):
    # Moondream 2's tiling rule), found by calibrate(); None: the `crops` estimate above
    crop_count: Callable[[int, int, str], int] | None = None
    ema: float = 0.1                 # online correction rate (0 disables)
    # online correction factors (actual / predicted)
    f_encode: float = 1.0
    f_prefill: float = 1.0
    f_step: float = 1.0
    encode_seen: dict = field(default_factory=dict)   # encode_key -> observed encode ms (EMA)
    # batched costs, learned online: one encode call for n frames of crop modes m costs
    # encode_batch_factor[(n, m)] x (the n frames one by one) (m: crop_modes(), e.g.
    # "overlap": one global crop batches far better than 9 crops); a decode step of b runs costs
    # decode_step_ms[b] x f_step_b[b] (f_step for a batch size not seen yet)
    encode_batch_factor: dict = field(default_factory=dict)
    f_step_b: dict = field(default_factory=dict)

    def __post_init__(self):
        self.decode_step_ms = {int(k): float(v) for k, v in sorted(self.decode_step_ms.items())}
        if not self.decode_step_ms:
            raise ValueError("decode_step_ms needs at least one batch size")

    # -- predictions --------------------------------------------------------------
    def encode_ms(self, image: Any = None, shape: tuple[int, int] | None = None) -> float:
        shape = shape if shape is not None else encode_key(image)
        seen = self.encode_seen.get(shape)
        if seen is not None:                  # cameras keep their size: what it last cost
            return seen
        return self.f_encode * (self.encode_base_ms + self.encode_per_crop_ms * self._crops(shape))

    def _crops(self, key) -> int:
        """Crops of an encode_key: the engine's count where it has one (crop_count); else
        estimated: 1 for a global-crop frame, at most 1 + N for "overlap:N", else
        self.crops(shape)."""
        if self.crop_count is not None and key is not None:
            return int(self.crop_count(key[0], key[1], key[2] if len(key) == 3 else "overlap"))
        if key is None or len(key) != 3:
            return self.crops(key)
        budget = crop_budget_of(key[2])
        return 1 if budget is None else min(1 + budget, self.crops(key[:2]))

    def prefill_ms(self, tokens: int) -> float:
        return self.f_prefill * (self.prefill_base_ms + self.prefill_per_token_ms * tokens)

    def _step_base(self, batch: int) -> float:
        pts = self.decode_step_ms
        if batch in pts:
            return pts[batch]
        ks = list(pts)
        if len(ks) == 1:
            return pts[ks[0]]
        if batch < ks[0]:
            return pts[ks[0]]
        lo, hi = (ks[-2], ks[-1]) if batch > ks[-1] else next(
            (a, b) for a, b in zip(ks, ks[1:]) if a < batch < b)
        return pts[lo] + (pts[hi] - pts[lo]) * (batch - lo) / (hi - lo)

    def step_ms(self, batch: int) -> float:
        b = max(1, batch)
        return self.f_step_b.get(b, self.f_step) * self._step_base(b)

    def batch_factor(self, n: int, modes: str = "overlap") -> float:
        """One encode call of n frames of crop modes `modes` / n separate encodes (learned;
        1.0 if never seen: the nearest smaller n seen for those modes, else no gain assumed)."""
        if n <= 1 or not self.encode_batch_factor:
            return 1.0
        ks = [k for k, m in self.encode_batch_factor if k <= n and m == modes]
        return self.encode_batch_factor[(max(ks), modes)] if ks else 1.0

    def encode_batch_ms(self, images: list) -> float:
        """Predicted time of one batched encode of `images` (engine.encode_batch)."""
        return self.batch_factor(len(images), crop_modes(images)) * \
            sum(self.encode_ms(im) for im in images)

    # -- online correction ----------------------------------------------------------
    def _toward(self, old: float | None, r: float) -> float:
        """One online correction of a factor `old` (None: none yet) by a measured ratio r
        (actual / uncorrected prediction). Dearer than believed: the usual small EMA step, the
        ratio capped at MAX_RATIO (a one-off slow outlier moves it little; misses that follow
        an underestimate keep correcting it). Much cheaper than believed (r below half the
        factor): halfway at once. An overestimate is the dangerous error: admission skips the
        work it thinks hopeless and so gets no further measurements (a calibration on a loaded
        machine once silenced a node for good), so fresh cheap measurements are believed
        quickly, down to MIN_RATIO."""
        r = min(MAX_RATIO, max(MIN_RATIO, r))
        if old is None:
            return r
        rate = max(self.ema, FAST_RATE) if r < 0.5 * old else self.ema
        return old + rate * (r - old)

    def _upd(self, name: str, predicted_base: float, actual: float) -> None:
        if self.ema <= 0 or predicted_base <= 0 or actual <= 0:
            return
        setattr(self, name, self._toward(getattr(self, name), actual / predicted_base))

    def observe_encode(self, image: Any, ms: float) -> None:
        shape = encode_key(image)
        n = self._crops(shape)
        self._upd("f_encode", self.encode_base_ms + self.encode_per_crop_ms * n, ms)
        if self.ema > 0 and shape is not None and ms > 0:
            old = self.encode_seen.get(shape)
            # cheaper than believed: take it at once (a skipped camera is only re-measured by a
            # probe, so a slow outlier must not linger); dearer: a quarter of the way
            self.encode_seen[shape] = ms if old is None or ms < old else \
                old + max(self.ema, 0.25) * (ms - old)

    def observe_prefill(self, tokens: int, ms: float) -> None:
        self._upd("f_prefill", self.prefill_base_ms + self.prefill_per_token_ms * tokens, ms)

    def observe_step(self, batch: int, ms: float) -> None:
        b = max(1, batch)
        self._upd("f_step", self._step_base(b), ms)
        if self.ema > 0 and ms > 0 and self._step_base(b) > 0:
            self.f_step_b[b] = self._toward(self.f_step_b.get(b), ms / self._step_base(b))

    def observe_encode_batch(self, images: list, ms: float) -> None:
        """One encode call took `ms` for `images` (n > 1: learns the batch factor)."""
        n = len(images)
        if n == 1:
            self.observe_encode(images[0], ms)
            return
        single = sum(self.encode_ms(im) for im in images)
        if self.ema <= 0 or single <= 0 or ms <= 0:
            return
        r = min(2.0, max(0.1, ms / single))
        key = (n, crop_modes(images))
        old = self.encode_batch_factor.get(key)
        self.encode_batch_factor[key] = r if old is None else (1 - self.ema) * old + self.ema * r

    def scaled(self, k: float) -> "CostModel":
        """Every cost times k (the simulator sets load levels this way)."""
        return CostModel(self.encode_base_ms * k, self.encode_per_crop_ms * k,
                         self.prefill_base_ms * k, self.prefill_per_token_ms * k,
                         {b: v * k for b, v in self.decode_step_ms.items()}, self.crops,
                         self.crop_count, self.ema,
                         encode_batch_factor=dict(self.encode_batch_factor))

    def as_dict(self) -> dict:
        return {"encode_base_ms": self.encode_base_ms, "encode_per_crop_ms": self.encode_per_crop_ms,
                "prefill_base_ms": self.prefill_base_ms, "prefill_per_token_ms": self.prefill_per_token_ms,
                "decode_step_ms": dict(self.decode_step_ms),
                "encode_batch_factor": {f"{n} {m}": v for (n, m), v in
                                        sorted(self.encode_batch_factor.items())},
                "step_factor_by_batch": dict(self.f_step_b)}

    # -- calibration -----------------------------------------------------------------
    @classmethod
    def calibrate(cls, engine: Any, clock: Any = None, *,
                  image_sizes: tuple[tuple[int, int], ...] = ((378, 378), (756, 756)),
                  batch_sizes: tuple[int, ...] = (1, 2, 4, 8), steps: int = 3, repeats: int = 2,
                  make_image: Callable[[int, int], Any] | None = None, **kw) -> "CostModel":
        """Time the engine: encode at two image sizes (-> base + per crop), prefill of a short
        and a long prompt (-> base + per token), one decode step at each batch size."""
        from .clock import MonotonicClock
        clock = clock or MonotonicClock()
        if make_image is None:
            import numpy as np
            rng = np.random.default_rng(0)

            def make_image(h, w):
                return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)

        def timed(fn, *a):
            t0 = clock.now()
            out = fn(*a)
            return out, (clock.now() - t0) * 1e3

        imgs = {s: make_image(*s) for s in image_sizes}
        encs, enc_pts = {}, []
        for img in imgs.values():       # warm-up: a new size may set things up once (the
            engine.encode_image(img)    # fast path captures a graph per crop tiling)
        for s, img in imgs.items():
            ts = []
            for _ in range(max(1, repeats)):
                encs[s], ms = timed(engine.encode_image, img)
                ts.append(ms)
            n = encoded_crops(encs[s]) or moondream_crops(s)
            enc_pts.append((int(n), statistics.median(ts)))
        base, per = _fit(enc_pts)
        enc = encs[image_sizes[0]]

        short = Task("query", question="Why?", max_tokens=8)
        long_ = Task("query", question="Describe " + "the scene in front of the robot, " * 8,
                     max_tokens=8)
        pre_pts = []
        for t in (short, long_, short, long_):
            run, ms = timed(engine.start, enc, t)
            run.cancel("cancelled")
            pre_pts.append((count_prompt_tokens(engine, t), ms))
        if hasattr(engine, "drain"):
            engine.drain()
        p_base, p_per = _fit(pre_pts[2:] if repeats > 1 else pre_pts)

        steps_ms: dict[int, float] = {}
        cap = engine_capacity(engine)
        batch_sizes = tuple(b for b in batch_sizes if cap is None or b <= cap) or (1,)
        probe = Task("query", question="Describe the image in detail.", max_tokens=steps + 8)
        for b in batch_sizes:
            pool, ts = [], []
            for i in range(steps + 1):                 # the first step is a warm-up
                pool += [engine.start(enc, probe) for _ in range(b - len(pool))]
                alive, ms = timed(step_batch, engine, pool)
                if i:
                    ts.append(ms)
                pool = [r for r, a in zip(pool, alive) if a]   # finished ones are replaced
            for r in pool:
                r.cancel("cancelled")
            if hasattr(engine, "drain"):                # a pipelined engine frees rows on commit
                engine.drain()
            steps_ms[b] = statistics.median(ts)
        if not steps_ms:
            raise RuntimeError("calibration: every probe run finished before a decode step was timed")
        # a bigger batch never costs less per step than a smaller one
        best = 0.0
        for b in sorted(steps_ms):
            best = steps_ms[b] = max(steps_ms[b], best)
        kw.setdefault("crop_count", crop_counter(engine))
        return cls(encode_base_ms=base, encode_per_crop_ms=per, prefill_base_ms=p_base,
                   prefill_per_token_ms=p_per, decode_step_ms=steps_ms, **kw)


def _fit(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """Line through (x, y) points -> (intercept, slope), both >= 0."""
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    if len(set(xs)) < 2:
        x, y = max(xs[0], 1), statistics.median(ys)
        return 0.0, y / x
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


# Decode steps a task takes with no history yet.
PRIOR_STEPS = {"detect": 10.0, "point": 6.0, "query": 16.0,
               "caption": {"short": 24.0, "normal": 60.0, "long": 150.0}}


@dataclass
class TokenEstimator:
    """Decode steps per task, learned online per (stream, task name) — scenes change slowly,
    so the last frames of a stream predict the next — with the task name and then the skill
    as fall-backs. `conservative` adds k mean absolute deviations (admission uses it)."""

    alpha: float = 0.25
    k: float = 2.0                # 1.5 until the per-task probes: see docs/benchmarks.md, session 7
    # A (stream, task) key with fewer observations than this is estimated from the task
    # name's pooled stats when those have more: one stream's first result must not give it a
    # looser estimate (dev starts at a quarter of the steps) than the streams served longer,
    # else under tight deadlines admission keeps preferring the served ones and the new
    # stream starves on its own uncertainty (found by test_scheduler_properties). 8, not 3
    # (session 8): at 3 own results the key left the pooled stats while its own deviation
    # (0.75^3 of its start) still made it look hopeless near the deadline, and it starved
    # again (hypothesis seed 27: 15 / 6 detect results, now 20 / 19; simulator targets held).
    min_own: int = 8
    stats: dict = field(default_factory=dict)     # key -> [mean, dev, n]

    def prior(self, task: Task) -> float:
        p = PRIOR_STEPS.get(task.skill, 16.0)
        if isinstance(p, dict):
            p = p.get(task.caption_length, 60.0)
        return min(float(task.max_tokens), p)

    def _get(self, key, name, task):
        own, pooled = self.stats.get(key), self.stats.get(("*", name))
        if own is not None and (own[2] >= self.min_own or pooled is None or pooled[2] <= own[2]):
            return own
        if pooled is not None:
            return pooled
        p = self.prior(task)
        return [p, 0.5 * p, 0]

    def measured(self, key: tuple) -> bool:
        """Whether key's estimate rests on a measurement (its own, or its task name's pooled
        over streams) rather than the skill's prior."""
        return key in self.stats or ("*", key[-1]) in self.stats

    def estimate(self, key: tuple, task: Task, conservative: bool = True) -> float:
        mean, dev, _ = self._get(key, key[-1], task)
        est = mean + (self.k * dev + 1.0 if conservative else 0.0)
        return max(1.0, min(float(task.max_tokens), est))

    def observe_overrun(self, key: tuple, task: Task, steps: int) -> None:
        """A run was stopped (deadline) after `steps` without finishing: it needed more.
        Learn at least that much, so admission stops trusting the old estimate."""
        mean, dev, _ = self._get(key, key[-1], task)
        if steps + 1 > mean:
            self.observe(key, task, max(steps + 1, int(math.ceil(mean + self.k * dev + 1))))

    def observe(self, key: tuple, task: Task, steps: int) -> None:
        for k in (key, ("*", key[-1])):
            s = self.stats.get(k)
            if s is None:
                self.stats[k] = [float(steps), max(1.0, 0.25 * steps), 1]
                continue
            d = steps - s[0]
            s[0] += self.alpha * d
            s[1] += self.alpha * (abs(d) - s[1])
            s[2] += 1

"""Per-camera counters, rates and latency percentiles (the diagnostics' camera entries)."""
from __future__ import annotations

import collections
import math
import threading

import numpy as np

from photon_ros.transport_loss import TransportLoss

WINDOW_S = 5.0            # rates and the transport-loss WARN look at the last WINDOW_S


class CameraStats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.in_times: collections.deque = collections.deque(maxlen=600)
        self.proc_times: collections.deque = collections.deque(maxlen=600)
        self.latencies: collections.deque = collections.deque(maxlen=1000)
        self.last_input: float | None = None
        self.last_processed_key = None
        self.transport = TransportLoss()

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
    def _rate(times, now: float, window: float = WINDOW_S) -> float:
        recent = [t for t in times if now - t <= window]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0], 1e-6)
        return len(recent) / max(span, min(window, span))

    def loss_window(self, now: float) -> dict:
        """Frames lost before the node in the last WINDOW_S (lost, gaps, rmw) and received."""
        w = self.transport.window(now, WINDOW_S)
        with self.lock:
            w["received"] = sum(1 for t in self.in_times if now - t <= WINDOW_S)
        return w

    def snapshot(self, now: float) -> dict:
        transport = self.transport.totals()
        lost_window = self.loss_window(now)
        with self.lock:
            lat = sorted(self.latencies)
            return {
                "counts": {**self.counts, **transport},
                "transport_window": lost_window,
                "input_fps": self._rate(self.in_times, now),
                "processed_fps": self._rate(self.proc_times, now),
                "latency_p50_ms": float(np.percentile(lat, 50)) if lat else float("nan"),
                "latency_p99_ms": float(np.percentile(lat, 99)) if lat else float("nan"),
                "since_input_s": (now - self.last_input) if self.last_input is not None else None,
            }

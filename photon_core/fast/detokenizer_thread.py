"""Detokenization, streaming callbacks and result text on a CPU thread, off the decode loop.

The decode loop only appends (run, token) / (run, FINISH) to a FIFO; one worker thread feeds
each run's TextStreamer (the reference's word-safe chunking, so the same deltas and final
text), calls the run's stream callback with every non-empty delta, and sets the run's
`text_done` event after the finish marker. `threaded=False` (or after close()) processes
inline, which tests use to compare orderings.
"""
from __future__ import annotations

import queue
import threading

_FINISH = object()


class DetokenizerThread:
    def __init__(self, threaded: bool = True):
        self.threaded = threaded
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.errors: list[BaseException] = []
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="photon-detok", daemon=True)
            self._thread.start()

    def token(self, run, token: int) -> None:
        self._put((run, token))

    def finish(self, run) -> None:
        self._put((run, _FINISH))

    def _put(self, item) -> None:
        if self._thread is None:
            self._handle(*item)
        else:
            self.q.put(item)

    def _handle(self, run, item) -> None:
        try:
            delta = run.streamer.finish() if item is _FINISH else run.streamer.push(item)
            if delta and run.stream is not None:
                run.stream(delta)
        except BaseException as e:  # noqa: BLE001 - a callback error must not kill the thread
            self.errors.append(e)
        if item is _FINISH:
            run.text_done.set()

    def _loop(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            self._handle(*item)

    def close(self) -> None:
        if self._thread is not None:
            self.q.put(None)
            self._thread.join(timeout=5)
            self._thread = None

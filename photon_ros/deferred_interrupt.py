"""Ctrl-C / SIGTERM during a long loop (a bag replay), taken at a safe point.

Python runs a signal handler between bytecodes, also inside a callback that C code makes
(rclpy's (de)serialization, a pybind11 return value conversion): a KeyboardInterrupt raised
there can come out as an unrelated error (pybind11: "TypeError: Unable to convert function
return value to a Python type"), and the replay then reports an internal error instead of
closing its output bag as interrupted. Here the first signal is only noted; the loop calls
`check()` between frames, which raises KeyboardInterrupt there. A second signal raises at
once (a loop stuck inside one frame can still be stopped)."""
from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredInterrupt:
    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {signum} (second)")
        self.signum = signum

    def check(self) -> None:
        """Raise KeyboardInterrupt if a signal came since the last check."""
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {self.signum}")

    def __enter__(self) -> "DeferredInterrupt":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                old = signal.getsignal(s)
                # SIGINT ignored (a background job of a shell script) stays ignored
                if old is not signal.SIG_IGN:
                    self._old[s] = old
                    signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._old.clear()

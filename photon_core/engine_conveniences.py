"""EngineConveniences: run() and the one-call detect/point/query/caption every engine offers
on top of its start(): one loop, shared by the families' reference engines and FastEngine.

An engine that mixes it in provides start(enc, task, stream, ignore_eos) -> a run with
finished / step() / cancel(reason) / result(); an engine that keeps work after a run's end
(FastEngine: launched steps still to commit) overrides _after_run().
"""
from __future__ import annotations

from typing import Callable

from .task import Task, TaskResult


class EngineConveniences:
    def run(self, enc, task: Task, stream: Callable[[str], None] | None = None,
            should_stop: Callable[[], str | None] | None = None,
            ignore_eos: bool = False) -> TaskResult:
        """Run a task to the end. should_stop() is asked before every decode step; a
        non-None answer (e.g. "cancelled", "deadline") ends the task with that reason."""
        r = self.start(enc, task, stream, ignore_eos)
        while not r.finished:
            reason = should_stop() if should_stop is not None else None
            if reason:
                r.cancel(reason)
                break
            r.step()
        self._after_run()
        return r.result()

    def _after_run(self) -> None:
        """Called once a run of run() has ended (before its result is read)."""

    # -- conveniences returning the standard dicts ---------------------------------------
    def detect(self, image, object: str, max_objects: int = 50) -> dict:
        return self.run(image, Task("detect", object=object, max_objects=max_objects)).output

    def point(self, image, object: str, max_objects: int = 50) -> dict:
        return self.run(image, Task("point", object=object, max_objects=max_objects)).output

    def query(self, image, question: str, stream: Callable[[str], None] | None = None,
              **sampling) -> dict:
        return self.run(image, Task("query", question=question, **sampling), stream).output

    def caption(self, image, length: str = "normal",
                stream: Callable[[str], None] | None = None, **sampling) -> dict:
        return self.run(image, Task("caption", caption_length=length, **sampling), stream).output

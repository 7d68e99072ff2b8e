"""The node's executor: image callbacks inline on the spinning thread, everything else in a
pool, and an exception escaping a callback reported instead of ending spin()."""
from __future__ import annotations

from rclpy.exceptions import InvalidHandle
from rclpy.executors import (ConditionReachedException, ExternalShutdownException,
                             MultiThreadedExecutor, ShutdownException, TimeoutException)
from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy


class InlineGroupExecutor(MultiThreadedExecutor):
    """A MultiThreadedExecutor that runs the callbacks of one callback group on the spinning
    thread itself instead of handing them to the pool. The node's image callbacks are short
    (convert, submit) and per frame; the pool hand-off cost ~2 ms per 640x480 frame (measured,
    see docs/benchmarks.md). Services, the action and timers still run in the pool, so a
    service waiting for its result never holds up images.

    An exception escaping a callback is handed to `on_error` (logged and counted by the node)
    instead of ending spin(): one bad request or parameter update must not stop the node.
    Without `on_error` it propagates, as in rclpy's executors."""

    def __init__(self, inline_group, num_threads: int = 4, on_error=None, **kw):
        super().__init__(num_threads, **kw)
        # relies on MultiThreadedExecutor internals (rclpy Jazzy/Kilted); elsewhere: plain pool
        self.inline_group = inline_group if (hasattr(self, "_executor") and
                                             hasattr(self, "_futures")) else None
        self.on_error = on_error

    def _failed(self, exc: BaseException) -> None:
        if self.on_error is None or isinstance(exc, (ExternalShutdownException, ShutdownException)):
            raise exc
        if not self._shutdown_casualty(exc):
            self.on_error(exc)

    def _shutdown_casualty(self, exc: BaseException) -> bool:
        """A callback that failed only because the process is shutting down: rcl refusing an
        entity of a context already shut down (a timer's publish racing SIGTERM: "publisher's
        context is invalid"), or an entity whose destruction was requested (InvalidHandle,
        once the context is down)."""
        return isinstance(exc, (_rclpy.RCLError, InvalidHandle)) and not self._context.ok()

    def _spin_once_impl(self, timeout_sec=None, wait_condition=lambda: False) -> None:
        try:
            self._spin_once_inline(timeout_sec, wait_condition)
        except _rclpy.RCLError:
            # a shutdown (SIGTERM / SIGINT: rclpy's signal handler) between spin()'s check of
            # the context and the wait set's creation: rcl refuses the wait set or a guard
            # condition of a context already shut down. spin() ends at its next check.
            if self._context.ok():
                raise

    def _spin_once_inline(self, timeout_sec, wait_condition) -> None:
        if self.inline_group is None:
            return super()._spin_once_impl(timeout_sec, wait_condition)
        try:
            handler, entity, node = self.wait_for_ready_callbacks(timeout_sec, None, wait_condition)
        except (ExternalShutdownException, ShutdownException, TimeoutException,
                ConditionReachedException):
            return
        if getattr(entity, "callback_group", None) is self.inline_group:
            handler()
            exc = handler.exception()
            if exc is not None:
                self._failed(exc)
            return
        self._executor.submit(handler)
        self._futures.append(handler)
        for future in self._futures[:]:
            if future.done():
                self._futures.remove(future)
                exc = future.exception()
                if exc is not None:
                    self._failed(exc)

    def shutdown(self, timeout_sec=None, **kw) -> bool:
        """rclpy's shutdown, then the pool's finished tasks that spin() never checked: a
        callback's exception goes to `on_error`; a task that failed only because of the
        shutdown is dropped - an entity the executor's shutdown itself destroyed (rclpy
        destroys its guard condition without waiting for the pool's running tasks:
        InvalidHandle, "cannot use Destroyable") or any _shutdown_casualty. Unretrieved,
        rclpy printed each at exit as "The following exception was never retrieved"."""
        ok = super().shutdown(timeout_sec, **kw)      # (joins the pool's threads)
        for future in getattr(self, "_futures", ())[:]:
            if future.done():
                self._futures.remove(future)
                exc = future.exception()
                if exc is None or isinstance(exc, InvalidHandle) or \
                        self._shutdown_casualty(exc):
                    continue
                if self.on_error is not None:
                    self.on_error(exc)
        return ok

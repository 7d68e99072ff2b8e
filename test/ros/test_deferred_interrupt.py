"""DeferredInterrupt: a signal during a replay is raised between frames, not inside C code."""
import signal
import threading

import pytest

from photon_ros.deferred_interrupt import DeferredInterrupt


@pytest.fixture(autouse=True)
def _sigint_handled():
    """SIGINT at Python's default handler during each test: a test process started in the
    background by a non-interactive shell (`cmd &`, as `nohup bash -c "... .ci/run" &` runs
    CI) inherits SIGINT ignored, which DeferredInterrupt rightly leaves ignored
    (test_ignored_sigint_stays_ignored) - the SIGINT case would then test nothing and fail."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _signal_main_thread(sig):
    """sig to this (the main) thread: its handler has run when this returns (os.kill sends it
    to the process, where another thread may take it)."""
    signal.pthread_kill(threading.main_thread().ident, sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_first_signal_waits_for_check_second_raises(sig):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with DeferredInterrupt() as intr:
        intr.check()                      # nothing pending: no raise
        _signal_main_thread(sig)          # handled synchronously on the main thread
        assert intr.signum == sig         # noted, not raised
        with pytest.raises(KeyboardInterrupt):
            intr.check()
        with pytest.raises(KeyboardInterrupt):
            _signal_main_thread(sig)      # a second one raises at once
    assert {s: signal.getsignal(s) for s in before} == before


def test_ignored_sigint_stays_ignored():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with DeferredInterrupt():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)

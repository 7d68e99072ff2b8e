"""DeferredInterrupt: a signal during a replay is raised between frames, not inside C code."""
import os
import signal

import pytest

from photon_ros.deferred_interrupt import DeferredInterrupt


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_first_signal_waits_for_check_second_raises(sig):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with DeferredInterrupt() as intr:
        intr.check()                      # nothing pending: no raise
        os.kill(os.getpid(), sig)         # handled synchronously on the main thread
        assert intr.signum == sig         # noted, not raised
        with pytest.raises(KeyboardInterrupt):
            intr.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)     # a second one raises at once
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

"""lmspd.signals: a signal raised as an exception in the main thread, for
the model load (server) and the launch (its started server must be stopped)."""

from __future__ import annotations

import os
import signal

import pytest

from lmspd import signals


class _Raised(signals.Signalled):
    pass


@pytest.fixture
def usr_handlers():
    """SIGUSR1/SIGUSR2 as they were, whatever a test leaves."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    yield
    signals.restore(before)


def test_a_signal_raises_its_error_naming_it_and_the_handlers_come_back(usr_handlers):
    def mine(sig, frame):  # pragma: no cover - never called
        raise AssertionError

    signal.signal(signal.SIGUSR1, mine)
    with pytest.raises(_Raised) as caught, signals.raised(_Raised, [signal.SIGUSR1, signal.SIGUSR2]):
        os.kill(os.getpid(), signal.SIGUSR2)
        signal.sigtimedwait([], 0)  # a point where the interpreter runs handlers, were the kill late
    assert (caught.value.signal, caught.value.name) == (signal.SIGUSR2, "SIGUSR2")
    assert signal.getsignal(signal.SIGUSR1) is mine
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_the_first_signal_puts_the_handlers_back_before_the_clean_up_runs(usr_handlers):
    """A second signal during the clean-up acts as it would have (here:
    ignored), not as a second exception out of the clean-up."""
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    seen = []
    try:
        with signals.raised(_Raised, [signal.SIGUSR1]):
            os.kill(os.getpid(), signal.SIGUSR1)
            signal.sigtimedwait([], 0)
    except _Raised:
        seen.append(signal.getsignal(signal.SIGUSR1))
    assert seen == [signal.SIG_DFL]


def test_a_signal_the_process_ignores_stays_ignored(usr_handlers):
    """nohup's SIGHUP (or a background job's SIGINT): whoever started the
    process asked for that."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    with signals.raised(_Raised, [signal.SIGUSR1]):
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR1)
        signal.sigtimedwait([], 0)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN


def test_an_except_exception_on_the_way_does_not_swallow_it(usr_handlers):
    with pytest.raises(_Raised), signals.raised(_Raised, [signal.SIGUSR1]):
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            signal.sigtimedwait([], 0)
        except Exception:  # noqa: BLE001 - the point of the test
            pytest.fail("a signal was caught as an Exception")

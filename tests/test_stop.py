"""The one stop helper every long command uses: real signals sent to this process."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from eyas.stop import StopSignals


class Dropped(Exception):
    pass


def test_first_signal_is_named_and_later_ones_only_counted():
    said = []
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(on_first=said.append) as stop:
        assert not stop.requested and not stop.event.is_set()
        assert signal.getsignal(signal.SIGTERM) == stop._on
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.event.is_set()
        assert stop.name == "SIGTERM" and stop.reason == "stopped by SIGTERM"
    assert said == ["SIGTERM"]  # the announcement comes once
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_a_unit_of_work_is_abandoned_at_once_and_none_starts_after():
    reached = []
    with StopSignals() as stop:
        with pytest.raises(Dropped), stop.abandoning(Dropped):
            os.kill(os.getpid(), signal.SIGINT)
            reached.append("after the signal")  # never: the handler raised
        assert reached == []
        with pytest.raises(Dropped), stop.abandoning(Dropped):
            reached.append("a unit started after the stop")
        assert reached == []
        os.kill(os.getpid(), signal.SIGTERM)  # outside a unit: noted, nothing raised
    assert stop.name == "SIGINT"


def test_a_shared_event_and_a_disabled_helper():
    ev = threading.Event()
    with StopSignals(event=ev) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
    assert ev.is_set() and stop.event is ev
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(enabled=False):
        assert signal.getsignal(signal.SIGTERM) is before  # a rank that leaves the stop to another


def test_outside_the_main_thread_nothing_is_installed():
    seen = []

    def run():
        with StopSignals() as stop:
            seen.append(signal.getsignal(signal.SIGTERM) == stop._on)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [False]


def test_a_signal_while_a_helper_thread_starts_waits_for_the_start():
    """A signal landing inside `Thread.start` would raise there, leaving a thread that no one
    stops, still starting while the interpreter shuts down (a traceback torn in half on
    stderr). `start_thread` holds the signals until the thread runs; the signal is then
    handled, as the block ends."""
    from eyas.errors import Stopped
    from eyas.stop import held, start_thread, stop_at_once

    seen = []
    with pytest.raises(Stopped), stop_at_once("eyas extract --resume run"):
        with held():
            os.kill(os.getpid(), signal.SIGINT)
            seen.append("still running")  # not raised in here
        seen.append("after")
    assert seen == ["still running"]
    waited = []

    class SignalledStart(threading.Event):  # the start's wait for the thread: a signal lands in it
        def wait(self, timeout=None):
            os.kill(os.getpid(), signal.SIGINT)
            waited.append(super().wait(timeout))
            return waited[-1]

    gate = threading.Event()
    t = threading.Thread(target=gate.wait, daemon=True)
    t._started = SignalledStart()
    with pytest.raises(Stopped), stop_at_once("eyas extract --resume run"):
        start_thread(t)
    assert waited == [True] and t.is_alive()  # started whole before the Stopped
    gate.set()
    t.join()


def test_still_working_stops_its_thread_when_a_signal_comes_as_it_starts(monkeypatch):
    """The signal `start_thread` held is raised as the start returns, inside `__enter__`, where
    no `__exit__` follows: the thread is stopped and joined there."""
    import eyas.host.ui as ui
    from eyas.errors import Stopped

    def start_then_stop(thread):
        thread.start()
        raise Stopped("stopped by SIGTERM")

    monkeypatch.setattr(ui, "start_thread", start_then_stop)
    with pytest.raises(Stopped), ui.still_working("loading the target", every=60):
        pytest.fail("the block ran")
    assert not [t for t in threading.enumerate() if t.name == "eyas-still-working"]

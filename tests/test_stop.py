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

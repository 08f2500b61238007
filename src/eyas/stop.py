"""SIGINT and SIGTERM as a request to stop: the one way every long command stops cleanly.

A long stage runs its loop inside `StopSignals()`. The first signal records its name
(`name`, `reason`), sets `event` (which worker threads may wait on) and calls `on_first`
(a stage that must say something at once, within a scheduler's short grace period). The
loop checks `requested` between units of work and stops after the last complete one; a unit
that may be dropped midway (a training step before the optimizer moves, a prompt being
decoded) runs inside `abandoning(exc)`, where a signal raises `exc` at once. The previous
handlers come back on leaving. Outside the main thread (where Python allows no handlers)
nothing is installed and the stage runs to its end.

The stage then raises its own error with exit code 75 (errors.EXIT_STOPPED) naming the
command that resumes.

Outside a stage's loops (starting up, loading a model of hundreds of GB, finishing) the
command line runs the stage inside `stop_at_once(then)`: there the first signal raises
`Stopped` at once (exit 75, naming `then`), which unwinds like any error: locks released,
nothing half-written published (the store's commits survive even SIGKILL). A signal whose
exception Python swallows (one raised inside a `__del__`) is not lost: it stays pending, and
the next `StopSignals` starts as requested, so the stage's loop stops at its first check.

A helper thread is started with `start_thread`, which holds both signals while the thread
starts: a signal landing inside `Thread.start` would raise there and leave a thread that
nobody stops, still starting up while the interpreter shuts down (its traceback torn
in half on stderr).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from eyas.errors import Stopped

__all__ = ["SIGNALS", "StopSignals", "held", "start_thread", "stop_at_once"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_pending: list[str] = []  # a signal `stop_at_once` took, until it ends


class StopSignals:
    """Handlers for SIGINT and SIGTERM while the `with` block runs. `enabled=False` installs
    none (a rank that leaves the stop to another); `event` may be one the stage already
    sets for its own reasons (a writer thread's failure)."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        on_first: Callable[[str], None] | None = None,
        event: threading.Event | None = None,
    ) -> None:
        self.name: str | None = None
        self.event = event if event is not None else threading.Event()
        self._enabled = enabled
        self._on_first = on_first
        self._abandon: type[BaseException] | None = None
        self._old: dict = {}

    def __enter__(self) -> StopSignals:
        if self._enabled and threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on) for s in SIGNALS}
            if _pending and self.name is None:  # taken at start-up, its exception swallowed
                self.name = _pending[0]
                if self._on_first is not None:
                    self._on_first(self.name)
                self.event.set()
        return self

    def __exit__(self, *exc) -> bool:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
        return False

    @property
    def requested(self) -> bool:
        """A signal came."""
        return self.name is not None

    @property
    def reason(self) -> str:
        return f"stopped by {self.name}"

    def _on(self, signum: int, _frame) -> None:
        if self.name is None:
            self.name = signal.Signals(signum).name
            if self._on_first is not None:
                self._on_first(self.name)
        self.event.set()
        if self._abandon is not None:
            exc, self._abandon = self._abandon, None
            raise exc()

    @contextmanager
    def abandoning(self, exc: type[BaseException]) -> Iterator[None]:
        """A unit of work a signal abandons at once by raising `exc` (at once, too, when
        the signal came before it started)."""
        if self.requested:
            raise exc()
        self._abandon = exc
        try:
            yield
        finally:
            self._abandon = None


@contextmanager
def stop_at_once(then: str) -> Iterator[None]:
    """While the block runs (and no `StopSignals` of a stage's loop is active), the first
    SIGINT or SIGTERM raises `Stopped` naming `then`, the command that continues; later
    ones, while that unwinds, are ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on(signum: int, _frame) -> None:
        if _pending:
            return
        _pending.append(signal.Signals(signum).name)
        raise Stopped(
            f"stopped by {_pending[0]} outside the work's own loop (starting up, loading, or "
            f"finishing); everything committed is kept. Continue with: {then}"
        )

    old = {s: signal.signal(s, on) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _pending.clear()


@contextmanager
def held() -> Iterator[None]:
    """SIGINT and SIGTERM are only noted while the block runs, and handled as it ends, by
    whatever handlers were there (the signal sent again). A mask would not do: the kernel
    gives a process's signal to any thread that does not block it (a library's pool), and
    Python then runs the handler in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: noted.append(signum)) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for signum in noted:
            signal.raise_signal(signum)


def start_thread(thread: threading.Thread) -> threading.Thread:
    """`thread` started whole: a signal during the start is handled after it (raising in
    the caller, who can then still stop and join the thread)."""
    with held():
        thread.start()
    return thread

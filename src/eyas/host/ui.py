"""Progress reporting for long stages: a rich bar on a terminal, plain log lines otherwise.

Runs go for days under nohup or systemd, where a redrawn bar is noise in a log file; so on
a non-TTY the same facts are printed as one line every `log_every` seconds.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from eyas.stop import start_thread

console = Console(stderr=True, soft_wrap=True)


class Reporter:
    """Counts units of work; `extra()` supplies a short status string (speed, free disk)."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "samples",
        enabled: bool = True,
        extra: Callable[[], str] | None = None,
        eta: Callable[[], float | None] | None = None,
        rate: Callable[[], float | None] | None = None,
        log_every: float = 30.0,
    ):
        self.label, self.total, self.unit = label, total, unit
        self.eta = eta  # seconds left, when the caller knows better than units/s (tokens/s)
        self.recent = rate  # units/s as `status` measures them, when the caller has that
        log_every = float(os.environ.get("EYAS_LOG_EVERY", log_every))  # seconds between log lines
        self.enabled, self.extra, self.log_every = enabled, extra or (lambda: ""), log_every
        self.done = 0
        self._skipped = 0
        self.start = time.monotonic()
        self._last_log = self.start
        self._logged = -1
        self._progress: Progress | None = None
        self._task = None
        self._noting = False

    def __enter__(self) -> Reporter:
        if self.enabled and sys.stderr.isatty():
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[extra]}"),
                *(
                    [TextColumn("ETA {task.fields[eta]}")]
                    if self.eta
                    else [TextColumn("ETA"), TimeRemainingColumn()]
                ),
                console=console,
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.label, total=self.total, extra="", eta="?")
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.update(self._task, extra=self.extra())
            self._progress.__exit__(*exc)
        elif self.enabled and self.done and self.done != self._logged:
            self._log()  # the final count, unless the last line already said it

    def skip(self, n: int) -> None:
        """Count `n` units done before this session (a resume) without counting them in the rate."""
        self.done += n
        self._skipped += n
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done)

    def rate(self) -> float:
        return (self.done - self._skipped) / max(time.monotonic() - self.start, 1e-9)

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.done > self.total:  # the total was an estimate (streamed windows): never "54/50"
            self.retotal(self.done)
        if self._progress is not None:
            self._progress.update(self._task, advance=n, extra=self.extra(), eta=self._eta_text())
        elif self.enabled and time.monotonic() - self._last_log >= self.log_every:
            self._log()

    def retotal(self, total: int) -> None:
        """A better estimate of the units in all (never below those done)."""
        self.total = max(total, self.done)
        if self._progress is not None:
            self._progress.update(self._task, total=self.total)

    def note(self, msg: str | None) -> None:
        """Show a state that is not progress (waiting for the other side) now: on a terminal
        in the status field; in logs as a line when it begins and every log interval while it
        lasts. None: the state is over."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, extra=msg if msg is not None else self.extra())
        elif msg is not None and (
            not self._noting or time.monotonic() - self._last_log >= self.log_every
        ):
            self._last_log = time.monotonic()
            console.print(f"{self.label}: {msg}", markup=False, highlight=False)
        self._noting = msg is not None

    def _eta_text(self) -> str:
        from eyas.run.fsutil import human_duration

        if self.eta is not None:
            left = self.eta()
            return human_duration(left) if left is not None else "?"
        rate = self.rate()
        return human_duration(max(self.total - self.done, 0) / rate if rate > 0 else float("inf"))

    def _log(self) -> None:
        self._last_log = time.monotonic()
        self._logged = self.done
        rate = self.recent() if self.recent is not None else self.rate()
        console.print(
            f"{self.label}: {self.done}/{self.total} {self.unit} ({pace(rate, self.unit)}) "
            f"{self.extra()} ETA {self._eta_text()}",
            markup=False,
            highlight=False,
        )


def pace(rate: float | None, unit: str) -> str:
    """Units per second, or seconds per unit when a unit takes longer than a second (a CPU
    training step), so that a slow pace never reads as 0.0/s."""
    if not rate:
        return "-"
    if rate >= 1:
        return f"{rate:.1f}/s"
    return f"{1 / rate:.1f} s/{unit.rstrip('s') if unit.endswith('s') else unit}"


class still_working:  # noqa: N801 - used as a context manager, like a function
    """While the block runs (a model loading, a first training step on a CPU), a line every
    `every` seconds says that `what` goes on and for how long, so that a minute of silence
    never reads as a hang. `EYAS_LOG_EVERY` shortens the interval for logs and tests.
    `stop()` ends it early (idempotent)."""

    def __init__(self, what: str, every: float = 15.0, enabled: bool = True):
        self.what, self.enabled = what, enabled
        self.every = min(every, float(os.environ.get("EYAS_LOG_EVERY", every)) or 1.0)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> still_working:
        if self.enabled:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(
                target=self._beat, name="eyas-still-working", daemon=True
            )
            try:
                start_thread(self._thread)
            except BaseException:  # a signal taken as the thread started: it ends here too
                self.stop()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join()
            self._thread = None

    def _beat(self) -> None:
        from eyas.run.fsutil import human_duration

        while not self._done.wait(self.every):
            console.print(
                f"... {self.what}: {human_duration(time.monotonic() - self._t0)} so far",
                markup=False,
                highlight=False,
            )


RATE_WINDOW = 300.0  # seconds of commits that make the live rate


def recent_rate(commits: list[tuple[float, int]], now: float, window: float = RATE_WINDOW):
    """(samples/s, tokens/s) of the commits of the last `window` seconds, measured from the
    first of them to now; that first commit's own work was done before the window's clock
    started, so it is not counted. (None, None) until there are two commits to measure."""
    recent = sorted((t, n) for t, n in commits if t >= now - window)
    if len(recent) < 2 or now - recent[0][0] <= 0:
        return None, None
    span = now - recent[0][0]
    return (len(recent) - 1) / span, sum(n for _, n in recent[1:]) / span

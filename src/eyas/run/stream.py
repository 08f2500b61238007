"""The stream between `extract` and `train --follow`: followers, consumption, retirement.

A trainer that follows a run registers in it: one small file per training directory,
`followers/<name>.json`, written atomically by the trainer, and rewritten only after each
of its checkpoints is durable. It says which pass the trainer is in and which samples of
that pass its newest checkpoint has consumed.

An extractor with `--max-store` keeps the run's sample bytes under the budget (plus the one
batch in flight): before committing a batch it retires what every follower has passed and,
when the store is still full, waits for them. Retiring a sample is two steps, in this
order: a `retired` line in the writer's journal (fsynced), then the file's deletion. A kill
between them leaves a file whose sample is retired, which the next writer deletes; a
sample is never deleted before its retirement is durable, so a resume never re-extracts it.

Guarantee: a sample is deleted only when every registered follower has a durable checkpoint
past it, so a follower killed at any moment, resumed from its newest checkpoint, never needs
a deleted sample. A run without followers deletes nothing.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from eyas.run.fsutil import atomic_write_json, fsync_dir, human_bytes, read_json
from eyas.run.journal import Journal, Ledger, pass_of
from eyas.run.store import sample_relpath

HISTORY = 20  # publications kept in a follower's file: its consumption rate


def to_ranges(indices) -> list[list[int]]:
    """Sorted integers as [first, last] runs: a pass's consumed set stays small on disk."""
    out: list[list[int]] = []
    for i in sorted(indices):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def from_ranges(ranges) -> set[int]:
    return {i for a, b in ranges for i in range(a, b + 1)}


def follower_path(run: Path, out: Path) -> Path:
    name = hashlib.sha1(str(Path(out).resolve()).encode()).hexdigest()[:16]
    return Path(run) / "followers" / f"train-{name}.json"


@dataclass
class Follower:
    """One registered trainer, as its file says (`problem` set when the file is unreadable:
    such a follower has passed nothing, so nothing is deleted on its account)."""

    path: Path
    out: str = ""
    pass_: int = 0
    consumed: set[int] = field(default_factory=set)
    finished: bool = False
    waiting: bool = False
    updated: float | None = None
    command: str = ""
    history: list = field(default_factory=list)  # [time, pass, samples consumed so far]
    problem: str | None = None

    def has_passed(self, p: int, index: int) -> bool:
        """Whether this follower's newest durable checkpoint is past sample `index` of pass p."""
        if self.problem is not None:
            return False
        return self.finished or self.pass_ > p or (self.pass_ == p and index in self.consumed)

    def rate(self) -> float | None:
        """Samples consumed per second over the publications kept."""
        h = [x for x in self.history if isinstance(x, list) and len(x) == 3]
        if len(h) < 2 or h[-1][0] <= h[0][0]:
            return None
        return (h[-1][2] - h[0][2]) / (h[-1][0] - h[0][0])

    def describe(self) -> str:
        if self.problem:
            return f"{self.path}: {self.problem}"
        what = (
            "finished"
            if self.finished
            else f"pass {self.pass_ + 1}, {len(self.consumed)} sample(s) consumed as of its last checkpoint"
        )
        r = self.rate()
        rate = f", {r:.2f} samples/s" if r else ""
        wait = ", waiting for samples" if self.waiting and not self.finished else ""
        return f"{self.out or self.path}: {what}{rate}{wait}"


_CACHE: dict[Path, tuple[tuple, Follower]] = {}
_CACHE_LOCK = threading.Lock()


def read_followers(run: Path) -> list[Follower]:
    """The followers registered in a run (each file parsed once per change)."""
    d = Path(run) / "followers"
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        with _CACHE_LOCK:
            hit = _CACHE.get(p)
        if hit is not None and hit[0] == key:
            out.append(hit[1])
            continue
        f = _parse_follower(p)
        with _CACHE_LOCK:
            _CACHE[p] = (key, f)
        out.append(f)
    return out


def _parse_follower(p: Path) -> Follower:
    try:
        d = read_json(p)
        f = Follower(
            p,
            out=str(d["out"]),
            pass_=int(d["pass"]),
            consumed=from_ranges(d["consumed"]),
            finished=bool(d.get("finished")),
            waiting=bool(d.get("waiting")),
            updated=d.get("updated"),
            command=str(d.get("command", "")),
            history=list(d.get("history", [])),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Follower(
            p,
            problem=f"unreadable follower file ({type(exc).__name__}: {exc}); "
            "nothing is deleted until it is rewritten or removed",
        )
    return f


def publish(
    run: Path,
    out: Path,
    p: int,
    consumed: set[int],
    trained: int,
    *,
    command: str,
    finished: bool = False,
    waiting: bool = False,
) -> None:
    """Register or update this trainer in the run. Call only once the checkpoint holding
    `consumed` is durable: the extractor deletes what this file says was consumed.
    `trained`: samples consumed in all passes so far (the consumption rate's clock)."""
    path = follower_path(run, out)
    prev = {}
    if path.exists():
        try:
            prev = read_json(path)
        except (OSError, ValueError):
            prev = {}
    kept = prev.get("history", []) if isinstance(prev, dict) else []
    now = time.time()
    history = ([h for h in kept if isinstance(h, list)] + [[now, p, trained]])[-HISTORY:]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        path,
        {
            "out": str(Path(out).resolve()),
            "pass": p,
            "consumed": to_ranges(consumed),
            "finished": finished,
            "waiting": waiting,
            "updated": now,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": command,
            "history": history,
        },
    )


class Retirer:
    """The extractor's side of `--max-store`: this writer's samples' bytes, retirement of
    what every follower has passed, and waiting for room."""

    def __init__(self, run: Path, journal: Journal, led: Ledger, mine: set[int], budget: int):
        self.run, self.journal, self.led, self.mine, self.budget = (
            Path(run),
            journal,
            led,
            mine,
            budget,
        )
        self.bytes = sum(e["size"] for i, e in led.present.items() if i in mine)
        self.retired = 0
        self.waited = 0.0  # seconds spent waiting for followers

    def committed(self, entry: dict) -> None:
        self.bytes += entry["size"]

    def retire(self) -> int:
        """Retire every present sample of this writer that all followers have passed."""
        followers = read_followers(self.run)
        if not followers:
            return 0
        gone = [
            (i, e)
            for i, e in self.led.present.items()
            if i in self.mine and all(f.has_passed(pass_of(e), i) for f in followers)
        ]
        if not gone:
            return 0
        now = time.time()
        for _, e in gone:
            self.journal.append({**e, "retired": True, "t": now})
        self.journal.sync()  # durable before any file goes: a resume never redoes them
        dirs = set()
        for i, e in gone:
            p = self.run / sample_relpath(i)
            p.unlink(missing_ok=True)
            dirs.add(p.parent)
            self.led.add({**e, "retired": True})
            self.bytes -= e["size"]
        for d in dirs:
            fsync_dir(d)
        self.retired += len(gone)
        return len(gone)

    def make_room(self, batch: list[int], stop: threading.Event, show) -> bool:
        """Block until this writer's store is under the budget and no sample of `batch` still
        has a file from an earlier pass; False if `stop` was set meanwhile."""
        waited, t0 = False, time.monotonic()
        while True:
            self.retire()
            busy = [i for i in batch if i in self.led.present]
            if self.bytes < self.budget and not busy:
                if waited:
                    show(None)
                    self.waited += time.monotonic() - t0
                return True
            if stop.is_set():
                return False
            followers = read_followers(self.run)
            why = (
                f"store {human_bytes(self.bytes)} of its {human_bytes(self.budget)} budget"
                if not busy
                else f"{len(busy)} sample(s) of the last pass not yet consumed"
            )
            who = (
                "no trainer follows this run (start `eyas train --follow --data "
                f"{self.run} --out DIR`)"
                if not followers
                else "waiting for the trainer"
            )
            show(f"{who}: {why}")
            waited = True
            stop.wait(0.2)


def leftover_files(run: Path, led: Ledger, mine: set[int]) -> list[Path]:
    """Files of this writer's samples whose newest line retires them (a kill came between
    the retirement and the deletion, or the file is a later pass's write whose entry was
    lost): deleting them is always safe."""
    out = []
    for p in range(led.passes_seen()):
        for i in led.pass_retired(p):
            if i in mine and i not in led.present:
                f = run / sample_relpath(i)
                if f.exists():
                    out.append(f)
    return out

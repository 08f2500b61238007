"""One writer per run, per rank: kernel file locks, with the holder written inside for people.

Each writer holds `flock(LOCK_EX)` on `locks/rank-NNNNN.lock` for as long as it runs; the
kernel drops the lock when the process dies, however it dies, so a lock can never be held
twice and a crashed writer never blocks the next one. Inside the file the holder writes a
JSON record (PID, host, start time, rank, world, phase) for `status` and `doctor`; the record
is only information: whether a lock is live is asked of the kernel, never parsed from it.

Split and whole-run writers exclude each other through `locks/run.lock`: a writer of a
split run (`--world` > 1) holds it shared, a whole-run writer (`--world` 1) exclusive.

A record naming another host is never taken over: file locks may not reach across the
hosts of a shared filesystem, and that writer cannot be checked from here. A record that
cannot be parsed (a torn or damaged file) belongs to no live writer and is taken over.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError

RUN_LOCK = "run.lock"


def _proc_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class LockHeld(EyasError):
    """Another writer holds the lock; the message names it."""


@dataclass
class LockInfo:
    path: Path
    live: bool
    record: dict | None  # None: empty (released) or unreadable
    problem: str = ""  # why the record could not be read

    @property
    def pid(self) -> int | None:
        pid = (self.record or {}).get("pid")
        return pid if isinstance(pid, int) else None

    @property
    def host(self) -> str:
        return str((self.record or {}).get("host", "?"))

    @property
    def phase(self) -> str | None:
        return (self.record or {}).get("phase")

    @property
    def foreign(self) -> bool:
        """Held, as far as the record says, by a writer on another host."""
        return self.record is not None and self.host != socket.gethostname()

    def describe(self) -> str:
        if self.record is None:
            who = f"unreadable holder record ({self.problem})" if self.problem else "no record"
        else:
            r = self.record
            who = f"PID {r.get('pid')} on {r.get('host')} since {r.get('started')}"
            if isinstance(r.get("world"), int) and r["world"] > 1:
                who += f", rank {r.get('rank')}/{r.get('world')}"
            if r.get("phase"):
                who += f", {r['phase']}"
        state = "live" if self.live else "on another host" if self.foreign else "stale"
        return f"{who} ({state})"


def _parse_record(data: bytes) -> tuple[dict | None, str]:
    if not data.strip():
        return None, ""
    try:
        rec = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, "not valid JSON"
    if not isinstance(rec, dict):
        return None, f"a JSON {type(rec).__name__}, not an object"
    if not isinstance(rec.get("pid"), int) or not isinstance(rec.get("host"), str):
        return None, "no numeric pid and host"
    return rec, ""


def _probe(fd: int) -> bool:
    """True when some process holds the lock exclusively (a writer)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def read_lock(path: Path) -> LockInfo | None:
    """The lock's state: live (a writer holds it), stale (a record but no holder), or None
    when the file is absent or empty (nobody ever held it, or the holder released it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        live = _probe(fd)
        data = os.pread(fd, 1 << 16, 0)
    finally:
        os.close(fd)
    rec, problem = _parse_record(data)
    if not live and rec is None and not problem:
        return None
    return LockInfo(Path(path), live, rec, problem)


def _try_lock(fd: int, exclusive: bool, probed: bool = False) -> bool:
    """Take the lock without blocking. On a lock that readers probe (`probed`), a reader's
    brief shared hold is waited out; a writer's exclusive hold never is."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    for _ in range(2000):
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if not (exclusive and probed) or _probe(fd):
            return False  # a writer holds it
        time.sleep(0.0005)  # only readers: they let go within microseconds
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WriterLock:
    """The locks of one writer: `locks/run.lock` (shared or exclusive) and its rank's lock."""

    def __init__(self, run: Path, rank: int, world: int, what: str = "extract"):
        self.run, self.rank, self.world, self.what = Path(run), rank, world, what
        self.dir = self.run / "locks"
        self.path = self.dir / f"rank-{rank:05d}.lock"
        self.taken_over: LockInfo | None = None
        self._fds: list[int] = []

    def acquire(self) -> WriterLock:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            run_fd = self._open(self.dir / RUN_LOCK)
            if not _try_lock(run_fd, exclusive=self.world == 1):
                raise LockHeld(self._who_holds_run())
            fd = self._open(self.path)
            deadline = time.monotonic() + 30
            while not (got := _try_lock(fd, exclusive=True, probed=True)):
                # The recorded writer is dead but the lock is held: children it forked still
                # hold the open file and are exiting. Give them a moment.
                rec = _parse_record(os.pread(fd, 1 << 16, 0))[0]
                mine = rec is not None and rec.get("host") == socket.gethostname()
                if not (mine and not _pid_alive(rec["pid"])) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if not got:
                holder = read_lock(self.path)
                raise LockHeld(
                    f"{self.path} is held by {holder.describe() if holder else 'another writer'}; "
                    f"another {self.what} is running on {self.run}"
                )
            rec, problem = _parse_record(os.pread(fd, 1 << 16, 0))
            if rec is not None and rec.get("host") != socket.gethostname():
                raise LockHeld(
                    f"{self.path} names a writer on another host ({rec.get('host')}, PID "
                    f"{rec.get('pid')}) that cannot be checked from here; if it is gone, delete "
                    f"{self.path} and start again"
                )
            if rec is not None or problem:
                self.taken_over = LockInfo(self.path, False, rec, problem)
            self.set_phase("starting")
        except BaseException:
            self.release()
            raise
        return self

    def _open(self, path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._fds.append(fd)
        return fd

    def _who_holds_run(self) -> str:
        live = [lk for lk in live_locks(self.run)]
        names = "; ".join(lk.describe() for lk in live) or "a writer starting up"
        if self.world == 1:
            return (
                f"{self.run} has live writers ({names}); {self.what} cannot start while "
                "they run. Let them finish (split extracts: resume their ranks with the same --rank/--world)"
            )
        return (
            f"{self.run} is being extracted as a whole by another writer ({names}); "
            "let it finish, it covers every rank's samples"
        )

    def set_phase(self, phase: str) -> None:
        """Rewrite the holder record (what `status` shows: loading the model, extracting)."""
        if len(self._fds) < 2:
            return
        rec = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "proc_start": _proc_start(os.getpid()),
            "started": getattr(self, "_started", None) or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rank": self.rank,
            "world": self.world,
            "phase": phase,
        }
        self._started = rec["started"]
        self._owned = True
        data = json.dumps(rec).encode()
        fd = self._fds[1]
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def release(self) -> None:
        """Clear the record and let go; the file stays (deleting it would let a process
        that opened it earlier lock a file nobody else can see)."""
        if len(self._fds) >= 2 and getattr(self, "_owned", False):
            try:
                os.ftruncate(self._fds[1], 0)
            except OSError:
                pass
        for fd in reversed(self._fds):
            try:
                os.close(fd)  # closing drops the flock
            except OSError:
                pass
        self._fds = []

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_files(run: Path) -> list[Path]:
    d = Path(run) / "locks"
    return sorted(d.glob("rank-*.lock")) if d.is_dir() else []


def all_locks(run: Path) -> list[LockInfo]:
    return [lk for lk in (read_lock(p) for p in lock_files(run)) if lk is not None]


def live_locks(run: Path) -> list[LockInfo]:
    return [lk for lk in all_locks(run) if lk.live]

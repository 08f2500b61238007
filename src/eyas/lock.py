"""One writer per run (per rank): a lock file holding PID, host and process start time.

A second writer is refused with the holder named. A lock whose PID is dead on this host
(or alive but a different process, by its start time) is stale and taken over atomically.
A lock held on another host cannot be checked from here and is never taken over.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from .fsutil import fsync_dir


def _proc_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class LockInfo:
    path: Path
    pid: int
    host: str
    started: str
    proc_start: str | None
    live: bool | None  # None: held on another host, liveness unknown

    def describe(self) -> str:
        state = "live" if self.live else "stale" if self.live is False else "on another host"
        return f"PID {self.pid} on {self.host} since {self.started} ({state})"


def read_lock(path: Path) -> LockInfo | None:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, OSError):
        return LockInfo(
            path, -1, "?", "?", None, False
        )  # torn lock file: no writer finished writing it
    live = None
    if d.get("host") == socket.gethostname():
        pid = int(d.get("pid", -1))
        live = (
            pid > 0
            and pid_alive(pid)
            and (d.get("proc_start") is None or _proc_start(pid) == d.get("proc_start"))
        )
    return LockInfo(
        path,
        int(d.get("pid", -1)),
        d.get("host", "?"),
        d.get("started", "?"),
        d.get("proc_start"),
        live,
    )


class LockHeld(RuntimeError):
    pass


def acquire_lock(path: Path) -> LockInfo | None:
    """Take the writer lock; returns the stale lock that was taken over, if any."""
    path.parent.mkdir(parents=True, exist_ok=True)
    me = {
        "pid": os.getpid(), "host": socket.gethostname(), "proc_start": _proc_start(os.getpid()),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip
    taken_over = None
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_lock(path)
            if holder is None:
                continue
            if holder.live is False:
                taken_over = holder
                # Replace atomically so two takers cannot both win.
                stale = path.with_name(path.name + f".stale-{os.getpid()}")
                try:
                    os.rename(path, stale)
                    stale.unlink()
                except FileNotFoundError:
                    pass
                continue
            raise LockHeld(
                f"{path} is held by {holder.describe()}; another extract is running on this run"
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path.parent)
        return taken_over
    raise LockHeld(f"could not take {path}: it keeps changing")


def release_lock(path: Path) -> None:
    info = read_lock(path)
    if info is not None and info.pid == os.getpid():
        path.unlink(missing_ok=True)

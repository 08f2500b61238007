"""`eyas status`: where an extraction run stands, read from its directory alone.

Counts come from the journals (what is committed), the error logs (what failed its checks)
and run.json (what the run is for); nothing is inferred from files merely existing.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .fsutil import filesystem_info
from .lock import read_lock
from .store import read_all_journals, read_errors, read_run_meta, stray_temp_files


@dataclass
class RunStatus:
    run: str
    total: int
    done: int
    failed: int
    remaining: int
    tokens_total: int
    tokens_done: int
    bytes_done: int
    bytes_projected: int
    bytes_needed: int
    free_bytes: int
    fs_type: str
    mount_point: str
    fs_warning: str | None
    last_commit: float | None
    recent_samples_per_s: float
    recent_tokens_per_s: float
    eta_seconds: float | None
    locks: list[dict] = field(default_factory=list)
    temp_files: int = 0
    ranks: list[int] = field(default_factory=list)

    @property
    def live_writer(self) -> bool:
        return any(lk["live"] for lk in self.locks)

    def to_dict(self) -> dict:
        return {**asdict(self), "live_writer": self.live_writer}


def run_status(run: str | Path, recent_window: float = 600.0) -> RunStatus:
    run = Path(run)
    meta = read_run_meta(run)
    journals = read_all_journals(run)
    entries = {e["index"]: e for es in journals.values() for e in es}
    failed = {e["index"] for e in read_errors(run)} - set(entries)
    total = meta["samples"]
    tokens_done = sum(e["tokens"] for e in entries.values())
    bytes_done = sum(e["size"] for e in entries.values())
    tokens_total = meta["tokens"]
    per_token = bytes_done / tokens_done if tokens_done else meta["bytes_per_token"]
    projected = int(per_token * tokens_total)
    fs = filesystem_info(run)

    times = sorted(e["t"] for e in entries.values() if "t" in e)
    last = times[-1] if times else None
    rs = rt = 0.0
    if last is not None:
        recent = [e for e in entries.values() if e.get("t", 0) >= last - recent_window]
        span = last - min(e["t"] for e in recent)
        if len(recent) > 1 and span > 0:
            rs = (len(recent) - 1) / span
            rt = sum(e["tokens"] for e in recent) / span
    remaining = total - len(entries) - len(failed)
    tokens_left = max(tokens_total - tokens_done, 0)
    eta = tokens_left / rt if rt > 0 else None
    locks = []
    for p in sorted((run / "locks").glob("*.lock")) if (run / "locks").is_dir() else []:
        info = read_lock(p)
        if info is not None:
            locks.append({"path": str(p), "pid": info.pid, "host": info.host, "started": info.started,
                          "live": bool(info.live), "describe": info.describe()})  # fmt: skip
    return RunStatus(
        run=str(run), total=total, done=len(entries), failed=len(failed), remaining=remaining,
        tokens_total=tokens_total, tokens_done=tokens_done, bytes_done=bytes_done,
        bytes_projected=projected, bytes_needed=max(projected - bytes_done, 0),
        free_bytes=fs.free_bytes, fs_type=fs.fs_type, mount_point=fs.mount_point, fs_warning=fs.warning(),
        last_commit=last, recent_samples_per_s=rs, recent_tokens_per_s=rt, eta_seconds=eta,
        locks=locks, temp_files=len(stray_temp_files(run)), ranks=sorted(journals),
    )  # fmt: skip


def ago(t: float | None) -> str:
    if t is None:
        return "never"
    from .fsutil import human_duration

    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))} ({human_duration(time.time() - t)} ago)"

"""Durable file operations and filesystem facts shared by every stage.

Guarantee: a file published with `atomic_write` is either the complete new content or
whatever was there before, also after a power failure: data is written to a temp file in
the same directory, fsynced, renamed over the final name, and the directory is fsynced.
A failed fsync is never retried (the kernel may have dropped the dirty pages); the temp
file is removed and the error propagates so the caller redoes the work.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from eyas.errors import UsageError

TMP_MARK = ".tmp-"


class DiskFullError(OSError):
    """Raised when a write fails for lack of space (ENOSPC/EDQUOT) or the free-space floor is hit."""


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")


def is_temp_file(path: Path) -> bool:
    return TMP_MARK in path.name


def atomic_write(
    path: Path, write: Callable[[BinaryIO], None], *, reserve: int = 0, sync_dir: bool = True
) -> None:
    """Publish `path` atomically; `write(f)` fills the temp file.

    `reserve` bytes are allocated up front with posix_fallocate so that a full disk
    surfaces as ENOSPC here, before any byte is written, rather than at close time.
    With `sync_dir=False` the caller fsyncs the directory itself (once for many files)
    before it relies on the rename.
    """
    path = Path(path)
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            if reserve > 0:
                os.posix_fallocate(f.fileno(), 0, reserve)
            write(f)
            f.flush()
            if reserve > 0:
                f.truncate(f.tell())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise DiskFullError(exc.errno, f"no space left writing {path}") from exc
        raise
    if sync_dir:
        fsync_dir(path.parent)


_libc = None


def reserve_beyond_eof(fd: int, nbytes: int) -> bool:
    """Allocate `nbytes` past the end of a file without changing its size (fallocate with
    FALLOC_FL_KEEP_SIZE), so later appends cannot fail for space. Raises DiskFullError
    when the space is not there; returns False where the filesystem cannot reserve."""
    global _libc
    import ctypes
    import ctypes.util

    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    size = os.fstat(fd).st_size
    if _libc.fallocate(fd, 1, size, nbytes) == 0:  # 1 = FALLOC_FL_KEEP_SIZE
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(err, "no space left to reserve journal space")
    return False


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data), reserve=len(data))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def honour_umask(path: Path) -> None:
    """Give a file the mode a plain `open` would (0666 less the umask): some writers create
    0600 files, which a server running as another user cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def hash_file(path: Path, h, chunk: int = 1 << 22) -> str:
    """The hex digest of `path` by the hash object `h` (hashlib's or xxhash's), read in chunks."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    return hash_file(path, hashlib.sha256())


@dataclass(frozen=True)
class FilesystemInfo:
    path: str
    mount_point: str
    device: str
    fs_type: str
    total_bytes: int
    free_bytes: int

    def warning(self) -> str | None:
        if self.fs_type in ("tmpfs", "ramfs"):
            return f"{self.path} is on {self.fs_type}: its contents are lost at reboot"
        if self.fs_type == "overlay":
            return f"{self.path} is on an overlay filesystem (a container layer): it may vanish with the container"
        if is_under_tmp(self.path):
            return f"{self.path} is under /tmp: it may be cleaned at reboot"
        return None


def is_under_tmp(path: str | Path) -> bool:
    p = Path(path).resolve()
    return any(p == Path(t) or Path(t) in p.parents for t in ("/tmp", "/var/tmp", "/dev/shm"))


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def filesystem_info(path: str | Path, mounts_file: str = "/proc/mounts") -> FilesystemInfo:
    """Device, type and space of the filesystem that holds `path` (or would hold it)."""
    real = _existing_ancestor(Path(path)).resolve()
    usage = shutil.disk_usage(real)
    mount_point, device, fs_type = "/", "?", "?"
    try:
        with open(mounts_file, encoding="utf-8") as f:
            best = -1
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mp = parts[1].replace("\\040", " ")
                mpath = Path(mp)
                if (real == mpath or mpath in real.parents) and len(mp) > best:
                    best, mount_point, device, fs_type = len(mp), mp, parts[0], parts[2]
    except OSError:
        pass
    return FilesystemInfo(
        str(Path(path).absolute()), mount_point, device, fs_type, usage.total, usage.free
    )


def free_bytes(path: str | Path) -> int:
    return shutil.disk_usage(_existing_ancestor(Path(path))).free


def human_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def human_duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(seconds)
    if s < 1:
        return "<1s" if seconds > 0 else "0s"
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def parse_size(spec: str, total: int) -> int:
    """'2%' of `total` (at least 1 GiB, or 5% of a small filesystem), or '500M', '2GiB', bytes."""
    s = str(spec).strip()
    try:
        if s.endswith("%"):
            pct = float(s[:-1])
            return int(max(total * pct / 100, min(1 << 30, total * 0.05))) if pct > 0 else 0
        units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
        low = s.lower().removesuffix("ib").removesuffix("b")
        if low and low[-1] in units:
            return int(float(low[:-1]) * units[low[-1]])
        return int(float(low))
    except ValueError:
        raise UsageError(
            f"cannot read size {spec!r}: use bytes, a K/M/G suffix or a percentage"
        ) from None

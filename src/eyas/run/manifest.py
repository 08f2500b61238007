"""Manifests: a directory's files, their sizes and xxh3-128 checksums, written last.

What makes the sample store safe, applied to everything else eyas writes as a directory
(training checkpoints, the final drafter, exports): the files are written and fsynced, then
the manifest is published atomically. A directory is trusted only when its manifest exists
and every file it names has its recorded size and checksum; anything else is damage, named
in one line, and the caller falls back to an older good state or stops.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from eyas.errors import ProblemError
from eyas.run.fsutil import atomic_write_json, hash_file


class ManifestError(ProblemError):
    """A directory that does not match its manifest; the message names the file and why."""


def file_digest(path: Path) -> str:
    return hash_file(path, xxhash.xxh3_128())


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_manifest(directory: Path, names: list[str], manifest: str, **extra) -> Path:
    """fsync `names` (files in `directory`), then publish `manifest` naming them with their
    sizes and checksums, plus `extra` fields. The manifest is the last thing written."""
    directory = Path(directory)
    files = {}
    for name in names:
        p = directory / name
        fsync_file(p)
        files[name] = {"size": p.stat().st_size, "xxh3_128": file_digest(p)}
    path = directory / manifest
    atomic_write_json(path, {**extra, "files": files})
    return path


def read_manifest(directory: Path, manifest: str) -> dict:
    """The manifest, checked for shape (not yet against the files)."""
    path = Path(directory) / manifest
    try:
        m = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing (the directory was not completely written)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: unreadable ({exc})") from None
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, dict)
        and isinstance(v.get("size"), int)
        and isinstance(v.get("xxh3_128"), str)
        for v in files.values()
    ):
        raise ManifestError(f"{path}: damaged (no valid list of files)")
    return m


def check_manifest(directory: Path, manifest: str, *, checksums: bool = True) -> dict:
    """Raise ManifestError naming the first file that is missing, has another size, or (with
    `checksums`) another checksum than the manifest records; return the manifest."""
    directory = Path(directory)
    m = read_manifest(directory, manifest)
    for name, want in m["files"].items():
        p = directory / name
        if "/" in name or name.startswith("."):
            raise ManifestError(
                f"{directory / manifest}: names a file outside its directory: {name!r}"
            )
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise ManifestError(f"{p}: missing (listed in {manifest})") from None
        if size != want["size"]:
            raise ManifestError(
                f"{p}: {size} bytes, {manifest} records {want['size']} (truncated or replaced)"
            )
        if checksums and file_digest(p) != want["xxh3_128"]:
            raise ManifestError(f"{p}: checksum does not match {manifest} (the file is damaged)")
    return m

"""The journals and error logs of an extraction run: what is committed, and what failed.

One append-only JSONL journal per writer rank (`journal/rank-NNNNN.jsonl`): a line per
committed sample, written only after the sample file is published (see `store`). Every
line is checked when read: a line that is not a valid entry is damage, reported with its
number and set aside by repairs; a final line without its newline is a torn append and is
cut. `committed(run)` is the one answer to "which sample files should exist".

A run streamed to a trainer (`extract --max-store`, `--passes`) has two more kinds of line:
an entry with `"pass": p` (p > 0) is the sample extracted again for pass p, and a copy of
an entry with `"retired": true` says its file was deleted after every follower had a
durable checkpoint past it. `ledger(run)` folds them: per pass, which samples were
committed and which retired; a retired sample is done, never missing.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from eyas.run.fsutil import DiskFullError, atomic_write_bytes, reserve_beyond_eof


def journal_path(run: Path, rank: int) -> Path:
    return run / "journal" / f"rank-{rank:05d}.jsonl"


def errors_path(run: Path, rank: int) -> Path:
    return run / "errors" / f"rank-{rank:05d}.jsonl"


class Journal:
    """Append-only JSONL journal of committed samples, one per rank.

    A torn last line (crash mid-append) is cut off on open. Appends are buffered and
    fsynced by `sync()`; an entry lost at a crash leaves a valid file without an entry,
    which `resume` checks and adopts or redoes.
    """

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._cut_torn_tail()
        self._f = open(path, "ab")
        self._pending = 0
        self._reserved = 0

    def _cut_torn_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
                os.fsync(f.fileno())

    def reserve(self, entries: int) -> None:
        """Make sure the next `entries` lines fit on the disk before their samples are
        written, so a full disk never leaves complete files without their journal lines."""
        need = entries * 512
        if self._reserved < need:
            self._f.flush()
            if reserve_beyond_eof(self._f.fileno(), max(need, 64 << 10)):
                self._reserved = max(need, 64 << 10)

    def append(self, entry: dict) -> None:
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        self._f.write(line)
        self._reserved -= len(line)
        self._pending += 1

    def flush(self) -> None:
        """Hand entries to the kernel (survives a killed process; `sync` survives power loss)."""
        self._f.flush()

    def sync(self) -> None:
        if self._pending:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError as exc:
                if exc.errno in (28, 122):
                    raise DiskFullError(
                        exc.errno, f"no space left appending to {self.path}"
                    ) from exc
                raise
            self._pending = 0

    def close(self) -> None:
        """Sync and close; on a full disk the unsynced entries are dropped, not raised:
        their sample files are complete and `recover` adopts them on resume."""
        try:
            self.sync()
        except DiskFullError:
            pass
        finally:
            try:
                self._f.close()
            except OSError:
                pass


_HEX32 = re.compile(r"[0-9a-f]{32}")


def entry_problem(e: object) -> str | None:
    """Why a parsed journal line is not a valid entry, or None."""
    if not isinstance(e, dict):
        return f"a JSON {type(e).__name__}, not an object"
    for key, typ in (
        ("index", int),
        ("size", int),
        ("tokens", int),
        ("header_xxh3", str),
        ("id", str),
    ):
        v = e.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            return f"field {key!r} is missing or not a {typ.__name__}"
    if e["index"] < 0 or e["size"] <= 0 or e["tokens"] < 0:
        return "negative index, size or token count"
    if not _HEX32.fullmatch(e["header_xxh3"]):
        return "header_xxh3 is not a 128-bit hex digest"
    p = e.get("pass", 0)
    if not isinstance(p, int) or isinstance(p, bool) or p < 0:
        return "field 'pass' is not a non-negative integer"
    if e.get("retired", True) is not True:
        return "field 'retired' is not true"
    return None


def pass_of(e: dict) -> int:
    return e.get("pass", 0)


@dataclass
class JournalScan:
    path: Path
    entries: list[dict] = field(default_factory=list)
    damaged: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)


def scan_journal(path: Path) -> JournalScan:
    """Valid entries of one journal, and its damaged lines by number. A final line without
    its newline is a torn append (the writer died mid-write): ignored, not damage."""
    scan = JournalScan(Path(path))
    if not path.exists():
        return scan
    lines = path.read_bytes().split(b"\n")
    for n, line in enumerate(lines, start=1):
        if not line.strip() or n == len(lines):  # the last piece has no newline: torn or empty
            continue
        try:
            e = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            scan.damaged.append((n, "not UTF-8 text"))
            continue
        except json.JSONDecodeError:
            scan.damaged.append((n, "not valid JSON"))
            continue
        problem = entry_problem(e)
        if problem:
            scan.damaged.append((n, problem))
        else:
            scan.entries.append(e)
    return scan


def read_journal(path: Path) -> list[dict]:
    return scan_journal(path).entries


def journal_files(run: Path) -> dict[int, Path]:
    d = run / "journal"
    out = {}
    for p in sorted(d.glob("rank-*.jsonl")) if d.is_dir() else []:
        m = re.fullmatch(r"rank-(\d+)\.jsonl", p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def scan_journals(run: Path) -> dict[int, JournalScan]:
    return {rank: scan_journal(p) for rank, p in journal_files(run).items()}


def read_all_journals(run: Path) -> dict[int, list[dict]]:
    return {rank: s.entries for rank, s in scan_journals(run).items()}


@dataclass
class Ledger:
    """The journals folded: per pass, the committed samples (index -> first entry) and
    the retired ones; `present`: the samples whose files should exist (index -> the entry
    of the newest pass that committed it and has not retired it)."""

    commits: list[dict[int, dict]]
    retired: list[set[int]]
    present: dict[int, dict]

    def passes_seen(self) -> int:
        return len(self.commits)

    def pass_commits(self, p: int) -> dict[int, dict]:
        return self.commits[p] if p < len(self.commits) else {}

    def pass_retired(self, p: int) -> set[int]:
        return self.retired[p] if p < len(self.retired) else set()

    def add(self, e: dict) -> None:
        """Fold one more line in (a writer keeps its ledger current as it appends)."""
        p, i = pass_of(e), e["index"]
        while len(self.commits) <= p:
            self.commits.append({})
            self.retired.append(set())
        if e.get("retired"):
            self.retired[p].add(i)
            if i in self.present and pass_of(self.present[i]) == p:
                del self.present[i]
        elif i not in self.commits[p]:
            self.commits[p][i] = e
            cur = self.present.get(i)
            if (cur is None and i not in self.retired[p]) or (cur is not None and pass_of(cur) < p):
                self.present[i] = e


def ledger(run: Path, scans: dict[int, JournalScan] | None = None) -> Ledger:
    """The ledger of a run's journals (from `scans` when the caller has them already).
    Lines are folded pass by pass, so the order of the rank journals does not matter."""
    lines = [
        e
        for _, scan in sorted((scans if scans is not None else scan_journals(run)).items())
        for e in scan.entries
    ]
    led = Ledger([], [], {})
    by_pass: dict[int, list[dict]] = defaultdict(list)
    for e in lines:
        by_pass[pass_of(e)].append(e)
    for p in sorted(by_pass):
        for e in sorted(by_pass[p], key=lambda e: bool(e.get("retired"))):  # commits first
            led.add(e)
    return led


def committed(run: Path, scans: dict[int, JournalScan] | None = None) -> dict[int, dict]:
    """Every sample of a run (all ranks) whose file should exist: index -> its journal
    entry (the first one; the newest pass's for a run with passes). Retired samples are
    not in it: their files are deleted on purpose."""
    return ledger(run, scans).present


def rewrite_journal(path: Path, entries: list[dict]) -> None:
    atomic_write_bytes(
        path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries).encode()
    )


def set_aside_damaged_lines(run: Path, scan: JournalScan) -> Path | None:
    """Copy a journal with damaged lines into quarantine, then keep only its valid entries.
    The samples of the dropped lines are files without an entry: adopted by their checksums
    on resume, or re-extracted. Only a writer holding the rank's lock, or a repair with no
    writer live, may call this."""
    if not scan.damaged:
        return None
    q = run / "quarantine" / f"journal-{time.strftime('%Y%m%d-%H%M%S')}" / scan.path.name
    q.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(q, scan.path.read_bytes())
    rewrite_journal(scan.path, scan.entries)
    return q


def append_error(run: Path, rank: int, entry: dict) -> None:
    p = errors_path(run, rank)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_errors(run: Path) -> list[dict]:
    out = []
    for p in sorted((run / "errors").glob("rank-*.jsonl")) if (run / "errors").is_dir() else []:
        for line in p.read_bytes().splitlines():
            try:
                e = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(e, dict) and isinstance(e.get("index"), int):
                out.append(e)
    return out

"""`eyas verify`: check every journaled sample of a run, and repair what is broken.

Checks per journaled sample: the file is present, its header is valid, shapes and dtypes
agree with each other and with the run, the token count matches, the size matches the
journal, and (unless `quick`) every tensor's checksum and the whole-file checksum hold.
Also finds orphans (files no journal names), duplicates (an index journaled twice) and
stray temp files. `repair` moves bad files to `quarantine/`, drops their journal entries
and removes temp files, so that `extract --resume` re-extracts exactly those samples.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .fsutil import fsync_dir, is_temp_file
from .lock import read_lock
from .store import (
    StoreError,
    check_sample_file,
    iter_sample_files,
    journal_path,
    read_all_journals,
    read_run_meta,
    rewrite_journal,
    stray_temp_files,
)


@dataclass
class Problem:
    kind: str  # missing | corrupt | orphan | duplicate | temp
    path: str
    detail: str
    index: int | None = None


@dataclass
class VerifyReport:
    run: str
    checked: int = 0
    ok: int = 0
    problems: list[Problem] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    quick: bool = False
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not self.problems

    def count(self, kind: str) -> int:
        return sum(p.kind == kind for p in self.problems)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "run": self.run, "clean": self.clean, "checked": self.checked, "ok": self.ok,
            "quick": self.quick, "repaired": self.repaired,
            "counts": {k: self.count(k) for k in ("missing", "corrupt", "orphan", "duplicate", "temp")},
            "bytes_read": self.bytes_read, "seconds": round(self.seconds, 3), "mb_per_s": round(self.mb_per_s, 1),
            "problems": [p.__dict__ for p in self.problems],
        }  # fmt: skip


def verify(
    run: str | Path, *, quick: bool = False, repair: bool = False, workers: int | None = None
) -> VerifyReport:
    run = Path(run)
    meta = read_run_meta(run)
    H = meta["hidden_size"]
    rep = VerifyReport(str(run), quick=quick)
    journals = read_all_journals(run)

    by_index: dict[int, list[tuple[int, dict]]] = defaultdict(list)
    for rank, entries in journals.items():
        for e in entries:
            by_index[e["index"]].append((rank, e))

    t0 = time.monotonic()
    items = sorted(by_index.items())

    def check(item):
        idx, refs = item
        entry = refs[0][1]
        return (
            idx,
            refs,
            check_sample_file(run / entry["path"], checksums=not quick, hidden_size=H, entry=entry),
        )

    bad: set[int] = set()
    with ThreadPoolExecutor(workers or min(8, (os.cpu_count() or 2))) as ex:
        for idx, refs, c in ex.map(check, items):
            rep.checked += 1
            rep.bytes_read += c.nbytes if not quick else 0
            if c.ok:
                rep.ok += 1
            else:
                kind = "missing" if "is missing" in c.problem else "corrupt"
                rep.problems.append(Problem(kind, str(c.path), c.problem, idx))
                bad.add(idx)
            if len(refs) > 1:
                ranks = ", ".join(f"rank {r}" for r, _ in refs)
                rep.problems.append(
                    Problem(
                        "duplicate",
                        refs[0][1]["path"],
                        f"sample {idx} journaled {len(refs)} times ({ranks})",
                        idx,
                    )
                )
    rep.seconds = time.monotonic() - t0

    named = {run / e["path"] for refs in by_index.values() for _, e in refs}
    for p in iter_sample_files(run):
        if is_temp_file(p):
            continue
        if p not in named:
            rep.problems.append(Problem("orphan", str(p), f"{p}: file has no journal entry"))
    for p in stray_temp_files(run):
        rep.problems.append(Problem("temp", str(p), f"{p}: temp file left by an interrupted write"))

    if repair and rep.problems:
        live = [
            lk
            for lk in (read_lock(p) for p in sorted((run / "locks").glob("*.lock")))
            if lk and lk.live is not False
        ]
        if live:
            raise StoreError(
                f"{run}: cannot repair while a writer holds the run: {live[0].describe()}"
            )
        _repair(run, rep, journals, bad)
        rep.repaired = True
    return rep


def _repair(run: Path, rep: VerifyReport, journals: dict[int, list[dict]], bad: set[int]) -> None:
    qdir = run / "quarantine" / time.strftime("%Y%m%d-%H%M%S")
    for p in rep.problems:
        src = Path(p.path)
        if p.kind == "temp":
            src.unlink(missing_ok=True)
        elif p.kind in ("corrupt", "orphan") and src.exists():
            dst = qdir / src.relative_to(run)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(src, dst)
            fsync_dir(src.parent)
    seen: set[int] = set()
    for rank, entries in sorted(journals.items()):
        keep = []
        for e in entries:
            if e["index"] in bad or e["index"] in seen:
                continue
            seen.add(e["index"])
            keep.append(e)
        if len(keep) != len(entries):
            rewrite_journal(journal_path(run, rank), keep)

"""`eyas verify`: check every journaled sample of a run, and repair what is broken.

Per journaled sample: the file (at the path its index gives) is present, its header is
valid, its tensors agree with the run's layout and hidden size, the token count matches,
size, header hash and sample index match the journal entry, and (unless `quick`) every
tensor's checksum holds. Around the samples: `run.json` and its backup, every journal line
(a line that is not a valid entry is damage, reported with its number), files no journal
names, samples journaled twice, stray temp files.

A file without an entry that is intact is not damage: the crash came between its rename
and its journal line (or its line was damaged), and `extract --resume` adopts it after
checking every checksum. `repair` quarantines bad files, sets damaged journal lines aside
(a copy goes to `quarantine/`), drops entries of bad files and restores a damaged
`run.json` from its backup, so that `extract --resume` re-extracts exactly what was lost.
Repairs never act on a path read from a file: only on paths derived from sample indices.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from eyas.host.ui import Reporter
from eyas.run.fsutil import fsync_dir, is_temp_file
from eyas.run.journal import (
    journal_files,
    ledger,
    pass_of,
    rewrite_journal,
    scan_journals,
    set_aside_damaged_lines,
)
from eyas.run.lock import LockHeld, WriterLock
from eyas.run.runmeta import is_run, load_run_meta, restore_run_meta
from eyas.run.store import (
    Layout,
    StoreError,
    check_sample_file,
    ensure_inside,
    iter_sample_files,
    sample_index_of,
    sample_relpath,
    samples_dir,
    stray_temp_files,
)
from eyas.stages.config import VerifyConfig

KINDS = ("missing", "corrupt", "orphan", "duplicate", "temp", "journal", "meta")


@dataclass
class Problem:
    kind: str  # one of KINDS
    path: str
    detail: str
    index: int | None = None


@dataclass
class VerifyReport:
    run: str
    checked: int = 0
    ok: int = 0
    problems: list[Problem] = field(default_factory=list)
    unjournaled: list[str] = field(default_factory=list)  # intact files that resume adopts
    retired: int = 0  # consumed by a following trainer and deleted: done, not missing
    bytes_read: int = 0
    seconds: float = 0.0
    quick: bool = False
    repaired: bool = False
    repairs: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems

    def count(self, kind: str) -> int:
        return sum(p.kind == kind for p in self.problems)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def render(self) -> str:
        """The report for people, as text."""
        run, lines = self.run, []
        what = "headers and sizes" if self.quick else "headers, sizes and checksums"
        hashed = (
            ""
            if self.quick
            else f"; {self.bytes_read / 1e6:.1f} MB hashed at {self.mb_per_s:.0f} MB/s"
        )
        lines.append(
            f"checked {self.checked} samples ({what}): {self.ok} ok in {self.seconds:.2f}s{hashed}"
        )
        if self.retired:
            lines.append(
                f"  {self.retired} retired sample(s): consumed by training and deleted (done, "
                "not missing)"
            )
        lines += [f"  {p.kind:9s} {p.detail}" for p in self.problems]
        if self.unjournaled:
            lines.append(
                f"  {len(self.unjournaled)} intact sample file(s) have no journal entry (written "
                f"just before a stop): `eyas extract --resume {run}` adopts them after checking "
                "every checksum"
            )
        lines += [f"  repaired: {r}" for r in self.repairs]
        if self.repaired:
            lines.append(f"repaired; now run: eyas extract --resume {run}")
        elif self.problems:
            lines.append(f"to fix: eyas verify --repair {run} && eyas extract --resume {run}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "run": self.run,
            "clean": self.clean,
            "checked": self.checked,
            "ok": self.ok,
            "quick": self.quick,
            "repaired": self.repaired,
            "repairs": self.repairs,
            "counts": {k: self.count(k) for k in KINDS},
            "unjournaled": len(self.unjournaled),
            "retired": self.retired,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3),
            "mb_per_s": round(self.mb_per_s, 1),
            "problems": [p.__dict__ for p in self.problems],
        }


def verify(cfg: VerifyConfig | str | Path, *, workers: int | None = None) -> VerifyReport:
    """Check a run (`cfg`, or the run's path for the defaults: every checksum, no repair);
    with `repair`, hold the whole run's writer lock from before the check until the repair
    is done, so no writer can append to what the repair rewrites."""
    if not isinstance(cfg, VerifyConfig):
        cfg = VerifyConfig(run=str(cfg))
    run, quick, repair, progress = Path(cfg.run), cfg.quick, cfg.repair, cfg.progress
    if not repair:
        return _verify(Path(run), quick, False, workers, progress)
    if not is_run(run):
        return _verify(Path(run), quick, False, workers, progress)  # raises: not a run
    try:
        lock = WriterLock(Path(run), 0, 1, what="verify --repair").acquire()
    except LockHeld as exc:
        raise StoreError(f"cannot repair while a writer holds the run: {exc}") from None
    try:
        lock.set_phase("repairing")
        return _verify(Path(run), quick, True, workers, progress)
    finally:
        lock.release()


def _verify(
    run: Path, quick: bool, repair: bool, workers: int | None, progress: bool
) -> VerifyReport:
    rep = VerifyReport(str(run), quick=quick)
    meta = _check_meta(run, rep)
    H, layout, total = meta["hidden_size"], Layout.parse(meta.get("layout")), meta["samples"]
    scans = scan_journals(run)
    led = ledger(run, scans)
    rep.retired = sum(len(r) for r in led.retired)
    refs = _journal_refs(rep, scans, total)
    # The samples whose files should exist: each with its pass's journal lines.
    by_index = {i: refs[(pass_of(e), i)] for i, e in led.present.items() if i < total}
    retired_files = {i for r in led.retired for i in r} - set(led.present)
    bad = _check_samples(run, rep, by_index, H, layout, quick, workers, progress)
    _check_strays(run, rep, by_index, retired_files, H, layout, total, quick)
    if repair and rep.problems:
        _repair(run, rep, scans, led, bad, total)
        rep.repaired = True
    return rep


def _check_meta(run: Path, rep: VerifyReport) -> dict:
    """The run's meta (raises StoreError when neither copy is usable); damage to a copy is a problem."""
    mr = load_run_meta(run)
    for damage in (
        mr.damage,
        mr.backup_damage and f"{run / 'run.backup.json'} is {mr.backup_damage}",
    ):
        if damage:
            rep.problems.append(Problem("meta", str(run / "run.json"), damage))
    return mr.meta


def _journal_refs(rep: VerifyReport, scans, total: int) -> dict[tuple[int, int], list]:
    """Each live journal line by (pass, index), with its rank; damaged and out-of-range lines are problems."""
    refs: dict[tuple[int, int], list[tuple[int, dict]]] = defaultdict(list)
    for rank, scan in scans.items():
        for n, why in scan.damaged:
            rep.problems.append(
                Problem(
                    "journal", f"{scan.path}:{n}", f"{scan.path}:{n}: damaged journal line ({why})"
                )
            )
        for e in scan.entries:
            if e["index"] >= total:
                rep.problems.append(
                    Problem(
                        "journal",
                        str(scan.path),
                        f"{scan.path}: entry for sample {e['index']}, "
                        f"but the run has {total} samples",
                        e["index"],
                    )
                )
                continue
            if not e.get("retired"):
                refs[(pass_of(e), e["index"])].append((rank, e))
    return refs


def _check_samples(
    run: Path, rep, by_index, H: int, layout, quick: bool, workers, progress: bool
) -> set[int]:
    """Read every journaled sample (in threads); returns the indices found missing or corrupt."""
    t0 = time.monotonic()

    def speed() -> str:
        hashed = (
            "" if quick else f"{rep.bytes_read / max(time.monotonic() - t0, 1e-9) / 1e6:.0f} MB/s, "
        )
        return f"{hashed}{len(rep.problems)} problem(s) so far"

    def check(item):
        idx, refs = item
        path = run / sample_relpath(idx)
        return (
            idx,
            refs,
            check_sample_file(
                path, checksums=not quick, hidden_size=H, entry=refs[0][1], layout=layout
            ),
        )

    bad: set[int] = set()
    shown = Reporter("verify", len(by_index), enabled=progress, extra=speed)
    with shown, ThreadPoolExecutor(workers or min(8, (os.cpu_count() or 2))) as ex:
        for idx, refs, c in ex.map(check, sorted(by_index.items())):
            shown.advance()
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
                        str(c.path),
                        f"sample {idx} journaled {len(refs)} times ({ranks})",
                        idx,
                    )
                )
    rep.seconds = time.monotonic() - t0
    return bad


def _check_strays(run: Path, rep, by_index, retired_files, H, layout, total, quick) -> None:
    """Files the journals do not account for: retired leftovers, unjournaled samples, orphans, temps."""
    if (sd := samples_dir(run)).is_symlink():
        rep.problems.append(
            Problem(
                "corrupt",
                str(sd),
                f"{sd} is a symlink (to {sd.resolve()}); eyas keeps samples inside the run",
            )
        )
    for p in iter_sample_files(run):
        idx = sample_index_of(p)
        if is_temp_file(p) or (
            idx is not None and idx in by_index and p == run / sample_relpath(idx)
        ):
            continue
        if idx in retired_files and p == run / sample_relpath(idx):
            rep.problems.append(
                Problem(
                    "temp",
                    str(p),
                    f"{p}: file of a retired sample (a kill came between its "
                    "retirement and its deletion); deleted by a repair or a resume",
                    idx,
                )
            )
            continue
        c = check_sample_file(p, checksums=not quick, hidden_size=H, layout=layout)
        if (
            idx is not None
            and idx < total
            and p == run / sample_relpath(idx)
            and c.ok
            and int(c.header["__metadata__"]["sample_index"]) == idx
        ):
            rep.unjournaled.append(str(p))
        else:
            rep.problems.append(
                Problem(
                    "orphan", str(p), f"{p}: file has no journal entry and is not an intact sample"
                )
            )
    for p in stray_temp_files(run):
        rep.problems.append(Problem("temp", str(p), f"{p}: temp file left by an interrupted write"))


def _repair(run: Path, rep: VerifyReport, scans, led, bad: set[int], total: int) -> None:
    if (done := restore_run_meta(run)) is not None:
        rep.repairs.append(done)
    qdir = run / "quarantine" / time.strftime("%Y%m%d-%H%M%S")
    for p in rep.problems:
        src = Path(p.path)
        if p.kind not in ("temp", "corrupt", "orphan") or not src.is_file() or src.is_symlink():
            continue
        ensure_inside(run, src)  # never act on anything outside the run
        if p.kind == "temp":
            src.unlink(missing_ok=True)
            continue
        dst = qdir / src.relative_to(run)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(src, dst)
        fsync_dir(src.parent)
        rep.repairs.append(f"moved {src} to {dst}")
    seen: set[tuple[int, int, bool]] = set()
    paths = journal_files(run)
    for rank, scan in sorted(scans.items()):
        if (q := set_aside_damaged_lines(run, scan)) is not None:
            rep.repairs.append(
                f"set aside {len(scan.damaged)} damaged line(s) of {scan.path} (copy in {q})"
            )
        keep = []
        for e in scan.entries:
            key = (pass_of(e), e["index"], bool(e.get("retired")))
            present = led.present.get(e["index"])
            dropped = e["index"] in bad and present is not None and pass_of(present) == key[0]
            if key in seen or e["index"] >= total or (dropped and not key[2]):
                continue
            seen.add(key)
            keep.append(e)
        if len(keep) != len(scan.entries):
            rewrite_journal(paths[rank], keep)

"""What a writer checks and repairs before it extracts again, under its lock.

After a crash the store and the journals may disagree in known ways: temp files of an
interrupted commit, a published file whose journal line was lost, a file whose sample was
retired but not yet deleted, and (damage from outside) a journaled file that is missing or
of another size. `check_journaled_files` and `recover` bring this writer's samples back in
line, at the cost of a `stat` per journaled sample and a full check only of unjournaled
files; nothing journaled is trusted because a file merely exists.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from eyas.run.journal import Journal, Ledger, journal_files, pass_of, read_journal, rewrite_journal
from eyas.run.store import (
    Layout,
    check_sample_file,
    journal_entry,
    read_head,
    sample_names,
    sample_relpath,
)


def recover(
    run: Path, journal: Journal, mine: set[int], led: Ledger, layout: Layout, H: int
) -> int:
    """Bring the store in line with the journal after a crash; returns samples adopted.

    Only this writer's samples are touched (other ranks may be writing theirs right now).
    Their temp files are removed. A sample file without a journal entry (the crash came
    between rename and journal append, or its line was damaged) is adopted only if every
    checksum holds; else it is removed. A file whose sample is retired is deleted (the kill
    came between retirement and deletion). `verify` checks journaled files deeper.
    """
    done = led.present
    retired = set().union(*led.retired) if led.retired else set()
    adopted = 0
    for d, name in list(sample_names(run)):
        stem = name.split(".tmp-")[0]
        idx = int(stem[:-12]) if stem.endswith(".safetensors") and stem[:-12].isdigit() else None
        if ".tmp-" in name:
            if idx in mine:
                (d / name).unlink(missing_ok=True)
            continue
        if idx is None or idx not in mine or idx in done:
            continue  # the common case, decided from the name alone
        p = d / name
        if idx in retired:
            p.unlink(missing_ok=True)
            continue
        c = check_sample_file(p, checksums=True, hidden_size=H, layout=layout)
        if c.ok and int(c.header["__metadata__"]["sample_index"]) == idx:
            e = journal_entry(idx, c.header["__metadata__"]["sample_id"], read_head(p), c.nbytes)
            journal.append(e)
            led.add(e)
            adopted += 1
        else:
            p.unlink(missing_ok=True)
    journal.sync()
    return adopted


def check_journaled_files(
    run: Path, done: dict, mine: set[int], rank: int, whole: bool
) -> list[str]:
    """What the journal claims, checked at the cost of a `stat` per sample: a file that is
    missing or not of its journaled size is not done. Its entry is dropped from this rank's
    journal (from every journal when this writer holds the whole run) and the file, if
    any, moved to quarantine; the sample is then extracted again. Returns the problems."""
    from eyas.run.fsutil import fsync_dir

    lost: dict[int, str] = {}
    root = str(run)
    for i, e in done.items():
        if i not in mine:
            continue
        try:
            size = os.stat(f"{root}/{sample_relpath(i)}").st_size  # strings: 100k stats in ~0.2 s
        except FileNotFoundError:
            lost[i] = f"{run / sample_relpath(i)} is missing"
            continue
        if size != e["size"]:
            p = run / sample_relpath(i)
            lost[i] = f"{p} has {size} bytes, its journal entry {e['size']}"
            q = run / "quarantine" / time.strftime("%Y%m%d-%H%M%S") / sample_relpath(i)
            q.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(p, q)
            fsync_dir(p.parent)
    if lost:
        dropped = {
            (i, pass_of(done[i])) for i in lost
        }  # the present entry; other passes' lines stay
        for r, path in journal_files(run).items():
            if whole or r == rank:
                entries = read_journal(path)
                keep = [
                    e
                    for e in entries
                    if e.get("retired") or (e["index"], pass_of(e)) not in dropped
                ]
                if len(keep) != len(entries):
                    rewrite_journal(path, keep)
    return list(lost.values())

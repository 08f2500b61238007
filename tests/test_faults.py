"""Fault tests with real processes and files: SIGKILL, SIGTERM, disk full, corruption."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import eyas, grow

from eyas.run.journal import read_all_journals
from eyas.run.store import iter_sample_files
from eyas.stages.extract import ExtractConfig, extract
from eyas.stages.verify import verify

BATCH = "512"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, targets, llama_dataset) -> Path:
    """An uninterrupted run: what every interrupted run must end up identical to."""
    run = tmp_path_factory.mktemp("ref") / "run"
    extract(
        ExtractConfig(
            model=str(targets["llama"]),
            data=str(llama_dataset),
            out=str(run),
            batch_tokens=int(BATCH),
            progress=False,
        )
    )
    return run


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in iter_sample_files(run)}


def _assert_identical(run: Path, reference: Path) -> None:
    got, want = _files(run), _files(reference)
    assert sorted(got) == sorted(want)
    assert all(got[k] == want[k] for k in want), "sample files differ from the uninterrupted run"
    idx = [e["index"] for es in read_all_journals(run).values() for e in es]
    assert sorted(idx) == sorted(set(idx)) == list(range(len(want)))
    assert verify(run).clean


def _cmd(targets, data, run, *extra):
    return [sys.executable, "-m", "eyas.cli", "extract", "--model", str(targets["llama"]), "--data", str(data),
            "--out", str(run), "--batch-tokens", BATCH, *map(str, extra)]  # fmt: skip


def _count_samples(run: Path) -> int:
    d = run / "samples"
    return (
        sum(1 for sub in d.iterdir() for f in sub.iterdir() if ".tmp-" not in f.name)
        if d.is_dir()
        else 0
    )


@pytest.mark.slow  # the long loop; CI runs it (python -m pytest -m slow)
def test_sigkill_at_random_moments_then_resume(tmp_path, targets, llama_dataset, reference):
    """SIGKILL the extractor until 10 kills have landed, resuming each time; the end is
    bit-identical. The count is demanded, not raced: a run that completes before its kill
    is checked and then started again from nothing, so a fast machine kills as often as a
    slow one."""
    import shutil

    run = tmp_path / "run"
    rng = random.Random(1234)
    kills = completions = 0
    for _attempt in range(200):
        fresh = not (run / "run.json").exists()  # new, or killed before run.json was written
        cmd = (
            _cmd(targets, llama_dataset, run)
            if fresh
            else [sys.executable, "-m", "eyas.cli", "extract", "--resume", str(run)]
        )
        before = _count_samples(run)
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if kills >= 10:  # enough: let this one finish
            p.wait()
            break
        if rng.random() < 0.25:  # a blind kill at a random time: start-up, load, or mid-write
            time.sleep(rng.uniform(0.0, 4.0))
        else:  # a kill once a random number of further samples has been committed
            target = before + rng.randint(1, 9)
            while p.poll() is None and _count_samples(run) < target:
                time.sleep(0.002)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            kills += 1
        p.wait()
        if p.returncode == 0:  # it finished before the kill: check it, then start over
            _assert_identical(run, reference)
            completions += 1
            shutil.rmtree(run)
    assert kills >= 10, f"only {kills} kills landed in 200 attempts"
    assert p.returncode == 0
    _assert_identical(run, reference)


def test_sigterm_finishes_commit_and_exits_75(tmp_path, targets, llama_dataset, reference):
    run = tmp_path / "run"
    p = subprocess.Popen(
        _cmd(targets, llama_dataset, run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    while p.poll() is None and _count_samples(run) < 5:
        time.sleep(0.002)
    # Frozen while the signal is sent, the run cannot finish before it lands: the test checks
    # the stop every time, never turning into a pass for a run that simply ended first.
    assert p.poll() is None, "the run ended before 5 of its samples were seen"
    os.kill(p.pid, signal.SIGSTOP)
    p.send_signal(signal.SIGTERM)
    os.kill(p.pid, signal.SIGCONT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err
    assert "SIGTERM" in err and f"eyas extract --resume {run}" in err
    rep = verify(run)
    assert (
        rep.clean and rep.checked == _count_samples(run) > 0
    )  # every file journaled: the journal was flushed
    assert eyas("extract", "--resume", run).returncode == 0
    _assert_identical(run, reference)


def test_disk_full_real_enospc(tmpfs, targets, llama_dataset, reference):
    """A real ENOSPC mid-write: temp file removed, nothing half-committed, exit 75, resume completes."""
    run = tmpfs / "run"
    p = eyas(*_cmd(targets, llama_dataset, run)[3:], "--min-free", "0", "--allow-partial")
    assert p.returncode == 75, p.stderr
    assert "disk full" in p.stderr and "eyas extract --resume" in p.stderr
    assert "is on tmpfs" in p.stderr  # a run on volatile storage is warned about
    assert not any(".tmp-" in f.name for f in iter_sample_files(run))
    rep = verify(run)
    done = rep.checked
    assert rep.clean and 0 < done < 120
    grow(tmpfs, "16m")
    p = eyas("extract", "--resume", run, "--min-free", "0")
    assert p.returncode == 0, p.stderr
    _assert_identical(run, reference)


def test_disk_full_watchdog_and_refusal(tmpfs, targets, llama_dataset, reference):
    run = tmpfs / "run"
    # The projection (~5 MB) does not fit in 2 MB: refused before any work.
    p = eyas(*_cmd(targets, llama_dataset, run)[3:], "--min-free", "0")
    assert p.returncode == 1 and "not enough space" in p.stderr and "--allow-partial" in p.stderr
    assert "--min-free" in p.stderr and not run.exists()  # a refusal leaves nothing behind
    # With --allow-partial, the watchdog stops cleanly at the free-space floor.
    p = eyas(*_cmd(targets, llama_dataset, run)[3:], "--min-free", "1M", "--allow-partial")
    assert p.returncode == 75, p.stderr
    assert "fell below the --min-free floor" in p.stderr and "samples are committed" in p.stderr
    assert "free space first" in p.stderr
    rep = verify(run)
    assert rep.clean and 0 < rep.checked < 120
    # Resumed with the disk still full: refused before the target loads, naming what to free.
    p = eyas("extract", "--resume", run)
    assert p.returncode == 75, p.stderr
    assert "no room for even one sample" in p.stderr and "free at least" in p.stderr, p.stderr
    assert "was not loaded" in p.stderr and "loading the target" not in p.stderr, p.stderr
    assert verify(run).checked == rep.checked
    grow(tmpfs, "16m")
    # A plain resume remembers --min-free and --allow-partial (2% of 16 MiB would be 5%: 0.8 MiB).
    p = eyas("extract", "--resume", run)
    assert p.returncode == 0, p.stderr
    _assert_identical(run, reference)


def test_corruption_found_and_repaired(tmp_path, targets, llama_dataset, reference):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    files = sorted(p for p in iter_sample_files(run))
    trunc, zero, flip, gone = files[3], files[10], files[20], files[30]
    os.truncate(trunc, trunc.stat().st_size // 2)
    b = bytearray(zero.read_bytes())
    b[-2000:-1000] = bytes(1000)
    zero.write_bytes(bytes(b))
    b = bytearray(flip.read_bytes())
    b[len(b) - 77] ^= 0x10
    flip.write_bytes(bytes(b))
    gone.unlink()
    stray = files[40].with_name(files[40].name + ".tmp-99999")
    stray.write_bytes(b"partial")
    p = eyas("verify", run, "--json")
    assert p.returncode == 1
    import json

    rep = json.loads(p.stdout)
    by_path = {pr["path"]: pr for pr in rep["problems"]}
    assert by_path[str(trunc)]["kind"] == "corrupt" and by_path[str(zero)]["kind"] == "corrupt"
    assert "checksum" in by_path[str(zero)]["detail"] and "checksum" in by_path[str(flip)]["detail"]
    assert by_path[str(gone)]["kind"] == "missing" and by_path[str(stray)]["kind"] == "temp"
    assert rep["counts"] == {"missing": 1, "corrupt": 3, "orphan": 0, "duplicate": 0, "temp": 1,
                             "journal": 0, "meta": 0}  # fmt: skip
    # --quick still sees the truncation and the deletion, not the silent corruption.
    q = json.loads(eyas("verify", run, "--quick", "--json").stdout)
    assert q["counts"]["missing"] == 1 and q["counts"]["corrupt"] == 1
    assert eyas("verify", run, "--repair").returncode == 0
    assert len(list((run / "quarantine").rglob("*.safetensors"))) == 3
    p = eyas("extract", "--resume", run)
    assert p.returncode == 0 and "extracted 4 samples" in p.stderr, p.stderr
    _assert_identical(run, reference)


def test_orphan_with_lost_journal_entry_is_adopted(tmp_path, reference):
    """A crash between rename and journal append leaves a complete file without an entry."""
    import shutil

    from eyas.run.journal import journal_path, read_journal, rewrite_journal

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    entries = read_journal(journal_path(run, 0))
    rewrite_journal(journal_path(run, 0), entries[:-3])
    rep = verify(run)  # intact files without an entry: not damage, and --repair keeps them
    assert rep.clean and len(rep.unjournaled) == 3
    assert eyas("verify", run, "--repair").returncode == 0 and len(verify(run).unjournaled) == 3
    p = eyas("extract", "--resume", run)
    assert p.returncode == 0 and "adopted 3" in p.stderr, p.stderr
    _assert_identical(run, reference)


def test_verify_says_how_far_it_is_while_it_reads(reference):
    """A verify of terabytes is minutes to hours of reading: it says, as it goes, the samples
    checked of all, the rate, the problems so far and the time left (here a line each)."""
    r = eyas("verify", reference, env={**os.environ, "EYAS_LOG_EVERY": "0"})
    lines = [x for x in r.stderr.splitlines() if x.startswith("verify: ")]
    assert r.returncode == 0 and len(lines) == 120, r.stderr[-2000:]
    assert lines[0].startswith("verify: 1/120 samples") and lines[-1].startswith("verify: 120/120")
    assert all("MB/s" in x and "0 problem(s) so far" in x and "ETA" in x for x in lines), lines[:3]

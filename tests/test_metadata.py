"""The metadata around the samples under attack: locks, journals, run.json, split runs,
paths from data, and what `train` reads. Real processes, real files, real damage."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import eyas

from eyas.run.journal import journal_path, read_journal, rewrite_journal
from eyas.run.lock import LockHeld, WriterLock, read_lock
from eyas.run.runmeta import read_run_meta, write_run_meta
from eyas.run.store import sample_relpath
from eyas.stages.extract import ExtractConfig, extract, plan_run
from eyas.stages.verify import verify


@pytest.fixture(scope="module")
def reference(tmp_path_factory, targets, llama_dataset) -> Path:
    run = tmp_path_factory.mktemp("meta-ref") / "run"
    extract(
        ExtractConfig(
            model=str(targets["llama"]), data=str(llama_dataset), out=str(run), progress=False
        )
    )
    return run


def _copy(reference: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    return run


def _files(run: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run)): p.read_bytes() for p in sorted(run.glob("samples/*/*.safetensors"))
    }


# ---------------------------------------------------------------------------- the lock


def _racer(base: str, trials: int, barrier, results, stale_every: int) -> None:
    for t in range(trials):
        run = Path(base) / f"trial-{t}"
        barrier.wait()
        try:
            held, got = WriterLock(run, 0, 1).acquire(), True
        except LockHeld:
            held, got = None, False
        barrier.wait()  # every process has tried while the winner still holds the lock
        if held is not None:
            held.release()
        results.put((t, got))


def test_lock_race_never_has_two_holders(tmp_path):
    """4 processes race for the same lock 200 times, also over stale and torn lock files."""
    procs_n, trials = 4, 200
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for t in range(
        trials
    ):  # a third of the trials start from a stale lock, a third from a torn one
        lock = tmp_path / f"trial-{t}" / "locks" / "rank-00000.lock"
        if t % 3 == 1:
            lock.parent.mkdir(parents=True)
            lock.write_text(
                json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "x"})
            )
        elif t % 3 == 2:
            lock.parent.mkdir(parents=True)
            lock.write_bytes(os.urandom(40))
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(procs_n), ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(str(tmp_path), trials, barrier, results, 3))
        for _ in range(procs_n)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(procs_n * trials)]
    for p in procs:
        p.join(timeout=60)
    winners = [0] * trials
    for t, won in got:
        winners[t] += won
    assert winners == [1] * trials, [(t, w) for t, w in enumerate(winners) if w != 1]


def test_unparseable_lock_is_stale_and_taken_over(tmp_path, reference, targets, llama_dataset):
    run = _copy(reference, tmp_path)
    lock = run / "locks" / "rank-00000.lock"
    for junk in (
        os.urandom(64),
        b"[]",
        json.dumps({"pid": "abc", "host": socket.gethostname()}).encode(),
    ):
        lock.write_bytes(junk)
        p = eyas("status", run)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        assert "unreadable holder record" in p.stdout and "stale" in p.stdout
        p = eyas("extract", "--resume", run)
        assert (
            p.returncode == 0 and "took over a stale lock" in p.stderr and str(lock) in p.stderr
        ), p.stderr
        assert lock.read_bytes() == b""


def test_refused_writer_names_the_holder_without_traceback(tmp_path, reference):
    run = _copy(reference, tmp_path)
    with WriterLock(run, 0, 1):
        p = eyas("extract", "--resume", run)
    assert p.returncode == 1 and f"PID {os.getpid()}" in p.stderr and "Traceback" not in p.stderr


def test_lock_of_another_host_is_never_taken_over(tmp_path):
    lock = tmp_path / "locks" / "rank-00000.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({"pid": 1, "host": "some-other-node", "started": "x"}))
    with pytest.raises(LockHeld, match="another host"):
        WriterLock(tmp_path, 0, 1).acquire()
    info = read_lock(lock)
    assert info is not None and not info.live and info.foreign


# ---------------------------------------------------------------------------- journals


JUNK = {
    4: b"\xff\xfe\x00binary\x81",
    8: b"[1,2,3]",
    12: b'{"index": 5}',
    16: b"garbage that is not json",
}


def test_damaged_journal_lines_are_reported_and_repaired(tmp_path, reference):
    """A binary line, JSON that is not an object, an object without the keys, garbage."""
    run = _copy(reference, tmp_path)
    jp = journal_path(run, 0)
    lines = jp.read_bytes().split(b"\n")
    for n, junk in JUNK.items():
        lines[n - 1] = junk  # line n replaced; its sample loses its entry
    jp.write_bytes(b"\n".join(lines))
    p = eyas("verify", run, "--json")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    rep = json.loads(p.stdout)
    assert rep["counts"]["journal"] == 4 and rep["unjournaled"] == 4  # the sample files are intact
    details = " ".join(pr["detail"] for pr in rep["problems"])
    assert all(f"{jp}:{n}:" in details for n in JUNK), details
    assert eyas("verify", run, "--repair").returncode == 0
    assert list(
        (run / "quarantine").glob("journal-*/rank-00000.jsonl")
    )  # the damaged journal is kept
    p = eyas("extract", "--resume", run)
    assert p.returncode == 0 and "adopted 4" in p.stderr, p.stderr
    assert verify(run).clean and _files(run) == _files(reference)


def test_resume_sets_aside_damaged_lines_itself(tmp_path, reference):
    run = _copy(reference, tmp_path)
    jp = journal_path(run, 0)
    lines = jp.read_bytes().split(b"\n")
    lines[3] = b"[]"
    jp.write_bytes(b"\n".join(lines))
    p = eyas("extract", "--resume", run)
    assert p.returncode == 0 and f"{jp}:4: damaged journal line" in p.stderr, p.stderr
    assert verify(run).clean and _files(run) == _files(reference)


# ---------------------------------------------------------------------------- run.json


def test_truncated_run_json_is_read_from_backup_and_restored(tmp_path, reference):
    run = _copy(reference, tmp_path)
    data = (run / "run.json").read_bytes()
    (run / "run.json").write_bytes(data[: len(data) // 2])
    p = eyas("status", run)
    assert p.returncode == 0 and "run.json is not valid JSON" in p.stdout, p.stdout + p.stderr
    p = eyas("verify", run)
    assert p.returncode == 1 and "meta" in p.stdout
    assert eyas("verify", run, "--repair").returncode == 0
    assert (run / "run.json").read_bytes() == (reference / "run.json").read_bytes()
    assert verify(run).clean


def test_edited_hidden_size_is_damage_to_run_json_not_to_samples(tmp_path, reference):
    run = _copy(reference, tmp_path)
    meta = json.loads((run / "run.json").read_text())
    meta["hidden_size"] = 2 * meta["hidden_size"]  # an edit, not re-signed
    (run / "run.json").write_text(json.dumps(meta))
    rep = verify(run)
    assert rep.count("meta") == 1 and rep.count("corrupt") == 0 and rep.ok == rep.checked == 120
    p = eyas("verify", run, "--repair")
    assert p.returncode == 0 and "restored" in p.stdout
    assert not (run / "quarantine").exists() or not list(
        (run / "quarantine").rglob("*.safetensors")
    )
    assert read_run_meta(run)["hidden_size"] == meta["hidden_size"] // 2
    assert eyas("extract", "--resume", run).returncode == 0 and _files(run) == _files(reference)


def test_both_copies_damaged_is_named_and_nothing_is_touched(tmp_path, reference):
    run = _copy(reference, tmp_path)
    (run / "run.json").write_text("{")
    (run / "run.backup.json").write_text("")
    for cmd in (["verify", run, "--repair"], ["extract", "--resume", run], ["status", run]):
        p = eyas(*cmd)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        assert "run.json" in p.stderr and "run.backup.json" in p.stderr
    assert _files(run) == _files(reference)


def test_resume_never_takes_trust_remote_code_from_run_json(tmp_path, reference):
    run = _copy(reference, tmp_path)
    meta = read_run_meta(run)
    meta["config"]["trust_remote_code"] = True  # even correctly re-signed, it is ignored
    write_run_meta(run, meta)
    cfg, *_ = plan_run(None, resume=str(run))
    assert cfg.trust_remote_code is False
    meta["trust_remote_code_required"] = True  # a run that needs the model's code
    write_run_meta(run, meta)
    p = eyas("extract", "--resume", run)
    assert p.returncode == 2 and "--trust-remote-code" in p.stderr
    assert eyas("extract", "--resume", run, "--trust-remote-code").returncode == 0


# ---------------------------------------------------------------------------- split runs


def test_plain_resume_of_a_split_run_finishes_every_share(tmp_path, targets, llama_dataset):
    run = tmp_path / "run"
    p = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run, "--rank", "1",
             "--world", "2")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "rank" not in read_run_meta(run)["config"]  # no rank's view in the shared run.json
    # While rank 0 of the split is live, a whole-run writer is refused, naming it.
    with WriterLock(run, 0, 2):
        p = eyas("extract", "--resume", run)
        assert p.returncode == 1 and "rank 0/2" in p.stderr, p.stderr
    plan = json.loads(eyas("doctor", run, "--json").stdout)["plan"]
    assert plan[-1]["command"] == f"eyas extract --resume {run}"
    p = eyas("extract", "--resume", run)
    assert (
        p.returncode == 0 and "extracted 60 samples" in p.stderr and "120/120 done" in p.stderr
    ), p.stderr
    assert verify(run).clean


# ---------------------------------------------------------------------------- paths from data


def test_repair_never_follows_journal_paths(tmp_path, reference):
    run = _copy(reference, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    entries = read_journal(journal_path(run, 0))
    entries[0]["path"] = "../victim.txt"
    entries[1]["path"] = "../../../../x/y/z.safetensors"
    entries[2]["path"] = "/etc/passwd"
    (run / sample_relpath(entries[0]["index"])).unlink()  # make the repair act on these samples
    os.truncate(run / sample_relpath(entries[1]["index"]), 10)
    rewrite_journal(journal_path(run, 0), entries)
    p = eyas("verify", run, "--repair")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert victim.read_text() == "not yours" and not (tmp_path.parent / "x").exists()
    assert eyas("extract", "--resume", run).returncode == 0 and _files(run) == _files(reference)


def test_symlinked_samples_directory_is_refused(tmp_path, targets, llama_dataset):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / "samples").symlink_to(elsewhere)
    p = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run)
    assert p.returncode == 1 and "outside the run directory" in p.stderr, p.stderr
    assert not any(elsewhere.iterdir())


# ---------------------------------------------------------------------------- start-up kills


def _phase(run: Path) -> str | None:
    info = read_lock(run / "locks" / "rank-00000.lock")
    return info.phase if info else None


@pytest.mark.parametrize("when", ["0.1s", "1s", "mid-load"])
def test_kill_during_start_up_then_resume(tmp_path, targets, llama_dataset, reference, when):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "eyas.cli", "extract", "--model", str(targets["llama"]), "--data",
           str(llama_dataset), "--out", str(run)]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if when == "mid-load":
        deadline = time.monotonic() + 60
        while (
            p.poll() is None and _phase(run) != "loading the model" and time.monotonic() < deadline
        ):
            time.sleep(0.001)
        assert _phase(run) == "loading the model"
    else:
        time.sleep(float(when[:-1]))
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    if (run / "run.json").exists():  # the intent was written: --resume works from here on
        if when == "mid-load":
            st = eyas("status", run)
            assert "never loaded" in st.stdout, st.stdout
        r = eyas("extract", "--resume", run)
    else:  # killed before it wrote anything: nothing to resume, nothing left behind
        assert not (run / "samples").exists()
        r = eyas(*cmd[3:])
    assert r.returncode == 0, r.stderr
    assert _files(run) == _files(reference) and verify(run).clean


# ---------------------------------------------------------------------------- what train reads


def test_train_never_trains_on_damaged_samples(tmp_path, reference):
    """Six kinds of damage: each named, none trained on; training itself goes on."""
    from eyas.run.runmeta import read_run_meta
    from eyas.run.store import Sample, encode_sample, load_sample

    run = _copy(reference, tmp_path)
    path = lambda i: run / sample_relpath(i)  # noqa: E731
    size = {i: path(i).stat().st_size for i in range(8)}

    def flip(i: int, at: int) -> None:
        b = bytearray(path(i).read_bytes())
        b[at] ^= 0x04
        path(i).write_bytes(bytes(b))

    flip(0, size[0] - 40)  # a bit in the last tensor's data (hidden states)
    b = bytearray(path(1).read_bytes())
    b[-600:-300] = bytes(300)  # a zero-filled region
    path(1).write_bytes(bytes(b))
    t = load_sample(run, 2)  # a flipped token id, in the ids tensor right after the header
    n = int.from_bytes(path(2).read_bytes()[:8], "little")
    flip(2, 8 + n + 1)
    t = load_sample(run, 3)  # data changed and the header re-signed with fresh checksums
    t["aux_hidden_states"] = t["aux_hidden_states"] + 1
    enc = encode_sample(Sample(3, "x", "x", t), read_run_meta(run))
    path(3).write_bytes(enc.header + b"".join(bytes(p) for p in enc.parts))
    a, b = path(4).read_bytes(), path(5).read_bytes()  # two files swapped
    path(4).write_bytes(b)
    path(5).write_bytes(a)
    os.truncate(path(6), size[6] // 2)  # truncated
    r = eyas("train", "--data", run, "--out", tmp_path / "t", "--epochs", "1", "--ttt-steps", "2",
             "--batch-tokens", "1024", "--val-fraction", "0")  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]  # the line a user reads last says it too
    assert last.startswith("trained ") and "7 damaged sample(s) left out" in last, last
    for i in range(7):
        assert str(path(i)) in r.stderr, (i, r.stderr)
    assert str(path(7)) not in r.stderr
    lines = [
        json.loads(x) for x in (tmp_path / "t" / "skipped_samples.jsonl").read_text().splitlines()
    ]
    # Every sample left out is listed once, with why and when: 0-2 by their checksums on
    # first read, 3-6 by their headers at start-up.
    assert sorted(e["index"] for e in lines) == list(range(7))
    when = {e["index"]: e["found"] for e in lines}
    assert all(when[i] == "while training" for i in range(3))
    assert all(when[i].startswith("at start-up") for i in range(3, 7))
    # Without tensor checksums the header checks still hold: swapped, re-signed, truncated.
    r = eyas("train", "--data", run, "--out", tmp_path / "t2", "--epochs", "1", "--ttt-steps", "2",
             "--batch-tokens", "1024", "--val-fraction", "0", "--no-verify-data")  # fmt: skip
    assert r.returncode == 0 and all(str(path(i)) in r.stderr for i in (3, 4, 5, 6)), r.stderr


_BLOCKED_LOAD = (
    "import os, eyas.targets.target as t\n"
    "real = t.load_causal_lm\n"
    "def load(*a, **k):\n"
    "    open(os.environ['EYAS_TEST_LOAD_GATE']).read()  # a FIFO nobody writes: loading never ends\n"
    "    return real(*a, **k)\n"
    "t.load_causal_lm = load\n"
    "from eyas.cli import main\n"
    "main()\n"
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_target_loads_stops_cleanly_and_resumes(
    sig, tmp_path, targets, llama_dataset, reference
):
    """A scheduler's SIGTERM (or a Ctrl-C) while the target loads, the longest silent phase
    of a big target: exit 75 and one `stopped:` line naming the command that continues, the
    lock released; that command then finishes the run to the files an uninterrupted one
    writes. The load blocks on a FIFO until the signal, so the signal lands inside it."""
    run, gate = tmp_path / "run", tmp_path / "gate"
    os.mkfifo(gate)
    cmd = [sys.executable, "-c", _BLOCKED_LOAD, "extract", "--model", str(targets["llama"]),
           "--data", str(llama_dataset), "--out", str(run)]  # fmt: skip
    env = {**os.environ, "EYAS_TEST_LOAD_GATE": str(gate)}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    while p.poll() is None and _phase(run) != "loading the model":
        time.sleep(0.01)
    assert _phase(run) == "loading the model", p.communicate()
    os.kill(p.pid, sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err
    stopped = [x for x in err.splitlines() if x.startswith("stopped:")]
    assert stopped and f"stopped by {sig.name}" in stopped[0], err
    assert f"Continue with: eyas extract --resume {run}" in err, err
    assert "Traceback" not in err and _phase(run) is None  # the lock is gone with the process
    r = eyas("extract", "--resume", run)
    assert r.returncode == 0, r.stderr
    assert _files(run) == _files(reference) and verify(run).clean


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # that is the point
def test_a_stop_swallowed_at_start_up_stops_the_next_loop():
    """A signal whose exception Python swallows (raised inside a `__del__`: "Exception
    ignored in ...") is not lost: the stage's loop, entered next, starts stopped."""
    from eyas.stop import StopSignals, stop_at_once

    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs, and raises, in here

    with stop_at_once("eyas extract --resume run"):
        Dropped()
        with StopSignals() as loop:
            assert loop.requested and loop.name == "SIGINT"
    with StopSignals() as later:  # gone with the command
        assert not later.requested

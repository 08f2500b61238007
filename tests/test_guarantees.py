"""The store's guarantee beyond the store: checkpoints, the training lock, exports, resumes
that check what the journal claims, repairs under the writer lock, hostile prepared
datasets, and a full disk in every stage. Real files, real processes, real tmpfs mounts."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import eyas, grow
from safetensors.torch import load_file

from eyas.demo_target.build import DEMO_TARGET
from eyas.stages.extract import ExtractConfig, extract
from eyas.stages.train import TrainConfig, train

STEPS_CUT = 10  # the interrupted run "died" after its checkpoint of this step


def _cfg(run: Path, out: Path, **kw) -> TrainConfig:
    """A short training whose drafter exports for both engines (the three norms off)."""
    return TrainConfig.of(data=str(run), out=str(out), epochs=2, lr=3e-3, warmup_steps=2, batch_tokens=1024,
                       ttt_steps=2, save_every=2, val_fraction=0.1, progress=False, norm_before_fc=False,
                       norm_before_residual=False, norm_output=False, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def small_run(demo_runs) -> Path:
    return demo_runs(60)


@pytest.fixture(scope="module")
def finished(small_run, tmp_path_factory) -> Path:
    """An uninterrupted training run that kept every checkpoint."""
    out = tmp_path_factory.mktemp("ref") / "train"
    train(_cfg(small_run, out, keep_checkpoints=100))
    return out


def _killed_copy(finished: Path, dest: Path) -> Path:
    """`finished` as a run killed right after its checkpoint of step STEPS_CUT would be."""
    shutil.copytree(finished, dest)
    for p in (dest / "checkpoints").iterdir():
        if int(p.name.split("-")[1]) > STEPS_CUT:
            shutil.rmtree(p)
    for name in ("drafter.safetensors", "drafter_config.json", "drafter.manifest.json"):
        (dest / name).unlink()
    return dest


def _flip(path: Path, at: int, bit: int = 0x40) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= bit
    path.write_bytes(bytes(b))


def _damage(ckpt: Path, kind: str) -> None:
    d, o = ckpt / "drafter.safetensors", ckpt / "optimizer.safetensors"
    if kind == "exponent bit in the weights":
        _flip(d, d.stat().st_size - 1)  # the high byte of the last float32: its exponent
    elif kind == "bit in the optimizer state":
        _flip(o, o.stat().st_size - 3, 0x01)
    elif kind == "truncated weights":
        os.truncate(d, d.stat().st_size // 2)
    elif kind == "zero-filled weights":
        b = bytearray(d.read_bytes())
        b[-400:-100] = bytes(300)
        d.write_bytes(bytes(b))
    elif kind == "flipped header":
        _flip(d, 12, 0x20)
    elif kind == "garbage state":
        (ckpt / "state.json").write_text("{not json")
    elif kind == "garbage manifest":
        (ckpt / "COMPLETE").write_bytes(os.urandom(64))
    else:
        raise AssertionError(kind)


KINDS = ["exponent bit in the weights", "bit in the optimizer state", "truncated weights",
         "zero-filled weights", "flipped header", "garbage state", "garbage manifest"]  # fmt: skip


def test_damaged_newest_checkpoint_falls_back_to_the_older_one(
    small_run, finished, tmp_path, capsys
):
    """Every kind of damage to the newest checkpoint: the resume says so, loads the older
    intact one, and ends with the weights of the uninterrupted run, bit for bit."""
    want = load_file(str(finished / "drafter.safetensors"))
    for n, kind in enumerate(KINDS):
        out = _killed_copy(finished, tmp_path / f"k{n}")
        newest = out / "checkpoints" / f"step-{STEPS_CUT:08d}"
        _damage(newest, kind)
        capsys.readouterr()
        train(_cfg(small_run, out, keep_checkpoints=100), resume=True)
        err = capsys.readouterr().err
        assert f"checkpoint step-{STEPS_CUT:08d} is damaged" in err and "falling back" in err, (
            kind,
            err,
        )
        assert f"step-{STEPS_CUT - 2:08d}" in err, (kind, err)
        got = load_file(str(out / "drafter.safetensors"))
        assert all(torch.equal(got[k], want[k]) for k in want), kind
        assert list((out / "checkpoints").glob("damaged-step-*")), kind  # set aside, not deleted


def test_every_checkpoint_damaged_is_one_line_and_final_drafter_is_checked(
    small_run, finished, tmp_path
):
    out = _killed_copy(finished, tmp_path / "all")
    for ckpt in (out / "checkpoints").iterdir():
        _flip(ckpt / "drafter.safetensors", ckpt.joinpath("drafter.safetensors").stat().st_size - 1)
    cmd = ["train", "--data", small_run, "--out", out, "--resume", "--epochs", "2", "--lr", "3e-3",
           "--warmup-steps", "2", "--batch-tokens", "1024", "--ttt-steps", "2", "--save-every", "2",
           "--val-fraction", "0.1", "--keep-checkpoints", "100"]  # fmt: skip
    r = eyas(*cmd)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "every checkpoint is damaged" in r.stderr and "Rerun the same command" in r.stderr
    # As it says: the same command trains again from step 0, and says so; nothing is lost.
    r = eyas(*cmd)
    assert r.returncode == 0, r.stderr
    assert "no intact checkpoint" in r.stderr and "starts again from step 0" in r.stderr, r.stderr
    assert (
        list((out / "checkpoints").glob("damaged-step-*"))
        and (out / "drafter.safetensors").exists()
    )
    # A bit flipped in the final drafter: export refuses, naming the file and what to run.
    done = tmp_path / "done"
    shutil.copytree(finished, done)
    _flip(done / "drafter.safetensors", (done / "drafter.safetensors").stat().st_size - 1)
    r = eyas("export", done, "--format", "vllm", "--out", tmp_path / "x")
    assert (
        r.returncode == 1
        and "checksum does not match" in r.stderr
        and "eyas train --resume" in r.stderr
    )
    assert not (tmp_path / "x").exists()


def test_one_training_per_directory(small_run, tmp_path):
    """A second training on a directory in use is refused, naming the holder; the first
    one runs on undisturbed (far longer than the test: stopped by SIGTERM, never racing
    the clock), with one line of metrics per step."""
    out = tmp_path / "t"
    args = ["train", "--data", small_run, "--out", out, "--epochs", "1000", "--batch-tokens", "1024",
            "--ttt-steps", "2", "--save-every", "5"]  # fmt: skip
    first = subprocess.Popen([sys.executable, "-m", "eyas.cli", *map(str, args)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while (
            not (out / "checkpoints").is_dir()
            and first.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()
        for extra in ([], ["--resume"]):
            r = eyas(*args, *extra)
            assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
            assert "train cannot start" in r.stderr and f"PID {first.pid}" in r.stderr, r.stderr
        metrics = out / "metrics.jsonl"
        while (  # a few steps logged before the stop, so the check below has lines to check
            not (metrics.is_file() and metrics.read_text().count('"train"') >= 3)
            and first.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert first.returncode == 75
    steps = [
        json.loads(x)["step"]
        for x in (out / "metrics.jsonl").read_text().splitlines()
        if '"train"' in x
    ]
    assert len(steps) >= 3 and len(steps) == len(set(steps))
    assert not list((out / "checkpoints").glob("*.tmp"))


# ---------------------------------------------------------------------------- export


def test_export_is_atomic_and_refuses_foreign_directories(finished, tmp_path):
    from eyas.stages.config import ExportConfig
    from eyas.stages.export import MANIFEST, export, load_export

    out = tmp_path / "x"
    export(ExportConfig(train_dir=str(finished), format="vllm", out=str(out)))
    # Killed at random moments while an SGLang export replaces it: out is always one whole
    # export, never a mix, and no temp directory outlives the next export.
    import random

    rng = random.Random(7)
    cmd = [
        sys.executable,
        "-m",
        "eyas.cli",
        "export",
        str(finished),
        "--format",
        "sglang",
        "--out",
        str(out),
    ]
    kills = 0
    for _ in range(40):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 3.0))
        if p.poll() is None:
            p.kill()
            kills += 1
        p.wait()
        _, aux = load_export(out)  # checks the manifest: a mix or a torn file raises
        fmt = json.loads((out / MANIFEST).read_text())["format"]
        assert fmt in ("vllm", "sglang")
        if fmt == "sglang" and p.returncode == 0:
            export(
                ExportConfig(train_dir=str(finished), format="vllm", out=str(out))
            )  # back to the old one, and kill again
        if kills >= 5:
            break
    assert kills >= 5
    export(ExportConfig(train_dir=str(finished), format="sglang", out=str(out)))
    assert not [
        p for p in tmp_path.iterdir() if p.name.startswith(".x.")
    ]  # stale temp dirs removed
    # A config swapped in from another export: refused, not loaded as a mix.
    other = tmp_path / "v"
    export(ExportConfig(train_dir=str(finished), format="vllm", out=str(other)))
    shutil.copy(other / "config.json", out / "config.json")
    with pytest.raises(ValueError, match="config.json"):
        load_export(out)
    # A directory of unrelated files: refused unless --force.
    foreign = tmp_path / "f"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    r = eyas("export", finished, "--format", "vllm", "--out", foreign)
    assert r.returncode == 2 and "--force" in r.stderr and (foreign / "notes.txt").exists()
    r = eyas("export", finished, "--format", "vllm", "--out", foreign, "--force")
    assert r.returncode == 0 and not (foreign / "notes.txt").exists()
    load_export(foreign)


# ---------------------------------------------------------------------------- resume and repair


def test_resume_checks_journaled_files(tmp_path, targets, llama_dataset):
    from eyas.run.store import sample_relpath
    from eyas.stages.verify import verify

    run = tmp_path / "run"
    extract(
        ExtractConfig(
            model=str(targets["llama"]), data=str(llama_dataset), out=str(run), progress=False
        )
    )
    gone, cut = run / sample_relpath(5), run / sample_relpath(17)
    gone.unlink()
    os.truncate(cut, cut.stat().st_size - 100)
    st = eyas("status", run)
    assert "from the journals; files not read" in st.stdout
    r = eyas("extract", "--resume", run)
    assert r.returncode == 0, r.stderr
    assert (
        "2 journaled sample(s) have no intact file" in r.stderr
        and "extracted 2 samples" in r.stderr
    )
    rep = verify(run)
    assert rep.clean and rep.checked == 120


def test_repair_holds_the_writer_lock(tmp_path, targets, llama_dataset, monkeypatch):
    """A writer that starts while a repair runs (its moves slowed, standing in for a slow
    shared filesystem) is refused; the repair's journal is the one that stays."""
    import eyas.stages.verify as verify_mod
    from eyas.run.store import sample_relpath
    from eyas.stages.config import VerifyConfig
    from eyas.stages.verify import verify

    run = tmp_path / "run"
    extract(
        ExtractConfig(
            model=str(targets["llama"]), data=str(llama_dataset), out=str(run), progress=False
        )
    )
    _flip(run / sample_relpath(3), (run / sample_relpath(3)).stat().st_size - 10)
    real_move = shutil.move
    moving, release = threading.Event(), threading.Event()

    def held_move(a, b):  # the repair holds its lock here until the writer has tried
        moving.set()
        release.wait(600)
        return real_move(a, b)

    monkeypatch.setattr(verify_mod.shutil, "move", held_move)
    t = threading.Thread(target=verify, args=(VerifyConfig(run=str(run), repair=True),))
    t.start()
    try:
        assert moving.wait(600), "the repair never reached its first move"
        r = eyas("extract", "--resume", run)
    finally:
        release.set()
        t.join()
    assert r.returncode == 1 and "repairing" in r.stderr, r.stderr
    r = eyas("extract", "--resume", run)
    assert r.returncode == 0 and "extracted 1 sample " in r.stderr, r.stderr
    assert verify(run).clean


# ---------------------------------------------------------------------------- hostile datasets


def _rewrite(ds: Path, key: str, data: bytes) -> None:
    meta = json.loads((ds / "dataset.json").read_text())
    (ds / meta["files"][key]["name"]).write_bytes(data)
    meta["files"][key]["sha256"] = hashlib.sha256(data).hexdigest()
    (ds / "dataset.json").write_text(json.dumps(meta))


def _tokens(ds: Path):
    from safetensors.numpy import load_file as np_load

    meta = json.loads((ds / "dataset.json").read_text())
    return np_load(str(ds / meta["files"]["tokens"]["name"]))


def test_hostile_datasets_are_named_not_tracebacks(tmp_path, targets, llama_dataset):
    from safetensors.numpy import save

    def attempt(edit) -> str:
        ds = tmp_path / f"ds{len(list(tmp_path.iterdir()))}"
        shutil.copytree(llama_dataset, ds)
        edit(ds)
        r = eyas(
            "extract", "--model", targets["llama"], "--data", ds, "--out", tmp_path / "r" / ds.name
        )
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        return r.stderr

    def ids(value):
        def edit(ds):
            t = dict(_tokens(ds))
            t["input_ids"] = t["input_ids"].copy()
            t["input_ids"][3] = value
            _rewrite(ds, "tokens", save(t))

        return edit

    assert "token id 99999 is outside the vocabulary" in attempt(ids(99999))
    assert "token id -7 is outside the vocabulary" in attempt(ids(-7))

    def swapped_offsets(ds):
        t = dict(_tokens(ds))
        o = t["offsets"].copy()
        o[4], o[5] = o[5], o[4]
        t["offsets"] = o
        _rewrite(ds, "tokens", save(t))

    assert "offsets are not" in attempt(swapped_offsets)

    def mask7(ds):
        t = dict(_tokens(ds))
        t["loss_mask"] = t["loss_mask"].copy()
        t["loss_mask"][9] = 7
        _rewrite(ds, "tokens", save(t))

    assert "loss mask value 7" in attempt(mask7)

    def huge_header(ds):
        meta = json.loads((ds / "dataset.json").read_text())
        b = bytearray((ds / meta["files"]["tokens"]["name"]).read_bytes())
        b[:8] = (1 << 62).to_bytes(8, "little")
        _rewrite(ds, "tokens", bytes(b))

    assert "unreadable" in attempt(huge_header)

    def short_records(ds):
        meta = json.loads((ds / "dataset.json").read_text())
        lines = (ds / meta["files"]["records"]["name"]).read_bytes().splitlines(keepends=True)
        _rewrite(ds, "records", b"".join(lines[:-10]))

    assert "110 records, dataset.json says 120 samples" in attempt(short_records)

    def record_tokens(value):
        def edit(ds):
            meta = json.loads((ds / "dataset.json").read_text())
            lines = (ds / meta["files"]["records"]["name"]).read_text().splitlines()
            r = json.loads(lines[2])
            r["tokens"] = value
            lines[2] = json.dumps(r)
            _rewrite(ds, "records", ("\n".join(lines) + "\n").encode())

        return edit

    assert ":3: record does not describe sample 2" in attempt(record_tokens(-5))
    assert ":3: record does not describe sample 2" in attempt(record_tokens(10**12))

    def draft_vocab(ds):
        meta = json.loads((ds / "dataset.json").read_text())
        meta["draft_vocab_size"] = 10**12
        (ds / "dataset.json").write_text(json.dumps(meta))

    assert "draft_vocab_size" in attempt(draft_vocab)

    def vocab_freq_header(ds):
        meta = json.loads((ds / "dataset.json").read_text())
        p = ds / meta["files"]["vocab_freq"]["name"]
        b = bytearray(p.read_bytes())
        b[:8] = (1 << 40).to_bytes(8, "little")
        p.write_bytes(bytes(b))  # its sha256 left as it was: the checksum catches it

    assert "vocab_freq" in attempt(vocab_freq_header)


def test_status_ignores_journal_entries_outside_the_dataset(tmp_path, targets, llama_dataset):
    from eyas.run.journal import journal_path

    run = tmp_path / "run"
    extract(
        ExtractConfig(
            model=str(targets["llama"]), data=str(llama_dataset), out=str(run), progress=False
        )
    )
    line = json.loads(journal_path(run, 0).read_text().splitlines()[0])
    line["index"] = 10**12
    with open(journal_path(run, 0), "a") as f:
        f.write(json.dumps(line) + "\n")
    st = eyas("status", run)
    assert "120/120 done (100.0%), 0 remaining" in st.stdout, st.stdout
    assert "names sample 1000000000000" in st.stdout
    d = json.loads(eyas("status", run, "--json").stdout)
    assert d["done"] == 120 and d["model_loaded"] is True and len(d["ignored_entries"]) == 1


# ---------------------------------------------------------------------------- a full disk


def test_disk_full_in_train_export_prepare(tmpfs, small_run, finished, tmp_path, conversations):
    """ENOSPC in each stage: exit 75, one line, nothing half-written left to be trusted."""
    # train: the checkpoints of the tiny drafter outgrow 2 MiB.
    out = tmpfs / "t"
    args = ["train", "--data", small_run, "--out", out, "--epochs", "2", "--batch-tokens", "1024",
            "--ttt-steps", "2", "--save-every", "1", "--keep-checkpoints", "100"]  # fmt: skip
    r = eyas(*args)
    assert r.returncode == 75 and "disk full" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "eyas train --resume" in r.stderr
    assert not list((out / "checkpoints").glob("*.tmp"))
    grow(tmpfs, "64m")
    r = eyas(*args, "--resume")
    assert r.returncode == 0, r.stderr
    shutil.rmtree(out)
    grow(tmpfs, "1m")
    # export
    r = eyas("export", finished, "--format", "vllm", "--out", tmpfs / "x")
    assert r.returncode == 75 and "disk full" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list(tmpfs.iterdir())  # no partial export, no temp directory
    # prepare: a dataset larger than what is left
    filler = tmpfs / "filler"
    filler.write_bytes(b"\0" * (1024 * 1024 - 8192))
    r = eyas("prepare", "--model", DEMO_TARGET, "--data", conversations, "--out", tmpfs / "ds")
    assert r.returncode == 75 and "disk full" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmpfs / "ds" / "dataset.json").exists()

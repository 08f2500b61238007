"""Streaming: `extract --max-store` and `train --follow` run side by side, in real processes.

The store's bytes are sampled every 50 ms and never exceed the budget plus one batch;
the trainer's consumption log shows every sample trained exactly once per pass, across
SIGKILLs of either side (at random moments, right after a deletion, during checkpoint
saves), a full disk, and two passes.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import eyas, mounted_tmpfs

from eyas.drafters import KINDS
from eyas.run.journal import ledger, read_journal
from eyas.run.store import bytes_on_disk
from eyas.training.train_data import split_samples

BATCH = 1024  # extraction and training token budget per batch
BUDGET = 2600 << 10  # about a quarter of the llama run's 9.9 MiB


def start(*args, torchrun: int = 0) -> subprocess.Popen:
    """The CLI in a child process; its output goes to a file (a pipe nobody reads while the
    test waits would fill and stall the child)."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun)]
        if torchrun
        else []
    )
    log = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([sys.executable, *launcher, "-m", "eyas.cli", *map(str, args)], stdout=log,
                         stderr=subprocess.STDOUT, text=True)  # fmt: skip
    p.log = log  # type: ignore[attr-defined]
    return p


def output(p: subprocess.Popen, timeout: float = 300) -> str:
    p.wait(timeout=timeout)
    p.log.seek(0)  # type: ignore[attr-defined]
    return p.log.read()  # type: ignore[attr-defined]


def extract_cmd(targets, ds, run: Path, *extra) -> list:
    if (run / "run.json").exists():
        return ["extract", "--resume", run]
    return ["extract", "--model", targets["llama"], "--data", ds, "--out", run,
            "--batch-tokens", BATCH, "--max-store", f"{BUDGET >> 10}K", *extra]  # fmt: skip


def train_cmd(run: Path, out: Path, *extra) -> list:
    return ["train", "--follow", "--resume", "--data", run, "--out", out, "--batch-tokens", BATCH,
            "--seed", 1, *extra]  # fmt: skip


class StoreSampler:
    """The bytes under a run's samples/ every 50 ms, from a thread."""

    def __init__(self, run: Path):
        self.run, self.peak, self.samples = run, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._work, daemon=True)
        self._t.start()

    def _work(self) -> None:
        while not self._stop.is_set():
            total = bytes_on_disk(self.run)
            self.peak, self.samples = max(self.peak, total), self.samples + 1
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def batch_bytes(run: Path) -> int:
    """The most bytes one extraction batch can hold (its token budget at the run's rate)."""
    meta = json.loads((run / "run.json").read_text())
    return int(BATCH * meta["bytes_per_token"] * 1.1) + (64 << 10)


def consumption(out: Path) -> dict[int, list[int]]:
    """Pass -> samples in the order trained, from the trainer's consumption log."""
    per: dict[int, list[int]] = {}
    for line in (out / "consumed.jsonl").read_text().splitlines():
        rec = json.loads(line)
        per.setdefault(rec["pass"], []).extend(rec["samples"])
    return per


def assert_each_once(out: Path, n: int, passes: int) -> None:
    train_idx, _ = split_samples(list(range(n)), 0.05)
    per = consumption(out)
    assert sorted(per) == list(range(passes))
    for p in range(passes):
        assert sorted(per[p]) == sorted(train_idx), f"pass {p}: not every sample exactly once"


def kill_running(*procs) -> None:
    """SIGKILL what a failed test left running."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out = output(proc, timeout)
    assert proc.returncode == 0, out
    return out


def test_without_followers_nothing_is_deleted_and_the_writer_waits(
    targets, llama_dataset, tmp_path
):
    run = tmp_path / "run"
    ex = start(*extract_cmd(targets, llama_dataset, run))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        lock = run / "locks"
        if lock.exists() and any("waiting for followers" in p.read_text(errors="replace")
                                 for p in lock.glob("*") if p.is_file()):  # fmt: skip
            break
        time.sleep(0.1)
    else:
        pytest.fail("the extractor never waited for a follower")
    st = eyas("status", run, check=True).stdout
    assert "train --follow" in st
    ex.send_signal(signal.SIGTERM)
    out = output(ex, 60)
    assert ex.returncode == 75, out
    # about 2.5 batches of budget: said up front, with the bound the store may reach
    assert "holds fewer than 4 batches of --batch-tokens 1024" in out and "plus one batch" in out, (
        out
    )
    led = ledger(run)
    assert not any(led.retired) and len(led.present) > 0
    # A follower whose --epochs the run cannot give is refused, and leaves nothing that would
    # make the corrected command "config differs".
    t = tmp_path / "train"
    p = eyas("train", "--follow", "--data", run, "--out", t, "--epochs", 3)
    assert p.returncode == 2 and "--epochs must be the run's --passes (1)" in p.stderr, p.stderr
    assert not t.exists()
    assert eyas("verify", run).returncode == 0
    # A trainer that registered, checkpointed, and is not running now: both sides' commands.
    from eyas.run.stream import publish

    gone = tmp_path / "train-gone"
    first = sorted(led.present)[:3]
    publish(
        run,
        gone,
        0,
        set(first),
        len(first),
        command=f"eyas train --follow --resume --data {run} --out {gone}",
    )
    st = eyas("status", run, check=True).stdout
    assert (
        f"follower   {gone.resolve()}: pass 1, 3 sample(s) consumed" in st and "not running" in st
    ), st
    assert f"next       eyas train --follow --resume --data {run} --out {gone}" in st, st
    assert f"next       eyas extract --resume {run}" in st, st
    doc = eyas("doctor", run).stdout
    assert f"eyas train --follow --resume --data {run} --out {gone}" in doc and "rm " in doc, doc
    # With the extractor running again and waiting for room that only the dead follower could
    # make, the run is blocked: no ETA, and doctor exits 1.
    ex = start(*extract_cmd(targets, llama_dataset, run))
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not any(
            "waiting for followers" in p.read_text(errors="replace")
            for p in (run / "locks").glob("*") if p.is_file()
        ):  # fmt: skip
            time.sleep(0.1)
        st = eyas("status", run, check=True).stdout
        assert "ETA        - (blocked:" in st, st
        assert eyas("doctor", run).returncode == 1
    finally:
        ex.send_signal(signal.SIGTERM)
        output(ex, 120)


def _retired_lines(run: Path) -> int:
    p = run / "journal" / "rank-00000.jsonl"
    return sum(1 for e in read_journal(p) if e.get("retired")) if p.exists() else 0


@pytest.mark.slow  # the long loop; CI runs it (python -m pytest -m slow)
def test_sigkills_of_both_sides_then_resume(targets, llama_dataset, tmp_path):
    """At least 10 SIGKILLs, two of each kind, split between the two sides: at random moments,
    right after a retirement (either side: the extractor between journal line and deletion,
    the trainer just after samples it consumed were deleted), and while the trainer saves a
    checkpoint. A streamed run that completes before its kills have landed (a fast machine)
    is checked like any other and the kills go on in a fresh one: the test never races the
    clock."""
    rng = random.Random(5)
    kinds = [
        "extract-random",
        "train-random",
        "extract-after-retire",
        "train-during-save",
        "train-after-retire",
    ]
    kills: dict[str, int] = {k: 0 for k in kinds}
    attempt, turn = 0, 0

    def check(run: Path, out: Path, tr_out: str, logs: list[str]) -> None:
        assert "deleted before this trainer consumed" not in tr_out + "".join(logs)
        assert_each_once(out, 120, 1)
        r = eyas("extract", "--resume", run, check=True)
        v = json.loads(eyas("verify", run, "--json", check=True).stdout)
        assert v["clean"] and v["retired"] == 120, (v, r.stdout)

    while min(kills.values()) < 2:
        attempt += 1
        assert attempt <= 30, kills
        run, out, logs = tmp_path / f"run{attempt}", tmp_path / f"train{attempt}", []
        ex = start(*extract_cmd(targets, llama_dataset, run))
        tr = start(*train_cmd(run, out, "--epochs", 1, "--save-every", 1))
        while min(kills.values()) < 2 and (ex.poll() is None or tr.poll() is None):
            kind = [k for k in kinds if kills[k] < 2][
                turn % len([k for k in kinds if kills[k] < 2])
            ]
            turn += 1
            proc = ex if kind.startswith("extract") else tr
            if proc.poll() is not None:
                assert proc.returncode == 0, output(proc)
                time.sleep(0.05)
                continue
            deadline = time.monotonic() + rng.uniform(0.5, 3.0)
            limit = deadline + (
                20 if kind.endswith(("retire", "save")) else 1
            )  # watchers wait longer
            before = _retired_lines(run)
            hit = False
            while time.monotonic() < limit and proc.poll() is None:
                if kind.endswith("after-retire") and _retired_lines(run) > before:
                    hit = True
                elif kind == "train-during-save" and list((out / "checkpoints").glob("step-*.tmp")):
                    hit = True
                elif kind.endswith("random") and time.monotonic() >= deadline:
                    hit = True
                if hit:
                    break
                time.sleep(0.002)
            if not hit or proc.poll() is not None:
                continue  # its moment did not come (or it finished): another kind's turn
            proc.kill()
            logs.append(output(proc))
            kills[kind] += 1
            if proc is ex:
                ex = start(*extract_cmd(targets, llama_dataset, run))
            else:
                tr = start(*train_cmd(run, out, "--epochs", 1, "--save-every", 1))
        finish(ex)
        check(run, out, finish(tr), logs)
    print("kills:", kills, "runs:", attempt)
    assert sum(kills.values()) >= 10


def test_a_disk_smaller_than_the_budget_is_used_as_it_is(targets, llama_dataset, tmp_path):
    """The run's disk holds less than the budget (something else took the room): the
    extractor keeps the store under what the disk holds, says so, and both sides finish."""
    with mounted_tmpfs(tmp_path, "4m") as mnt:
        run, out = mnt / "run", tmp_path / "train"
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (1900 << 10))
        tr = None
        try:
            ex = start(*extract_cmd(targets, llama_dataset, run, "--min-free", "0"))
            while not (run / "run.json").exists() and ex.poll() is None:
                time.sleep(0.02)
            tr = start(*train_cmd(run, out, "--epochs", 1))
            text = finish(ex, 600)
            assert "less than its --max-store share" in text, text
            finish(tr, 600)
            tr = None
        finally:
            if tr is not None:
                tr.kill()
                tr.wait()
        assert_each_once(out, 120, 1)
        eyas("extract", "--resume", run, check=True)  # deletes what the trainer consumed last
        v = json.loads(eyas("verify", run, "--json", check=True).stdout)
        assert v["clean"] and v["retired"] == 120


def test_a_full_disk_under_a_budget_recovers(targets, llama_dataset, tmp_path):
    """The extractor stops (exit 75) with the store full; the trainer trains what is there,
    checkpoints and publishes it although its window never filled; the disk then fills up.
    A resume retires what was consumed before it judges the disk, and both sides finish."""
    with mounted_tmpfs(tmp_path, "8m") as mnt:
        run, out = mnt / "run", tmp_path / "train"
        ex = start(*extract_cmd(targets, llama_dataset, run, "--min-free", "0"))
        tr = None
        try:
            while not (run / "run.json").exists() and ex.poll() is None:
                time.sleep(0.02)
            tr = start(*train_cmd(run, out, "--epochs", 1))

            def follower() -> list[dict]:
                return [json.loads(p.read_text()) for p in (run / "followers").glob("*.json")]

            while ex.poll() is None and not any(f.get("consumed") for f in follower()):
                time.sleep(0.05)
            ex.send_signal(signal.SIGTERM)  # unless the full disk stopped it first
            # It cannot have finished: the budget holds a quarter of the run, and at most one
            # window of it was consumed.
            said = output(ex)
            assert ex.returncode == 75, said
            assert "stopped by SIGTERM" in said or "disk full" in said, said
            train_idx = set(split_samples(list(range(120)), 0.05)[0])

            def published() -> set[int]:
                from eyas.run.stream import from_ranges

                return set().union(*(from_ranges(f["consumed"]) for f in follower()))

            committed = {i for i in ledger(run).present if i in train_idx}
            deadline = time.monotonic() + 600  # a state to wait for; the bound only ends a failure
            while (
                tr.poll() is None and not committed <= published() and time.monotonic() < deadline
            ):
                time.sleep(0.05)  # the trainer trains the part window and publishes it
            assert committed <= published(), "the trainer never published what it trained"
            free = shutil.disk_usage(mnt).free
            (mnt / "filler").write_bytes(b"\0" * max(free - (600 << 10), 0))
            finish(start(*extract_cmd(targets, llama_dataset, run, "--min-free", "0")), 600)
            finish(tr, 600)
            tr = None
        finally:
            kill_running(ex, tr)
        assert_each_once(out, 120, 1)


def test_two_extractor_ranks_under_one_budget(targets, llama_dataset, tmp_path):
    """--world 2 with --max-store: each rank keeps its share of the budget plus its own batch,
    so the store stays under the budget plus two batches (the bound the README states); a
    follower trains every sample once."""
    run, out = tmp_path / "run", tmp_path / "train"
    cmds = [extract_cmd(targets, llama_dataset, run, "--rank", r, "--world", 2) for r in (0, 1)]
    exs = [start(*c) for c in cmds]  # both commands made before either writes run.json
    tr = None
    try:
        while not (run / "run.json").exists() and all(e.poll() is None for e in exs):
            time.sleep(0.02)
        sampler = StoreSampler(run)
        tr = start(*train_cmd(run, out, "--epochs", 1))
        for e in exs:
            finish(e, 600)
        finish(tr, 600)
        tr = None
        sampler.stop()
    finally:
        kill_running(*exs, tr)
    assert sampler.samples > 10
    assert BUDGET // 2 < sampler.peak <= BUDGET + 2 * batch_bytes(run), (sampler.peak, BUDGET)
    assert_each_once(out, 120, 1)
    v = json.loads(eyas("verify", run, "--json", check=True).stdout)
    assert v["clean"], v


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_follow_without_a_budget_under_torchrun(targets, llama_dataset, tmp_path, kind):
    """No --max-store, two ranks: epoch 1 follows the extraction (rank 0 decides every window
    and sends it to rank 1, and both wait together), epoch 2 reads the full store; nothing is
    deleted. The trainer starts before the run exists and waits for it. Both drafter kinds."""
    run, out = tmp_path / "run", tmp_path / "train"
    tr = start(*train_cmd(run, out, "--epochs", 2, "--kind", kind), torchrun=2)
    deadline = time.monotonic() + 120
    while (
        "to be created by `eyas extract`"
        not in Path(f"/proc/self/fd/{tr.log.fileno()}").read_text()
    ):
        assert tr.poll() is None and time.monotonic() < deadline, (
            "the trainer did not wait for its run"
        )
        time.sleep(0.05)
    ex = start("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run,
               "--batch-tokens", BATCH)  # fmt: skip
    finish(ex)
    text = finish(tr)
    saved = json.loads((out / "train.json").read_text())
    assert saved["world"] == 2 and saved["config"]["kind"] == kind, text
    assert_each_once(out, 120, 2)
    led = ledger(run)
    assert not any(led.retired) and len(led.present) == 120
    assert (out / "drafter.safetensors").exists()


@pytest.mark.slow  # the long loop; CI runs it (python -m pytest -m slow)
def test_under_a_budget_every_sample_once_per_pass_and_as_good_as_offline(tmp_path):
    """extract --max-store (a quarter of the data) --passes 2 and train --follow --epochs 2 side
    by side, on the demo target (which has something to learn): the store's bytes, sampled
    every 50 ms, stay under the budget plus one batch; each pass trains every sample once,
    each pass in its own order; retired samples are done, not missing, for verify, status and
    a resume; and the drafter's validation accuracy is that of offline training on the same
    data, within the spread of offline training over two seeds."""
    from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare
    from eyas.stages.train import TrainConfig, train

    src = tmp_path / "conv.jsonl"
    src.write_text("".join(DEMO_CONVERSATIONS.read_text().splitlines(keepends=True)[:200]))
    ds = tmp_path / "ds"
    prepare(PrepareConfig(model=str(DEMO_TARGET), data=(str(src),), out=str(ds), draft_vocab_size=400,
                          progress=False))  # fmt: skip
    recipe = dict(
        epochs=2, batch_tokens=1024, lr=3e-3, warmup_steps=5, ttt_steps=3, val_fraction=0.1
    )

    def acc0(out: Path) -> float:
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in recs if r["split"] == "val"][-1]["acc"][0]

    full = tmp_path / "full"
    extract(
        ExtractConfig(
            model=str(DEMO_TARGET), data=str(ds), out=str(full), batch_tokens=1024, progress=False
        )
    )
    offline = []
    for seed in (0, 1):
        train(
            TrainConfig.of(
                data=str(full),
                out=str(tmp_path / f"off{seed}"),
                seed=seed,
                progress=False,
                **recipe,
            )
        )
        offline.append(acc0(tmp_path / f"off{seed}"))
    budget = sum(p.stat().st_size for p in (full / "samples").rglob("*.safetensors")) // 4
    run, out = tmp_path / "streamed", tmp_path / "follow"
    ex = start("extract", "--model", DEMO_TARGET, "--data", ds, "--out", run, "--batch-tokens", 1024,
               "--max-store", f"{budget >> 10}K", "--passes", 2)  # fmt: skip
    while not (run / "samples").exists():
        time.sleep(0.02)
    sampler = StoreSampler(run)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in recipe.items()]
    tr = start("train", "--follow", "--data", run, "--out", out, *flags, "--seed", 0)
    finish(ex)
    tr_out = finish(tr)
    sampler.stop()
    meta = json.loads((run / "run.json").read_text())
    n = meta["samples"]
    assert sampler.samples > 20
    assert (
        budget // 2
        < sampler.peak
        <= (budget >> 10 << 10) + int(1024 * meta["bytes_per_token"] * 1.1) + (64 << 10)
    )
    assert "deleted before" not in tr_out
    # Windows make more batches than the whole set planned at once: the step total grows as
    # they come, and the progress never shows more steps done than in all.
    shown = [(int(a), int(b)) for a, b in re.findall(r"train: (\d+)/(\d+) steps", tr_out)]
    planned = int(re.search(r": (\d+) optimizer steps", tr_out).group(1))
    done = max(json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines())
    print(f"steps planned {planned}, done {done}, shown {shown}")
    assert shown and all(a <= b for a, b in shown) and shown[-1] == (done, done), shown
    # Each pass: every sample once, in the pass's own order.
    train_idx, _ = split_samples(list(range(n)), 0.1)
    per = consumption(out)
    assert sorted(per) == [0, 1] and all(sorted(per[p]) == train_idx for p in (0, 1))
    order = [(e.get("pass", 0), e["index"]) for e in read_journal(run / "journal" / "rank-00000.jsonl")
             if not e.get("retired")]  # fmt: skip
    first, second = [i for p, i in order if p == 0], [i for p, i in order if p == 1]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second
    # Finished on both sides: what the trainer consumed last is still on disk, and status and
    # doctor say so and how to delete it; doctor's verify cost counts the bytes on disk.
    left = bytes_on_disk(run)
    assert left > 0
    st = eyas("status", run, check=True).stdout
    assert f"next       eyas extract --resume {run}   (deletes the" in st, st
    doc = eyas("doctor", run).stdout
    assert "consumed samples are still on disk" in doc and f"eyas extract --resume {run}" in doc, (
        doc
    )
    m = re.search(r"`eyas verify \S+` reads ([\d.]+) (KiB|MiB)", doc)
    assert m, doc
    shown_bytes = float(m.group(1)) * (1024 if m.group(2) == "KiB" else 1 << 20)
    assert abs(shown_bytes - left) <= max(0.05 * left, 64 << 10), (m.group(0), left)
    # Retired samples are done, not missing: a resume, verify and status agree.
    r = eyas("extract", "--resume", run, check=True)  # deletes what the trainer consumed last
    assert "extracted 0 samples" in r.stdout + r.stderr
    assert not list((run / "samples").rglob("*.safetensors"))
    v = json.loads(eyas("verify", run, "--json", check=True).stdout)
    assert v["clean"] and v["retired"] == 2 * n
    st = eyas("status", run, check=True).stdout
    assert f"{2 * n}/{2 * n} done" in st and f"{2 * n} retired" in st and "finished" in st, st
    assert "(deletes the" not in st
    # A follower that comes after the extractor deleted everything: the loss is said at its
    # start, before any step, not at the end of the pass.
    r = eyas("train", "--follow", "--data", run, "--out", tmp_path / "late", *flags, "--seed", 0)
    said = r.stderr.find("were deleted before this trainer consumed them")
    assert said >= 0, r.stderr
    assert "train: " not in r.stderr[:said], r.stderr
    # with nothing left to train it ends with the reason (exit 1), and saves no untrained drafter
    assert r.returncode == 1 and "no optimizer step was taken" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "late" / "drafter.safetensors").exists()
    r = eyas("train", "--data", run, "--out", tmp_path / "offline")  # refused, naming --follow
    assert r.returncode == 2 and "train --follow" in r.stderr
    # As good as offline.
    followed = acc0(out)
    noise = max(abs(offline[0] - offline[1]), 0.03)
    print(f"val acc0: offline {offline}, streamed {followed:.4f}")
    assert min(offline) > 0.2  # the recipe learns: a broken follower could not pass by luck
    assert abs(followed - statistics.mean(offline)) <= 2 * noise, (followed, offline)
    # A trainer that resumed from nothing after its pass's samples were deleted: status and
    # doctor say how many its pass lacks.
    from eyas.run.stream import publish

    ghost = tmp_path / "ghost"
    publish(
        run, ghost, 1, set(), 0, command=f"eyas train --follow --resume --data {run} --out {ghost}"
    )
    lacking = n  # the run is finished: every sample of pass 2 is retired
    st = eyas("status", run, check=True).stdout
    assert f"warning    {lacking} sample(s) of pass 2 were deleted before {ghost}" in st, st
    assert (
        f"follower: {lacking} sample(s) of pass 2 were deleted before" in eyas("doctor", run).stdout
    )


def test_a_checkpoint_replaced_at_the_same_step_survives_a_kill(tmp_path):
    """A followed pass that ends right after the save made before waiting saves a new state
    at the same step: the old directory is set aside as step-N.old, the new one renamed in.
    A kill at any point leaves one whole step-N after the next start's clean-up."""
    from eyas.training.checkpoint import MARKER, remove_stale_temp

    def ckpt(name: str, state: str) -> None:
        d = tmp_path / "checkpoints" / name
        d.mkdir(parents=True)
        (d / "state.json").write_text(state)
        (d / MARKER).write_text("{}")

    ckpt("step-00000005.old", "old")  # killed after the old one was set aside...
    ckpt("step-00000005.tmp", "new")  # ...and before the complete new one was renamed in
    remove_stale_temp(tmp_path)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert (
        names == ["step-00000005"]
        and (tmp_path / "checkpoints/step-00000005/state.json").read_text() == "new"
    )

    ckpt("step-00000009.old", "old")  # killed while the new one was still being written
    (tmp_path / "checkpoints" / "step-00000009.tmp").mkdir()
    remove_stale_temp(tmp_path)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000005", "step-00000009"]
    assert (tmp_path / "checkpoints/step-00000009/state.json").read_text() == "old"


def test_a_damaged_newest_checkpoint_loses_no_sample(targets, llama_dataset, tmp_path):
    """The trainer publishes consumption as of the oldest checkpoint it keeps: killed once
    the extractor has deleted what it published, with its newest checkpoint then damaged, it
    falls back to the older one, whose samples are all still there; every sample is trained
    once."""
    from eyas.training.checkpoint import _ckpt_dirs

    run, out = tmp_path / "run", tmp_path / "train"
    ex = start(*extract_cmd(targets, llama_dataset, run))
    tr = None
    try:
        while not (run / "run.json").exists() and ex.poll() is None:
            time.sleep(0.02)
        tr = start(*train_cmd(run, out, "--epochs", 1, "--save-every", 2))
        deadline = time.monotonic() + 600  # a state to wait for; the bound only ends a failure
        while True:  # the trainer is frozen while the state is looked at: it cannot run past it
            tr.send_signal(signal.SIGSTOP)
            reached = _retired_lines(run) > 0 and len(_ckpt_dirs(out)) >= 2
            if reached or tr.poll() is not None or time.monotonic() > deadline:
                break
            tr.send_signal(signal.SIGCONT)
            time.sleep(0.01)
        assert reached and tr.poll() is None, "the trainer never reached the state the test needs"
        tr.kill()
        tr.wait()
        newest = _ckpt_dirs(out)[-1]
        big = max((p for p in newest.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
        data = bytearray(big.read_bytes())
        data[len(data) // 2] ^= 0x40
        big.write_bytes(bytes(data))
        tr = start(*train_cmd(run, out, "--epochs", 1, "--save-every", 2))
        text = finish(tr, 600)
        tr = None
        assert "deleted before this trainer consumed them" not in text, text
        finish(ex, 600)
    finally:
        kill_running(ex, tr)
    assert_each_once(out, 120, 1)


def test_a_sample_that_could_not_be_read_is_never_counted_as_consumed(
    targets, llama_dataset, tmp_path
):
    from eyas.run.store import sample_relpath
    from eyas.run.stream import from_ranges

    run, out = tmp_path / "run", tmp_path / "train"
    eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run, check=True)
    train_idx, _ = split_samples(list(range(120)), 0.05)
    gone = train_idx[7]
    (run / sample_relpath(gone)).unlink()
    p = eyas(
        "train", "--follow", "--data", run, "--out", out, "--epochs", 1, "--batch-tokens", BATCH
    )
    assert p.returncode == 0, p.stderr
    assert "pass 1 is incomplete: 1 sample(s)" in p.stderr, p.stderr
    assert gone not in consumption(out)[0] and len(consumption(out)[0]) == len(train_idx) - 1
    for f in (run / "followers").glob("*.json"):
        assert gone not in from_ranges(json.loads(f.read_text())["consumed"])
    assert eyas("verify", run).returncode == 1  # the missing file is reported, not hidden

"""Resume at scale: how long `eyas extract --resume` spends on a run of 100,000 journaled
samples before its first new commit, beyond importing and loading the model.

Builds a tiny target, a prepared dataset of --samples + 1 short conversations, and a run
whose first --samples samples are committed (real sample files, fsynced, journaled; their
states random), and the same with 1 committed sample. Times `eyas extract --resume` of each
in a child process, alternating, reading its stderr as it comes: start -> "loading the
target" is imports plus the journal work (reading the journals, the stat of every journaled
file, recovery); the model load follows; then the one remaining sample is committed. The
journal work of the big run is the difference of the two. Run from the repo root:

    python bench/resume.py [--samples 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(work: Path, samples: int) -> Path:
    from eyas.data.dataset import PreparedDataset
    from eyas.demo_target.tiny import TinySizes, build_tiny_target
    from eyas.run.journal import Journal, journal_path
    from eyas.run.runmeta import write_run_meta
    from eyas.run.store import Sample, commit_samples
    from eyas.stages.extract import ExtractConfig, new_run_meta, resolve
    from eyas.stages.prepare import PrepareConfig, prepare

    model = build_tiny_target(work / "target", "llama", sizes=TinySizes(hidden_size=16, num_attention_heads=2,
                                                                         num_key_value_heads=1, intermediate_size=32))  # fmt: skip
    src = work / "c.jsonl"
    with open(src, "w") as f:
        for i in range(samples + 1):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"hi {i}"},
                                                          {"role": "assistant", "content": f"ok {i}"}]}) + "\n")  # fmt: skip
    prepare(PrepareConfig(model=str(model), data=(str(src),), out=str(work / "ds"), progress=False))
    ds = PreparedDataset.open(work / "ds")
    run = work / "run"
    cfg = resolve(
        ExtractConfig(model=str(model), data=str(work / "ds"), out=str(run), min_free="0")
    )
    meta = new_run_meta(cfg, ds)
    run.mkdir()
    write_run_meta(run, meta)
    H = meta["hidden_size"]
    journal = Journal(journal_path(run, 0))
    t0 = time.monotonic()
    for start in range(0, samples, 1000):
        batch = []
        for i in range(start, min(start + 1000, samples)):
            x, m = ds.sample(i)
            T = len(x)
            batch.append(Sample(i, ds.records[i]["id"], "bench", {
                "input_ids": torch.from_numpy(x.astype("int32")), "loss_mask": torch.from_numpy(m.copy()),
                "aux_hidden_states": torch.randn(T, 3 * H), "last_hidden_states": torch.randn(T, H)}))  # fmt: skip
        journal.reserve(len(batch))
        for e in commit_samples(run, batch, meta):
            journal.append(e)
        journal.sync()
        print(f"  committed {min(start + 1000, samples):,}/{samples:,} ({time.monotonic() - t0:.0f}s)",
              file=sys.stderr, flush=True)  # fmt: skip
    journal.close()
    return run


def time_resume(run: Path) -> dict:
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "eyas.cli", "extract", "--resume", str(run)],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    marks = {}
    for line in p.stderr:
        now = time.monotonic() - t0
        if "journaled sample(s) have no intact file" in line:
            marks["lost"] = line.strip()
        if line.startswith("loading the target"):
            marks["loading"] = now
        if line.startswith("extracted "):
            marks["done"] = now
    p.wait()
    if p.returncode != 0:
        raise RuntimeError(f"resume exited {p.returncode}")
    return marks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    from eyas.run.journal import journal_path, read_journal, rewrite_journal

    work = Path(tempfile.mkdtemp(prefix="eyas-resume-", dir=args.workdir))
    try:
        runs = {"big": build(work / "big", args.samples), "small": build(work / "small", 1)}
        kept = {k: read_journal(journal_path(r, 0)) for k, r in runs.items()}
        rows = {"big": [], "small": []}
        for r in range(args.rounds):
            for k in ("big", "small") if r % 2 == 0 else ("small", "big"):
                marks = time_resume(runs[k])
                rows[k].append((marks["loading"], marks["done"]))
                rewrite_journal(
                    journal_path(runs[k], 0), kept[k]
                )  # the last sample uncommitted again
                n = args.samples if k == "big" else 1
                (runs[k] / "samples").joinpath(*_last(n)).unlink(missing_ok=True)
            b, s_ = rows["big"][-1], rows["small"][-1]
            print(f"round {r + 1}: start -> loading the target {b[0]:.2f}s ({args.samples:,} journaled) vs "
                  f"{s_[0]:.2f}s (1 journaled): journal work {b[0] - s_[0]:.2f}s; first new commit {b[1]:.2f}s "
                  f"vs {s_[1]:.2f}s", flush=True)  # fmt: skip
        med = {k: [statistics.median(x[i] for x in v) for i in range(2)] for k, v in rows.items()}
        work_s = med["big"][0] - med["small"][0]
        print(f"{args.samples:,} journaled samples, medians of {args.rounds} rounds: start -> loading the target "
              f"{med['big'][0]:.2f}s against {med['small'][0]:.2f}s for 1: {work_s:.2f}s of journal work "
              f"(target: at most 2 s); first new commit {med['big'][1]:.2f}s against {med['small'][1]:.2f}s")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _last(samples: int) -> tuple[str, str]:
    from eyas.run.store import sample_relpath

    parts = sample_relpath(samples).split("/")
    return parts[-2], parts[-1]


if __name__ == "__main__":
    main()

"""Is CPU training bit-reproducible from one process to the next? One thread against two.

A resumed training is promised the weights of an unbroken one; that holds only where two
unbroken trainings agree. Each round trains the same
drafter twice in fresh `eyas train` processes, once with EYAS_THREADS=1 and once with 2
(alternating which goes first), on the same small extraction run of the demo target (150
conversations, 2 epochs, feature noise on, a CPU hog beside them with --hogs 1). It prints,
per thread count, how many distinct final weights came out over the rounds (1: every
process agreed bit for bit) and the largest difference between two of them, and the median
ratio of the pairs' wall times (two threads / one).

    python bench/reproducible.py [--rounds 6] [--hogs 0]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ARGS = ["--lr", "3e-3", "--warmup-steps", "5", "--batch-tokens", "1024", "--ttt-steps", "3",
        "--seed", "3", "--epochs", "2", "--feature-noise", "0.1"]  # fmt: skip


def demo_run(work: Path) -> Path:
    from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare

    src = work / "conv.jsonl"
    src.write_text("".join(DEMO_CONVERSATIONS.read_text().splitlines(keepends=True)[:150]))
    prepare(PrepareConfig(model=str(DEMO_TARGET), data=(str(src),), out=str(work / "ds"),
                          draft_vocab_size=400, progress=False))  # fmt: skip
    extract(ExtractConfig(model=str(DEMO_TARGET), data=str(work / "ds"), out=str(work / "run"),
                          progress=False))  # fmt: skip
    return work / "run"


def train_once(run: Path, out: Path, threads: int) -> tuple[dict, float]:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "EYAS_THREADS": str(threads)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eyas.cli", "train", "--data", str(run), "--out", str(out),
                    *ARGS], env=env, check=True, capture_output=True)  # fmt: skip
    return load_file(str(out / "drafter.safetensors")), time.perf_counter() - t0


def digest(w: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(w):
        h.update(k.encode() + w[k].contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--hogs", type=int, default=0, help="busy processes beside the trainings")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="eyas-repro-"))
    run = work / "run" if (work / "run").exists() else demo_run(work)
    got: dict[int, list] = {1: [], 2: []}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        for r in range(args.rounds):
            for threads in (1, 2) if r % 2 == 0 else (2, 1):
                got[threads].append(train_once(run, work / f"t{threads}", threads))
            print(f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{t} thread(s) {digest(got[t][-1][0])} in {got[t][-1][1]:.1f} s" for t in got),
                  flush=True)  # fmt: skip
    finally:
        for h in hogs:
            h.kill()
    for t, rows in got.items():
        first = rows[0][0]
        worst = max(
            float((w[k].double() - first[k].double()).abs().max()) for w, _ in rows for k in w
        )
        print(f"{t} thread(s): {len({digest(w) for w, _ in rows})} distinct final weights over "
              f"{len(rows)} processes; largest difference from the first {worst:.3g}")  # fmt: skip
    ratios = [b[1] / a[1] for a, b in zip(got[1], got[2], strict=True)]
    print(f"wall time, two threads / one: median {statistics.median(ratios):.3f}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

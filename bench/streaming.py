"""Extract-then-train against streaming (`extract --max-store` + `train --follow`), in one run.

On the demo target and conversations, the same drafter recipe three ways, each as real
`eyas` processes:

1. offline: `extract`, then `train --epochs E` on the full store;
2. follow: `extract` and `train --follow --epochs E` side by side (epoch 1 follows the
   extraction, later epochs read the full store);
3. budget: `extract --max-store B --passes E` and `train --follow --epochs E` side by side,
   with B a quarter of the data (the target runs once per epoch).

Per way: wall time, peak bytes under samples/ (sampled every 50 ms), each side's idle time
(offline: the trainer waits for the whole extraction and the extractor has nothing to do
while training runs; streaming: the waits each side reports), and the drafter's validation
accuracy. With `--rounds N` the ways alternate in order and medians are reported.

On this 2-core CPU both sides share the cores, so streaming cannot beat the sum of the two
sides by much here; on separate GPUs (the target on its node, the trainer on another, over
a shared filesystem) the sides overlap and the goal is wall time close to the slower side.

    python bench/streaming.py [--epochs 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BATCH = 2048  # extraction's token budget per batch: the store may exceed --max-store by one batch


class Sampler:
    """The peak of `store.bytes_on_disk(run)`, sampled every 50 ms from a thread."""

    def __init__(self, run: Path):
        self.run, self.peak = run, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._work, daemon=True)
        self._t.start()

    def _work(self) -> None:
        from eyas.run.store import bytes_on_disk

        while not self._stop.is_set():
            self.peak = max(self.peak, bytes_on_disk(self.run))
            self._stop.wait(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def eyas(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eyas.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def wait(p: subprocess.Popen) -> tuple[str, float]:
    out, _ = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"eyas exited {p.returncode}:\n{out}")
    return out, time.monotonic()


def waited(text: str, what: str) -> float:
    m = re.search(rf"waited ([0-9.]+)s for {what}", text)
    return float(m.group(1)) if m else 0.0


def val_acc(train_dir: Path) -> float:
    recs = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["split"] == "val"][-1]["acc"][0]


def one(way: str, work: Path, model: Path, ds: Path, epochs: int, budget: str, seed: int) -> dict:
    run, out = work / f"run-{way}", work / f"train-{way}"
    train = ["--data", run, "--out", out, "--epochs", epochs, "--batch-tokens", 2048, "--lr", "3e-3",
             "--warmup-steps", 10, "--val-fraction", 0.1, "--save-every", 1000, "--seed", seed]  # fmt: skip
    extract = ["extract", "--model", model, "--data", ds, "--out", run, "--batch-tokens", BATCH]
    (run / "samples").mkdir(parents=True)
    sampler = Sampler(run)
    t0 = time.monotonic()
    if way == "offline":
        ex_text, t_ex = wait(eyas(*extract))
        tr_text, t_end = wait(eyas("train", *train))
        idle = {"extract": t_end - t_ex, "train": t_ex - t0}
    else:
        extra = ["--max-store", budget, "--passes", epochs] if way == "budget" else []
        ex = eyas(*extract, *extra)
        while not (run / "run.json").exists():
            time.sleep(0.02)
        tr = eyas("train", "--follow", *train)
        ex_text, t_ex = wait(ex)
        tr_text, t_end = wait(tr)
        # the extractor's waits, and its time with nothing left to do while training runs
        idle = {"extract": waited(ex_text, "the trainer") + max(0.0, t_end - t_ex),
                "train": waited(tr_text, "samples")}  # fmt: skip
    return {"wall": t_end - t0, "peak": sampler.stop(), "idle_extract": idle["extract"],
            "idle_train": idle["train"], "acc0": val_acc(out)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="each with its own training seed")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
    from eyas.stages.prepare import PrepareConfig, prepare

    work = Path(tempfile.mkdtemp(prefix="eyas-stream-", dir=args.workdir))
    try:
        ds = work / "ds"
        prepare(PrepareConfig(model=str(DEMO_TARGET), data=(str(DEMO_CONVERSATIONS),), out=str(ds),
                              draft_vocab_size=512, progress=False))  # fmt: skip
        ways = ["offline", "follow", "budget"]
        rows: dict[str, list[dict]] = {w: [] for w in ways}
        budget = (
            None  # a quarter of the data: set by the first offline run (round 1 starts with it)
        )
        for r in range(args.rounds):
            for w in ways if r % 2 == 0 else list(reversed(ways)):
                row = one(w, work / f"r{r}", DEMO_TARGET, ds, args.epochs, budget or "0", seed=r)
                rows[w].append(row)
                budget = budget or f"{row['peak'] // 4 >> 10}K"
                shutil.rmtree(work / f"r{r}" / f"run-{w}", ignore_errors=True)
        print(f"demo target, 300 conversations, {args.epochs} epoch(s), --max-store {budget} (a quarter of the "
              f"data; one extraction batch is {BATCH} tokens), {args.rounds} round(s) with seeds 0..{args.rounds - 1}, "
              f"{os.cpu_count()} CPU(s) shared by both sides; medians over rounds")  # fmt: skip
        base = statistics.median(x["wall"] for x in rows["offline"])
        for w in ways:
            med = {k: statistics.median(x[k] for x in rows[w]) for k in rows[w][0]}
            accs = [x["acc0"] for x in rows[w]]
            print(f"{w:8s} wall {med['wall']:6.1f}s ({med['wall'] / base:.2f}x offline)  peak store "
                  f"{med['peak'] / 2**20:6.2f} MiB  idle: extractor {med['idle_extract']:5.1f}s, trainer "
                  f"{med['idle_train']:5.1f}s  val acc0 {statistics.mean(accs):.4f} "
                  f"(seeds {' '.join(f'{a:.4f}' for a in accs)})")  # fmt: skip
        if args.rounds > 1:
            spread = statistics.stdev(x["acc0"] for x in rows["offline"])
            for w in ("follow", "budget"):
                d = [b["acc0"] - a["acc0"] for a, b in zip(rows["offline"], rows[w], strict=True)]
                print(f"{w} - offline, same seed: val acc0 {100 * statistics.mean(d):+.2f} pp "
                      f"(offline seed-to-seed stdev {100 * spread:.2f} pp)")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

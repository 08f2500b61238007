"""DSpark's training step with the Markov bias computed once per distinct token of a batch
(`DSparkDrafter.slot_head`, the default) against once per block slot (the plain
`slot_logits`), inside one process: the same Trainer, the same batches, passes alternated.

    python bench/dspark_head.py --run RUN [--steps 3] [--pairs 4] [--draft-vocab-size D]

One CPU thread. Two warm-up steps, then every pass trains the same `--steps` batches of eyas's
first epoch (1,024 tokens, the argmax kept from the warm-up, so later-epoch steps); which path
goes first alternates pair by pair. Prints each pass's seconds and the median of the pairs'
ratios (per slot / shared). Both paths give the same values and gradients
(tests/test_dspark.py); only the time is measured.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from train_speed import WARM, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="an extraction (--target last)")
    ap.add_argument("--steps", type=int, default=3, help="timed batches a pass")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--draft-vocab-size", type=int, default=None)
    args = ap.parse_args()

    import torch

    from eyas.drafters.dspark.model import DSparkDrafter
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import _resolve_schedule
    from eyas.training.config import TrainConfig
    from eyas.training.train_data import SampleReader, usable_samples
    from eyas.training.trainer import Trainer

    torch.set_num_threads(1)
    p = plan(args.run, args.steps, 1024, "cpu", 1)
    meta = read_run_meta(args.run)
    extra = {"draft_vocab_size": args.draft_vocab_size} if args.draft_vocab_size else {}
    cfg = TrainConfig.of(data=str(args.run), out=tempfile.mkdtemp(), kind="dspark", epochs=1,
                         batch_tokens=1024, seed=0, dtype="float32", **extra)  # fmt: skip
    cfg = _resolve_schedule(cfg, meta, 1)
    entries, _ = usable_samples(args.run, meta["hidden_size"], lambda m: None)
    t = Trainer(cfg, meta, 0, 1, torch.device("cpu"), Path(cfg.out),
                SampleReader(args.run, entries, True))  # fmt: skip
    t.schedule(1000)
    shared = DSparkDrafter.slot_head

    def per_slot(self, prev):
        return lambda xs, i, rows: self.slot_logits(xs, prev[:, rows, i])

    def step(idx):
        t.step(iter([(None, t.load(idx))]), 1, cfg.lr)

    for idx in p["batches"]:  # warm-up, and every batch's argmax kept
        step(idx)
    times: dict[str, list[float]] = {"shared": [], "per slot": []}
    for r in range(args.pairs):
        for name in ("shared", "per slot") if r % 2 == 0 else ("per slot", "shared"):
            DSparkDrafter.slot_head = shared if name == "shared" else per_slot
            t0 = time.perf_counter()
            for idx in p["batches"][WARM:]:
                step(idx)
            times[name].append(time.perf_counter() - t0)
    DSparkDrafter.slot_head = shared
    ratios = [a / b for a, b in zip(times["per slot"], times["shared"], strict=True)]
    print(f"DSpark, draft vocabulary {len(t.drafter.draft_ids)}, {args.steps} steps a pass")
    for name, ts in times.items():
        print(f"  {name:9}: {', '.join(f'{x:.1f}' for x in ts)} s")
    print(f"  per slot / shared: median {statistics.median(ratios):.3f} "
          f"({', '.join(f'{x:.3f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main()

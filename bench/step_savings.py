"""A drafter's training step with one of its savings and without it, inside one process:
the same Trainer, the same batches, passes alternated.

    python bench/step_savings.py --run RUN --compare head|rows [--kind dspark|dflash]
        [--loss-until-miss] [--steps 3] [--pairs 4] [--draft-vocab-size D]

`--compare head`: DSpark's Markov bias computed once per distinct token of a batch
(`DSparkDrafter.slot_head`) against once per block slot. `--compare rows`: each block slot's loss
computed at its counted blocks alone (`drafters.loss.by_rows` given `live`: under Spec-AUF the
blocks before their first miss) against at every block, masked. Both ways give the same
values and gradients (tests/test_dspark.py, tests/test_dflash.py); only the time is measured.
(EAGLE-3's TTT loss keeps every root: its batches hold the trainable span alone, ~99% of it
counted, and listing the rows cost more than it saved.)

One CPU thread. Two warm-up steps, then every pass trains the same `--steps` batches of eyas's
first epoch (1,024 tokens, the argmax kept from the warm-up, so later-epoch steps); which way
goes first alternates pair by pair. Prints each pass's seconds and the median of the pairs'
ratios (without / with).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from train_speed import WARM, plan


def savings(compare: str) -> tuple[object, str, object, object]:
    """(the owner, the attribute, its value with the saving, its value without)."""
    if compare == "head":
        from eyas.drafters.dspark.model import DSparkDrafter
        from eyas.drafters.loss import at_rows

        def per_slot(self, prev):
            return lambda xs, i, rows: self.slot_logits(xs, at_rows(prev[..., i], rows))

        return DSparkDrafter, "slot_head", DSparkDrafter.slot_head, per_slot
    from eyas.drafters import block_kind, loss

    def every_row(*a, live, **kw):
        return loss.by_rows(*a, **kw)

    return block_kind, "by_rows", block_kind.by_rows, every_row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="an extraction (--target last)")
    ap.add_argument("--compare", choices=["head", "rows"], required=True)
    ap.add_argument("--kind", choices=["dspark", "dflash"], default="dspark")
    ap.add_argument("--loss-until-miss", action="store_true", help="Spec-AUF (DSpark's default)")
    ap.add_argument("--steps", type=int, default=3, help="timed batches a pass")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--draft-vocab-size", type=int, default=None)
    args = ap.parse_args()

    import torch

    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import _resolve_schedule
    from eyas.training.config import TrainConfig
    from eyas.training.train_data import SampleReader, usable_samples
    from eyas.training.trainer import Trainer

    torch.set_num_threads(1)
    p = plan(args.run, args.steps, 1024, "cpu", 1)
    meta = read_run_meta(args.run)
    extra = {"draft_vocab_size": args.draft_vocab_size} if args.draft_vocab_size else {}
    if args.loss_until_miss:
        extra["loss_until_miss"] = True
    cfg = TrainConfig.of(data=str(args.run), out=tempfile.mkdtemp(), kind=args.kind, epochs=1,
                         batch_tokens=1024, seed=0, dtype="float32", **extra)  # fmt: skip
    cfg = _resolve_schedule(cfg, meta, 1)
    entries, _ = usable_samples(args.run, meta["hidden_size"], lambda m: None)
    t = Trainer(cfg, meta, 0, 1, torch.device("cpu"), Path(cfg.out),
                SampleReader(args.run, entries, True))  # fmt: skip
    t.schedule(1000)
    owner, attr, saved, plain = savings(args.compare)

    def step(idx):
        t.step(iter([(None, t.load(idx))]), 1, cfg.lr)

    for idx in p["batches"]:  # warm-up, and every batch's argmax kept
        step(idx)
    times: dict[str, list[float]] = {"with": [], "without": []}
    for r in range(args.pairs):
        for name in ("with", "without") if r % 2 == 0 else ("without", "with"):
            setattr(owner, attr, saved if name == "with" else plain)
            t0 = time.perf_counter()
            for idx in p["batches"][WARM:]:
                step(idx)
            times[name].append(time.perf_counter() - t0)
    setattr(owner, attr, saved)
    ratios = [a / b for a, b in zip(times["without"], times["with"], strict=True)]
    auf = ", Spec-AUF" if cfg.options.loss_until_miss else ""
    print(f"{args.kind}{auf}, draft vocabulary {len(t.drafter.draft_ids)}, "
          f"--compare {args.compare}, {args.steps} steps a pass")  # fmt: skip
    for name, ts in times.items():
        print(f"  {name:7}: {', '.join(f'{x:.1f}' for x in ts)} s")
    print(f"  without / with: median {statistics.median(ratios):.3f} "
          f"({', '.join(f'{x:.3f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main()

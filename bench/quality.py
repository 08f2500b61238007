"""Does compact storage cost drafter quality? The same drafter, trained twice, side by side.

Extracts the demo conversations from the demo target twice: lossless (float32 aux and final
states) and compact (`--storage fp8 --target topk:K`), trains the same drafter on each (same
seed, split, batches and steps: the demo's recipe) and prints validation accuracy per TTT
step, conditional accuracy and the estimated acceptance length for chains of 3, plus bytes
per token on disk. Run from the repo root:

    python bench/quality.py [--topk 64] [--epochs 10] [--ttt-steps 5]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    from eyas.demo_target import DEMO_CONVERSATIONS, DEMO_TARGET
    from eyas.extract import ExtractConfig, extract
    from eyas.prepare import PrepareConfig, prepare
    from eyas.train import TrainConfig, train

    work = Path(tempfile.mkdtemp(prefix="eyas-quality-", dir=args.workdir))
    try:
        ds = work / "ds"
        prepare(PrepareConfig(model=str(DEMO_TARGET), data=(str(DEMO_CONVERSATIONS),), out=str(ds), draft_vocab_size=512,
                              progress=False))  # fmt: skip
        rows = {}
        for name, storage, target in (
            ("lossless", "dense", "last"),
            ("compact", "fp8", f"topk:{args.topk}"),
        ):
            run = work / f"run-{name}"
            x = extract(ExtractConfig(model=str(DEMO_TARGET), data=str(ds), out=str(run), storage=storage,
                                      target=target, progress=False))  # fmt: skip
            t = train(TrainConfig(data=str(run), out=str(work / f"train-{name}"), epochs=args.epochs,
                                  ttt_steps=args.ttt_steps, lr=3e-3, warmup_steps=10, batch_tokens=2048,
                                  val_fraction=0.1, seed=0, progress=False))  # fmt: skip
            rows[name] = (x.bytes_written / x.tokens, t["val"], f"aux={storage}, target={target}")
        print(
            f"demo target (H=128), 300 conversations, {args.epochs} epochs, {args.ttt_steps} TTT steps, same seed"
        )
        for name, (bpt, v, mode) in rows.items():
            acc = " ".join(f"{a:.4f}" for a in v["acc"])
            cond = " ".join(f"{a:.4f}" for a in v["cond_acc"])
            print(f"{name:9s} {mode:28s} {bpt:7.0f} B/token  acc {acc}  cond {cond}  "
                  f"est. acceptance (k=3) {v['accept_len'][2]:.3f}")  # fmt: skip
        (_, a, _), (_, b, _) = rows["lossless"], rows["compact"]
        print(f"difference (compact - lossless): acc_0 {100 * (b['acc'][0] - a['acc'][0]):+.2f} pp, "
              f"est. acceptance (k=3) {b['accept_len'][2] - a['accept_len'][2]:+.3f}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

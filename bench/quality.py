"""Drafter quality, side by side: compact storage against lossless (`--compare storage`),
or the drafter's head started from the target's against a random one (`--compare head`).

`--compare head` trains on one lossless extraction of the demo conversations with
`--head-init random`, `target` and `target-frozen`, over `--seeds` seeds each, and reports
per-step validation accuracy, the estimated acceptance length and tokens emitted per target
forward measured by `eyas evaluate` on `--eval-prompts` held-out prompts; the figure that
decides is the mean over seeds, with the seed spread beside it.

Extracts the demo conversations from the demo target twice: lossless (float32 aux and final
states) and compact (`--storage fp8 --target topk:K`), trains the same drafter on each (same
seed, split, batches and steps: the demo's recipe) and prints validation accuracy per TTT
step, conditional accuracy and the estimated acceptance length for chains of 3, plus bytes
per token on disk. Run from the repo root:

    python bench/quality.py [--topk 64] [--epochs 10] [--ttt-steps 5]
    python bench/quality.py --compare head [--seeds 3] [--eval-prompts 200]
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
    ap.add_argument("--compare", choices=("storage", "head"), default="storage")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eval-prompts", type=int, default=200)
    args = ap.parse_args()
    if args.compare == "head":
        return compare_heads(args)

    from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare
    from eyas.stages.train import TrainConfig, train

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
            t = train(TrainConfig.of(data=str(run), out=str(work / f"train-{name}"), epochs=args.epochs,
                                  ttt_steps=args.ttt_steps, lr=3e-3, warmup_steps=10, batch_tokens=2048,
                                  val_fraction=0.1, seed=0, progress=False))  # fmt: skip
            rows[name] = (x.bytes_written / x.tokens, t.val, f"aux={storage}, target={target}")
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


def compare_heads(args) -> None:
    import statistics

    from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
    from eyas.demo_target.data import generate_conversations, write_jsonl
    from eyas.ops.demo import EVAL_SEED
    from eyas.stages.config import ExportConfig
    from eyas.stages.evaluate import evaluate
    from eyas.stages.export import export
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare
    from eyas.stages.train import TrainConfig, train

    work = Path(tempfile.mkdtemp(prefix="eyas-heads-", dir=args.workdir))
    try:
        ds, run = work / "ds", work / "run"
        prepare(PrepareConfig(model=str(DEMO_TARGET), data=(str(DEMO_CONVERSATIONS),), out=str(ds), draft_vocab_size=512,
                              progress=False))  # fmt: skip
        extract(ExtractConfig(model=str(DEMO_TARGET), data=str(ds), out=str(run), progress=False))
        held = work / "held.jsonl"
        write_jsonl(held, generate_conversations(args.eval_prompts, seed=EVAL_SEED))
        inits = ("random", "target", "target-frozen")
        rows: dict[str, list[dict]] = {h: [] for h in inits}
        for seed in range(args.seeds):
            for h in inits:  # alternating: each seed runs every variant
                out = work / f"train-{h}-{seed}"
                t = train(TrainConfig.of(data=str(run), out=str(out), epochs=args.epochs, ttt_steps=args.ttt_steps,
                                      lr=3e-3, warmup_steps=10, batch_tokens=2048, val_fraction=0.1, seed=seed,
                                      head_init=h, progress=False))  # fmt: skip
                ex = export(
                    ExportConfig(
                        train_dir=str(out), format="vllm", out=str(work / f"ex-{h}-{seed}")
                    )
                ).path
                e = evaluate(str(DEMO_TARGET), str(ex), str(held), k=3, max_new_tokens=48,
                             limit=args.eval_prompts, progress=False).to_dict()  # fmt: skip
                v = t.val
                rows[h].append({"acc": v["acc"], "loss0": v["loss"][0], "est": v["accept_len"][min(2, len(v["acc"]) - 1)],
                                "tpf": e["tokens_per_forward"], "tpf_ci": e["tokens_per_forward_ci95"],
                                "al": e["acceptance_length"], "rounds": e["rounds"]})  # fmt: skip
                acc = " ".join(f"{a:.3f}" for a in v["acc"])
                print(f"seed {seed} {h:13s} val acc/step {acc}  loss0 {v['loss'][0]:.3f}  est. acceptance (k=3) "
                      f"{rows[h][-1]['est']:.3f}  tokens/forward {e['tokens_per_forward']:.3f} {e['tokens_per_forward_ci95']} "
                      f"acceptance length {e['acceptance_length']:.3f} ({e['rounds']} rounds)", flush=True)  # fmt: skip
        print(f"\ndemo target (H=128), 300 conversations, {args.epochs} epochs, {args.ttt_steps} TTT steps, "
              f"{args.seeds} seeds, {args.eval_prompts} held-out prompts, K=3")  # fmt: skip

        def ms(xs):
            return f"{statistics.mean(xs):.3f} (spread {max(xs) - min(xs):.3f})"

        for h in inits:
            r = rows[h]
            steps = len(r[0]["acc"])
            acc = " ".join(f"{statistics.mean(x['acc'][i] for x in r):.3f}" for i in range(steps))
            print(f"{h:13s} mean val acc/step {acc} | loss0 {ms([x['loss0'] for x in r])} | est. acceptance "
                  f"{ms([x['est'] for x in r])} | tokens/forward {ms([x['tpf'] for x in r])} | acceptance length "
                  f"{ms([x['al'] for x in r])}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

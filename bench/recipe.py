"""Which training choices make a better drafter: variants of `eyas train` on one extraction,
each judged on a held-out extraction with one metric.

    python bench/recipe.py --run RUN --holdout HOLDOUT_RUN --work WORK \\
        --variant base= --variant muon='--optimizer muon' [--seeds 0,1] [--jobs 2] \\
        [--holdout-samples 245:811:2] [--epochs 3]

Every variant trains `--epochs` epochs (EAGLE-3 with `--ttt-steps`; another `--kind` with its
own defaults), plus `--common` and its own options, on RUN, once per seed, in its own process
on one CPU thread, `--jobs` at a time; a finished training is reused. Each trained drafter is
then scored on the samples of HOLDOUT_RUN (another extraction of the same target, or one whose
samples `--holdout-samples` START:STOP[:STEP] RUN never had; its aux layers must be the
training's): accuracy per TTT step or block position, conditional accuracy and the estimated
acceptance length, with eyas's metric for all. Prints one row per variant (the mean over
seeds, and each seed; the acceptance for 3 drafts and for every position the drafter has) and
writes WORK/recipe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path


def holdout_accuracy(train_dir: Path, holdout: Path, steps: int, samples=None) -> dict:
    """eyas's validation summary of a trained drafter over the samples of `holdout` (a
    `range`, or all of them)."""
    from eyas.training.checkpoint import load_trained
    from eyas.training.config import saved_flat

    d, kind = load_trained(train_dir)
    cfg = saved_flat(json.loads((train_dir / "train.json").read_text())["config"])
    how = screen_config(kind.name, steps, d, cfg.get("block_size"))
    return scored(d, kind, how, holdout, samples=samples)


def screen_config(kind: str, steps: int, drafter, block_size: int | None = None):
    """The config a screen scores a drafter of `kind` with: KL, every position alike, no
    alignment mask (as validation scores), `steps` TTT steps or the drafter's own block."""
    import dataclasses

    from eyas.drafters import options_class
    from eyas.training.config import TrainConfig

    own = {f.name for f in dataclasses.fields(options_class(kind))}
    block = block_size or getattr(drafter.config, "block_size", None)
    wanted = {"ttt_steps": steps, "step_decay": 1.0, "align_topk": 0, "block_size": block,
              "block_decay": 4.0, "anchor_stride": 1}  # fmt: skip
    return TrainConfig.of(data="-", out="-", kind=kind, loss="kl", loss_average="token",
                          **{k: v for k, v in wanted.items() if k in own and v is not None})  # fmt: skip


def scored(drafter, kind, how, run: Path, batches=None, model: str | None = None, samples=None):
    """eyas's validation summary (per TTT step or block position, `kind`'s) of `drafter` over
    `batches` of `run` (lists of sample indices; default: every sample, or those in
    `samples`, 4,096 tokens a batch), the target's head read from `model` (default: the
    run's), with the summed positions."""
    import torch

    from eyas.drafters.loss import summarize
    from eyas.run.runmeta import read_run_meta
    from eyas.targets.weights import lm_head_weight
    from eyas.training.train_data import SampleReader, plan_batches, to_device, usable_samples

    drafter.eval()
    meta = read_run_meta(run)
    entries, _ = usable_samples(run, meta["hidden_size"], lambda m: None)
    if batches is None:
        chosen = sorted(i for i in entries if samples is None or i in samples)
        batches = plan_batches({i: entries[i]["tokens"] for i in chosen}, chosen, 4096)
    reader = SampleReader(run, entries, checksums=True)
    head = lm_head_weight(model or meta["model_path"]).float()
    stats = torch.zeros(kind.positions(how), 6, dtype=torch.float64)
    try:
        with torch.no_grad():
            for idx in batches:
                host = reader.batch(idx)
                b = to_device(host, torch.device("cpu"))
                reader.release(host)
                kind.prepare_batch(drafter, b, head, how)
                stats += kind.loss(drafter, b, how, None)[1]
    finally:
        reader.close()
    s = summarize(stats)
    s["positions"] = int(stats[0, 3])
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="the extraction to train on")
    ap.add_argument(
        "--holdout", type=Path, required=True, help="an extraction of other conversations"
    )
    ap.add_argument("--work", type=Path, required=True, help="where the trainings go")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=OPTIONS: eyas train options of one variant (repeat)")  # fmt: skip
    ap.add_argument("--common", default="", help="options every variant gets")
    ap.add_argument("--seeds", default="0", help="comma-separated training seeds")
    ap.add_argument("--jobs", type=int, default=2, help="trainings at once (one thread each)")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--holdout-samples", default=None,
                    help="START:STOP[:STEP]: the holdout's samples to score (default: all)")  # fmt: skip
    args = ap.parse_args()
    samples = range(*map(int, args.holdout_samples.split(":"))) if args.holdout_samples else None
    variants = dict(v.split("=", 1) for v in args.variant)
    seeds = [int(s) for s in args.seeds.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    todo = [(n, s) for n in variants for s in seeds]
    env = {**os.environ, "EYAS_THREADS": "1", "OMP_NUM_THREADS": "1"}
    running: dict = {}
    t0 = time.monotonic()
    while todo or running:
        while todo and len(running) < args.jobs:
            name, seed = todo.pop(0)
            out = args.work / f"{name}-s{seed}"
            if (out / "drafter.manifest.json").is_file():
                continue
            options = [*shlex.split(args.common), *shlex.split(variants[name])]
            eagle3 = "--kind" not in options or options[options.index("--kind") + 1] == "eagle3"
            steps = ["--ttt-steps", str(args.ttt_steps)] if eagle3 else []
            cmd = [sys.executable, "-m", "eyas.cli", "train", "--data", str(args.run), "--out", str(out),
                   *steps, "--epochs", str(args.epochs), "--seed", str(seed), *options]  # fmt: skip
            if (out / "train.json").is_file():
                cmd.append("--resume")
            log = open(args.work / f"{name}-s{seed}.log", "a")
            print(
                f"[{time.monotonic() - t0:.0f} s] start {name} seed {seed}: {shlex.join(cmd[3:])}",
                flush=True,
            )
            running[(name, seed)] = (
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                log,
            )
        for key, (p, log) in list(running.items()):
            if p.poll() is not None:
                log.close()
                del running[key]
                print(
                    f"[{time.monotonic() - t0:.0f} s] {key[0]} seed {key[1]} exit {p.returncode}",
                    flush=True,
                )
        time.sleep(2)
    rows = {}
    for name in variants:
        per = {}
        for s in seeds:
            out = args.work / f"{name}-s{s}"
            if (out / "drafter.manifest.json").is_file():
                print(f"scoring {out.name} on {args.holdout}", flush=True)
                per[s] = holdout_accuracy(out, args.holdout, args.ttt_steps, samples)
        rows[name] = per
    (args.work / "recipe.json").write_text(
        json.dumps(
            {
                "variants": variants,
                "holdout": str(args.holdout),
                "holdout_samples": args.holdout_samples,
                "results": rows,
            },
            indent=1,
        )
    )
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    print(
        f"\nheld-out {args.holdout}: accuracy per TTT step or block position | conditional | "
        "est. acceptance for 3 drafts | for every position"
    )
    for name, per in rows.items():
        if not per:
            print(f"{name:<24} (no finished training)")
            continue
        n = min(len(p["acc"]) for p in per.values())

        def mean(key: str, per: dict = per, n: int = n) -> list[float]:
            return [sum(p[key][i] for p in per.values()) / len(per) for i in range(n)]

        accept = mean("accept_len")
        print(
            f"{name:<24} {fmt(mean('acc'))} | {fmt(mean('cond_acc'))} | {accept[min(2, n - 1)]:.3f}"
            f" | {accept[-1]:.3f}   ({variants[name] or 'eyas as it is'})"
        )
        for s, p in per.items():
            print(
                f"{'':<24} seed {s}: {fmt(p['acc'])} | {fmt(p['cond_acc'])} | "
                f"{p['accept_len'][min(2, n - 1)]:.3f} | {p['accept_len'][-1]:.3f}"
            )


if __name__ == "__main__":
    main()

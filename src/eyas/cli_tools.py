"""The operator's commands of `eyas`: a tiny target to rehearse with, the disk a run will
take, the state of any directory, the assessment after a failure, and the demo. Registered
on `eyas.cli_support.app` when `eyas.cli` loads."""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.cli_support import app, config, exits, fail, print_json, quiet_transformers, report, say
from eyas.errors import EXIT_PROBLEMS, EXIT_USAGE
from eyas.options import OPTS, config_options
from eyas.stages.config import DemoConfig, EstimateConfig, TinyTargetConfig


@app.command("tiny-target")
@config_options(TinyTargetConfig)
def tiny_target(
    out: Path = typer.Option(..., "--out", help="Directory to write the model to."),
    opts: dict = OPTS,
) -> None:
    """Build a small random target of a real architecture, with tokenizer and chat template.

    Its weights are random: it rehearses the machinery (extract, train, export, evaluate),
    and a drafter trained on it learns nothing (accuracy about 0). `eyas demo`'s target is
    the one that learns."""
    from eyas.demo_target.tiny import build_tiny_target

    quiet_transformers()
    cfg = config(TinyTargetConfig, **opts)
    like = Path(cfg.like) if cfg.like else None
    with exits():
        path = build_tiny_target(
            out,
            cfg.arch,
            like=like,
            sizes=cfg.sizes(),
            seed=cfg.seed,
            trust_remote_code=cfg.trust_remote_code,
            base=cfg.base,
        )
    say(f"tiny {cfg.arch if like is None else f'copy of {like}'} target written to {path}")


@app.command()
@config_options(EstimateConfig)
def estimate(
    samples: int = typer.Option(..., "--samples", help="Number of samples."),
    tokens_per_sample: float = typer.Option(
        ..., "--tokens-per-sample", help="Mean tokens per sample."
    ),
    opts: dict = OPTS,
) -> None:
    """Disk an extraction run will take, before there is a dataset or a GPU."""
    from eyas.ops.estimate import estimate as run_estimate

    cfg = config(EstimateConfig, samples=samples, tokens_per_sample=tokens_per_sample, **opts)
    with exits():
        report.print(run_estimate(cfg).render(), markup=False, highlight=False)


@app.command()
def status(
    run: Path = typer.Argument(
        ...,
        help="Any eyas directory: an extraction run, a training, a dataset, an exported drafter, or generate's output.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Done/remaining/failed samples, bytes, free space, throughput, ETA and the lock holder."""
    from eyas.ops.status import status_of

    with exits():
        as_dict, text = status_of(run)
    if as_json:
        print_json(as_dict)
    else:
        report.print(text, markup=False, highlight=False)


@app.command()
def doctor(
    runs: list[Path] | None = typer.Argument(None, help="Run directories to assess."),
    deep: bool = typer.Option(
        False, "--deep", help="Check every sample's checksums, not only headers and sizes."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
) -> None:
    """Assess GPUs, disks and runs after a failure; end with an ordered plan."""
    from eyas.ops.doctor import doctor as run_doctor
    from eyas.ops.doctor import render as render_doctor
    from eyas.ops.status import not_eyas
    from eyas.stages.generate import STATE_SUFFIX

    # Every path given is assessed in one report; a wrong one (missing, or not eyas's) makes
    # the exit code a usage error's, as status and verify give.
    wrong = [
        r
        for r in runs or []
        if (not r.exists() and not r.with_name(r.name + STATE_SUFFIX).is_dir())
        or (r.exists() and not_eyas(r) is not None)
    ]
    code = EXIT_USAGE if wrong else EXIT_PROBLEMS
    rep = run_doctor(list(runs or []), deep=deep)
    if as_json:
        print_json(rep.to_dict())
    else:
        render_doctor(rep, report)
    if wrong or rep.needs_action:
        raise typer.Exit(code)


@app.command()
@config_options(DemoConfig)
def demo(
    as_json: bool = typer.Option(False, "--json", help="Also print the summary as JSON."),
    opts: dict = OPTS,
) -> None:
    """Run the whole pipeline on the built-in demo target and conversations."""
    from eyas.ops.demo import run_demo

    quiet_transformers()
    with exits():
        summary = run_demo(config(DemoConfig, **opts))
    if as_json:
        print_json(summary)
    if not summary["lossless"]:
        raise fail("speculative decoding differed from greedy decoding")

"""The `eyas` command line: parse, build a config, call one library function, map errors.
The pipeline's verbs are here; the operator's tools in `cli_tools`, what every command does
alike (the exit rule, the checks of the directories it reads) in `cli_support`.

Exit codes: 0 success; 1 the command ran but found problems (failed records above the
threshold, corrupt samples, a run that needs action); 2 usage errors; 75 (EX_TEMPFAIL)
extraction stopped early for lack of disk space or by signal, resumable.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from eyas.cli_support import (
    app,
    config,
    exits,
    fail,
    json_object,
    need,
    print_json,
    quiet_transformers,
    report,
    run_app,
    say,
    this_command,
)
from eyas.drafters import KINDS, option_owners, options_class
from eyas.drafters.formats import FORMATS
from eyas.errors import EXIT_PROBLEMS, EXIT_STOPPED, EXIT_USAGE
from eyas.host.cpu import pin_runtime_env
from eyas.options import OPTS, config_options, given
from eyas.run.runmeta import is_run
from eyas.stages.config import (
    EvaluateConfig,
    ExportConfig,
    ExtractConfig,
    GenerateConfig,
    PrepareConfig,
    VerifyConfig,
)
from eyas.training.config import TrainConfig

pin_runtime_env()  # before torch loads

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@app.command()
@config_options(PrepareConfig, skip={"progress"})
def prepare(
    model: Path = typer.Option(..., "--model", help="Model dir with tokenizer and chat template."),
    data: list[Path] = typer.Option(
        ..., "--data", help="Input JSONL/JSON file(s); repeat for more."
    ),
    out: Path = typer.Option(..., "--out", help="Dataset directory to write."),
    chat_template_kwargs: str | None = typer.Option(
        None,
        "--chat-template-kwargs",
        help="JSON object of chat-template variables, e.g. '{\"thinking\": false}'; kept in dataset.json.",
    ),
    extra_data: list[Path] | None = typer.Argument(None, help="More input files."),
    opts: dict = OPTS,
) -> None:
    """Render conversations with the model's chat template; write ids, loss masks, vocab counts."""
    from eyas.stages.prepare import prepare as run

    quiet_transformers()
    cfg = config(
        PrepareConfig,
        model=str(model),
        data=tuple(str(p) for p in [*data, *(extra_data or [])]),
        out=str(out),
        chat_template_kwargs=json_object(chat_template_kwargs),
        **opts,
    )
    from eyas.stages.prepare import PrepareFailed

    with exits(then=this_command("prepare", "prepare again")):
        try:
            s = run(cfg)
        except PrepareFailed as exc:
            say(exc.summary.render(written=False))
            raise
    say(s.render())


@app.command()
@config_options(GenerateConfig, skip={"progress"})
def generate(
    endpoint: str = typer.Option(
        ..., "--endpoint", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000."
    ),
    model: str = typer.Option(..., "--model", help="Model name the endpoint serves."),
    data: list[Path] = typer.Option(
        ..., "--data", help="Input JSONL/JSON file(s); repeat for more."
    ),
    out: Path = typer.Option(
        ..., "--out", help="Output JSONL (state next to it in OUT.eyas-gen/)."
    ),
    opts: dict = OPTS,
) -> None:
    """Replace assistant turns with the target's own answers, through a serving endpoint, exactly once."""
    from eyas.stages.generate import generate as run_generate

    cfg = config(
        GenerateConfig,
        endpoint=endpoint,
        model=model,
        data=tuple(str(p) for p in data),
        out=str(out),
        **opts,
    )
    command = this_command("generate", "eyas generate ...")
    with exits(then=command):
        s = run_generate(cfg, command)
    say(s.render())
    if (problems := s.problems()) is not None:
        raise fail(problems)


@app.command()
@config_options(ExtractConfig, skip={"progress", "queue_depth"})
def extract(
    ctx: typer.Context,
    model: Path | None = typer.Option(None, "--model", help="Target model directory."),
    data: Path | None = typer.Option(None, "--data", help="Prepared dataset directory."),
    out: Path | None = typer.Option(None, "--out", help="Run directory to create or continue."),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this directory (needs nothing else)."
    ),
    opts: dict = OPTS,
) -> None:
    """Run the target over a prepared dataset; store aux and final hidden states, crash-safe."""
    from eyas.stages.extract import extract as run_extract

    quiet_transformers()
    need(resume, "run")
    need(data, "dataset")
    again = f"eyas extract --resume {resume or out}"
    # A run's resume on a disk still full is a clean stop that names itself; a new run's
    # refusal for lack of space is not (there is no run to resume yet).
    exists = resume is not None or (out is not None and is_run(out))
    with exits(then=again if exists else None, resume=again):
        if resume is not None:
            if out:
                raise fail(
                    "--resume names the run directory; drop --out (--model and --data point to a "
                    "target or dataset that moved)",
                    EXIT_USAGE,
                )
            moved = {k: str(Path(v).resolve()) for k, v in (("model", model), ("data", data)) if v}
            s = run_extract(resume=str(resume), overrides={**given(ctx, opts), **moved})
        else:
            if not (model and data and out):
                raise fail("need --model, --data and --out (or --resume RUN_DIR)", EXIT_USAGE)
            cfg = config(ExtractConfig, model=str(model), data=str(data), out=str(out), **opts)
            s = run_extract(cfg)
    say(s.render())
    if (problems := s.problems()) is not None:
        raise fail(problems)


@app.command()
@config_options(VerifyConfig, skip={"progress"})
def verify(
    run: Path = typer.Argument(..., help="Extraction run directory (from eyas extract)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    opts: dict = OPTS,
) -> None:
    """Check every committed sample; report missing, corrupt, orphan and duplicate samples."""
    from eyas.stages.verify import verify as run_verify

    need(run, "run", eyas_only=True)
    with exits():
        rep = run_verify(config(VerifyConfig, run=str(run), progress=True, **opts))
    if as_json:
        print_json(rep.to_dict())
    else:
        report.print(rep.render(), markup=False, highlight=False)
    if not rep.clean and not rep.repaired:
        raise typer.Exit(EXIT_PROBLEMS)


@app.command()
@config_options(
    TrainConfig,
    skip={"progress", "data", "out", "model"},
    also=[(name, options_class(name)) for name in KINDS],
)
def train(
    ctx: typer.Context,
    data: Path | None = typer.Option(
        None, "--data", help="Extraction run directory (a resume: the saved one)."
    ),
    out: Path = typer.Option(..., "--out", help="Training directory."),
    model: Path | None = typer.Option(
        None, "--model", help="Target model dir (default: the run's)."
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue from the latest checkpoint in --out, with the options it was started with.",
    ),
    opts: dict = OPTS,
) -> None:
    """Train a drafter of any kind on an extraction run; torchrun for data parallel."""
    from eyas.stages.train import resume_options
    from eyas.stages.train import train as run_train

    quiet_transformers()
    typed, owned = given(ctx, opts), option_owners()  # a kind's options: the typed ones alone
    opts = {k: v for k, v in opts.items() if k not in owned or k in typed}
    opts = {"data": str(data) if data else None, "model": str(model) if model else None, **opts}
    if resume:
        with exits():
            opts = resume_options(out, opts, given(ctx, opts))
    if not opts["data"]:
        raise fail("need --data RUN (or --resume with an --out that holds a training)", EXIT_USAGE)
    data, follow = Path(opts["data"]), opts["follow"]
    if not follow:  # a follower may start before its run exists, and waits for it
        need(data, "run")
    cfg = config(TrainConfig.of, out=str(out), **opts)
    with exits(then=f"eyas train --resume --out {out}", also=(KeyError,)):
        res = run_train(cfg, resume=resume)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one line for the training
        say(res.render())


@app.command()
@config_options(ExportConfig, skip={"format"})
def export(
    train_dir: Path = typer.Argument(..., help="Training directory (from eyas train)."),
    fmt: str = typer.Option(
        ...,
        "--format",
        help=f"The engine's format: {' or '.join(FORMATS)} (a kind is written in some of them).",
    ),
    out: Path = typer.Option(
        ..., "--out", help="Directory to write config.json and model.safetensors to."
    ),
    opts: dict = OPTS,
) -> None:
    """Write the trained drafter in a format vLLM or SGLang loads (atomically: --out is
    always a whole export, the old one or the new one)."""
    from eyas.stages.export import export as run_export

    need(train_dir, "training")
    cfg = config(ExportConfig, train_dir=str(train_dir), format=fmt, out=str(out), **opts)
    with exits(then=this_command("export", "export again")):
        say(run_export(cfg).render())


@app.command()
@config_options(EvaluateConfig, skip={"drafters"})
def evaluate(
    model: Path = typer.Option(..., "--model", help="Target model directory."),
    drafter: list[Path] = typer.Option(
        ...,
        "--drafter",
        help="Exported drafter (either format); repeat to compare several on the same prompts.",
    ),
    data: Path = typer.Option(
        ...,
        "--data",
        help='JSONL prompts: a last user turn, {"prompt": ...}, or conversations cut before '
        "their last assistant turn; a category field gives a table per category.",
    ),
    chat_template_kwargs: str | None = typer.Option(
        None,
        "--chat-template-kwargs",
        help="JSON object of chat-template variables (default: those the drafter's training data was prepared with).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
    opts: dict = OPTS,
) -> None:
    """Speculative decoding vs plain greedy: acceptance length, speed, and a lossless check.
    Several --drafter are judged on the same prompts, with their paired differences."""
    from eyas.stages.evaluate import judge

    quiet_transformers()
    cfg = config(
        EvaluateConfig,
        model=str(model),
        drafters=tuple(str(d) for d in drafter),
        data=str(data),
        chat_template_kwargs=json_object(chat_template_kwargs),
        **opts,
    )
    for dr in drafter:
        if Path(dr).exists():  # a missing one is said after the prompts and the tokenizer
            need(dr, "export")
    with exits():
        s = judge(cfg)
    if as_json:
        print_json(s.to_json())
    else:
        report.print(s.render(), markup=False, highlight=False)
    if not s.lossless:
        raise typer.Exit(EXIT_PROBLEMS)
    if (line := s.stopped()) is not None:
        say(line)
        raise typer.Exit(EXIT_STOPPED)


import eyas.cli_tools  # noqa: E402, F401 - the operator's commands, registered on `app`


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()

"""The `eyas` command line: parse, build a config, call one library function, map errors.

Exit codes: 0 success; 1 the command ran but found problems (failed records above the
threshold, corrupt samples, a run that needs action); 2 usage errors; 75 (EX_TEMPFAIL)
extraction stopped early for lack of disk space or by signal, resumable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from eyas.drafters import KINDS, option_owners, options_class
from eyas.errors import EXIT_PROBLEMS, EXIT_STOPPED, EXIT_USAGE, EyasError, exit_code
from eyas.host.cpu import pin_runtime_env
from eyas.host.ui import console
from eyas.options import OPTS, config_options, given
from eyas.stages.config import (
    DemoConfig,
    EstimateConfig,
    EvaluateConfig,
    ExportConfig,
    ExtractConfig,
    GenerateConfig,
    PrepareConfig,
    TinyTargetConfig,
)
from eyas.training.config import TrainConfig

pin_runtime_env()  # before torch loads
report = Console(soft_wrap=True)  # reports go to stdout; progress and errors to stderr

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _flag_type(self, ctx):
    """Boolean flags take no value: show no `<bool>` type next to them in --help."""
    return None if getattr(self, "is_flag", False) else self.display_type(ctx)


if hasattr(typer.core.TyperOption, "display_type_rich"):
    typer.core.TyperOption.display_type_rich = _flag_type

app = typer.Typer(
    add_completion=False,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    help="Train EAGLE-3 drafters: prepare -> extract -> verify -> train -> export -> evaluate.",
)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the eyas version and exit.", is_eager=True
    ),
) -> None:
    if version:
        from eyas import __version__

        print(f"eyas {__version__}")
        raise typer.Exit(0)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


_KIND_NAMES = {
    "run": "extraction run directory",
    "dataset": "prepared dataset directory",
    "training": "training directory",
    "export": "exported drafter directory",
}


def _need(path, kind: str, eyas_only: bool = False) -> None:
    """A directory the command reads must be there, and not an eyas directory of another
    kind (`kind`: run, dataset, training, export), nor a file; with `eyas_only`, nor a
    directory eyas did not write. Each is a usage error (exit 2) that says what the path is
    and which command reads it."""
    from eyas.ops.status import not_eyas, wrong_kind

    if path is None:
        return
    if not Path(path).exists():
        raise fail(f"{path}: no such {_KIND_NAMES[kind]}", EXIT_USAGE)
    if (msg := wrong_kind(Path(path), kind)) is not None:
        raise fail(msg, EXIT_USAGE)
    if (Path(path).is_file() or eyas_only) and (msg := not_eyas(Path(path))) is not None:
        raise fail(msg, EXIT_USAGE)


def fail(msg: str, code: int = EXIT_PROBLEMS) -> typer.Exit:
    """Say why the command ends (a clean, resumable stop is no error) and exit with `code`."""
    label = "[bold yellow]stopped:[/]" if code == EXIT_STOPPED else "[bold red]error:[/]"
    console.print(f"{label} {escape(msg)}", highlight=False)
    return typer.Exit(code)


def _disk_full(exc: BaseException, then: str) -> None:
    """A full disk is a clean, resumable stop in every stage: exit 75 and one line."""
    from eyas.run.fsutil import is_disk_full

    if is_disk_full(exc):
        raise fail(
            f"disk full: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}. "
            f"Nothing half-written is kept; free space, then: {then}",
            EXIT_STOPPED,
        ) from None


def _this_command(verb: str, otherwise: str) -> str:
    """This command line as typed, which is what continues it; `otherwise` where eyas runs
    the stage from code (the demo, a test's runner)."""
    return shlex.join(["eyas", *sys.argv[1:]]) if sys.argv[1:2] == [verb] else otherwise


@contextlib.contextmanager
def _exits(
    then: str | None = None, also: tuple[type[Exception], ...] = (), resume: str | None = None
):
    """A stage's error as one line and its exit code, by the one rule of `eyas.errors`: a
    clean stop 75, a usage error or missing file 2, anything the stage found 1. With `then`,
    the command that continues, a full disk is a clean stop that names it. `also`: more
    exception types the stage raises for damaged input (others keep their traceback). A
    signal outside the stage's own loops stops it at once (75), naming `resume` (or `then`)."""
    from eyas.stop import stop_at_once

    try:
        with stop_at_once(resume or then or "the same command again"):
            yield
    except (EyasError, ValueError, OSError, *also) as exc:
        if then is not None:
            _disk_full(exc, then)
        raise fail(str(exc), exit_code(exc)) from None


def _json_object(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"--chat-template-kwargs is not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(obj, dict):
        raise fail("--chat-template-kwargs must be a JSON object", EXIT_USAGE)
    return obj


def _config(factory, **kw):
    try:
        return factory(**kw)
    except (ValueError, TypeError) as exc:
        raise fail(str(exc), EXIT_USAGE) from None


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

    _quiet_transformers()
    cfg = _config(TinyTargetConfig, **opts)
    like = Path(cfg.like) if cfg.like else None
    with _exits():
        path = build_tiny_target(
            out,
            cfg.arch,
            like=like,
            sizes=cfg.sizes(),
            seed=cfg.seed,
            trust_remote_code=cfg.trust_remote_code,
            base=cfg.base,
        )
    _say(f"tiny {cfg.arch if like is None else f'copy of {like}'} target written to {path}")


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

    _quiet_transformers()
    cfg = _config(
        PrepareConfig,
        model=str(model),
        data=tuple(str(p) for p in [*data, *(extra_data or [])]),
        out=str(out),
        chat_template_kwargs=_json_object(chat_template_kwargs),
        **opts,
    )
    from eyas.stages.prepare import PrepareFailed

    with _exits(then=_this_command("prepare", "prepare again")):
        try:
            s = run(cfg)
        except PrepareFailed as exc:
            _say(exc.summary.render(written=False))
            raise
    _say(s.render())


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

    cfg = _config(
        GenerateConfig,
        endpoint=endpoint,
        model=model,
        data=tuple(str(p) for p in data),
        out=str(out),
        **opts,
    )
    command = _this_command("generate", "eyas generate ...")
    with _exits(then=command):
        s = run_generate(cfg, command)
    _say(s.render())
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

    _quiet_transformers()
    _need(resume, "run")
    _need(data, "dataset")
    again = f"eyas extract --resume {resume or out}"
    # A run's resume on a disk still full is a clean stop that names itself; a new run's
    # refusal for lack of space is not (there is no run to resume yet).
    exists = resume is not None or (out is not None and (out / "run.json").exists())
    with _exits(then=again if exists else None, resume=again):
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
            cfg = _config(ExtractConfig, model=str(model), data=str(data), out=str(out), **opts)
            s = run_extract(cfg)
    _say(s.render())
    if (problems := s.problems()) is not None:
        raise fail(problems)


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

    cfg = _config(EstimateConfig, samples=samples, tokens_per_sample=tokens_per_sample, **opts)
    with _exits():
        report.print(run_estimate(cfg).render(), markup=False, highlight=False)


@app.command()
def verify(
    run: Path = typer.Argument(..., help="Extraction run directory (from eyas extract)."),
    quick: bool = typer.Option(
        False, "--quick", help="Headers, shapes and sizes only; skip checksums."
    ),
    repair: bool = typer.Option(
        False, "--repair", help="Quarantine bad files and drop their journal entries."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check every committed sample; report missing, corrupt, orphan and duplicate samples."""
    from eyas.stages.verify import render as render_verify
    from eyas.stages.verify import verify as run_verify

    _need(run, "run", eyas_only=True)
    with _exits():
        rep = run_verify(run, quick=quick, repair=repair, progress=True)
    if as_json:
        _print_json(rep.to_dict())
    else:
        render_verify(rep, report)
    if not rep.clean and not rep.repaired:
        raise typer.Exit(EXIT_PROBLEMS)


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

    with _exits():
        as_dict, text = status_of(run)
    if as_json:
        _print_json(as_dict)
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
        _print_json(rep.to_dict())
    else:
        render_doctor(rep, report)
    if wrong or rep.needs_action:
        raise typer.Exit(code)


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
    from eyas.stages.train import render_result, resume_options
    from eyas.stages.train import train as run_train

    _quiet_transformers()
    typed, owned = given(ctx, opts), option_owners()  # a kind's options: the typed ones alone
    opts = {k: v for k, v in opts.items() if k not in owned or k in typed}
    opts = {"data": str(data) if data else None, "model": str(model) if model else None, **opts}
    if resume:
        with _exits():
            opts = resume_options(out, opts, given(ctx, opts))
    if not opts["data"]:
        raise fail("need --data RUN (or --resume with an --out that holds a training)", EXIT_USAGE)
    data, follow = Path(opts["data"]), opts["follow"]
    if not follow:  # a follower may start before its run exists, and waits for it
        _need(data, "run")
    cfg = _config(TrainConfig.of, out=str(out), **opts)
    with _exits(then=f"eyas train --resume --out {out}", also=(KeyError,)):
        res = run_train(cfg, resume=resume)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one line for the training
        _say(render_result(res, out, resume))


@app.command()
@config_options(ExportConfig)
def export(
    train_dir: Path = typer.Argument(..., help="Training directory (from eyas train)."),
    fmt: str = typer.Option(
        ...,
        "--format",
        help="vllm (speculators Eagle3Speculator) or sglang (LlamaForCausalLMEagle3).",
    ),
    out: Path = typer.Option(
        ..., "--out", help="Directory to write config.json and model.safetensors to."
    ),
    opts: dict = OPTS,
) -> None:
    """Write the trained drafter in a format vLLM or SGLang loads (atomically: --out is
    always a whole export, the old one or the new one)."""
    from eyas.stages.export import export as run_export
    from eyas.stages.export import render_export

    _need(train_dir, "training")
    cfg = _config(ExportConfig, **opts)
    with _exits(then=_this_command("export", "export again")):
        path = run_export(train_dir, fmt, out, **dataclasses.asdict(cfg))
    _say(render_export(path, fmt, cfg.speculative_tokens))


@app.command()
@config_options(EvaluateConfig)
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
    from eyas.stages.eval_report import render_inputs, render_paired, render_result, stopped_line
    from eyas.stages.evaluate import judge

    _quiet_transformers()
    cfg = _config(EvaluateConfig, **opts)
    engine = cfg.engine
    for dr in drafter:
        if Path(dr).exists():  # a missing one is said after the prompts and the tokenizer
            _need(dr, "export")
    with _exits():
        results, pairs = judge(
            cfg,
            str(model),
            [str(d) for d in drafter],
            str(data),
            _json_object(chat_template_kwargs),
        )
    ds = [{"engine": engine, **r.to_dict()} for r in results]
    if as_json:
        _print_json(ds[0] if len(drafter) == 1 else {"drafters": ds, "paired": pairs})
    else:
        render_inputs(report, ds[0], data)
        for d in ds:
            render_result(report, d)
        render_paired(report, pairs)
    if not all(d["lossless"] for d in ds):
        raise typer.Exit(EXIT_PROBLEMS)
    if (line := stopped_line(ds, len(drafter))) is not None:
        _say(line)
        raise typer.Exit(EXIT_STOPPED)


@app.command()
@config_options(DemoConfig)
def demo(
    as_json: bool = typer.Option(False, "--json", help="Also print the summary as JSON."),
    opts: dict = OPTS,
) -> None:
    """Run the whole pipeline on the built-in demo target and conversations."""
    from eyas.ops.demo import run_demo

    _quiet_transformers()
    with _exits():
        summary = run_demo(_config(DemoConfig, **opts))
    if as_json:
        _print_json(summary)
    if not summary["lossless"]:
        raise fail("speculative decoding differed from greedy decoding")


def _say(text: str) -> None:
    """A stage's summary, as the stage wrote it (no markup read into it)."""
    console.print(text, markup=False, highlight=False)


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def main() -> None:
    if len(sys.argv) == 1:
        sys.argv.append("--help")
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        app()
        return
    # A torchrun rank leaves without the interpreter's teardown: its work is on disk and its
    # process group destroyed by then, and tearing down torch's distributed runtime at
    # interpreter exit aborted a rank now and then (SIGABRT, "terminate called without an
    # active exception") after a finished training, which made torchrun report a failure.
    code: int | str | None = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code
    if isinstance(code, str):  # sys.exit("message"): said on stderr, status 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()

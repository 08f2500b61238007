"""What every `eyas` command does alike: the app they register on, saying why a command
ends and exiting with the code of `eyas.errors`'s one rule, checking the directories it
reads, building its config, printing its summary, and leaving a torchrun rank cleanly.
The commands themselves are in `eyas.cli` and `eyas.cli_tools`."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from eyas.errors import EXIT_PROBLEMS, EXIT_STOPPED, EXIT_USAGE, EyasError, exit_code
from eyas.host.ui import console

report = Console(soft_wrap=True)  # reports go to stdout; progress and errors to stderr


def flag_type(self, ctx):
    """Boolean flags take no value: show no `<bool>` type next to them in --help."""
    return None if getattr(self, "is_flag", False) else self.display_type(ctx)


if hasattr(typer.core.TyperOption, "display_type_rich"):
    typer.core.TyperOption.display_type_rich = flag_type


app = typer.Typer(
    add_completion=False,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    help="Train speculative-decoding drafters (EAGLE-3, DFlash, DSpark): generate -> prepare -> "
    "extract -> verify -> train -> export -> evaluate.",
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


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


KIND_NAMES = {
    "run": "extraction run directory",
    "dataset": "prepared dataset directory",
    "training": "training directory",
    "export": "exported drafter directory",
}


def need(path, kind: str, eyas_only: bool = False) -> None:
    """A directory the command reads must be there, and not an eyas directory of another
    kind (`kind`: run, dataset, training, export), nor a file; with `eyas_only`, nor a
    directory eyas did not write. Each is a usage error (exit 2) that says what the path is
    and which command reads it."""
    from eyas.ops.status import not_eyas, wrong_kind

    if path is None:
        return
    if not Path(path).exists():
        raise fail(f"{path}: no such {KIND_NAMES[kind]}", EXIT_USAGE)
    if (msg := wrong_kind(Path(path), kind)) is not None:
        raise fail(msg, EXIT_USAGE)
    if (Path(path).is_file() or eyas_only) and (msg := not_eyas(Path(path))) is not None:
        raise fail(msg, EXIT_USAGE)


def fail(msg: str, code: int = EXIT_PROBLEMS) -> typer.Exit:
    """Say why the command ends (a clean, resumable stop is no error) and exit with `code`."""
    label = "[bold yellow]stopped:[/]" if code == EXIT_STOPPED else "[bold red]error:[/]"
    console.print(f"{label} {escape(msg)}", highlight=False)
    return typer.Exit(code)


def disk_full(exc: BaseException, then: str) -> None:
    """A full disk is a clean, resumable stop in every stage: exit 75 and one line."""
    from eyas.run.fsutil import is_disk_full

    if is_disk_full(exc):
        raise fail(
            f"disk full: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}. "
            f"Nothing half-written is kept; free space, then: {then}",
            EXIT_STOPPED,
        ) from None


def this_command(verb: str, otherwise: str) -> str:
    """This command line as typed, which is what continues it; `otherwise` where eyas runs
    the stage from code (the demo, a test's runner)."""
    return shlex.join(["eyas", *sys.argv[1:]]) if sys.argv[1:2] == [verb] else otherwise


@contextlib.contextmanager
def exits(
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
            disk_full(exc, then)
        raise fail(str(exc), exit_code(exc)) from None


def json_object(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"--chat-template-kwargs is not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(obj, dict):
        raise fail("--chat-template-kwargs must be a JSON object", EXIT_USAGE)
    return obj


def config(factory, **kw):
    try:
        return factory(**kw)
    except (ValueError, TypeError) as exc:
        raise fail(str(exc), EXIT_USAGE) from None


def say(text: str) -> None:
    """A stage's summary, as the stage wrote it (no markup read into it)."""
    console.print(text, markup=False, highlight=False)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def run_app(app) -> None:
    """Run the command line; a torchrun rank leaves without the interpreter's teardown."""
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

"""The README and docs/ show commands the CLI accepts, and the shipped examples prepare."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

try:  # typer carries its own copy of click
    from typer._click import exceptions as click
except ImportError:  # older typer: click itself
    import click

from eyas.cli import app

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands(text: str) -> list[str]:
    """Every `eyas ...` (or `torchrun ... -m eyas.cli ...`) command in the page's code
    blocks and inline code, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            for part in re.split(r" && | \| ", line):
                part = part.strip()
                if part.startswith("eyas ") or "-m eyas.cli " in part:
                    out.append(part)
    for code in re.findall(r"`(eyas [^`]+)`", text):
        out.append(code.replace("\n", " "))
    return out


def _args(cmd: str) -> list[str]:
    args = shlex.split(cmd)
    if "eyas.cli" in args:
        args = args[args.index("eyas.cli") + 1 :]
    else:
        args = args[1:]
    return [a for a in args if a not in ("[", "]") and not a.startswith(("[", "..."))]


def _check(group, cmd: str) -> str | None:
    """Why the CLI would not take `cmd` (an unknown command or option, an option's value of
    the wrong type), or None. Placeholders in capitals stand for values and pass."""
    args = _args(cmd)
    if not args:
        return None
    sub = group.commands.get(args[0])
    if sub is None:
        return f"no command {args[0]!r}"
    names = {n for p in sub.params for n in (*p.opts, *p.secondary_opts)}
    for a in args[1:]:
        flag = a.split("=", 1)[0]
        if flag.startswith("--") and flag not in names:
            return f"`eyas {args[0]}` has no option {flag}"
    try:
        sub.make_context(args[0], [a.rstrip(",") for a in args[1:]], resilient_parsing=False)
    except click.MissingParameter:
        return None  # a page may leave out what it is not about
    except click.BadParameter as exc:
        opts = getattr(exc.param, "opts", [])
        given = [args[i + 1] for i, a in enumerate(args[:-1]) if a in opts]
        if given and all(re.fullmatch(r"[A-Z][A-Z_0-9]*", v) for v in given):
            return None  # a placeholder for a value
        return str(exc)
    except click.UsageError as exc:
        return str(exc)
    return None


def test_every_command_shown_is_one_the_cli_accepts():
    group = typer.main.get_command(app)
    seen, wrong = 0, []
    for page in PAGES:
        for cmd in _commands(page.read_text()):
            seen += 1
            if (why := _check(group, cmd)) is not None:
                wrong.append(f"{page.relative_to(ROOT)}: {cmd}\n    {why}")
    assert seen > 40, seen
    assert not wrong, "\n".join(wrong)


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    first = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first[0].endswith("eyas demo") and first[1].endswith("python -m pytest -q")
    for link in re.findall(r"\]\((docs/[^)]+)\)", text):
        assert (ROOT / link).is_file(), link


@pytest.mark.parametrize("name", ["chats", "sharegpt", "text", "tools", "thinking"])
def test_the_shipped_examples_prepare(name, tmp_path, targets):
    """Each example file of docs/your-data.md prepares with no failed record on a template
    that renders tools and reasoning (the tiny qwen3's)."""
    from eyas.stages.prepare import PrepareConfig, prepare

    s = prepare(PrepareConfig(model=str(targets["qwen3"]), data=(str(ROOT / "examples" / f"{name}.jsonl"),),
                              out=str(tmp_path / "ds"), progress=False))  # fmt: skip
    assert s.failed == 0 and s.prepared == s.records > 0, s
    if name == "thinking":  # qwen3's template drops earlier turns' reasoning from the history
        assert set(s.dropped) == {"reasoning_in_history"}, s.dropped
        s = prepare(PrepareConfig(model=str(targets["qwen3"]), data=(str(ROOT / "examples" / f"{name}.jsonl"),),
                                  out=str(tmp_path / "pt"), per_turn_samples=True, progress=False))  # fmt: skip
    assert not s.dropped, s.dropped


def test_every_option_says_what_it_does():
    """Every option of every command has help; the options of the commands that have a
    config come from its fields, so their defaults are the config's (and the library's
    evaluate takes its defaults from the same config)."""
    import dataclasses
    import inspect

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
    from eyas.stages.evaluate import evaluate, evaluate_vllm
    from eyas.stages.export import export
    from eyas.training.config import TrainConfig

    group = typer.main.get_command(app)
    silent = [f"{name} {p.opts[0]}" for name, cmd in group.commands.items() for p in cmd.params
              if p.param_type_name == "option" and not (p.help or "").strip()]  # fmt: skip
    assert not silent, silent
    configs = {"train": TrainConfig, "prepare": PrepareConfig, "extract": ExtractConfig,
               "generate": GenerateConfig, "evaluate": EvaluateConfig, "export": ExportConfig,
               "demo": DemoConfig, "estimate": EstimateConfig, "tiny-target": TinyTargetConfig}  # fmt: skip
    for name, cls in configs.items():
        params = {p.name: p for p in group.commands[name].params}
        checked = 0
        for f in dataclasses.fields(cls):
            if f.name in params and f.default is not dataclasses.MISSING:
                assert params[f.name].default == f.default, (name, f.name)
                checked += 1
        # the command's options are the config's (export has four)
        assert checked >= min(4, len(dataclasses.fields(cls))), (name, checked)
    for fn, cls in (
        (evaluate, EvaluateConfig),
        (evaluate_vllm, EvaluateConfig),
        (export, ExportConfig),
    ):
        for p in inspect.signature(fn).parameters.values():
            if hasattr(cls, p.name) and p.default is not p.empty:
                assert p.default == getattr(cls, p.name), (fn.__name__, p.name)

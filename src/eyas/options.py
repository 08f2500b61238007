"""Command-line options defined once: a command's options come from its config dataclass,
each with the field's default and, as its help, the docstring written under the field.

    @app.command()
    @config_options(TrainConfig, skip={"progress"})
    def train(ctx: typer.Context, out: Path = typer.Option(...), opts: dict = OPTS) -> None:
        cfg = TrainConfig(out=str(out), **opts)

`also` adds the fields of more dataclasses, each with a label its help starts with (`train`
offers every drafter kind's options so, each labelled with the kinds that read it; a field
several declare is one option, its help giving each kind's default where they differ; a
boolean any of them defaults on is also offered as `--no-NAME`).

A field of integers (`tuple[int, ...] | None`) is given comma-separated. Fields of another
type a command line cannot give (other tuples, dicts) and those in `skip` are left to the
command. `given(ctx, opts)` keeps only the options typed on this command line: what a
resume may change, as opposed to what the saved config already says.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing

import typer
from rich.markup import escape

__all__ = ["OPTS", "config_options", "field_docs", "given"]

OPTS: dict = {}  # the `opts` parameter's marker: the config fields' values arrive there
_SCALARS = (int, float, str, bool)


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, whitespace folded to one line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for a, b in zip(body, body[1:], strict=False):
            if (
                isinstance(a, ast.AnnAssign)
                and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant)
                and isinstance(b.value.value, str)
            ):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def _scalar(tp) -> type | None:
    """int, float, str or bool for `tp` or `tp | None`; None for anything else."""
    if tp in _SCALARS:
        return tp
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in _SCALARS:
            return tp
    return None


_INTS = tuple[int, ...] | None  # a list of integers: given as 1,15,28 (or [1, 15, 28])


def _ints(ctx, param, value: str | None) -> tuple[int, ...] | None:
    """An option of integers separated by commas, as the tuple its field holds."""
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.replace(" ", "").strip("[]").split(","))
    except ValueError:
        raise typer.BadParameter(f"{value!r}: expected integers like 1,15,28") from None


def _declared(cls, also) -> dict[str, tuple[dataclasses.Field, type, str, str, dict]]:
    """Field name -> (field, type, help, label, defaults) over `cls` and then `also` ((label,
    class) pairs); a field of several `also` classes is labelled with all their labels, and
    `defaults` holds each label's default (one kind may default a shared option otherwise)."""
    out: dict[str, tuple[dataclasses.Field, type, str, str, dict]] = {}
    for label, klass in [("", cls), *also]:
        hints, docs = typing.get_type_hints(klass), field_docs(klass)
        for f in dataclasses.fields(klass):
            if f.name in out:
                first = out[f.name]
                if label and first[3] and label not in first[3].split(", "):
                    out[f.name] = (*first[:3], f"{first[3]}, {label}", first[4])
                first[4].setdefault(label, f.default)
                continue
            if f.name not in docs:
                raise TypeError(
                    f"{klass.__name__}.{f.name} has no docstring: an option must say what it does"
                )
            out[f.name] = (f, hints[f.name], docs[f.name], label, {label: f.default})
    return out


def _shown(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def config_options(cls, *, skip: set[str] | frozenset = frozenset(), also=()):
    """Give the decorated command one option per field of `cls` and of the classes in `also`
    ((label, class) pairs), not in `skip` and not declared by the command itself; their
    values reach it as the dict `opts`."""
    declared = _declared(cls, also)

    def deco(func):
        resolved = typing.get_type_hints(func)  # the command's own annotations, as types
        own = [
            p.replace(annotation=resolved.get(p.name, p.annotation))
            for p in inspect.signature(func).parameters.values()
            if p.name != "opts"
        ]
        taken = {p.name for p in own} | set(skip)
        generated = []
        for f, hint, doc, label, defaults in declared.values():
            ints = hint == _INTS
            tp = str | None if ints else _scalar(hint)
            if f.name in taken or tp is None:
                continue
            if f.default is dataclasses.MISSING:
                raise TypeError(
                    f"{cls.__name__}.{f.name} has no default: declare its option in the command"
                )
            flag = f"--{f.name.replace('_', '-')}"
            if tp is bool and any(defaults.values()):
                flag = f"{flag}/--no-{f.name.replace('_', '-')}"
            # the help is rich markup: `[tensorboard]` is text
            help_ = f"{label}: {doc}" if label else doc
            several = len(set(map(repr, defaults.values()))) > 1
            if several:  # each kind's default, as no single one is the option's
                help_ += " [default: " + ", ".join(f"{k} {_shown(v)}" for k, v in defaults.items())
                help_ += "]"
            help_ = escape(help_)
            generated.append(
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=tp,
                    default=typer.Option(
                        f.default,
                        flag,
                        help=help_,
                        show_default=not several
                        and f.default is not None
                        and f.default is not False,
                        callback=_ints if ints else None,
                    ),
                )
            )
        names = {p.name for p in generated}
        params = sorted(own, key=lambda p: p.kind) + generated
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]

        @functools.wraps(func)
        def command(**kw):
            opts = {k: kw.pop(k) for k in list(kw) if k in names}
            return func(**kw, opts=opts)

        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer must read the signature above, not func's
        return command

    return deco


def given(ctx: typer.Context, opts: dict) -> dict:
    """The options of `opts` typed on this command line (not left at their defaults)."""
    out = {}
    for k, v in opts.items():
        source = ctx.get_parameter_source(k)
        if getattr(source, "name", None) == "COMMANDLINE":
            out[k] = v
    return out

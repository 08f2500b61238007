"""The layout's rule, read from the source: lower layers never import higher ones, and only
`eyas.run` names the run directory's sample and journal paths."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "eyas"
# Bottom to top (then the CLI at eyas's top): the contract every stage needs, the run
# directory, the host, targets, the demo target, input data, drafter kinds, the kind-agnostic
# training layer, evaluation's decoders, the stages (one module per verb) and the inspecting commands; a module may
# import its own layer and those below it.
LAYERS = [
    "errors",
    "stop",
    "resume",
    "run",
    "host",
    "targets",
    "demo_target",
    "data",
    "drafters",
    "training",
    "decoders",
    "stages",
    "ops",
]


def _module(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return (
        len(LAYERS) if len(parts) > 1 else -1
    )  # a stage; `eyas` itself (its version) is below all


def _imports(path: Path, src: Path = SRC) -> list[tuple[int, str]]:
    """(line, module) of every eyas module `path` imports, at its top or inside functions."""
    me = _module(path, src).split(".")
    pkg = me if path.name == "__init__.py" else me[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            if mod == "eyas" or mod.startswith("eyas."):
                names = [a.name for a in node.names]
                subs = [f"{mod}.{n}" for n in names if (src.parent / f"{mod}.{n}".replace(".", "/")).exists()
                        or (src.parent / (f"{mod}.{n}".replace(".", "/") + ".py")).exists()]  # fmt: skip
                out += [(node.lineno, m) for m in (subs or [mod])]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("eyas")]
    return out


def _sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


def test_lower_layers_never_import_higher_ones():
    bad = []
    for path in _sources():
        mine = _layer(_module(path))
        for line, mod in _imports(path):
            if _layer(mod) > mine:
                bad.append(f"{path.relative_to(SRC)}:{line} ({LAYERS[mine] if mine < len(LAYERS) else 'top'}) "
                           f"imports {mod}")  # fmt: skip
    assert not bad, "\n".join(bad)
    assert len(_sources()) > 40  # the rule read every module, not an empty tree


def test_the_rule_sees_a_violation(tmp_path):
    """The reader of imports finds an upward import, relative or absolute, at the top or in a
    function (so the rule above can fail)."""
    src = tmp_path / "eyas"
    (src / "run").mkdir(parents=True)
    (src / "training").mkdir()
    (src / "training" / "train.py").write_text("")
    bad = src / "run" / "store.py"
    bad.write_text(
        "from ..training.train import x\n\ndef f():\n    from eyas.training import train\n"
    )
    got = _imports(bad, src)
    assert got == [(1, "eyas.training.train"), (4, "eyas.training.train")], got
    assert all(_layer(m) > _layer(_module(bad, src)) for _, m in got)
    assert (
        _layer("eyas.stages.prepare")
        > _layer("eyas.training.trainer")
        > _layer("eyas.data.dataset")
    )
    assert _layer("eyas.drafters.eagle3.model") > _layer("eyas.data.chat") > _layer("eyas.targets")
    assert _layer("eyas.ops.doctor") > _layer("eyas.stages.extract") > _layer("eyas.training")
    assert _layer("eyas.cli") == len(LAYERS) and _layer("eyas") == -1


def test_only_the_run_layer_names_sample_and_journal_paths():
    """Outside eyas.run, no `... / "samples"` or `... / "journal"` and no list of the run's
    sub-directories: every sample file and journal is reached through eyas.run's functions."""
    bad = []
    for path in _sources():
        if _module(path).startswith("eyas.run"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                if isinstance(node.right, ast.Constant) and node.right.value in (
                    "samples",
                    "journal",
                ):
                    bad.append(f"{path.relative_to(SRC)}:{node.lineno}: / {node.right.value!r}")
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if {"samples", "journal"} <= values:
                    bad.append(
                        f"{path.relative_to(SRC)}:{node.lineno}: a list of the run's sub-directories"
                    )
    assert not bad, "\n".join(bad)


def test_kinds_and_backends_are_reached_through_their_registries():
    """A drafter kind's folder and a backend's module are imported by their registry alone
    (`drafters`, `targets.backends`) and by nothing else in src: adding one is a new folder
    or module plus one registry line."""
    kinds = [
        f"eyas.drafters.{d.name}."
        for d in (SRC / "drafters").iterdir()
        if (d / "__init__.py").is_file()
    ]
    assert len(kinds) >= 2, kinds  # EAGLE-3's and DFlash's folders
    bad = []
    for path in _sources():
        me = _module(path)
        for line, mod in _imports(path):
            for pkg in (*kinds, "eyas.targets.backends."):
                inside = me.startswith(pkg.rstrip(".")) or me == pkg.rstrip(".")
                if mod.startswith(pkg) and not inside:
                    bad.append(f"{path.relative_to(SRC)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


# A module that is one registered thing's own (the vLLM judge runs vLLM itself) may name its
# engine's backend; each such lookup is listed with its reason.
NAMED_ON_PURPOSE = {("decoders/vllm.py", "vllm"): "vLLM's judge runs vLLM itself"}
_LOOKUPS = {"kind", "backend_module", "open_backend", "registered", "format_named"}
_REGISTRIES = {"KINDS", "_REGISTRY", "JUDGES", "FORMATS"}
# what a registered name is held in
_ASKERS = ("kind", "backend", "engine", "fmt", "format", "serve_with")


def _literal_lookups(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every registered name looked up or compared as a literal: a registry
    function called with it, a registry subscripted by it, a variable that holds a kind,
    backend, engine or format compared with it, or a list of such names written out (a
    registry's names, copied)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            lits = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if len(lits) > 1 and all(v in names for v in lits):
                out += [(node.lineno, v) for v in lits]
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            fname = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if fname in _LOOKUPS and node.args[0].value in names:
                out.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            v = node.value
            if isinstance(v, ast.Name) and v.id in _REGISTRIES and node.slice.value in names:
                out.append((node.lineno, node.slice.value))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            held = " ".join(ast.unparse(s) for s in sides if not isinstance(s, ast.Constant))
            for s in sides:
                lits = [s] if isinstance(s, ast.Constant) else list(getattr(s, "elts", []))
                for c in lits:
                    if (
                        isinstance(c, ast.Constant)
                        and c.value in names
                        and any(a in held for a in _ASKERS)
                    ):
                        out.append((node.lineno, c.value))
    return out  # fmt: skip


def test_registries_are_never_asked_by_a_literal_name():
    """Outside a registry, no kind, backend or judge is looked up or compared by its name
    written out: a caller asks the registry what the thing does (its traits), so a new one is
    one registration and no caller changes."""
    from eyas.drafters import KINDS
    from eyas.drafters.formats import FORMATS
    from eyas.stages.evaluate import JUDGES
    from eyas.targets.backends import BACKENDS

    names = set(KINDS) | set(BACKENDS) | set(JUDGES) | set(FORMATS)
    registries = {
        "drafters/__init__.py",
        "targets/backends/__init__.py",
        "drafters/formats/__init__.py",
    }
    bad = []
    for path in _sources():
        rel = str(path.relative_to(SRC))
        if rel in registries:
            continue
        for line, name in _literal_lookups(ast.parse(path.read_text()), names):
            if (rel, name) not in NAMED_ON_PURPOSE:
                bad.append(f"{rel}:{line}: {name!r}")
    assert not bad, "\n".join(bad)


def test_the_literal_rule_sees_each_form():
    code = (
        "kind('dflash')\nbackend_module('vllm')\nJUDGES['hf']\nif cfg.backend == 'hf': pass\n"
        "if engine in ('vllm',): pass\nif fmt == 'vllm': pass\nkind(name)\n"
        "if o.serve_with != 'sglang': pass\nENGINES = ('vllm', 'sglang')\nFORMATS['vllm']\n"
        "format_named('sglang')\nx = ('vllm', 'other')\n"
    )
    got = _literal_lookups(ast.parse(code), {"dflash", "vllm", "hf", "sglang"})
    assert sorted(got) == [(1, "dflash"), (2, "vllm"), (3, "hf"), (4, "hf"), (5, "vllm"),
                           (6, "vllm"), (8, "sglang"), (9, "sglang"), (9, "vllm"), (10, "vllm"),
                           (11, "sglang")], got  # fmt: skip


def test_no_module_of_eyas_shadows_the_standard_library():
    """A package or module named as one of the standard library's (eyas.inspect once) shadows
    it wherever its folder is on the path (run from src/eyas, `import eyas.stages.config`
    died in dataclasses)."""
    import sys

    names = {p.stem for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert not names & set(sys.stdlib_module_names), sorted(names & set(sys.stdlib_module_names))


# Built-in exceptions eyas may raise itself, and why: none of them can reach a user.
BUILTIN_RAISES = {
    ("options.py", "TypeError"),  # an option class without docstrings: a bug, at import
}
BUILTINS = {"ValueError", "RuntimeError", "Exception", "TypeError", "KeyError", "IndexError",
            "AssertionError", "OSError", "IOError"}  # fmt: skip


def _builtin_raises(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each `raise Builtin(...)` in a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTINS:
                out.append((node.lineno, exc.id))
    return out


def test_every_error_eyas_raises_carries_its_exit_code():
    """The library raises UsageError (2), ProblemError (1) or Stopped (75), each an EyasError
    that the command line maps by `exit_code` alone; a bare ValueError (or another built-in
    exception) would exit 1 whatever it meant. Re-raising what was caught (`raise`) and
    raising a caught exception are not new errors."""
    bad = [
        f"{p.relative_to(SRC)}:{line}: raise {name}"
        for p in _sources()
        for line, name in _builtin_raises(p)
        if (str(p.relative_to(SRC)), name) not in BUILTIN_RAISES
    ]
    assert not bad, "raise UsageError or ProblemError (eyas.errors) instead:\n" + "\n".join(bad)


def test_the_raise_rule_sees_each_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f(x):\n    if x:\n        raise ValueError('no')\n    raise KeyError\n")
    assert sorted(_builtin_raises(f)) == [(3, "ValueError"), (4, "KeyError")]


# Exception classes of eyas's own that are not EyasErrors, and why.
OWN_BUILTIN_CLASSES = {
    "StopRequested",  # training's data source to its loop, caught there
    "StepAbandoned",  # an optimizer step a stop cut short, caught by the training loop
    "RequestFailed",  # generate: one request's failure, retried or recorded per record
    "Malformed",  # generate: one response's, recorded per record
    "DiskFullError",  # an OSError: the command line makes a full disk a clean stop (75)
    "_Stopped",  # the hf decoder's stopping criterion to its generate call, caught there
    "EyasError",  # the root (errors.py)
}
ROOTS = {"EyasError", "UsageError", "ProblemError", "Stopped"}


def test_every_error_class_of_eyas_is_an_eyas_error():
    """A class deriving from a built-in exception would reach the command line without its
    exit code (an ExportError refusing a format exited 1); each derives from eyas.errors'."""
    bad = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in OWN_BUILTIN_CLASSES:
                names = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if names & (BUILTINS | {"BaseException"}) and not names & ROOTS:
                    bad.append(
                        f"{p.relative_to(SRC)}: class {node.name}({', '.join(sorted(names))})"
                    )
    assert not bad, "derive from UsageError or ProblemError (eyas.errors):\n" + "\n".join(bad)


def test_a_run_and_a_target_are_recognised_one_way():
    """Whether a directory is a run (run.json or its backup) is `runmeta.is_run`, and whether
    a model directory is a run's target is `targets.target.require_target`: neither is
    written out again elsewhere, where one copy could drift from the other."""
    import re

    inline_run = re.compile(r'"run(\.backup)?\.json"\)\.(exists|is_file)\(\)')
    inline_target = re.compile(r'!= *meta\["model_fingerprint"\]|meta\["model_fingerprint"\] *!=')
    bad = []
    for path in _sources():
        rel = str(path.relative_to(SRC))
        text = path.read_text()
        if not rel.startswith("run/") and inline_run.search(text):
            bad.append(f"{rel}: tests for run.json itself")
        if rel != "targets/target.py" and inline_target.search(text):
            bad.append(f"{rel}: compares the target's fingerprint itself")
    assert not bad, bad

"""Shared fixtures: tiny targets and prepared datasets, built once per test session."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of several workers: one CPU thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("EYAS_THREADS", "1")

from eyas.demo_target.data import generate_conversations, write_jsonl  # noqa: E402
from eyas.demo_target.tiny import build_tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def targets(tmp_path_factory) -> dict[str, Path]:
    """Tiny llama, qwen3 and deepseek_v3 targets (random weights, float32)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    base = tmp_path_factory.mktemp("targets")
    return {a: build_tiny_target(base / a, a) for a in ("llama", "qwen3", "deepseek_v3")}


@pytest.fixture(scope="session")
def conversations(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "conv.jsonl"
    write_jsonl(p, generate_conversations(120, seed=3))
    return p


@pytest.fixture(scope="session")
def llama_dataset(tmp_path_factory, targets, conversations) -> Path:
    from eyas.stages.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("ds") / "llama"
    prepare(
        PrepareConfig(
            model=str(targets["llama"]), data=(str(conversations),), out=str(out), progress=False
        )
    )
    return out


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory):
    """`demo_runs(n)`: the demo target's extraction run of its first `n` demo conversations
    (draft vocabulary 400), built once per session for each `n`, its dataset beside it
    (`run.parent / "ds"`). Tests read it and never change it (a test that does works on a
    copy)."""
    from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare

    built: dict[int, Path] = {}

    def get(n: int = 60) -> Path:
        if n not in built:
            base = tmp_path_factory.mktemp(f"demo{n}")
            src = base / "conv.jsonl"
            src.write_text("".join(DEMO_CONVERSATIONS.read_text().splitlines(keepends=True)[:n]))
            prepare(PrepareConfig(model=str(DEMO_TARGET), data=(str(src),), out=str(base / "ds"),
                                  draft_vocab_size=400, progress=False))  # fmt: skip
            extract(ExtractConfig(model=str(DEMO_TARGET), data=str(base / "ds"), out=str(base / "run"),
                                  progress=False))  # fmt: skip
            built[n] = base / "run"
        return built[n]

    return get


@contextlib.contextmanager
def mounted_tmpfs(base: Path, size: str):
    """A real tmpfs of `size` under `base` (skips the test where mounting is refused);
    always unmounted."""
    mnt = base / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({r.stderr.strip() or 'mount refused'}); needs root"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def tmpfs(tmp_path):
    """A real 2 MiB tmpfs (see `mounted_tmpfs`); `grow` resizes it."""
    with mounted_tmpfs(tmp_path, "2m") as mnt:
        yield mnt


def grow(mnt: Path, size: str) -> None:
    """Resize a mounted tmpfs (more space after a full disk)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mnt)], check=True)


def eyas(*args, check: bool = False, timeout: float = 300, child: bool = False, **kw):
    """Run the real CLI: in this process (typer's test runner: the same commands, options
    and exit codes, without a second torch import), or in a child process where the call
    needs one (`child=True`, or any of subprocess.run's env, cwd or input). Either way the
    answer reads as a CompletedProcess (returncode, stdout, stderr)."""
    argv = [str(a) for a in args]
    if child or kw:
        p = subprocess.run([sys.executable, "-m", "eyas.cli", *argv], capture_output=True,
                           text=True, timeout=timeout, **kw)  # fmt: skip
    else:
        p = _in_process(argv)
    if check and p.returncode != 0:
        raise AssertionError(f"eyas {' '.join(argv)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def _in_process(argv: list[str]) -> subprocess.CompletedProcess:
    """`python -m eyas.cli ARGV` in this process. What a child would print is printed here
    too: an uncaught exception's traceback (exit 1) and warnings, both on stderr."""
    import traceback
    import warnings

    from typer.testing import CliRunner

    from eyas.cli import app

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        r = CliRunner().invoke(app, argv or ["--help"], prog_name="eyas")
        code = r.exit_code
        stderr = r.stderr
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            stderr += "".join(traceback.format_exception(r.exception))
            code = 1
    return subprocess.CompletedProcess(["eyas", *argv], code, r.stdout, stderr)


def pytest_collection_modifyitems(config, items):
    """The whole-demo run, the longest test, goes first where workers share the tests (it
    would otherwise end the run alone), last in one process (the quick tests report first,
    not after minutes of silence)."""
    first = getattr(config.option, "numprocesses", None) not in (None, 0)
    items.sort(key=lambda it: it.nodeid.startswith("tests/test_demo.py") != first)

"""Stage 5, `export`: write a trained drafter in the formats serving engines load.

What an export holds depends on the drafter's kind (`training.kinds`: EAGLE-3 writes vLLM's
speculators format and SGLang's EAGLE format); this module makes it safe to write and to
read. The export is written whole into a temp directory beside `out` and swapped into
place, so `out` is always a complete export, old or new; `eyas-manifest.json`, written last,
holds the files' checksums, the format, the kind and how the training data was rendered.
`load_export` reads any kind's export back in the architecture its config declares, and
refuses one it cannot run as declared.
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas import __version__
from eyas.drafters import kind_for_export, kind_of
from eyas.drafters.formats import FORMATS, VLLM, format_named
from eyas.errors import EXIT_USAGE, ProblemError, UsageError
from eyas.run.fsutil import (
    DiskFullError,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    is_disk_full,
    read_json,
)
from eyas.run.manifest import ManifestError, write_manifest
from eyas.stages.card import recipe, write_card
from eyas.stages.config import ExportConfig
from eyas.training.checkpoint import save_safetensors

MANIFEST = "eyas-manifest.json"  # the export's files and checksums, written last
CHAT_TEMPLATE = "chat_template.jinja"  # the template the training data was rendered with
DEFAULT_TOKENS = 3  # a chain's draft length where nothing else says

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ProblemError):
    """An export that cannot be made or read as it is (exit 1)."""


class ExportUsage(ExportError, UsageError):
    """A flag that cannot work as given (exit 2); other ExportErrors are problems found (exit 1)."""

    code = EXIT_USAGE


def trained_weights(train_dir: Path) -> tuple[dict, dict, dict]:
    """(state dict, drafter config dict, train.json) of a finished training directory, its
    final drafter checked against its manifest."""
    from eyas.training.checkpoint import FINAL_MANIFEST, load_final

    train_dir = Path(train_dir)
    if not (train_dir / "train.json").is_file():
        raise ExportError(f"{train_dir}: not a training directory (no train.json)")
    info = read_json(train_dir / "train.json")
    final, cfg_path = train_dir / "drafter.safetensors", train_dir / "drafter_config.json"
    again = f"eyas train --resume --out {train_dir}"
    if (train_dir / FINAL_MANIFEST).is_file():
        try:
            state, cdict = load_final(train_dir)
        except ManifestError as exc:
            raise ExportError(
                f"{exc}; `{again}` writes it again from the last checkpoint"
            ) from None
        return state, cdict, info
    if not (final.is_file() and cfg_path.is_file()):
        raise ExportError(
            f"{train_dir}: no final drafter (training did not finish); finish it: {again}"
        )
    return (
        load_file(str(final)),
        read_json(cfg_path),
        info,
    )  # from before final drafters had manifests


@dataclass(frozen=True)
class ExportSummary:
    """An export written: where, in which format, and the tokens a round asked for."""

    path: Path
    format: str
    asked_tokens: int | None = None

    def render(self) -> str:
        return render_export(self.path, self.format, self.asked_tokens)


def export(cfg: ExportConfig) -> ExportSummary:
    """Write `cfg.train_dir`'s drafter to `cfg.out` in `cfg.format`; `cfg.verifier` is the
    target's name or path as the serving machine knows it (default: the local path it was
    trained against).

    The export is written whole into a temp directory beside `out` and swapped into place,
    so `out` is always a complete export (the old one or the new one). A directory that
    holds anything but an earlier export is refused unless `force` (then it is replaced)."""
    train_dir, fmt, out, dtype = cfg.train_dir, cfg.format, cfg.out, cfg.dtype
    speculative_tokens, verifier, force = cfg.speculative_tokens, cfg.verifier, cfg.force
    if fmt not in FORMATS:
        raise ExportUsage(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    form = FORMATS[fmt]
    if dtype not in _DTYPES:
        raise ExportUsage(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    state, cdict, info = trained_weights(Path(train_dir))
    k, cdict = kind_of(cdict)
    if form not in k.serving:
        raise ExportUsage(
            f"a {k.name} drafter exports as {', '.join(f.name for f in k.serving)}, not {fmt!r}"
        )
    target_cfg = (
        read_json(Path(info["model_path"]) / "config.json")
        if (Path(info["model_path"]) / "config.json").is_file()
        else {}
    )
    target = {
        "path": verifier or info["model_path"],
        "architectures": target_cfg.get("architectures", []),
    }
    tokens = speculative_tokens or DEFAULT_TOKENS
    try:
        tensors, config = k.export(form, state, cdict, info, target, _DTYPES[dtype], tokens)
    except UsageError as exc:  # a format the drafter cannot be served in: exit 2
        raise ExportUsage(f"{train_dir}: {exc}") from None
    except ValueError as exc:
        raise ExportError(f"{train_dir}: {exc}") from None
    out = Path(out).absolute()
    _check_destination(out, force)
    _remove_stale_temp(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", config)
        files = ["model.safetensors", "config.json"]
        if template := (info.get("rendering") or {}).get("chat_template"):
            # prepare --chat-template: the engine must render prompts with it too
            atomic_write_bytes(tmp / CHAT_TEMPLATE, template.encode())
            files.append(CHAT_TEMPLATE)
        write_manifest(
            tmp,
            files,
            MANIFEST,
            format=fmt,
            kind=k.name,
            rendering=info.get("rendering") or {},
            target=target["path"],
            drafts_per_round=k.drafts_per_round(config, tokens),
            recipe=recipe(info),
            trained_positions=_trained_positions(k, info),
            data=_data_facts(info),
            eyas_version=__version__,
        )
        _swap_into_place(tmp, out)
        write_card(out)  # derived from what the manifest says
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise DiskFullError(exc.errno, f"no space left writing the export to {out}") from exc
        raise
    return ExportSummary(out, fmt, speculative_tokens)


def _trained_positions(k, info: dict) -> int | None:
    """The drafts a round the drafter was trained for (its TTT steps, its block's drafts)."""
    from eyas.training.config import TrainConfig, saved_flat

    try:
        return k.positions(TrainConfig.of(**saved_flat(info["config"])))
    except (KeyError, TypeError, ValueError):
        return None  # a training directory of an older eyas: not said


def _data_facts(info: dict) -> dict:
    """The training data as the card names it: its run, fingerprints, samples and tokens."""
    facts = dict(info.get("data") or {})
    try:
        meta = read_json(Path(facts.get("run", "")) / "run.json")
        facts.update(samples=meta.get("samples"), tokens=meta.get("tokens"))
    except (OSError, ValueError):
        pass  # the run moved or is gone: its fingerprints still say what it was
    return facts


def is_export(path: Path) -> bool:
    """An earlier export (eyas's, or a drafter directory of a format some kind reads)."""
    if (path / MANIFEST).is_file():
        return True
    try:
        return kind_for_export(read_json(path / "config.json")) is not None
    except (OSError, ValueError, AttributeError):
        return False


def _check_destination(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportUsage(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not is_export(out) and not force:
        raise ExportUsage(
            f"--out {out} holds files that are not an earlier export; choose another "
            "--out, or pass --force to replace the directory and everything in it"
        )


def _remove_stale_temp(out: Path) -> None:
    """Temp directories of exports to `out` whose process is gone (killed mid-export)."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(p, ignore_errors=True)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Make `tmp` be `out` in one step: a rename, or an exchange (renameat2) with the old
    export, which is then removed. Where the exchange is not supported, two renames."""
    if not out.exists():
        os.rename(tmp, out)
    elif _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old export
    else:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(out.parent)


def _exchange(a: Path, b: Path) -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return (
        libc.renameat2(at_fdcwd, str(a).encode(), at_fdcwd, str(b).encode(), rename_exchange) == 0
    )


def export_rendering(path: str | Path) -> dict:
    """How the data an eyas export was trained on was rendered (`tokenizer_fingerprint`,
    `chat_template_kwargs`); {} for an export that does not say (another tool's, or older)."""
    m = Path(path) / MANIFEST
    try:
        return dict(read_json(m).get("rendering") or {}) if m.is_file() else {}
    except (OSError, ValueError, AttributeError):
        return {}


def export_kind(path: str | Path, cfg: dict | None = None):
    """The drafter kind of an export directory (by its config.json, or `cfg` read from it)."""
    k = kind_for_export(cfg if cfg is not None else read_json(Path(path) / "config.json"))
    if k is None:
        raise ExportError(f"{path}: not an export of a drafter kind eyas knows")
    return k


def vllm_speculative_config(path: str | Path, tokens: int) -> dict:
    """vLLM's `speculative_config` for the export at `path`: its kind's method, `tokens`
    drafted a round."""
    served = export_kind(path).serving[VLLM]
    return VLLM.speculative_config(served, str(Path(path).resolve()), tokens)


def export_serving(path: str | Path) -> dict:
    """What an export serves, from its manifest: `target` (the path or name it was exported
    for), `drafts_per_round` and `trained_positions` (what it was trained to draft); {} for an
    export that does not say (another tool's, older)."""
    m = Path(path) / MANIFEST
    try:
        made = read_json(m) if m.is_file() else {}
    except (OSError, ValueError):
        return {}
    keys = ("target", "drafts_per_round", "trained_positions")
    return {key: made[key] for key in keys if key in made}


def drafts_per_round(path: str | Path, tokens: int | None = None) -> int:
    """Tokens the export at `path` drafts a round: `tokens` where its kind lets that vary
    (a chain), else what it was exported to serve (a block drafts its block)."""
    cfg = read_json(Path(path) / "config.json")
    asked = tokens or export_serving(path).get("drafts_per_round") or DEFAULT_TOKENS
    return export_kind(path, cfg).drafts_per_round(cfg, asked)


def serve_command(path: str | Path, fmt: str, tokens: int | None = None) -> str:
    """The command that serves the export at `path` in `fmt`'s engine as it was trained and
    evaluated: the target it was exported for, its kind's method, and the tokens it drafts a
    round (`tokens`, else the export's own)."""
    cfg = read_json(Path(path) / "config.json")
    k, form = export_kind(path, cfg), format_named(fmt)
    if form not in k.serving:
        raise ExportUsage(f"a {k.name} drafter is not served by {form.engine}")
    target = str(export_serving(path).get("target") or "TARGET")
    template = Path(path) / CHAT_TEMPLATE
    render = ["--chat-template", str(template)] if template.is_file() else []
    line = form.serve_line(
        target, str(path), k.serving[form], cfg, drafts_per_round(path, tokens), render
    )
    return shlex.join(line)


def render_export(path: str | Path, fmt: str, asked_tokens: int | None = None) -> str:
    """What was written and the command that serves it; a note first where
    --speculative-tokens (`asked_tokens`) does not apply to the drafter's kind."""
    served = drafts_per_round(path)
    trained = export_serving(path).get("trained_positions")
    note = ""
    if asked_tokens is not None and served != asked_tokens:
        note = (
            f"note: --speculative-tokens {asked_tokens} does not apply to this drafter: its "
            f"block drafts {served} tokens a round (set by train --block-size)\n"
        )
    elif trained and served > trained:
        note = (
            f"note: it drafts {served} tokens a round but was trained for {trained}: the last "
            f"{served - trained} draft(s) of each round come from steps it never trained (train "
            f"with --ttt-steps {served}, or export with --speculative-tokens {trained})\n"
        )
    return (
        f"{note}exported {fmt} drafter to {path}, drafting {served} tokens a round\n"
        f"  serve with: {serve_command(path, fmt)}"
    )


def load_export(
    path: str | Path, target: str | Path | None = None
) -> tuple[torch.nn.Module, list[int]]:
    """A drafter from an export directory of any kind and format, in the architecture its
    config declares, and the target layers it reads (HF `hidden_states` indices); `target`,
    the model directory it drafts for, gives an embedding table its file leaves out."""
    from eyas.training.checkpoint import read_export

    try:
        _, drafter, layers = read_export(Path(path), target)
    except UsageError as exc:  # a drafter to fix (its config against its weights): exit 2
        raise ExportUsage(str(exc)) from None
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    return drafter, layers

"""Training checkpoints: all-or-nothing step directories, and drafter weights on disk.

A step directory is written under a temp name, fsynced, given its manifest (`COMPLETE`: the
sizes and xxh3-128 checksums of its files, written last) and renamed into place; only
directories with the manifest are considered, and a resume loads the newest one whose files
match it, falling back past damaged ones and saying so. The newest `keep` survive. The
final drafter carries a manifest too, checked by `export`.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.drafters.blocks import load_weights
from eyas.errors import ProblemError, UsageError
from eyas.run.fsutil import (
    DiskFullError,
    atomic_write_json,
    fsync_dir,
    honour_umask,
    is_disk_full,
    read_json,
)
from eyas.run.manifest import ManifestError, check_manifest, write_manifest


def save_safetensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """safetensors' own writer, with the file mode the umask gives (it creates 0600 files);
    its error for a full disk (not an OSError) becomes DiskFullError."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as exc:
        if "os error 28" in str(exc) or "os error 122" in str(exc):
            raise DiskFullError(28, f"no space left writing {path}") from exc
        raise
    honour_umask(path)


MARKER = "COMPLETE"  # the checkpoint's manifest: its files' sizes and checksums, written last
FINAL_MANIFEST = "drafter.manifest.json"  # the final drafter's: drafter.safetensors and its config


class CheckpointError(ProblemError):
    """No usable checkpoint where one was needed; the message says why and what to do."""


def _ckpt_dirs(out: Path) -> list[Path]:
    d = out / "checkpoints"
    if not d.is_dir():
        return []
    # A step-N.tmp directory holds its marker for a moment before its rename: skip it.
    return sorted(
        p for p in d.iterdir() if re.fullmatch(r"step-\d{8}", p.name) and (p / MARKER).is_file()
    )


def remove_stale_temp(out: Path) -> list[Path]:
    """Clean up after a killed save (only the lock holder may): a step-N.tmp directory is
    removed, or put in place when it is complete and its step-N is missing (the kill came
    while it replaced an older save of the same step, set aside as step-N.old)."""
    d = Path(out) / "checkpoints"
    stale = []
    for tmp in sorted(d.glob("step-*.tmp")) if d.is_dir() else []:
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        if (tmp / MARKER).is_file() and not final.exists():
            os.replace(tmp, final)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            stale.append(tmp)
    for old in sorted(d.glob("step-*.old")) if d.is_dir() else []:
        final = old.with_name(old.name.removesuffix(".old"))
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)
    return stale


def save_checkpoint(
    out: Path, drafter: torch.nn.Module, opt: torch.optim.Optimizer, state: dict, keep: int
) -> Path:
    final = out / "checkpoints" / f"step-{state['step']:08d}"
    if (final / MARKER).is_file():
        try:
            if read_json(final / "state.json") == state:
                return final
        except (OSError, ValueError):
            pass
    # else a new save, or a new state at the same step (a followed pass ended after the save
    # made before waiting): replaced below, the old one set aside until the new one is in place
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_safetensors(
            {k: v.contiguous() for k, v in drafter.state_dict().items()},
            tmp / "drafter.safetensors",
        )
        opt_tensors = {}
        for pi, st in opt.state_dict()["state"].items():
            for name, v in st.items():
                opt_tensors[f"{pi}.{name}"] = torch.as_tensor(v).contiguous()
        save_safetensors(opt_tensors, tmp / "optimizer.safetensors")
        atomic_write_json(tmp / "state.json", state)
        write_manifest(
            tmp,
            ["drafter.safetensors", "optimizer.safetensors", "state.json"],
            MARKER,
            step=state["step"],
        )
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        if is_disk_full(exc):
            raise DiskFullError(exc.errno, f"no space left saving checkpoint {final}") from exc
        raise
    for old in _ckpt_dirs(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    ckpt: Path, drafter: torch.nn.Module, opt: torch.optim.Optimizer | None
) -> dict:
    """Check `ckpt` against its manifest, then load it; raises ManifestError naming the
    damage (a legacy marker without checksums is loaded unchecked)."""
    try:
        check_manifest(ckpt, MARKER)
    except ManifestError:
        if not _legacy_marker(ckpt):
            raise
    try:
        drafter.load_state_dict(load_file(str(ckpt / "drafter.safetensors")))
        if opt is not None:
            flat = load_file(str(ckpt / "optimizer.safetensors"))
            state: dict[int, dict] = {}
            for key, v in flat.items():
                pi, name = key.split(".", 1)
                state.setdefault(int(pi), {})[name] = v
            sd = opt.state_dict()
            sd["state"] = state
            opt.load_state_dict(sd)
        st = read_json(ckpt / "state.json")
    except Exception as exc:  # noqa: BLE001 - any unreadable part means a damaged checkpoint
        raise ManifestError(f"{ckpt}: cannot be loaded ({type(exc).__name__}: {exc})") from None
    if not isinstance(st, dict) or not all(
        isinstance(st.get(k), int) for k in ("step", "epoch", "batch")
    ):
        raise ManifestError(f"{ckpt / 'state.json'}: not a training state")
    return st


def _legacy_marker(ckpt: Path) -> bool:
    """A marker from before checkpoints had manifests: {"step": N} and nothing else."""
    try:
        m = read_json(ckpt / MARKER)
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and set(m) == {"step"}


def resume_checkpoint(
    out: Path, drafter: torch.nn.Module, opt: torch.optim.Optimizer, log
) -> tuple[dict, Path] | None:
    """Load the newest checkpoint that checks out, falling back (and saying so) past damaged
    ones; None when there is none at all; CheckpointError when every one is damaged."""
    dirs = _ckpt_dirs(Path(out))
    damaged = []
    for ckpt in reversed(dirs):
        try:
            state = load_checkpoint(ckpt, drafter, opt)
        except ManifestError as exc:
            damaged.append(str(exc))
            aside = ckpt.with_name(f"damaged-{ckpt.name}-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(ckpt, aside)  # its step is saved afresh when training reaches it again
            log(f"warning: checkpoint {ckpt.name} is damaged, set aside as {aside.name}: {exc}")
            continue
        if damaged:
            log(
                f"falling back to the newest intact checkpoint, {ckpt.name}: steps after it are trained again"
            )
        return state, ckpt
    if damaged:
        raise CheckpointError(
            f"{out}: every checkpoint is damaged ({'; '.join(damaged)}); they are set aside "
            "as checkpoints/damaged-*. Rerun the same command to train again from step 0 "
            "in this directory, or use another --out"
        )
    if aside := sorted(p.name for p in (Path(out) / "checkpoints").glob("damaged-*")):
        log(
            f"warning: {out} has no intact checkpoint ({len(aside)} damaged one(s) set aside, e.g. {aside[0]}): "
            "training starts again from step 0"
        )
    return None


def latest_checkpoint(out: Path) -> Path | None:
    dirs = _ckpt_dirs(Path(out))
    return dirs[-1] if dirs else None


def save_final(out: Path, drafter, kind=None) -> None:
    """The trained drafter and its config (its kind's name first), then their manifest
    (written last)."""
    from eyas.drafters import kind as kind_named
    from eyas.drafters import with_kind

    kind = kind or kind_named(None)
    save_safetensors(
        {k: v.contiguous() for k, v in drafter.state_dict().items()}, out / "drafter.safetensors"
    )
    atomic_write_json(out / "drafter_config.json", with_kind(kind.name, kind.config_dict(drafter)))
    write_manifest(out, ["drafter.safetensors", "drafter_config.json"], FINAL_MANIFEST)


def load_trained(train_dir: Path):
    """(drafter, kind) of a training directory's final drafter, checked against its manifest."""
    from eyas.drafters import kind_of

    state, cdict = load_final(train_dir)
    kind, cdict = kind_of(cdict)
    model = kind.from_config(cdict)
    load_weights(model, state, Path(train_dir) / "drafter.safetensors")
    return model, kind


def load_final(train_dir: Path) -> tuple[dict, dict]:
    """(state dict, config dict) of a training directory's final drafter, checked against
    its manifest; ManifestError names what is wrong."""
    train_dir = Path(train_dir)
    check_manifest(train_dir, FINAL_MANIFEST)
    try:
        return load_file(str(train_dir / "drafter.safetensors")), read_json(
            train_dir / "drafter_config.json"
        )
    except Exception as exc:  # noqa: BLE001
        raise ManifestError(
            f"{train_dir / 'drafter.safetensors'}: cannot be loaded ({exc})"
        ) from None


EXPORT_MANIFEST = "eyas-manifest.json"  # an export's files and checksums (`eyas.stages.export`)


def read_export(path: Path, target: str | Path | None = None):
    """(kind, drafter, target layers as HF indices) of an export directory of any kind and
    format, in the architecture its config declares; ValueError names what is wrong. A file
    without the embedding table (speculators' save_pretrained leaves the target's frozen copy
    out) takes it from `target`, the model directory the drafter is for."""
    import json

    from eyas.drafters import kind_for_export

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UsageError(f"{path}: no config.json (not an exported drafter)")
    m = {}
    if (path / EXPORT_MANIFEST).is_file():  # eyas's own export: every file as it was written
        try:
            m = check_manifest(path, EXPORT_MANIFEST)
        except ManifestError as exc:
            raise ProblemError(f"{exc}; export the drafter again") from None
    cfg = json.loads(cfg_file.read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    k = kind_for_export(cfg)
    if k is None:
        raise UsageError(f"{cfg_file}: unknown architecture {arch!r}")
    if m.get("kind", k.name) != k.name:
        raise UsageError(
            f"{path}: {EXPORT_MANIFEST} says kind {m.get('kind')!r} but config.json is {arch!r}"
        )
    if m.get("format") is not None and m.get("format") not in {f.name for f in k.serving}:
        raise UsageError(
            f"{path}: {EXPORT_MANIFEST} says format {m.get('format')!r}, which a {k.name} export is not"
        )
    raw = load_file(str(path / "model.safetensors"))
    if "embed_tokens.weight" not in raw and target is not None:
        from eyas.targets.weights import embed_weight

        raw["embed_tokens.weight"] = embed_weight(target)
    return (k, *k.load_export(cfg, raw, cfg_file))


def initial_weights(path: Path, model, kind) -> None:
    """Load --init-from's drafter (a training directory or an export) into `model`, which
    must be of the same kind and shape; ValueError names what differs."""
    from eyas.drafters import kind_of

    if (path / FINAL_MANIFEST).is_file():
        state, cdict = load_final(path)
        theirs, cdict = kind_of(cdict)
        what = f"{path} (a {theirs.name} training)"
    elif (path / "config.json").is_file():
        theirs, other, _ = read_export(path)
        state = other.state_dict()
        what = f"{path} (a {theirs.name} export)"
    else:
        raise UsageError(f"--init-from {path}: neither a finished training directory nor an export")
    if theirs.name != kind.name:
        raise UsageError(f"--init-from {what}: this training is {kind.name}")
    mine = model.state_dict()
    for name, t in mine.items():
        if name not in state:
            raise UsageError(f"--init-from {what}: it has no tensor {name}")
        if tuple(state[name].shape) != tuple(t.shape):
            raise UsageError(
                f"--init-from {what}: {name} is {tuple(state[name].shape)}, this drafter's "
                f"{tuple(t.shape)} (another target, draft vocabulary or size)"
            )
    if "d2t" in mine and not torch.equal(state["d2t"].long(), mine["d2t"].long()):
        raise UsageError(f"--init-from {what}: another draft vocabulary than this run's")
    model.load_state_dict({n: state[n].to(t.dtype) for n, t in mine.items()})

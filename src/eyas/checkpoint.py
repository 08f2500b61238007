"""Training checkpoints: all-or-nothing step directories, and drafter weights on disk.

A step directory is written under a temp name, fsynced, given a COMPLETE marker (written
last) and renamed into place; only directories with the marker are ever loaded, so a
checkpoint is complete or invisible. The newest `keep` survive.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .drafter import Drafter
from .fsutil import atomic_write_json, fsync_dir, honour_umask, read_json


def save_safetensors(tensors: dict, path: Path) -> None:
    """safetensors' own writer, with the file mode the umask gives (it creates 0600 files)."""
    save_file(tensors, str(path))
    honour_umask(path)


def _ckpt_dirs(out: Path) -> list[Path]:
    d = out / "checkpoints"
    if not d.is_dir():
        return []
    # A step-N.tmp directory holds its marker for a moment before its rename: skip it.
    return sorted(
        p for p in d.iterdir() if re.fullmatch(r"step-\d{8}", p.name) and (p / "COMPLETE").is_file()
    )


def save_checkpoint(
    out: Path, drafter: Drafter, opt: torch.optim.Optimizer, state: dict, keep: int
) -> Path:
    final = out / "checkpoints" / f"step-{state['step']:08d}"
    if (final / "COMPLETE").is_file():
        return final
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_safetensors(
        {k: v.contiguous() for k, v in drafter.state_dict().items()}, tmp / "drafter.safetensors"
    )
    opt_tensors = {}
    for pi, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            opt_tensors[f"{pi}.{name}"] = torch.as_tensor(v).contiguous()
    save_safetensors(opt_tensors, tmp / "optimizer.safetensors")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    atomic_write_json(tmp / "state.json", state)
    atomic_write_json(tmp / "COMPLETE", {"step": state["step"]})  # the marker: written last
    os.replace(tmp, final)
    fsync_dir(final.parent)
    for old in _ckpt_dirs(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(ckpt: Path, drafter: Drafter, opt: torch.optim.Optimizer | None) -> dict:
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
    return read_json(ckpt / "state.json")


def latest_checkpoint(out: Path) -> Path | None:
    dirs = _ckpt_dirs(Path(out))
    return dirs[-1] if dirs else None

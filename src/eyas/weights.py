"""Read single tensors of a target straight from its safetensors shards.

Training needs the target's `lm_head` and `embed_tokens`, and fingerprints need the weight
layout; neither should load a model of hundreds of GB. Shards are found through
`model.safetensors.index.json` (or the single `model.safetensors`), and only the wanted
tensor's bytes are read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_map(model_dir: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name."""
    d = Path(model_dir)
    if (d / INDEX).is_file():
        return json.loads((d / INDEX).read_text())["weight_map"]
    if (d / SINGLE).is_file():
        with safe_open(d / SINGLE, framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    return {}


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def weight_layout(model_dir: str | Path) -> list:
    """[(shard, size, {name: [dtype, shape]})] for every shard: cheap, header-only."""
    d = Path(model_dir)
    shards = sorted(set(weight_map(d).values()))
    out = []
    for s in shards:
        h = _header(d / s)
        h.pop("__metadata__", None)
        out.append(
            [s, (d / s).stat().st_size, {k: [v["dtype"], v["shape"]] for k, v in sorted(h.items())}]
        )
    return out


def read_tensor(model_dir: str | Path, names: list[str]) -> torch.Tensor:
    """The first of `names` present in the checkpoint (e.g. lm_head, then tied embeddings)."""
    d = Path(model_dir)
    wm = weight_map(d)
    for name in names:
        if name in wm:
            with safe_open(d / wm[name], framework="pt") as f:
                return f.get_tensor(name)
    raise KeyError(f"{d}: none of {names} found in the checkpoint's weights")


def lm_head_weight(model_dir: str | Path) -> torch.Tensor:
    """(V, H) output projection of the target; falls back to tied input embeddings."""
    return read_tensor(
        model_dir,
        ["lm_head.weight", "model.embed_tokens.weight", "model.language_model.embed_tokens.weight"],
    )


def embed_weight(model_dir: str | Path) -> torch.Tensor:
    """(V, H) input embeddings of the target."""
    return read_tensor(
        model_dir,
        [
            "model.embed_tokens.weight",
            "model.language_model.embed_tokens.weight",
            "embed_tokens.weight",
        ],
    )

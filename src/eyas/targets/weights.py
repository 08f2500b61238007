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

from eyas.errors import UsageError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class MissingWeights(UsageError, KeyError):
    """A tensor eyas needs is not in the target's checkpoint (exit 2: another model, or its
    full weights). A KeyError, as a missing name is."""

    def __str__(self) -> str:  # a KeyError's would be quoted
        return str(self.args[0]) if self.args else ""


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
    raise MissingWeights(f"{d}: none of {names} found in the checkpoint's weights")


def _tied(model_dir: Path) -> bool:
    """Whether the target's output head is its input embeddings (`tie_word_embeddings`, in
    the text part of a wrapper's config where there is one; transformers' default: tied)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True)))


# Where a checkpoint keeps each tensor: plain causal LMs, transformers' multimodal layout
# (`model.language_model.*`) and the hub layout of wrapped targets such as Kimi-K2.5
# (`language_model.model.*`, `language_model.lm_head`).
_EMBED = [
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
]
_NORM = [
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "norm.weight",
]
_HEAD = ["lm_head.weight", "language_model.lm_head.weight"]


def lm_head_weight(model_dir: str | Path) -> torch.Tensor:
    """(V, H) output projection of the target: its `lm_head`, or its input embeddings only
    where the config says they are tied. An untied target without a head is an error."""
    try:
        return read_tensor(model_dir, _HEAD)
    except KeyError:
        if not _tied(Path(model_dir)):
            raise MissingWeights(
                f"{model_dir}: no lm_head in the checkpoint's weights (looked for {', '.join(_HEAD)}), "
                "and tie_word_embeddings is false, so the embeddings are not the head"
            ) from None
        return embed_weight(model_dir)


_LAYERS = ["model.layers", "model.language_model.layers", "language_model.model.layers", "layers"]
LAYER_TENSORS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def layer_weights(model_dir: str | Path, index: int) -> dict[str, torch.Tensor]:
    """The weights of the target's decoder layer `index` that a Llama-style layer has, by
    their names within the layer (`self_attn.q_proj`, ..., `post_attention_layernorm`)."""
    return {
        n: read_tensor(model_dir, [f"{p}.{index}.{n}.weight" for p in _LAYERS])
        for n in LAYER_TENSORS
    }


def embed_weight(model_dir: str | Path) -> torch.Tensor:
    """(V, H) input embeddings of the target."""
    return read_tensor(model_dir, _EMBED)


def final_norm_weight(model_dir: str | Path) -> torch.Tensor:
    """(H,) weight of the target's final RMSNorm (applied before its lm_head)."""
    return read_tensor(model_dir, _NORM)

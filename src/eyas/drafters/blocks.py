"""The blocks the drafter kinds share: RMSNorm, rotary embedding, the MLP, the draft
vocabulary's maps, the half-precision upcast, and loading trained weights into a model (one line naming
what does not fit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.errors import UsageError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = upcast(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Half precision -> float32 for norms and softmax; float32/64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's half-rotation layout); x (B, h, T, d), pos (B, T)."""
    d = x.shape[-1]
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=f) / d))
    ang = pos.to(f)[:, None, :, None] * inv  # (B, 1, T, d/2)
    cos, sin = (
        torch.cat([ang, ang], -1).cos().to(x.dtype),
        torch.cat([ang, ang], -1).sin().to(x.dtype),
    )
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DraftVocab(nn.Module):
    """A drafter's draft vocabulary as the engines store it: d2t (D,), d2t[i] = id_i - i for
    the i-th draft id (ascending), and t2d (V,), which target ids are draft ids. A drafter
    kind's model subclasses it and calls `draft_vocab_buffers` in its constructor."""

    def draft_vocab_buffers(self, draft: int, vocab: int) -> None:
        self.register_buffer("d2t", torch.zeros(draft, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids ascending (D,)."""
        self.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)  # (D,) target ids


class MLP(nn.Module):
    """The gated MLP of a Llama-style layer; `c` is a kind's config (hidden_size,
    intermediate_size, hidden_act)."""

    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act = {"silu": F.silu, "gelu": F.gelu}.get(c.hidden_act, F.silu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def load_weights(model: torch.nn.Module, state: dict, where) -> None:
    """Load `state` into `model`, or one line naming `where` and the first tensor that does not
    fit (its two shapes), or the tensors missing or left over: a config that does not match
    its weights is said, not a page of load_state_dict's traceback."""
    mine = model.state_dict()
    for name, t in mine.items():
        if name in state and tuple(state[name].shape) != tuple(t.shape):
            raise UsageError(
                f"{where}: tensor {name} is {tuple(state[name].shape)} there, but the config "
                f"makes it {tuple(t.shape)}: the config does not match the weights"
            )
    missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    if missing or unexpected:
        raise UsageError(
            f"{where}: the config's drafter has tensors the weights lack ({', '.join(missing[:4]) or 'none'}) "
            f"or the weights hold tensors it has not ({', '.join(unexpected[:4]) or 'none'})"
        )
    model.load_state_dict(state)


def layer_fields(layer: dict, where) -> dict:
    """The decoder-layer fields of another tool's config.json as eyas's drafters take them,
    in transformers 4's names or 5's (`rope_parameters`); a field that asks for a network
    eyas's drafters do not have (sliding-window layers, scaled rope) is refused in one line
    naming it (where: the file)."""
    windowed = [t for t in layer.get("layer_types") or [] if t != "full_attention"]
    if windowed or layer.get("use_sliding_window"):
        raise UsageError(
            f"{where}: layer_types {layer.get('layer_types')} / use_sliding_window "
            f"{layer.get('use_sliding_window')}: sliding-window layers, which eyas's drafter does "
            "not have; it cannot evaluate this drafter"
        )
    rope = dict(layer.get("rope_parameters") or {})
    scaling = layer.get("rope_scaling") or (
        {} if rope.get("rope_type", "default") == "default" else rope
    )
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise UsageError(
            f"{where}: rope {scaling}: a scaled rope, which eyas's drafter does not have; it "
            "cannot evaluate this drafter"
        )
    heads = layer["num_attention_heads"]
    return {
        "hidden_size": layer["hidden_size"],
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": layer.get("num_key_value_heads") or heads,
        "head_dim": layer.get("head_dim") or layer["hidden_size"] // heads,
        "vocab_size": layer["vocab_size"],
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "rope_theta": float(layer.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "max_position_embeddings": layer.get("max_position_embeddings", 4096),
        "hidden_act": layer.get("hidden_act", "silu"),
    }

"""The blocks the drafter kinds share: RMSNorm, rotary embedding, the MLP, the
half-precision upcast, and loading trained weights into a model (one line naming
what does not fit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
            raise ValueError(
                f"{where}: tensor {name} is {tuple(state[name].shape)} there, but the config "
                f"makes it {tuple(t.shape)}: the config does not match the weights"
            )
    missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    if missing or unexpected:
        raise ValueError(
            f"{where}: the config's drafter has tensors the weights lack ({', '.join(missing[:4]) or 'none'}) "
            f"or the weights hold tensors it has not ({', '.join(unexpected[:4]) or 'none'})"
        )
    model.load_state_dict(state)

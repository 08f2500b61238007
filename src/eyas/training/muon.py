"""Muon for the drafter's matrices: momentum, then the update orthogonalised by a
Newton-Schulz iteration, its size matched to AdamW's RMS so that one learning rate serves
both optimizers.

The same rule as `torch.optim.Muon` (nesterov momentum 0.95, the quintic iteration's
coefficients, decoupled weight decay, `match_rms_adamw`), with one difference: the
iteration runs in bfloat16 only where bfloat16 matrix products are fast (a GPU), and in
float32 on a CPU, where torch's bfloat16 iteration takes most of a training step.
"""

from __future__ import annotations

import math

import torch

from eyas.errors import ProblemError

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalise(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """An approximately orthogonal matrix with g's singular vectors (g: a 2-D update)."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16() if g.device.type == "cuda" else g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters; `lr` is scaled per matrix by 0.2 * sqrt(max(rows, cols))."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        ns_steps: int = 5,
    ):
        super().__init__(
            params,
            {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "ns_steps": ns_steps},
        )
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ProblemError(
                        f"Muon takes 2-D matrices, got a parameter of shape {tuple(p.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mom = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                update = orthogonalise(p.grad.lerp(buf, mom), group["ns_steps"])  # nesterov
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
        return None

"""The target model as eyas uses it: loading, capture hooks, batch plan, fingerprint.

The capture keeps only what EAGLE-3 needs (three aux layers' outputs and the final norm's
output) through forward hooks on the base model, so full-vocabulary logits are never
computed and other layers' states are never kept.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .fsutil import read_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """[1, n//2-1, n-4] as outputs of 0-based decoder layers (the EAGLE-3 default)."""
    return (1, n_layers // 2 - 1, n_layers - 4)


def model_fingerprint(model_dir: str | Path) -> str:
    """Hash of the config and the weight layout (names, shapes, dtypes, sizes), not the weights."""
    from .weights import weight_layout

    d = Path(model_dir)
    cfg = read_json(d / "config.json")
    for k in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        cfg.pop(k, None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    h.update(json.dumps(weight_layout(d), sort_keys=True).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- batch plan


def plan_batches(lengths: list[int], indices: list[int], batch_tokens: int) -> list[list[int]]:
    """Pack samples of similar length so that batch_size x longest <= batch_tokens.

    Deterministic in its inputs; a sample longer than the budget gets a batch of its own.
    """
    order = sorted(indices, key=lambda i: (lengths[i], i))
    batches, cur, longest = [], [], 0
    for i in order:
        n = lengths[i]
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


# ---------------------------------------------------------------------------- capture


class Capture:
    """Forward hooks that keep the aux layers' outputs and the final norm's output."""

    def __init__(self, model, aux_layers: tuple[int, ...]):
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.base = base
        self.layers = base.layers
        n = len(self.layers)
        for i in aux_layers:
            if not 0 <= i < n:
                raise ValueError(
                    f"aux layer {i} is outside 0..{n - 1} (the target has {n} decoder layers)"
                )
        self.states: dict[str, torch.Tensor] = {}
        self.handles = [
            self.layers[i].register_forward_hook(self._keep(f"aux{k}"))
            for k, i in enumerate(aux_layers)
        ]
        self.handles.append(base.norm.register_forward_hook(self._keep("last")))

    def _keep(self, key: str):
        def hook(_module, _inputs, output):
            self.states[key] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.states.clear()
        self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        aux = torch.cat([self.states[f"aux{k}"] for k in range(3)], dim=-1)  # (B, T, 3H)
        return aux, self.states["last"]  # (B, T, H)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def load_target(
    model_dir: str, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False
):
    """(model, input device, compute dtype); `multi` spreads layers over all GPUs."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    dt = (
        DTYPES[dtype] if dtype != "auto" else (torch.bfloat16 if device != "cpu" else torch.float32)
    )
    kw = dict(dtype=dt, trust_remote_code=trust_remote_code, local_files_only=True)
    if device == "multi":
        model = AutoModelForCausalLM.from_pretrained(model_dir, device_map="auto", **kw)
        input_device = next(model.parameters()).device
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kw).to(device)
        input_device = torch.device(device)
    model.eval()
    return model, input_device, dt


# ---------------------------------------------------------------------------- the run

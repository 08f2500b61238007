"""The transformers backend: the target in this process, states taken by forward hooks.

Hooks keep the three aux layers' outputs and the final norm's output; the base model is
called without its lm_head, so full-vocabulary logits are never computed (except in chunks
for top-K target storage). On a GPU nothing waits on the host: the NaN/Inf screen is a
device reduction that travels back with the data, and the copies go on a side stream into
pinned buffers, so the forward of the next batch overlaps this batch's copy, and the
writer thread commits the batch before it.
"""

from __future__ import annotations

import queue

import torch

from eyas.errors import UsageError
from eyas.targets.backends import Backend, BackendSpec, Pending, StateShaper


class Capture:
    """Forward hooks that keep the aux layers' outputs and the final norm's output."""

    def __init__(self, model, aux_layers: tuple[int, ...]):
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.base = base
        n = len(base.layers)
        for i in aux_layers:
            if not 0 <= i < n:
                raise UsageError(
                    f"aux layer {i} is outside 0..{n - 1} (the target has {n} decoder layers)"
                )
        self.states: dict[str, torch.Tensor] = {}
        self.handles = [
            base.layers[i].register_forward_hook(self._keep(f"aux{k}"))
            for k, i in enumerate(aux_layers)
        ]
        self.handles.append(base.norm.register_forward_hook(self._keep("last")))

    def _keep(self, key: str):
        def hook(_module, _inputs, output):
            self.states[key] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.inference_mode()
    def run(self, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        self.states.clear()
        self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        aux = torch.cat(
            [self.states[f"aux{k}"] for k in range(len(self.handles) - 1)], dim=-1
        )  # (B, T, L*H)
        return aux, self.states["last"]  # (B, T, H)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def load_target(model_dir: str, device: str, dtype: torch.dtype, trust_remote_code: bool = False):
    """(model, input device); `multi` spreads layers over all GPUs."""
    from eyas.targets.target import load_causal_lm

    if device == "multi":
        model = load_causal_lm(model_dir, dtype, trust_remote_code, device_map="auto")
        input_device = next(model.parameters()).device
    else:
        model = load_causal_lm(model_dir, dtype, trust_remote_code).to(device)
        input_device = torch.device(device)
    return model.eval(), input_device


class _Batch(Pending):
    def __init__(self, tensors: dict, lengths: list[int], T: int, done=None, pool=None):
        self.tensors, self.lengths, self.T = tensors, lengths, T  # tensors: flat (B*T, ...)
        self.done, self.pool = done, pool

    def result(self) -> list[dict | str]:
        if self.done is not None:
            self.done.synchronize()  # the copy off the device has landed
        t = self.tensors
        finite = t["finite"].tolist()
        out: list[dict | str] = []
        for r, n in enumerate(self.lengths):
            s = {k: v[r * self.T : r * self.T + n] for k, v in t.items() if k != "finite"}
            # A row sum is finite iff its terms are, barring overflow: only a row whose sum
            # is not finite gets the exact elementwise check.
            if not finite[r] and not all(
                torch.isfinite(v.float()).all()
                for k, v in s.items()
                if k in ("aux_hidden_states", "last_hidden_states")
            ):
                out.append("non-finite values (NaN/Inf) in hidden states")
            else:
                out.append(s)
        return out

    def release(self) -> None:
        if self.pool is not None:
            pool, slab = self.pool
            pool.put(slab)


class HFBackend(Backend):
    name = "hf"

    def __init__(self, spec: BackendSpec, log=print):
        self.spec = spec
        if spec.device == "cpu":
            from eyas.host.cpu import configure_threads
            from eyas.targets.target import target_facts

            configure_threads(target_facts(spec.model).hidden_size)
        self.model, self.device = load_target(
            spec.model, spec.device, spec.dtype, spec.trust_remote_code
        )
        self.capture = Capture(self.model, spec.aux_layers)
        lm_head = None
        if spec.layout.topk or spec.layout.argmax:
            lm_head = self.model.get_output_embeddings().weight.detach()
        self.shape = StateShaper(spec, lm_head)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.pool: queue.Queue = queue.Queue()

    def run(self, rows: list) -> Pending:
        B, T = len(rows), max(len(r) for r in rows)
        ids = torch.zeros((B, T), dtype=torch.long)
        att = torch.zeros((B, T), dtype=torch.long)
        for r, x in enumerate(rows):
            ids[r, : len(x)] = torch.from_numpy(x.astype("int64"))
            att[r, : len(x)] = 1
        if self.cuda:
            ids, att = ids.pin_memory(), att.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        att = att.to(self.device, non_blocking=True)
        aux, last = self.capture.run(ids, att)  # (B, T, 3H), (B, T, H)
        with torch.inference_mode():
            sums = aux.sum(-1, dtype=torch.float32) + last.sum(-1, dtype=torch.float32)  # (B, T)
            finite = (torch.isfinite(sums) | (att.to(sums.device) == 0)).all(-1)  # (B,)
            flat = self.shape(aux.reshape(B * T, -1), last.reshape(B * T, -1))
        flat["finite"] = finite
        lengths = [len(x) for x in rows]
        if not self.cuda:
            return _Batch(flat, lengths, T)
        return self._copy_off(flat, lengths, T)

    def _copy_off(self, flat: dict, lengths: list[int], T: int) -> Pending:
        """Copy to pinned host buffers on a side stream; nothing here waits for the GPU."""
        try:
            slab = self.pool.get_nowait()  # pinned buffers a committed batch gave back
        except queue.Empty:
            slab = {}
        for k, v in flat.items():  # grow a buffer only when a batch needs more
            if k not in slab or slab[k].numel() < v.numel() or slab[k].dtype != v.dtype:
                slab[k] = torch.empty(v.numel(), dtype=v.dtype, pin_memory=True)
        host = {k: slab[k][: v.numel()].view(v.shape) for k, v in flat.items()}
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream, after the forward and the screen
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            for k, v in flat.items():
                host[k].copy_(v, non_blocking=True)
                v.record_stream(self.stream)  # keep the device memory until the copy is done
        done = torch.cuda.Event()
        done.record(self.stream)
        return _Batch(host, lengths, T, done, (self.pool, slab))

    def close(self) -> None:
        self.capture.remove()

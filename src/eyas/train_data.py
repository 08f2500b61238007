"""Training data: which samples, in which batches, read how, checked how.

Nothing damaged is trained on. Before training starts every committed sample's file is
checked against its journal entry (size, header hash, sample index: header reads only),
and a sample that fails is left out and named. Each read checks the file against its
entry again (a file can be damaged, swapped or replaced while training runs), and with
`checksums` every tensor's xxh3 on its first read; a failure then stops training with the
file named, since the batch plan of a run must not change under it.

Batches are read ahead by a background thread (through the store module, into pinned
memory on a GPU) while the current step computes.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .store import StoreError, check_sample_file, committed, read_sample, sample_relpath
from .target import plan_batches


def usable_samples(run: Path, hidden_size: int, log) -> dict[int, dict]:
    """Committed samples whose files match their journal entries (index -> entry)."""
    entries = committed(run)
    good, bad = {}, []
    for i, e in sorted(entries.items()):
        c = check_sample_file(
            run / sample_relpath(i), checksums=False, hidden_size=hidden_size, entry=e
        )
        if c.ok:
            good[i] = e
        else:
            bad.append(c.problem)
    if bad:
        log(f"warning: {len(bad)} damaged sample(s) left out of training "
            f"(`eyas verify --repair {run}` and `eyas extract --resume {run}` redo them):")  # fmt: skip
        for p in bad[:10]:
            log(f"  {p}")
    return good


def split_samples(indices: list[int], val_fraction: float) -> tuple[list[int], list[int]]:
    """Deterministic split by sample: a fixed-seed permutation, the first share is validation."""
    g = torch.Generator().manual_seed(1234)
    perm = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
    n_val = math.ceil(len(indices) * val_fraction) if val_fraction > 0 and len(indices) > 1 else 0
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def epoch_batches(
    lengths: dict[int, int], indices: list[int], batch_tokens: int, seed: int, epoch: int
) -> list[list[int]]:
    """Length-bucketed batches, in an order that depends only on (seed, epoch)."""
    batches = plan_batches(lengths, sorted(indices), batch_tokens)
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


class SampleReader:
    """Reads and pads batches of committed samples, checking each file against its entry."""

    def __init__(self, run: Path, entries: dict[int, dict], checksums: bool, pin: bool = False):
        self.run, self.entries, self.checksums, self.pin = Path(run), entries, checksums, pin
        self._summed: set[int] = set()
        self._lock = threading.Lock()

    def _one(self, i: int) -> dict[str, torch.Tensor]:
        with self._lock:
            first = i not in self._summed
        s = read_sample(self.run, self.entries[i], checksums=self.checksums and first)
        with self._lock:
            self._summed.add(i)
        return s

    def batch(self, idx: list[int]) -> dict[str, torch.Tensor]:
        samples = [self._one(i) for i in idx]
        T = max(s["input_ids"].shape[0] for s in samples)
        B, W = len(samples), samples[0]["aux_hidden_states"].shape[1]
        b = {
            "input_ids": torch.zeros(B, T, dtype=torch.long),
            "loss_mask": torch.zeros(B, T, dtype=torch.bool),
            "valid": torch.zeros(B, T, dtype=torch.bool),
            "aux": torch.zeros(B, T, W),
        }
        topk = "target_topk_ids" in samples[0]
        if topk:
            K = samples[0]["target_topk_ids"].shape[1]
            b["topk_ids"] = torch.zeros(B, T, K, dtype=torch.long)
            b["topk_lp"] = torch.full((B, T, K), -1e4)
            b["tgt_top"] = torch.zeros(B, T, dtype=torch.long)
        else:
            b["last"] = torch.zeros(B, T, samples[0]["last_hidden_states"].shape[1])
        for r, s in enumerate(samples):
            n = s["input_ids"].shape[0]
            b["input_ids"][r, :n] = s["input_ids"].long()
            b["loss_mask"][r, :n] = s["loss_mask"].bool()
            b["valid"][r, :n] = True
            b["aux"][r, :n] = s["aux_hidden_states"].float()
            if topk:
                b["topk_ids"][r, :n] = s["target_topk_ids"]
                b["topk_lp"][r, :n] = s["target_topk_logprobs"].float()
                b["tgt_top"][r, :n] = s["target_argmax"].long()
            else:
                b["last"][r, :n] = s["last_hidden_states"].float()
        if self.pin:
            b = {k: v.pin_memory() for k, v in b.items()}
        return b


def prefetch(items: Iterable, load, depth: int = 2) -> Iterator:
    """Yield `(item, load(item))` in order, loading up to `depth` items ahead in a thread.
    An exception in `load` is raised here, at the item it belongs to."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        for it in items:
            if stop.is_set():
                return
            try:
                res = (it, load(it), None)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                res = (it, None, exc)
            while not stop.is_set():
                try:
                    q.put(res, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if res[2] is not None:
                return
        q.put(None)

    t = threading.Thread(target=work, name="eyas-prefetch", daemon=True)
    t.start()
    try:
        while (res := q.get()) is not None:
            it, val, exc = res
            if exc is not None:
                raise exc
            yield it, val
    finally:
        stop.set()


__all__ = [
    "SampleReader",
    "StoreError",
    "epoch_batches",
    "prefetch",
    "split_samples",
    "usable_samples",
]

"""Training data: which samples, in which batches, read how, checked how.

Nothing damaged is trained on. Before training starts every committed sample's file is
checked against its journal entry (size, header hash, sample index: header reads only),
and a sample that fails is left out and named. Each read checks the file against its
entry again (a file can be damaged, swapped or replaced while training runs), and with
`checksums` every tensor's xxh3 on its first read; a sample that fails then is masked out
of its batch (the batch plan must not change under a running job) and reported, on the
terminal and in `skipped_samples.jsonl` of the training directory.

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

from .journal import committed
from .store import StoreError, check_sample_file, read_sample, sample_relpath
from .target import plan_batches


def usable_samples(run: Path, hidden_size: int, log) -> tuple[dict[int, dict], dict[int, str]]:
    """Committed samples whose files match their journal entries (index -> entry), and
    those left out (index -> the problem)."""
    entries = committed(run)
    good, bad = {}, {}
    for i, e in sorted(entries.items()):
        c = check_sample_file(
            run / sample_relpath(i), checksums=False, hidden_size=hidden_size, entry=e
        )
        if c.ok:
            good[i] = e
        else:
            bad[i] = c.problem
    if bad:
        log(f"warning: {len(bad)} damaged sample(s) left out of training "
            f"(`eyas verify --repair {run}` and `eyas extract --resume {run}` redo them):")  # fmt: skip
        for p in list(bad.values())[:10]:
            log(f"  {p}")
    return good, bad


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

    def __init__(self, run: Path, entries: dict[int, dict], checksums: bool, pin: bool = False,
                 report=None):  # fmt: skip
        self.run, self.entries, self.checksums, self.pin = Path(run), entries, checksums, pin
        self.report = report or (lambda index, problem: None)
        self._summed: set[int] = set()
        self._bad: set[int] = set()
        self._lock = threading.Lock()

    def _one(self, i: int) -> dict[str, torch.Tensor] | None:
        with self._lock:
            first = i not in self._summed
            if i in self._bad:
                return None
        try:
            s = read_sample(self.run, self.entries[i], checksums=self.checksums and first)
        except StoreError as exc:
            with self._lock:
                self._bad.add(i)
            self.report(i, str(exc))
            return None
        with self._lock:
            self._summed.add(i)
        return s

    def _any_sample(self) -> dict[str, torch.Tensor]:
        """Some intact sample, for tensor widths when a whole batch is damaged."""
        for i in self.entries:
            if (s := self._one(i)) is not None:
                return s
        raise StoreError(
            f"{self.run}: every sample is damaged; run `eyas verify --repair {self.run}`"
        )

    def batch(self, idx: list[int]) -> dict[str, torch.Tensor]:
        got = [self._one(i) for i in idx]
        shapes = next((s for s in got if s is not None), None) or self._any_sample()
        # A damaged sample keeps its row (zeros, nothing valid): the batch's shape is unchanged.
        samples = [s if s is not None else {k: torch.zeros((self.entries[i]["tokens"], *v.shape[1:]), dtype=v.dtype)
                                            for k, v in shapes.items()}
                   for i, s in zip(idx, got, strict=True)]  # fmt: skip
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
            b["valid"][r, :n] = got[r] is not None
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


class prefetch:
    """Iterate `(item, load(item))` in order while a thread loads up to `depth` items ahead.
    An exception in `load` is raised at the item it belongs to. Use as a context manager
    (or call `close`): the thread is stopped and joined before the caller goes on."""

    def __init__(self, items: Iterable, load, depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._items, self._load = items, load
        self._t = threading.Thread(target=self._work, name="eyas-prefetch", daemon=True)
        self._t.start()

    def _put(self, res) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(res, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        for it in self._items:
            try:
                res = (it, self._load(it), None)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                res = (it, None, exc)
            if not self._put(res) or res[2] is not None:
                return
        self._put(None)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        res = self._q.get()
        if res is None:
            raise StopIteration
        it, val, exc = res
        if exc is not None:
            raise exc
        return it, val

    def close(self) -> None:
        self._stop.set()
        self._t.join()

    def __enter__(self) -> prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "SampleReader",
    "StoreError",
    "epoch_batches",
    "prefetch",
    "split_samples",
    "usable_samples",
]

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
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eyas.run.journal import committed
from eyas.run.store import StoreError, check_sample_file, read_into, sample_relpath, stored_layout
from eyas.stop import start_thread
from eyas.targets.target import plan_batches


def usable_samples(
    run: Path, hidden_size: int, log, entries: dict[int, dict] | None = None
) -> tuple[dict[int, dict], dict[int, str]]:
    """Committed samples (`entries`, or the journals' when not given) whose files match
    their journal entries (index -> entry), and those left out (index -> the problem)."""
    entries = committed(run) if entries is None else entries
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
        log(
            f"warning: {len(bad)} damaged sample(s) left out of training "
            f"(`eyas verify --repair {run}` and `eyas extract --resume {run}` redo them):"
        )
        for p in list(bad.values())[:10]:
            log(f"  {p}")
    return good, bad


def split_samples(indices: list[int], val_fraction: float) -> tuple[list[int], list[int]]:
    """Deterministic split by sample: a fixed-seed permutation, the first share is validation."""
    g = torch.Generator().manual_seed(1234)
    perm = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
    n_val = math.ceil(len(indices) * val_fraction) if val_fraction > 0 and len(indices) > 1 else 0
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def pack_batches(lengths, indices: list[int], batch_tokens: int) -> list[list[int]]:
    """Samples packed one after another into rows of at most `batch_tokens` tokens (no
    padding between them); a longer sample gets a row of its own. Deterministic."""
    batches, cur, used = [], [], 0
    for i in sorted(indices, key=lambda i: (lengths[i], i)):
        if cur and used + lengths[i] > batch_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        batches.append(cur)
    return batches


def epoch_batches(
    lengths: dict[int, int],
    indices: list[int],
    batch_tokens: int,
    seed: int,
    epoch: int,
    packed: bool = False,
) -> list[list[int]]:
    """Length-bucketed (or packed) batches, in an order that depends only on (seed, epoch)."""
    plan = pack_batches if packed else plan_batches
    batches = plan(lengths, sorted(indices), batch_tokens)
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


class StopRequested(Exception):
    """A data source saw a stop signal while it waited for samples."""


class StoreSource:
    """The samples of a finished run (or the committed part of one): every epoch trains the
    same samples, in length-bucketed (or packed) batches whose order is a pure function of
    (seed, epoch), so a resume at (epoch, batch) continues exactly where the run stopped."""

    saves_each_epoch = False

    def caught_up(self) -> None:
        """Nothing waits on a finished run's reader."""

    def __init__(self, cfg, entries: dict[int, dict], train_idx: list[int], val_idx: list[int]):
        self.cfg = cfg
        self.lengths = {i: e["tokens"] for i, e in entries.items()}
        self.train_idx, self.val_idx = train_idx, val_idx

    def describe(self) -> str:
        return f"{len(self.train_idx)} samples ({len(self.val_idx)} held out)"

    def steps_per_epoch(self) -> int:
        return len(self._batches(0))

    def steps_after(self, epoch: int, groups: list) -> None:
        """None: the step total planned at the start is exact."""
        return None

    def _batches(self, epoch: int) -> list[list[int]]:
        c = self.cfg
        return epoch_batches(self.lengths, self.train_idx, c.batch_tokens, c.seed, epoch, c.pack)

    def restore(self, state: dict) -> None:
        pass

    def windows(self, epoch: int, state: dict, hooks):
        """The epoch's optimizer steps (groups of --grad-accum batches), from the resume point."""
        batches, accum = self._batches(epoch), self.cfg.grad_accum
        start = state["batch"] if epoch == state["epoch"] else 0
        yield [batches[b : b + accum] for b in range(start, len(batches), accum)]

    def advance(self, state: dict, epoch: int, group: list[list[int]]) -> dict:
        return {"step": state["step"] + 1, "epoch": epoch, "batch": state["batch"] + len(group)}

    def end_epoch(self, state: dict, epoch: int) -> dict:
        return {"step": state["step"], "epoch": epoch + 1, "batch": 0}

    def has_val(self, epoch: int) -> bool:
        return bool(self.val_idx)

    def val_batches(self, epoch: int) -> list[list[int]]:
        plan = pack_batches if self.cfg.pack else plan_batches
        return plan(self.lengths, self.val_idx, self.cfg.batch_tokens)

    def stamp(self, state: dict) -> dict:
        return state

    def saved(self, state: dict) -> None:
        pass

    def finished(self, state: dict) -> None:
        pass

    def waiting(self) -> str | None:
        return None


class SampleReader:
    """Reads batches of committed samples, checking each file against its journal entry.

    The data path's cost is the bytes: each sample's tensors are read with one `preadv`
    straight into its row of the batch (pinned memory on a GPU), in their stored dtypes
    (bfloat16, float8 with scales, ...), by a few reader threads; the checksums hash the
    rows where they landed. Upcasting happens on the device (`to_device`), so the bytes
    that travel are the stored ones."""

    def __init__(
        self,
        run: Path,
        entries: dict[int, dict],
        checksums: bool,
        pin: bool = False,
        report=None,
        threads: int | None = None,
    ):
        self.run, self.entries, self.checksums, self.pin = Path(run), entries, checksums, pin
        self.report = report or (lambda index, problem: None)
        self._summed: set[int] = set()
        self._bad: set[int] = set()
        self._lock = threading.Lock()
        self._layout: dict | None = None
        self._free: list[dict[str, torch.Tensor]] = []  # buffers of released batches
        self._lent: dict[int, dict[str, torch.Tensor]] = {}
        # Reader threads beside the prefetch thread: a few on a many-core training host; none
        # on a small one, where they would only compete with the step for the same cores.
        threads = threads if threads is not None else min(4, (os.cpu_count() or 2) // 4)
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="eyas-read") if threads > 1 else None
        )

    def update(self, entries: dict[int, dict]) -> None:
        """Take newer journal entries (a followed run commits samples, or a later pass
        rewrites one): a changed entry is checked afresh, checksums included."""
        with self._lock:
            for i, e in entries.items():
                if self.entries.get(i) != e:
                    self.entries[i] = e
                    self._summed.discard(i)
                    self._bad.discard(i)

    def layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The stored tensors' dtypes and per-token shapes (from the first intact sample)."""
        if self._layout is None:
            for e in self.entries.values():
                try:
                    self._layout = stored_layout(self.run, e)
                    break
                except StoreError:
                    continue
            else:
                raise StoreError(
                    f"{self.run}: every sample is damaged; run `eyas verify --repair {self.run}`"
                )
        return self._layout

    def _fill(self, i: int, row: dict[str, torch.Tensor]) -> bool:
        """Read sample i into `row`; False (reported once) if it is damaged."""
        with self._lock:
            first = i not in self._summed
            if i in self._bad:
                return False
        try:
            read_into(self.run, self.entries[i], row, checksums=self.checksums and first)
        except StoreError as exc:
            with self._lock:
                new = i not in self._bad
                self._bad.add(i)
            if new:
                self.report(i, str(exc))
            return False
        with self._lock:
            self._summed.add(i)
        return True

    def batch(self, idx: list[int], packed: bool = False) -> dict[str, torch.Tensor]:
        """Host tensors of a batch in stored dtypes: input_ids (B, T) int32, loss_mask and
        valid (B, T), the stored states (B, T, ...); padding and damaged rows are zero (and
        not valid), so a damaged sample never changes the batch's shape. `packed`: one row
        holding the samples one after another, with `segments` and `positions` (1, T)."""
        if packed:
            return self._packed(idx)
        lay = self.layout()
        lengths = [self.entries[i]["tokens"] for i in idx]
        B, T = len(idx), max(lengths)
        need = {k: B * T * math.prod(shape) for k, (_, shape) in lay.items()}
        slab = self._take(need)
        buf = {k: slab[k][: need[k]].view(B, T, *shape) for k, (_, shape) in lay.items()}
        valid = torch.zeros(B, T, dtype=torch.bool)

        def one(r: int) -> None:
            n = lengths[r]
            ok = self._fill(idx[r], {k: v[r, :n] for k, v in buf.items()})
            for v in buf.values():
                _zero(v[r] if not ok else v[r, n:])  # padding, or all of a damaged row
            if ok:
                valid[r, :n] = True

        if self._pool is not None and B > 1:
            list(self._pool.map(one, range(B)))
        else:
            for r in range(B):
                one(r)
        out = {
            "input_ids": buf.pop("input_ids"),
            "loss_mask": buf.pop("loss_mask"),
            "valid": valid,
            **buf,
        }
        with self._lock:
            self._lent[out["input_ids"].data_ptr()] = slab
        if "target_topk_logprobs" in out:  # padding of log-probabilities is "impossible", not 0
            lp = out["target_topk_logprobs"]
            for r, n in enumerate(lengths):
                lp[r, n:] = -1e4
                if not valid[r].any():
                    lp[r] = -1e4
        return out

    def _packed(self, idx: list[int]) -> dict[str, torch.Tensor]:
        lay = self.layout()
        lengths = [self.entries[i]["tokens"] for i in idx]
        starts = [sum(lengths[:r]) for r in range(len(idx))]
        T = sum(lengths)
        need = {k: T * math.prod(shape) for k, (_, shape) in lay.items()}
        slab = self._take(need)
        buf = {k: slab[k][: need[k]].view(1, T, *shape) for k, (_, shape) in lay.items()}
        valid = torch.zeros(1, T, dtype=torch.bool)
        segments = torch.empty(1, T, dtype=torch.long)
        positions = torch.empty(1, T, dtype=torch.long)

        def one(r: int) -> None:
            a, n = starts[r], lengths[r]
            if self._fill(idx[r], {k: v[0, a : a + n] for k, v in buf.items()}):
                valid[0, a : a + n] = True
            else:
                for v in buf.values():
                    _zero(v[0, a : a + n])
            segments[0, a : a + n] = r
            positions[0, a : a + n] = torch.arange(n)

        if self._pool is not None and len(idx) > 1:
            list(self._pool.map(one, range(len(idx))))
        else:
            for r in range(len(idx)):
                one(r)
        out = {
            "input_ids": buf.pop("input_ids"),
            "loss_mask": buf.pop("loss_mask"),
            "valid": valid,
            "segments": segments,
            "positions": positions,
            **buf,
        }
        if "target_topk_logprobs" in out:
            lp = out["target_topk_logprobs"]
            for r, n in enumerate(lengths):
                if not valid[0, starts[r]]:
                    lp[0, starts[r] : starts[r] + n] = -1e4
        with self._lock:
            self._lent[out["input_ids"].data_ptr()] = slab
        return out

    def _take(self, need: dict[str, int]) -> dict[str, torch.Tensor]:
        """Buffers for a batch: the smallest returned slab big enough, or new ones (sized to a
        power of two, so that slabs fit later batches too). Reusing them spares the page
        faults of fresh memory (large allocations come straight from the kernel)."""
        with self._lock:
            fits = [
                n
                for n, slab in enumerate(self._free)
                if all(slab[k].numel() >= v for k, v in need.items())
            ]
            if fits:
                best = min(fits, key=lambda n: sum(t.numel() for t in self._free[n].values()))
                return self._free.pop(best)
        lay = self.layout()
        return {
            k: torch.empty(1 << max(v - 1, 0).bit_length(), dtype=lay[k][0], pin_memory=self.pin)
            for k, v in need.items()
        }

    def release(self, batch: dict[str, torch.Tensor], copied=None) -> None:
        """Give a batch's buffers back once the step that used them is done (optional: a
        batch never released is simply freed). `copied`: the CUDA event after its copy to
        the device, waited for first (the copy runs asynchronously from pinned memory)."""
        if copied is not None:
            copied.synchronize()
        with self._lock:
            slab = self._lent.pop(batch["input_ids"].data_ptr(), None)
            if slab is not None and len(self._free) < 8:
                self._free.append(slab)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def _zero(t: torch.Tensor) -> None:
    """memset in this thread: torch's own fill is parallel and waits on every intra-op
    thread, which stalls a reader thread for milliseconds on a busy host."""
    if t.numel():
        t.view(torch.uint8).numpy().fill(0)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch from `SampleReader.batch` on the device, in what training computes with: the
    stored bytes travel, the upcast (and float8 dequantisation) happens on the device."""
    from eyas.run.store import dequantize_fp8

    t = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    out = {
        "input_ids": t["input_ids"].long(),
        "loss_mask": t["loss_mask"].bool(),
        "valid": t["valid"],
    }
    for k in ("segments", "positions"):  # packed rows
        if k in t:
            out[k] = t[k]
    aux = t["aux_hidden_states"]
    if "aux_scales" in t:
        B, T, W = aux.shape
        aux = dequantize_fp8(aux.reshape(B * T, W), t["aux_scales"].reshape(B * T, -1)).view(
            B, T, W
        )
    out["aux"] = aux.float()
    if "target_topk_ids" in t:
        out["topk_ids"] = t["target_topk_ids"].long()
        out["topk_lp"] = t["target_topk_logprobs"].float()
    else:
        out["last"] = t["last_hidden_states"].float()
    if "target_argmax" in t:  # top-K's, or stored beside the final state (Layout.argmax)
        out["tgt_top"] = t["target_argmax"].long()
    return out


class prefetch:
    """Iterate `(item, load(item))` in order while a thread loads up to `depth` items ahead.
    An exception in `load` is raised at the item it belongs to. Use as a context manager
    (or call `close`): the thread is stopped and joined before the caller goes on."""

    def __init__(self, items: Iterable, load, depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._items, self._load = items, load
        self._t = threading.Thread(target=self._work, name="eyas-prefetch", daemon=True)
        start_thread(self._t)

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
    "StoreSource",
    "StopRequested",
    "to_device",
    "StoreError",
    "epoch_batches",
    "prefetch",
    "split_samples",
    "usable_samples",
]

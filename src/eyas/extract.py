"""Stage 2, `extract`: run the target over a prepared dataset and store its hidden states.

Guarantee: every sample in a run is either fully committed and checksummed, or absent, and
a restart continues exactly where it stopped (see `store` for the commit protocol).

How:
- Forward hooks capture the three aux layers' outputs and the final norm's output; the
  base model is called without its lm_head, so full-vocabulary logits are never computed.
- Samples are batched by length under a token budget; the batch plan is a pure function
  of the dataset, the rank and the budget, so a resumed run recomputes a partly-done batch
  with the same shapes and the stored tensors are bit-identical to an uninterrupted run.
- A writer thread hashes, writes and fsyncs while the next batch runs (bounded queue).
- The run stops cleanly (exit 75, resumable) on SIGINT/SIGTERM, when free space falls
  below `min_free`, or on a real ENOSPC; the in-flight commit finishes or leaves nothing.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import __version__
from .fsutil import DiskFullError, filesystem_info, free_bytes, human_bytes, is_disk_full, read_json
from .gpu import gpu_preflight
from .lock import acquire_lock, release_lock
from .prepare import PreparedDataset
from .store import (
    STORE_VERSION,
    Journal,
    Sample,
    append_error,
    bytes_per_token,
    check_sample_file,
    commit_samples,
    iter_sample_files,
    journal_entry,
    journal_path,
    lock_path,
    read_all_journals,
    read_run_meta,
    write_run_meta,
)
from .target import (
    DTYPES,
    Capture,
    default_aux_layers,
    load_target,
    model_fingerprint,
    plan_batches,
    resolve_device,
)
from .ui import Reporter, console


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    model: str
    """Target model directory (transformers format)."""
    data: str
    """Prepared dataset directory (from `eyas prepare`)."""
    out: str
    """Run directory; created if new."""
    aux_layers: tuple[int, ...] | None = None
    """Aux layers as outputs of 0-based decoder layers; default [1, n//2-1, n-4]."""
    device: str = "auto"
    """`auto` (cuda if present), `cpu`, `cuda`, `cuda:K`, or `multi` (device_map=auto over all GPUs)."""
    dtype: str = "auto"
    """Compute dtype: `auto` (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16."""
    store_dtype: str | None = None
    """Dtype of stored hidden states; default: the compute dtype."""
    batch_tokens: int = 8192
    """Token budget per batch (batch size x longest sample, padding included)."""
    trust_remote_code: bool = False
    rank: int = 0
    """This process's share of the samples: index % world == rank."""
    world: int = 1
    min_free: str = "2%"
    """Stop when free space on the run's filesystem falls below this (bytes, K/M/G suffix, or %); at least 1 GiB when given as %."""
    allow_partial: bool = False
    """Start even when the projected size does not fit on the disk."""
    queue_depth: int = 4
    """Batches waiting for the writer before the forward loop blocks."""
    max_foreign_gpu_mem: str = "2GiB"
    """Refuse to start when another process holds more than this on a GPU we use."""
    ignore_busy_gpus: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(
                f"--rank {self.rank} is outside 0..{self.world - 1} (--world {self.world})"
            )
        if self.batch_tokens < 1:
            raise ValueError(f"--batch-tokens must be positive, got {self.batch_tokens}")
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise ValueError(
                f"--aux-layers needs exactly three layers, got {list(self.aux_layers)}"
            )
        for d in (self.dtype, self.store_dtype or "auto"):
            if d not in ("auto", *DTYPES):
                raise ValueError(f"unknown dtype {d!r}; choose from auto, {', '.join(DTYPES)}")
        parse_size(self.min_free, 1)
        parse_size(self.max_foreign_gpu_mem, 1)


# Fields of ExtractConfig that may differ between a run and its resume. A changed
# batch_tokens (e.g. after running out of memory) regroups the remaining samples: still
# correct, but their files are then no longer bit-identical to an uninterrupted run's.
_RESUMABLE = {
    "batch_tokens",
    "progress",
    "device",
    "queue_depth",
    "min_free",
    "allow_partial",
    "ignore_busy_gpus",
    "max_foreign_gpu_mem",
    "rank",
    "world",
}


def parse_size(spec: str, total: int) -> int:
    """'2%' of `total` (at least 1 GiB), or '500M', '2GiB', '1048576' bytes."""
    s = str(spec).strip()
    try:
        if s.endswith("%"):
            return max(int(total * float(s[:-1]) / 100), 1 << 30)
        units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
        low = s.lower().removesuffix("ib").removesuffix("b")
        if low and low[-1] in units:
            return int(float(low[:-1]) * units[low[-1]])
        return int(float(low))
    except ValueError:
        raise ValueError(
            f"cannot read size {spec!r}: use bytes, a K/M/G suffix or a percentage"
        ) from None


class ExtractStopped(Exception):
    """The run stopped early but cleanly; `extract --resume` continues it."""

    def __init__(self, reason: str, done: int, total: int, run: Path):
        self.reason, self.done, self.total, self.run = reason, done, total, run
        super().__init__(
            f"{reason}. {done}/{total} samples are committed. Resume with: eyas extract --resume {run}"
        )


@dataclass
class ExtractSummary:
    run: str
    total: int
    done_before: int
    committed: int
    failed: int
    tokens: int
    seconds: float
    bytes_written: int


def _config_dict(cfg: ExtractConfig) -> dict:
    d = asdict(cfg)
    d["aux_layers"] = list(cfg.aux_layers) if cfg.aux_layers else None
    return d


def start_or_resume(
    cfg: ExtractConfig | None, resume: str | None = None, overrides: dict | None = None
) -> tuple[ExtractConfig, Path, dict]:
    """Resolve the config of a new run, or load and check the stored one of a resumed run."""
    if resume is not None:
        run = Path(resume)
        meta = read_run_meta(run)
        stored = {
            k: v for k, v in meta["config"].items() if k in ExtractConfig.__dataclass_fields__
        }
        stored["aux_layers"] = tuple(stored["aux_layers"]) if stored.get("aux_layers") else None
        cfg = ExtractConfig(**{**stored, **(overrides or {})})
        changed = [
            k for k in (overrides or {}) if k not in _RESUMABLE and overrides[k] != stored.get(k)
        ]
        if changed:
            raise ValueError(
                f"{run}/run.json: {', '.join(changed)} cannot change on resume (start a new run)"
            )
        _check_same_inputs(cfg, meta, run)
        if cfg.batch_tokens != meta["config"]["batch_tokens"]:  # kept for later resumes too
            meta["config"]["batch_tokens"] = cfg.batch_tokens
            write_run_meta(run, meta)
        return cfg, run, meta
    assert cfg is not None
    cfg = resolve(cfg)
    run = Path(cfg.out)
    if (run / "run.json").exists():
        meta = read_run_meta(run)
        if {k: v for k, v in _config_dict(cfg).items() if k not in _RESUMABLE} != {
            k: v for k, v in meta["config"].items() if k not in _RESUMABLE
        }:
            raise ValueError(
                f"{run} already holds a run with a different config; use `eyas extract --resume {run}` "
                "to continue it, or choose a new --out"
            )
        _check_same_inputs(cfg, meta, run)
        return cfg, run, meta
    return cfg, run, {}


def resolve(cfg: ExtractConfig) -> ExtractConfig:
    """Absolute paths and explicit aux layers, so the stored config means one thing."""
    aux = cfg.aux_layers
    if aux is None:
        n = read_json(Path(cfg.model) / "config.json").get("num_hidden_layers")
        if not isinstance(n, int):
            raise ValueError(f"{cfg.model}/config.json has no num_hidden_layers; pass --aux-layers")
        aux = default_aux_layers(n)
    ab = lambda p: str(Path(p).resolve())  # noqa: E731
    return replace(
        cfg, model=ab(cfg.model), data=ab(cfg.data), out=ab(cfg.out), aux_layers=tuple(aux)
    )


def _check_same_inputs(cfg: ExtractConfig, meta: dict, run: Path) -> None:
    ds = PreparedDataset.open(cfg.data, check=False)
    if ds.fingerprint != meta["dataset_fingerprint"]:
        raise ValueError(
            f"dataset changed: {cfg.data} has fingerprint {ds.fingerprint}, run {run} was made from "
            f"{meta['dataset_fingerprint']}; refusing to mix samples (start a new run)"
        )
    fp = model_fingerprint(cfg.model)
    if fp != meta["model_fingerprint"]:
        raise ValueError(
            f"model changed: {cfg.model} has fingerprint {fp}, run {run} was made with "
            f"{meta['model_fingerprint']}; refusing to mix samples (start a new run)"
        )


def new_run_meta(
    cfg: ExtractConfig,
    ds: PreparedDataset,
    model_config,
    dtype: torch.dtype,
    store_dtype: torch.dtype,
) -> dict:
    n = model_config.num_hidden_layers
    aux = tuple(cfg.aux_layers) if cfg.aux_layers else default_aux_layers(n)
    H = model_config.hidden_size
    return {
        "store_version": STORE_VERSION,
        "eyas_version": __version__,
        "command": sys.argv,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {**_config_dict(cfg), "aux_layers": list(aux)},
        "model_path": str(Path(cfg.model).resolve()),
        "model_fingerprint": model_fingerprint(cfg.model),
        "model_type": model_config.model_type,
        "num_hidden_layers": n,
        "hidden_size": H,
        "vocab_size": model_config.vocab_size,
        "dataset_path": str(Path(cfg.data).resolve()),
        "dataset_fingerprint": ds.fingerprint,
        "samples": len(ds),
        "tokens": int(ds.lengths().sum()),
        "aux_layers": list(aux),
        "aux_layers_convention": "output of 0-based decoder layer i",
        "aux_layers_hf": [i + 1 for i in aux],
        "aux_layers_hf_convention": "index into HF outputs.hidden_states (vLLM eagle_aux_hidden_state_layer_ids)",
        "last_hidden_state": "post_norm",
        "last_hidden_state_note": "output of the final norm: lm_head(last_hidden_states) gives the target logits",
        "compute_dtype": str(dtype).removeprefix("torch."),
        "store_dtype": str(store_dtype).removeprefix("torch."),
        "bytes_per_token": bytes_per_token(H, store_dtype),
    }


def done_indices(run: Path) -> dict[int, dict]:
    """Samples committed by any rank: a resume with another --world never redoes them."""
    return {e["index"]: e for es in read_all_journals(run).values() for e in es}


def recover(run: Path, rank: int, journal: Journal, mine: set[int], hidden_size: int) -> int:
    """Bring the store in line with the journal after a crash; returns samples adopted.

    Only this rank's samples are touched (other ranks may be writing theirs right now).
    Their temp files are removed. A sample file without a journal entry (the crash came
    between rename and journal append) is adopted only if every checksum holds; else it is
    removed. A journaled file is trusted here only for its size; `verify` checks deeper.
    """
    done = done_indices(run)
    adopted = 0
    for p in list(iter_sample_files(run)):
        try:
            idx = int(p.name.split(".")[0])
        except ValueError:
            continue
        if idx not in mine:
            continue
        if ".tmp-" in p.name:
            p.unlink(missing_ok=True)
            continue
        if idx in done:
            continue
        c = check_sample_file(p, checksums=True, hidden_size=hidden_size)
        if c.ok and int(c.header["__metadata__"]["sample_index"]) == idx:
            journal.append(
                journal_entry(idx, c.header["__metadata__"]["sample_id"], _head(p), c.nbytes)
            )
            adopted += 1
        else:
            p.unlink(missing_ok=True)
    journal.sync()
    return adopted


def _head(path: Path) -> bytes:
    """The header bytes (length prefix included) of a sample file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return n.to_bytes(8, "little") + f.read(n)


def extract(
    cfg: ExtractConfig | None = None, *, resume: str | None = None, overrides: dict | None = None
) -> ExtractSummary:
    """Run or resume an extraction. Raises ExtractStopped for a clean early stop."""
    cfg, run, meta = start_or_resume(cfg, resume, overrides)
    ds = PreparedDataset.open(cfg.data)
    fs = filesystem_info(run)
    if (w := fs.warning()) is not None:
        console.print(
            f"warning: {w}; a run of many hours should live on persistent storage",
            markup=False,
            highlight=False,
        )

    gpu_preflight(
        resolve_device(cfg.device),
        parse_size(cfg.max_foreign_gpu_mem, 1),
        cfg.ignore_busy_gpus,
        lambda m: console.print(m, markup=False, highlight=False),
    )
    model, input_device, dtype = load_target(
        cfg.model, cfg.device, cfg.dtype, cfg.trust_remote_code
    )
    store_dtype = DTYPES[cfg.store_dtype] if cfg.store_dtype else dtype
    run.mkdir(parents=True, exist_ok=True)
    if not meta:
        meta = new_run_meta(cfg, ds, model.config, dtype, store_dtype)
        write_run_meta(run, meta)
    aux = tuple(meta["aux_layers"])
    H = meta["hidden_size"]

    lock = lock_path(run, cfg.rank)
    taken = acquire_lock(lock)
    if taken is not None:
        console.print(f"took over a stale lock: {taken.describe()}", markup=False, highlight=False)
    journal = Journal(journal_path(run, cfg.rank))
    try:
        mine = [i for i in range(len(ds)) if i % cfg.world == cfg.rank]
        adopted = recover(run, cfg.rank, journal, set(mine), H)
        if adopted:
            console.print(
                f"adopted {adopted} complete sample(s) whose journal entry was lost",
                markup=False,
                highlight=False,
            )
        done = done_indices(run)
        lengths = ds.lengths().tolist()
        todo = [i for i in mine if i not in done]
        _check_disk(
            run, cfg, sum(lengths[i] for i in todo) * meta["bytes_per_token"] + 4096 * len(todo)
        )
        return _run_loop(
            cfg, run, meta, ds, model, input_device, store_dtype, aux, mine, done, journal
        )
    finally:
        journal.close()
        release_lock(lock)


def _check_disk(run: Path, cfg: ExtractConfig, need: int) -> None:
    fs = filesystem_info(run)
    floor = parse_size(cfg.min_free, fs.total_bytes)
    console.print(
        f"disk: this run needs ~{human_bytes(need)} more; {human_bytes(fs.free_bytes)} free on "
        f"{fs.mount_point} ({fs.fs_type}), floor {human_bytes(floor)}",
        markup=False,
        highlight=False,
    )
    if need > fs.free_bytes - floor and not cfg.allow_partial:
        raise DiskFullError(
            28,
            f"not enough space: the run needs ~{human_bytes(need)} but {fs.mount_point} has "
            f"{human_bytes(fs.free_bytes)} free (keeping {human_bytes(floor)} spare). Free space, "
            "use another --out, or pass --allow-partial to extract what fits",
        )


def _run_loop(
    cfg, run, meta, ds, model, input_device, store_dtype, aux, mine, done, journal
) -> ExtractSummary:
    lengths = ds.lengths().tolist()
    batches = plan_batches(lengths, mine, cfg.batch_tokens)
    todo = [b for b in batches if any(i not in done for i in b)]
    total, done_before = len(mine), sum(i in done for i in mine)
    capture = Capture(model, aux)
    pad_id = 0
    stop = threading.Event()
    stop_reason: list[str] = []
    q: queue.Queue = queue.Queue(maxsize=cfg.queue_depth)
    stats = {"committed": 0, "failed": 0, "bytes": 0, "tokens": 0}
    writer_error: list[BaseException] = []
    floor = parse_size(cfg.min_free, filesystem_info(run).total_bytes)

    def writer() -> None:
        last_sync = time.monotonic()
        while True:
            item = q.get()
            if item is None:
                break
            if writer_error:
                continue  # drain without committing after a failure
            try:
                for e in (s for s in item if isinstance(s, dict)):  # failed samples
                    append_error(run, cfg.rank, e)
                    stats["failed"] += 1
                for entry in commit_samples(run, [s for s in item if isinstance(s, Sample)], meta):
                    journal.append(entry)
                    stats["committed"] += 1
                    stats["bytes"] += entry["size"]
                    stats["tokens"] += entry["tokens"]
                journal.flush()
                if time.monotonic() - last_sync > 1.0:
                    journal.sync()
                    last_sync = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                writer_error.append(exc)
                stop.set()
        if not writer_error:
            try:
                journal.sync()
            except BaseException as exc:  # noqa: BLE001
                writer_error.append(exc)

    def on_signal(signum, _frame):
        stop_reason.append(f"stopped by {signal.Signals(signum).name}")
        stop.set()

    old = (
        {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    wt = threading.Thread(target=writer, name="eyas-writer", daemon=True)
    wt.start()
    t0 = time.monotonic()

    def extra() -> str:
        el = max(time.monotonic() - t0, 1e-9)
        return f"{stats['tokens'] / el:,.0f} tok/s, {human_bytes(free_bytes(run))} free"

    try:
        with Reporter("extract", total, enabled=cfg.progress, extra=extra) as rep:
            rep.skip(done_before)
            committed_seen = 0
            for batch in todo:
                if stop.is_set():
                    break
                if free_bytes(run) < floor:
                    stop_reason.append(
                        f"free space on {run} fell below --min-free {human_bytes(floor)}"
                    )
                    break
                q.put(_forward_batch(ds, batch, done, capture, input_device, store_dtype, pad_id))
                rep.advance(stats["committed"] + stats["failed"] - committed_seen)
                committed_seen = stats["committed"] + stats["failed"]
            q.put(None)
            wt.join()
            rep.advance(stats["committed"] + stats["failed"] - committed_seen)
    finally:
        if wt.is_alive():
            q.put(None)
            wt.join()
        for s, h in old.items():
            signal.signal(s, h)
        capture.remove()
    now_done = done_before + stats["committed"]
    if writer_error:
        exc = writer_error[0]
        if isinstance(exc, DiskFullError) or is_disk_full(exc):
            raise ExtractStopped(f"disk full while writing ({exc})", now_done, total, run)
        raise exc
    if stop_reason:
        raise ExtractStopped(stop_reason[0], now_done, total, run)
    return ExtractSummary(str(run), total, done_before, stats["committed"], stats["failed"], stats["tokens"],
                          time.monotonic() - t0, stats["bytes"])  # fmt: skip


def _forward_batch(ds, batch, done, capture: Capture, device, store_dtype, pad_id) -> list:
    """Run one batch; returns Samples (on CPU) and error dicts for samples that fail checks."""
    rows = [ds.sample(i) for i in batch]
    T = max(len(r[0]) for r in rows)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(batch), T), dtype=torch.long)
    for r, (x, _) in enumerate(rows):
        ids[r, : len(x)] = torch.from_numpy(x.astype("int64"))
        att[r, : len(x)] = 1
    aux, last = capture.run(ids.to(device), att.to(device))  # (B, T, 3H), (B, T, H)
    # One reduction pass finds rows that may hold NaN/Inf (a sum is finite iff its terms are,
    # barring overflow); only those rows get the exact elementwise check below.
    sums = aux.sum(-1, dtype=torch.float32) + last.sum(-1, dtype=torch.float32)  # (B, T)
    suspect = (~torch.isfinite(sums) & (att.to(sums.device) == 1)).any(-1).tolist()  # (B,)
    aux = aux.to("cpu", store_dtype)
    last = last.to("cpu", store_dtype)
    out: list = []
    for r, i in enumerate(batch):
        if i in done:
            continue
        x, m = rows[r]
        n = len(x)
        a, h = aux[r, :n], last[r, :n]  # padded positions never reach the store
        rec = ds.records[i]
        problem = None
        if a.shape[0] != n or h.shape[0] != n:
            problem = f"token-count mismatch: {n} ids but {a.shape[0]} hidden-state rows"
        elif suspect[r] and not (torch.isfinite(a).all() and torch.isfinite(h).all()):
            problem = "non-finite values (NaN/Inf) in hidden states"
        if problem:
            out.append(
                {
                    "index": i,
                    "id": rec["id"],
                    "file": rec["file"],
                    "line": rec["line"],
                    "reason": problem,
                }
            )
            continue
        out.append(Sample(i, rec["id"], f"{rec['file']}:{rec['line']}", torch.from_numpy(x.copy()),
                          torch.from_numpy(m.copy()), a, h))  # fmt: skip
    return out

"""Stage 4, `train`: an EAGLE-3 drafter from an extraction run, with training-time test.

Guarantees:
- Reproducible: batch order is a pure function of (seed, epoch); no other randomness.
- Crash-safe checkpoints: a step directory is written under a temp name, fsynced, given a
  COMPLETE marker and renamed; only directories with the marker are loaded. A run killed
  with SIGKILL and resumed ends with the same weights as an uninterrupted one (fp32).
- SIGTERM/SIGINT save a checkpoint at the next step boundary and exit 75.
- Data parallel under torchrun (gloo on CPU, nccl on GPU): each rank takes its share of
  every global batch; losses are normalised by global token counts and gradients summed,
  so the update equals a single-process step on the same global batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checkpoint import (
    latest_checkpoint,
    remove_stale_temp,
    resume_checkpoint,
    save_checkpoint,
    save_final,
)
from .cpu import choose_threads, configure_threads
from .drafter import Drafter, DrafterConfig
from .fsutil import DiskFullError, atomic_write_bytes, atomic_write_json, is_disk_full, read_json
from .lock import WriterLock
from .runmeta import read_run_meta
from .target import plan_batches
from .train_data import (
    SampleReader,
    epoch_batches,
    pack_batches,
    prefetch,
    split_samples,
    to_device,
    usable_samples,
)
from .ttt_attention import IMPLEMENTATIONS
from .ui import Reporter, console
from .weights import embed_weight, final_norm_weight, lm_head_weight


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    data: str
    """Extraction run directory (from `eyas extract`)."""
    out: str
    """Training directory: checkpoints, metrics.jsonl, plots, train.json."""
    model: str | None = None
    """Target model directory for lm_head/embeddings; default: the run's recorded model."""
    epochs: int = 3
    ttt_steps: int = 7
    """Unrolled training-time-test steps k."""
    step_decay: float = 0.8
    """Weight of step i's loss is step_decay ** i."""
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    """Cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int | None = None
    """Linear warmup; default: a tenth of the run's optimizer steps, at most 50."""
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 8192
    """Token budget of one micro-batch (summed over ranks)."""
    grad_accum: int = 1
    val_fraction: float = 0.05
    eval_every: int = 0
    """Also evaluate every N optimizer steps (0: once per epoch only)."""
    save_every: int = 100
    keep_checkpoints: int = 2
    draft_vocab_size: int | None = None
    """D; default: the dataset's (32000 or the target vocab if smaller)."""
    dtype: str = "float32"
    """float32 or bfloat16 (autocast on GPU)."""
    device: str = "auto"
    seed: int = 0
    verify_data: bool = True
    """Check every sample's tensor checksums on its first read (files are always checked
    against their journal entries)."""
    intermediate_size: int | None = None
    """Override the drafter MLP width (default: the target's)."""
    attention: str = "auto"
    """TTT attention: `reference` (full score matrices), `chunked` (blockwise, O(T) memory, any
    device), `flex` (fused kernel, GPU); `auto`: flex on a GPU, chunked on a CPU."""
    allow_partial: bool = False
    """Train on a run whose extraction is not finished (only the samples committed so far)."""
    head_init: str = "target"
    """The drafter's output head at the start: `target` (the target's own lm_head rows for
    the draft vocabulary, and its final norm's weight; still trained), `target-frozen` (the
    same, the head never trained) or `random`."""
    pack: bool = False
    """Pack samples one after another into rows of --batch-tokens (attention and positions
    per sample) instead of padding each to its batch's longest: no padded compute."""
    progress: bool = True

    def __post_init__(self) -> None:
        if self.head_init not in ("target", "target-frozen", "random"):
            raise ValueError(
                f"--head-init must be target, target-frozen or random, got {self.head_init!r}"
            )
        if self.ttt_steps < 1 or self.epochs < 1 or self.grad_accum < 1:
            raise ValueError("--ttt-steps, --epochs and --grad-accum must be at least 1")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must lie in [0, 1), got {self.val_fraction}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.attention not in ("auto", *IMPLEMENTATIONS):
            raise ValueError(
                f"--attention must be auto, {', '.join(IMPLEMENTATIONS)}; got {self.attention!r}"
            )


# May differ on resume. Paths may change (a moved run or training directory resumes):
# the data and the target are identified by their fingerprints, not where they live.
_RESUMABLE = {"progress", "device", "verify_data", "eval_every", "save_every", "keep_checkpoints",
              "data", "out", "model", "attention", "allow_partial"}  # fmt: skip


# What a training directory made before these options existed was trained with.
_BEFORE = {"head_init": "random", "pack": False}


class TrainStopped(Exception):
    pass


# ---------------------------------------------------------------------------- loss and metrics


def target_view(
    last: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, chunk: int = 2048
):
    """Target logits restricted to the draft vocab (B, T, D) and the full-vocab argmax (B, T),
    computed in row chunks so the (B*T, V) logits never exist at once."""
    B, T, H = last.shape
    flat = last.reshape(-1, H)
    sel, top = [], []
    for a in range(0, flat.shape[0], chunk):
        logits = flat[a : a + chunk] @ lm_head.T  # (c, V)
        sel.append(logits[:, draft_ids])
        top.append(logits.argmax(-1))
    return torch.cat(sel).view(B, T, -1), torch.cat(top).view(B, T)


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at position t, `fill` past the end; x (B, T, ...)."""
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], 1)


def add_targets(batch: dict, drafter: Drafter, lm_head: torch.Tensor | None) -> None:
    """Add the target's soft labels over the draft vocabulary, its full-vocabulary argmax
    and whether that argmax is in the draft vocabulary. From a stored final state the
    logits are recomputed; top-K storage brings its log-probabilities and argmax."""
    if "last" in batch:
        batch["tgt_logits"], batch["tgt_top"] = target_view(
            batch["last"], lm_head, drafter.draft_ids
        )
    batch["in_vocab"] = drafter.t2d[batch["tgt_top"]]  # (B, T)


def soft_ce(batch: dict, logits: torch.Tensor, n: int) -> torch.Tensor:
    """Cross-entropy (B, T) of the drafter's logits (B, T, D) against the target's
    distribution at position t+n: the full draft-vocabulary softmax, or the renormalised
    top-K (whose ids index the draft vocabulary)."""
    logp = F.log_softmax(logits.float(), -1)  # (B, T, D)
    if "tgt_logits" in batch:
        p = torch.softmax(shift(batch["tgt_logits"], n).float(), -1)  # (B, T, D)
        return -(p * logp).sum(-1)
    p = torch.softmax(shift(batch["topk_lp"], n, -1e4), -1)  # (B, T, K)
    return -(p * logp.gather(-1, shift(batch["topk_ids"], n))).sum(-1)


def loss_masks(batch: dict, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: (scored, loss mask). Scored: the predicted token x_{t+2+i} is trainable;
    the loss additionally needs the target's argmax at t+1+i in the draft vocabulary."""
    m = batch["valid"] & batch["loss_mask"]
    seg = batch.get("segments")  # packed rows: a prediction never reaches into the next sample
    out = []
    for i in range(steps):
        scored = shift(m, 2 + i, False)
        if seg is not None:
            scored = scored & (shift(seg, 2 + i, -1) == seg)
        out.append((scored, scored & shift(batch["in_vocab"], 1 + i, False)))
    return out


def ttt_loss(
    drafter: Drafter, batch: dict, steps: int, decay: float, norm: list[float] | None = None
):
    """Weighted TTT loss and per-step sums (steps, 6) for metrics.

    Step i at root t predicts the target's distribution at position t+1+i (soft
    cross-entropy over the draft vocabulary). `norm` gives per-step token counts to divide
    by (global ones under data parallel); default: this batch's.
    """
    dids = drafter.draft_ids
    outs = drafter.forward_ttt(
        batch["input_ids"], batch["aux"], steps, batch.get("segments"), batch.get("positions")
    )
    total = torch.zeros((), device=batch["aux"].device)
    all_right = torch.ones_like(batch["valid"])
    stats = []
    for i, ((logits, _), (scored, lmask)) in enumerate(
        zip(outs, loss_masks(batch, steps), strict=True)
    ):
        ce = soft_ce(batch, logits, 1 + i)  # (B, T)
        loss_sum = (ce * lmask).sum()
        n = norm[i] if norm is not None else float(lmask.sum())
        total = total + decay**i * loss_sum / max(n, 1.0)
        right = dids[logits.argmax(-1)] == shift(batch["tgt_top"], 1 + i, -1)  # (B, T)
        cond = scored & all_right
        all_right = all_right & right
        stats.append([float(loss_sum.detach()), float(lmask.sum()), float((right & scored).sum()), float(scored.sum()),
                      float((right & cond).sum()), float(cond.sum())])  # fmt: skip
    return total, torch.tensor(stats, dtype=torch.float64)


def summarize(stats: torch.Tensor) -> dict:
    """Per-step loss, accuracy, conditional accuracy and estimated acceptance lengths."""
    s = stats.double()
    loss = (s[:, 0] / s[:, 1].clamp(min=1)).tolist()
    acc = (s[:, 2] / s[:, 3].clamp(min=1)).tolist()
    cond = (s[:, 4] / s[:, 5].clamp(min=1)).tolist()
    accept, run, prod = [], 1.0, 1.0
    for c in cond:
        prod *= c
        run += prod
        accept.append(run)
    return {"loss": loss, "acc": acc, "cond_acc": cond, "accept_len": accept}


# ---------------------------------------------------------------------------- the run


def _dist() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():  # one GPU per rank; "cuda" then means this rank's
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def build_drafter(cfg: TrainConfig, meta: dict) -> tuple[Drafter, torch.Tensor | None]:
    """Drafter sized from the target, with the target's frozen embeddings; returns the
    target's lm_head too (None when the run stores the target's top-K: not needed)."""
    from .prepare import PreparedDataset
    from .target import check_model_dir, model_fingerprint, text_config

    model_dir = cfg.model or meta["model_path"]
    check_model_dir(model_dir, weights=True)
    if (fp := model_fingerprint(model_dir)) != meta["model_fingerprint"]:
        raise ValueError(f"{model_dir} is not the target {cfg.data} was extracted with (fingerprint {fp}, "
                         f"the run's is {meta['model_fingerprint']}); pass the right --model")  # fmt: skip
    tcfg = text_config(model_dir)  # a wrapper's language model (Kimi-K2.5) sizes the drafter
    ds = PreparedDataset.open(meta["dataset_path"], check=False)
    draft_ids = ds.draft_vocab(draft_vocab_for(cfg.draft_vocab_size, meta))
    over = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}
    dcfg = DrafterConfig.from_target(tcfg, len(draft_ids), **over)
    torch.manual_seed(cfg.seed)
    drafter = Drafter(dcfg)
    drafter.embed_tokens.weight.data.copy_(embed_weight(model_dir).float())
    drafter.set_draft_vocab(draft_ids)
    topk = "topk" in str(meta.get("layout", ""))
    from_target = cfg.head_init.startswith("target")
    head = lm_head_weight(model_dir).float() if from_target or not topk else None
    if from_target:
        # The drafter's last state stands in for the target's pre-norm state, so the target's
        # final norm and head rows are where the drafter's norm and head should start.
        drafter.lm_head.weight.data.copy_(head[draft_ids])  # (D, H)
        drafter.norm.weight.data.copy_(final_norm_weight(model_dir).float())  # (H,)
        drafter.lm_head.weight.requires_grad_(cfg.head_init != "target-frozen")
    return drafter, None if topk else head


def draft_vocab_for(requested: int | None, meta: dict) -> int | None:
    """D: the run's when it stores top-K over its draft vocabulary, else as requested."""
    fixed = meta.get("draft_vocab_size")
    if fixed and requested and requested != fixed:
        raise ValueError(f"the run stores the target's top-K over a draft vocabulary of {fixed}; "
                         f"--draft-vocab-size {requested} cannot differ")  # fmt: skip
    return fixed or requested


def _identity(meta: dict) -> dict:
    return {
        "dataset_fingerprint": meta["dataset_fingerprint"],
        "model_fingerprint": meta["model_fingerprint"],
    }


def train(cfg: TrainConfig, *, resume: bool = False) -> dict:
    """Train (or resume) a drafter; returns the last validation summary. Rank 0 holds the
    training directory's writer lock throughout: one training per directory."""
    rank, world = _dist()
    out, run = Path(cfg.out), Path(cfg.data)
    meta = read_run_meta(run)
    done = _check_complete(run, meta, cfg.allow_partial)
    if rank != 0:
        return _train(cfg, resume, rank, world, run, out, meta, done)
    out.mkdir(parents=True, exist_ok=True)
    lock = WriterLock(out, 0, 1, what="train").acquire()
    try:
        lock.set_phase("training")
        for p in remove_stale_temp(out):
            console.print(
                f"removed {p}, left by a killed checkpoint save", markup=False, highlight=False
            )
        return _train(cfg, resume, rank, world, run, out, meta, done)
    except OSError as exc:
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            raise DiskFullError(exc.errno, f"no space left writing to {out} ({exc})") from exc
        raise
    finally:
        lock.release()


def _check_complete(run: Path, meta: dict, allow_partial: bool) -> dict[int, dict]:
    """Refuse a run whose extraction is unfinished unless asked: hours spent on part of
    the data should be a choice, never a surprise."""
    from .journal import committed, read_errors

    done = committed(run)
    failed = {e["index"] for e in read_errors(run)} - set(done)
    left = meta["samples"] - len([i for i in done if i < meta["samples"]]) - len(failed)
    if left > 0 and not allow_partial:
        raise ValueError(
            f"{run}: extraction is not finished ({meta['samples'] - left}/{meta['samples']} samples "
            f"done or failed, {left} remaining). Finish it first: eyas extract --resume {run} "
            "(or pass --allow-partial to train on what is committed)"
        )
    return done  # the committed samples: training reads the journals once


def _train(
    cfg: TrainConfig, resume: bool, rank: int, world: int, run: Path, out: Path, meta: dict,
    done: dict[int, dict],
) -> dict:  # fmt: skip
    ident = _identity(meta)
    saved = out / "train.json"
    if saved.exists():
        prev = read_json(saved)
        if _identity(prev["data"]) != ident:
            raise ValueError(
                f"{saved}: this training directory was made from other data ({prev['data'].get('run')})"
            )
        mine = {k: v for k, v in asdict(cfg).items() if k not in _RESUMABLE}
        theirs = {**_BEFORE, **{k: v for k, v in prev["config"].items() if k not in _RESUMABLE}}
        if mine != theirs:
            diff = sorted(k for k in mine if mine[k] != theirs.get(k))
            raise ValueError(
                f"{saved}: config differs ({', '.join(diff)}); use another --out or the same options"
            )
        if not resume and latest_checkpoint(out) is not None:
            raise ValueError(
                f"{out} already has checkpoints; pass --resume to continue, or use another --out"
            )
    elif rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(saved, {"config": asdict(cfg), "data": {"run": str(run.resolve()), **ident},
                                  "aux_layers": meta["aux_layers"], "aux_layers_hf": meta["aux_layers_hf"],
                                  "model_path": str(Path(cfg.model or meta["model_path"]).resolve()),
                                  "world": world, "threads": choose_threads()
                                  if not torch.cuda.is_available() else None})  # fmt: skip

    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if cfg.device == "auto" else cfg.device))  # fmt: skip
    # Training batches are thousands of tokens: wide enough to use every CPU, unlike decoding.
    threads = configure_threads() if device.type == "cpu" else None
    if (
        saved.exists()
        and (was := read_json(saved).get("threads")) != threads
        and rank == 0
        and threads
    ):
        console.print(f"note: {threads} CPU thread(s) now, {was} before: float sums change order, so the "
                      "weights will differ from an uninterrupted run in the last bits", markup=False, highlight=False)  # fmt: skip
    drafter, lm_head = build_drafter(cfg, meta)
    drafter.attention = (
        cfg.attention
        if cfg.attention != "auto"
        else ("flex" if device.type == "cuda" else "chunked")
    )
    if drafter.attention == "flex" and device.type != "cuda":
        raise ValueError(
            "--attention flex trains on a GPU only (no backward pass on a CPU); use chunked"
        )
    drafter.to(device)
    lm_head = lm_head.to(device) if lm_head is not None else None
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    log = (
        (lambda m: console.print(m, markup=False, highlight=False))
        if rank == 0
        else (lambda m: None)
    )
    entries, rejected = usable_samples(run, meta["hidden_size"], log, done)
    if not entries:
        raise ValueError(f"{run}: no committed samples to train on")
    listed = _skipped_indices(out / "skipped_samples.jsonl") if rank == 0 else set()

    def skipped(index: int, problem: str, when: str = "while training") -> None:
        if when == "while training":
            console.print(f"warning: damaged sample left out of training: {problem}",
                          markup=False, highlight=False)  # fmt: skip
        if rank != 0 or index in listed:
            return
        listed.add(index)
        with open(out / "skipped_samples.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"index": index, "problem": problem, "found": when}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    for index, problem in rejected.items():
        skipped(index, problem, "at start-up (file against its journal entry)")

    reader = SampleReader(run, entries, cfg.verify_data, pin=device.type == "cuda", report=skipped)
    lengths = {i: e["tokens"] for i, e in entries.items()}
    train_idx, val_idx = split_samples(sorted(entries), cfg.val_fraction)
    per_epoch = len(epoch_batches(lengths, train_idx, cfg.batch_tokens, cfg.seed, 0, cfg.pack))
    total_steps = max(1, cfg.epochs * per_epoch // cfg.grad_accum)
    warmup = (
        cfg.warmup_steps if cfg.warmup_steps is not None else min(50, max(1, total_steps // 10))
    )
    log(f"training on {len(train_idx)} samples ({len(val_idx)} held out): {total_steps} optimizer steps, "
        f"warmup {warmup}, {cfg.ttt_steps} TTT steps")  # fmt: skip
    if rank == 0 and cfg.progress and warmup >= total_steps:
        log(f"warning: --warmup-steps {warmup} >= the run's {total_steps} optimizer steps: the learning "
            "rate never reaches --lr; train longer (--epochs) or lower --warmup-steps")  # fmt: skip
    if rank == 0 and cfg.progress and total_steps < 20:
        log(f"warning: only {total_steps} optimizer steps ({len(train_idx)} training samples, "
            f"--batch-tokens {cfg.batch_tokens}): the drafter will learn little; add data or epochs")  # fmt: skip

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return cfg.lr * (
            cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        )

    state = {"step": 0, "epoch": 0, "batch": 0}
    if resume and (found := resume_checkpoint(out, drafter, opt, log)) is not None:
        state, ckpt = found
        log(f"resuming from {ckpt} (epoch {state['epoch']}, batch {state['batch']})")
    if rank == 0:  # metrics logged after the state we start from are recomputed
        _truncate_metrics(out / "metrics.jsonl", state["step"])

    stop: list[str] = []
    handlers = {}
    if rank == 0 or world > 1:
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, lambda s, _f: stop.append(signal.Signals(s).name))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")
    steps, decay = cfg.ttt_steps, cfg.step_decay
    last_val: dict = {}

    def load(idx_all: list[int]) -> dict:
        """This rank's share of a global micro-batch, on the device (the prefetch thread)."""
        mine_idx = idx_all[rank::world]
        host = reader.batch(mine_idx or idx_all[:1], packed=cfg.pack)
        batch = to_device(host, device)
        if device.type == "cuda":
            batch["_copied"] = torch.cuda.Event()
            batch["_copied"].record()
        batch["_host"] = host  # its buffers go back to the reader after the step (`done`)
        if not mine_idx:  # this rank has no share: contribute zero loss and zero counts
            batch["valid"] = torch.zeros_like(batch["valid"])
        return batch

    def done(batch: dict) -> None:
        reader.release(batch.pop("_host"), batch.pop("_copied", None))

    def micro(batch: dict) -> tuple[torch.Tensor, dict]:
        add_targets(batch, drafter, lm_head)
        counts = torch.tensor(
            [float(lm.sum()) for _, lm in loss_masks(batch, steps)], dtype=torch.float64
        )
        if world > 1:
            all_reduce_cpu(counts)
        with autocast:
            loss, st = ttt_loss(drafter, batch, steps, decay, norm=counts.tolist())
        return loss, {"stats": st, "tokens": int(batch["valid"].sum())}

    def evaluate() -> dict:
        drafter.eval()
        acc = torch.zeros(steps, 6, dtype=torch.float64)
        with torch.no_grad():
            plan = pack_batches if cfg.pack else plan_batches
            with prefetch(plan(lengths, val_idx, cfg.batch_tokens), load) as batches:
                for _, batch in batches:
                    acc += micro(batch)[1]["stats"]
                    done(batch)
        if world > 1:
            all_reduce_cpu(acc)
        drafter.train()
        return summarize(acc)

    t0, tokens_seen = time.monotonic(), 0
    window = torch.zeros(steps, 6, dtype=torch.float64)
    shown: dict = {}

    def extra() -> str:
        speed = (
            f"{tokens_seen * world / max(time.monotonic() - t0, 1e-9):,.0f} tok/s"
            if tokens_seen
            else ""
        )
        vals = f"loss0 {shown['loss']:.3f} acc0 {shown['acc']:.2f} " if shown else ""
        return vals + speed

    rep = Reporter(
        "train", total_steps, unit="steps", enabled=cfg.progress and rank == 0, extra=extra
    )
    rep.__enter__()
    rep.skip(state["step"])
    stack = contextlib.ExitStack()
    try:
        for epoch in range(state["epoch"], cfg.epochs):
            batches = epoch_batches(lengths, train_idx, cfg.batch_tokens, cfg.seed, epoch, cfg.pack)
            start = state["batch"] if epoch == state["epoch"] else 0
            groups = [
                batches[bi : bi + cfg.grad_accum]
                for bi in range(start, len(batches), cfg.grad_accum)
            ]
            loaded = prefetch([b for g in groups for b in g], load)
            stack.callback(loaded.close)
            for bi, group in zip(range(start, len(batches), cfg.grad_accum), groups, strict=True):
                for g in opt.param_groups:
                    g["lr"] = lr_at(state["step"])
                opt.zero_grad(set_to_none=True)
                for _ in group:
                    batch = next(loaded)[1]
                    loss, info = micro(batch)
                    (
                        loss * world / len(group)
                    ).backward()  # all_reduce averages: undo it, so grads are sums
                    done(batch)
                    window += info["stats"]
                    tokens_seen += info["tokens"]
                if world > 1:
                    for p in params:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        dist.all_reduce(p.grad)
                        p.grad /= world
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                state = {"step": state["step"] + 1, "epoch": epoch, "batch": bi + len(group)}
                s = summarize(window)
                shown.update(loss=s["loss"][0], acc=s["acc"][0])
                rep.advance()
                if state["step"] % 10 == 0 or state["batch"] >= len(batches):
                    if world > 1:
                        all_reduce_cpu(window)
                    s = summarize(window)
                    _log(out, rank, {"split": "train", **state, "lr": lr_at(state["step"] - 1),
                                     "tokens_per_s": tokens_seen * world / max(time.monotonic() - t0, 1e-9), **s})  # fmt: skip
                    window.zero_()
                if cfg.eval_every and state["step"] % cfg.eval_every == 0 and val_idx:
                    last_val = evaluate()
                    _log(out, rank, {"split": "val", **state, **last_val})
                if rank == 0 and state["step"] % cfg.save_every == 0:
                    save_checkpoint(out, drafter, opt, state, cfg.keep_checkpoints)
                if _should_stop(stop, world):
                    if rank == 0:
                        save_checkpoint(out, drafter, opt, state, cfg.keep_checkpoints)
                    raise TrainStopped(f"stopped by {stop[0] if stop else 'another rank'} at step {state['step']}; "
                                       f"checkpoint saved. Resume with: eyas train --resume --data {run} --out {out}")  # fmt: skip
            state = {"step": state["step"], "epoch": epoch + 1, "batch": 0}
            if val_idx:
                last_val = evaluate()
                _log(out, rank, {"split": "val", **state, **last_val})
                if rank == 0 and cfg.progress:
                    _print_summary(epoch, last_val)
        loop_seconds = time.monotonic() - t0  # the training itself, without the final saves
        if rank == 0:
            save_checkpoint(out, drafter, opt, state, cfg.keep_checkpoints)
            save_final(out, drafter)
            plot_metrics(out)
    finally:
        stack.close()  # prefetch threads stopped and joined
        reader.close()
        rep.__exit__(None, None, None)
        for sig, h in handlers.items():
            signal.signal(sig, h)
    elapsed = time.monotonic() - t0
    return {"val": last_val, "steps": state["step"], "tokens_per_s": tokens_seen * world / max(loop_seconds, 1e-9),
            "seconds": elapsed}  # fmt: skip


def all_reduce_cpu(t: torch.Tensor) -> None:
    """Sum a small CPU tensor over ranks in place (NCCL only reduces GPU tensors)."""
    if dist.get_backend() == "nccl":
        x = t.to(f"cuda:{torch.cuda.current_device()}")
        dist.all_reduce(x)
        t.copy_(x.cpu())
    else:
        dist.all_reduce(t)


def _should_stop(stop: list, world: int) -> bool:
    if world == 1:
        return bool(stop)
    flag = torch.tensor([1.0 if stop else 0.0])
    all_reduce_cpu(flag)
    return bool(flag.item())


def _log(out: Path, rank: int, rec: dict) -> None:
    if rank != 0:
        return
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics logged after the checkpoint we resume from (they are recomputed), and
    a line torn by a kill or a full disk."""
    if not path.exists():
        return
    keep = []
    for line in path.read_bytes().splitlines():
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            keep.append(line.decode())
    atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())


def _skipped_indices(path: Path) -> set[int]:
    """Samples `skipped_samples.jsonl` already lists (a resume lists each once)."""
    out = set()
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                out.add(int(json.loads(line)["index"]))
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                continue
    return out


def _print_summary(epoch: int, s: dict) -> None:
    accs = " ".join(f"{a:.2f}" for a in s["acc"])
    console.print(f"epoch {epoch + 1}: val loss0 {s['loss'][0]:.3f}, acc/step [{accs}], "
                  f"est. acceptance length (k={len(s['acc'])}) {s['accept_len'][-1]:.2f}", markup=False, highlight=False)  # fmt: skip


def plot_metrics(out: Path) -> list[Path]:
    """loss.png and accuracy.png: per TTT step, train (thin) and validation (markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    paths = []
    for key, title in (("loss", "loss"), ("acc", "accuracy")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for split, style in (("train", "-"), ("val", "o--")):
            rs = [r for r in recs if r["split"] == split]
            if not rs:
                continue
            for i in range(len(rs[0][key])):
                ax.plot([r["step"] for r in rs], [r[key][i] for r in rs], style, label=f"{split} step {i}", color=f"C{i}",
                        alpha=0.5 if split == "train" else 1.0, markersize=3)  # fmt: skip
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(title)
        ax.set_title(f"drafter {title} per TTT step")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        p = out / f"{title}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths

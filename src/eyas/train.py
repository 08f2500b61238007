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

import json
import math
import os
import re
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from .drafter import Drafter, DrafterConfig
from .fsutil import atomic_write_json, fsync_dir, read_json
from .store import committed_indices, open_sample, read_run_meta
from .target import plan_batches
from .ui import Reporter, console
from .weights import embed_weight, lm_head_weight


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
    warmup_steps: int = 50
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
    verify_data: bool = False
    """Check every sample's checksums on first read."""
    intermediate_size: int | None = None
    """Override the drafter MLP width (default: the target's)."""
    progress: bool = True

    def __post_init__(self) -> None:
        if self.ttt_steps < 1 or self.epochs < 1 or self.grad_accum < 1:
            raise ValueError("--ttt-steps, --epochs and --grad-accum must be at least 1")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must lie in [0, 1), got {self.val_fraction}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")


_RESUMABLE = {"progress", "device", "verify_data", "eval_every", "save_every", "keep_checkpoints"}


class TrainStopped(Exception):
    pass


# ---------------------------------------------------------------------------- data


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
    dense = {i: lengths[i] for i in indices}
    batches = plan_batches(dense, sorted(indices), batch_tokens)
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def collate(run: Path, idx: list[int], verify: bool, checked: set[int]) -> dict[str, torch.Tensor]:
    from .store import load_sample

    samples = []
    for i in idx:
        if verify and i not in checked:
            load_sample(run, i, verify=True)  # raises StoreError naming the file
            checked.add(i)
        samples.append(open_sample(run, i))
    T = max(s["input_ids"].shape[0] for s in samples)
    B, H = len(samples), samples[0]["last_hidden_states"].shape[1]
    batch = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "valid": torch.zeros(B, T, dtype=torch.bool),
        "aux": torch.zeros(B, T, 3 * H),
        "last": torch.zeros(B, T, H),
    }
    for r, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        batch["input_ids"][r, :n] = s["input_ids"].long()
        batch["loss_mask"][r, :n] = s["loss_mask"].bool()
        batch["valid"][r, :n] = True
        batch["aux"][r, :n] = s["aux_hidden_states"].float()
        batch["last"][r, :n] = s["last_hidden_states"].float()
    return batch


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


def add_targets(batch: dict, drafter: Drafter, lm_head: torch.Tensor) -> None:
    """Add the target's draft-vocab logits, full-vocab argmax and in-draft-vocab flag."""
    batch["tgt_logits"], batch["tgt_top"] = target_view(batch["last"], lm_head, drafter.draft_ids)
    batch["in_vocab"] = drafter.t2d[batch["tgt_top"]]  # (B, T)


def loss_masks(batch: dict, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: (scored, loss mask). Scored: the predicted token x_{t+2+i} is trainable;
    the loss additionally needs the target's argmax at t+1+i in the draft vocabulary."""
    m = batch["valid"] & batch["loss_mask"]
    out = []
    for i in range(steps):
        scored = shift(m, 2 + i, False)
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
    outs = drafter.forward_ttt(batch["input_ids"], batch["aux"], steps)
    total = torch.zeros((), device=batch["aux"].device)
    all_right = torch.ones_like(batch["valid"])
    stats = []
    for i, ((logits, _), (scored, lmask)) in enumerate(
        zip(outs, loss_masks(batch, steps), strict=True)
    ):
        p = torch.softmax(shift(batch["tgt_logits"], 1 + i).float(), -1)  # (B, T, D)
        ce = -(p * F.log_softmax(logits.float(), -1)).sum(-1)  # (B, T)
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


# ---------------------------------------------------------------------------- checkpoints


def _ckpt_dirs(out: Path) -> list[Path]:
    d = out / "checkpoints"
    if not d.is_dir():
        return []
    # A step-N.tmp directory holds its marker for a moment before its rename: skip it.
    return sorted(
        p for p in d.iterdir() if re.fullmatch(r"step-\d{8}", p.name) and (p / "COMPLETE").is_file()
    )


def save_checkpoint(
    out: Path, drafter: Drafter, opt: torch.optim.Optimizer, state: dict, keep: int
) -> Path:
    final = out / "checkpoints" / f"step-{state['step']:08d}"
    if (final / "COMPLETE").is_file():
        return final
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in drafter.state_dict().items()},
        str(tmp / "drafter.safetensors"),
    )
    opt_tensors = {}
    for pi, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            opt_tensors[f"{pi}.{name}"] = torch.as_tensor(v).contiguous()
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    atomic_write_json(tmp / "state.json", state)
    atomic_write_json(tmp / "COMPLETE", {"step": state["step"]})  # the marker: written last
    os.replace(tmp, final)
    fsync_dir(final.parent)
    for old in _ckpt_dirs(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(ckpt: Path, drafter: Drafter, opt: torch.optim.Optimizer | None) -> dict:
    drafter.load_state_dict(load_file(str(ckpt / "drafter.safetensors")))
    if opt is not None:
        flat = load_file(str(ckpt / "optimizer.safetensors"))
        state: dict[int, dict] = {}
        for key, v in flat.items():
            pi, name = key.split(".", 1)
            state.setdefault(int(pi), {})[name] = v
        sd = opt.state_dict()
        sd["state"] = state
        opt.load_state_dict(sd)
    return read_json(ckpt / "state.json")


def latest_checkpoint(out: Path) -> Path | None:
    dirs = _ckpt_dirs(Path(out))
    return dirs[-1] if dirs else None


# ---------------------------------------------------------------------------- the run


def _dist() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():  # one GPU per rank; "cuda" then means this rank's
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def build_drafter(cfg: TrainConfig, meta: dict) -> tuple[Drafter, torch.Tensor]:
    """Drafter sized from the target, with the target's frozen embeddings; returns the target lm_head too."""
    from transformers import AutoConfig

    from .prepare import PreparedDataset

    model_dir = cfg.model or meta["model_path"]
    tcfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    ds = PreparedDataset.open(meta["dataset_path"], check=False)
    draft_ids = ds.draft_vocab(cfg.draft_vocab_size)
    over = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}
    dcfg = DrafterConfig.from_target(tcfg, len(draft_ids), **over)
    torch.manual_seed(cfg.seed)
    drafter = Drafter(dcfg)
    drafter.embed_tokens.weight.data.copy_(embed_weight(model_dir).float())
    drafter.set_draft_vocab(draft_ids)
    return drafter, lm_head_weight(model_dir).float()


def train(cfg: TrainConfig, *, resume: bool = False) -> dict:
    """Train (or resume) a drafter; returns the last validation summary."""
    rank, world = _dist()
    out, run = Path(cfg.out), Path(cfg.data)
    meta = read_run_meta(run)
    ident = {"run": str(run.resolve()), "dataset_fingerprint": meta["dataset_fingerprint"],
             "model_fingerprint": meta["model_fingerprint"]}  # fmt: skip
    saved = out / "train.json"
    ckpt = latest_checkpoint(out) if resume else None
    if saved.exists():
        prev = read_json(saved)
        if prev["data"] != ident:
            raise ValueError(
                f"{saved}: this training directory was made from other data ({prev['data']['run']})"
            )
        mine = {k: v for k, v in asdict(cfg).items() if k not in _RESUMABLE}
        theirs = {k: v for k, v in prev["config"].items() if k not in _RESUMABLE}
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
        atomic_write_json(saved, {"config": asdict(cfg), "data": ident, "aux_layers": meta["aux_layers"],
                                  "aux_layers_hf": meta["aux_layers_hf"], "model_path": cfg.model or meta["model_path"],
                                  "world": world})  # fmt: skip

    device = torch.device(
        "cuda"
        if cfg.device == "auto" and torch.cuda.is_available()
        else ("cpu" if cfg.device == "auto" else cfg.device)
    )
    drafter, lm_head = build_drafter(cfg, meta)
    drafter.to(device)
    lm_head = lm_head.to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    indices = committed_indices(run)
    if not indices:
        raise ValueError(f"{run}: no committed samples to train on")
    from .store import read_all_journals

    lengths = {e["index"]: e["tokens"] for es in read_all_journals(run).values() for e in es}
    train_idx, val_idx = split_samples(indices, cfg.val_fraction)
    per_epoch = len(epoch_batches(lengths, train_idx, cfg.batch_tokens, cfg.seed, 0))
    total_steps = max(1, cfg.epochs * per_epoch // cfg.grad_accum)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.lr * (
            cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        )

    state = {"step": 0, "epoch": 0, "batch": 0}
    if ckpt is not None:
        state = load_checkpoint(ckpt, drafter, opt)
        if rank == 0:
            console.print(
                f"resuming from {ckpt} (epoch {state['epoch']}, batch {state['batch']})",
                markup=False,
                highlight=False,
            )
    if rank == 0:  # metrics logged after the state we start from are recomputed
        _truncate_metrics(out / "metrics.jsonl", state["step"])

    stop: list[str] = []
    handlers = {}
    if rank == 0 or world > 1:
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, lambda s, _f: stop.append(signal.Signals(s).name))
    checked: set[int] = set()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")
    steps, decay = cfg.ttt_steps, cfg.step_decay
    last_val: dict = {}

    def micro(idx_all: list[int]) -> tuple[torch.Tensor, dict]:
        mine_idx = idx_all[rank::world]
        batch = collate(run, mine_idx or idx_all[:1], cfg.verify_data, checked)
        batch = {k: v.to(device) for k, v in batch.items()}
        add_targets(batch, drafter, lm_head)
        if not mine_idx:  # this rank has no share: contribute zero loss and zero counts
            batch["valid"].zero_()
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
            for b in plan_batches(lengths, val_idx, cfg.batch_tokens):
                _, info = micro(b)
                acc += info["stats"]
        if world > 1:
            all_reduce_cpu(acc)
        drafter.train()
        return summarize(acc)

    t0, tokens_seen = time.monotonic(), 0
    window = torch.zeros(steps, 6, dtype=torch.float64)
    shown = {"loss": float("nan"), "acc": float("nan")}
    rep = Reporter("train", total_steps, unit="steps", enabled=cfg.progress and rank == 0, extra=lambda: (
        f"loss0 {shown['loss']:.3f} acc0 {shown['acc']:.2f} {tokens_seen * world / max(time.monotonic() - t0, 1e-9):,.0f} tok/s"))  # fmt: skip
    rep.__enter__()
    rep.skip(state["step"])
    try:
        for epoch in range(state["epoch"], cfg.epochs):
            batches = epoch_batches(lengths, train_idx, cfg.batch_tokens, cfg.seed, epoch)
            start = state["batch"] if epoch == state["epoch"] else 0
            for bi in range(start, len(batches), cfg.grad_accum):
                for g in opt.param_groups:
                    g["lr"] = lr_at(state["step"])
                opt.zero_grad(set_to_none=True)
                group = batches[bi : bi + cfg.grad_accum]
                for b in group:
                    loss, info = micro(b)
                    (
                        loss * world / len(group)
                    ).backward()  # all_reduce averages: undo it, so grads are sums
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
                rep.advance()
                if state["step"] % 10 == 0 or state["batch"] >= len(batches):
                    if world > 1:
                        all_reduce_cpu(window)
                    s = summarize(window)
                    shown.update(loss=s["loss"][0], acc=s["acc"][0])
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
        if rank == 0:
            save_checkpoint(out, drafter, opt, state, cfg.keep_checkpoints)
            save_file(
                {k: v.contiguous() for k, v in drafter.state_dict().items()},
                str(out / "drafter.safetensors"),
            )
            atomic_write_json(out / "drafter_config.json", drafter.config.to_dict())
            plot_metrics(out)
    finally:
        rep.__exit__(None, None, None)
        for sig, h in handlers.items():
            signal.signal(sig, h)
    elapsed = time.monotonic() - t0
    return {
        "val": last_val,
        "steps": state["step"],
        "tokens_per_s": tokens_seen * world / max(elapsed, 1e-9),
        "seconds": elapsed,
    }


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
    """Drop metrics logged after the checkpoint we resume from: they are recomputed."""
    if not path.exists():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(line + "\n" for line in keep))


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

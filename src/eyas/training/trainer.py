"""The model side of training: the drafter built from the target, its optimizer and
learning-rate schedule, one optimizer step over a group of micro-batches, evaluation, and
checkpoints.

Data parallel under torchrun: each rank loads its share of every global micro-batch; the
loss is normalised by global token counts and the gradients are summed over ranks, so an
update equals a single-process step on the same global batch. Which samples make the
batches is a data source's business (`train_data.StoreSource`, `follow.FollowSource`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from eyas.drafters import kind
from eyas.drafters.loss import TargetHead, summarize
from eyas.errors import UsageError
from eyas.stop import StopSignals
from eyas.training.checkpoint import initial_weights, resume_checkpoint, save_checkpoint
from eyas.training.muon import Muon
from eyas.training.train_data import SampleReader, prefetch, to_device


def build_drafter(cfg, meta: dict) -> tuple[torch.nn.Module, torch.Tensor | None]:
    """The drafter of `cfg`'s kind for the run's target (checked to be the run's, with the
    tokenizer its data was made with), and the target's lm_head where its loss needs it."""
    from eyas.data.dataset import PreparedDataset, check_tokenizer
    from eyas.targets.target import require_target

    model_dir = cfg.model or meta["model_path"]
    require_target(model_dir, meta, f"run {cfg.data}", "pass the right --model")
    ds = PreparedDataset.open(meta["dataset_path"], check=False)
    check_tokenizer(
        meta["dataset_path"],
        ds.meta,
        model_dir,
        trust_remote_code=bool(meta.get("trust_remote_code_required")),
    )
    draft_ids = ds.draft_vocab(draft_vocab_for(cfg.draft_vocab_size, meta))
    return kind(cfg.kind).build(cfg, meta, model_dir, draft_ids)


def draft_vocab_for(requested: int | None, meta: dict) -> int | None:
    """D: the run's when it stores top-K over its draft vocabulary, else as requested."""
    fixed = meta.get("draft_vocab_size")
    if fixed and requested and requested != fixed:
        raise UsageError(
            f"the run stores the target's top-K over a draft vocabulary of {fixed}; "
            f"--draft-vocab-size {requested} cannot differ"
        )
    return fixed or requested


def noisy(
    aux: torch.Tensor, scale: float, gen: torch.Generator | None = None, layers: int = 3
) -> torch.Tensor:
    """aux (B, T, L*H) plus Gaussian noise whose std is `scale` times the RMS of each of its
    `layers` states at each token: a regulariser against learning a small set by heart (at
    1,000 real conversations it changed nothing measurable; bench/RESULTS.md)."""
    B, T, H3 = aux.shape
    if aux.device.type == "cpu":
        # In numpy, serially: in torch with two CPU threads, the same batch and seed gave
        # other noisy states now and then (2 or 3 of 8 trainings parted in the last bits,
        # only with --feature-noise; bench/reproducible.py), and a resume must redo exactly
        # what an unbroken training did.
        a = aux.detach().float().numpy().reshape(B, T, layers, H3 // layers)
        seed = gen.initial_seed() if gen is not None else int(torch.randint(0, 2**62, (1,)))
        noise = np.random.default_rng(seed).standard_normal(a.shape, dtype=np.float32)
        rms = np.sqrt(np.mean(a * a, axis=-1, keepdims=True, dtype=np.float32))
        out = a + noise * rms * np.float32(scale)
        return torch.from_numpy(out.reshape(B, T, H3)).to(aux.dtype)
    parts = aux.view(B, T, layers, H3 // layers)
    rms = parts.pow(2).mean(-1, keepdim=True).sqrt()  # (B, T, L, 1)
    noise = torch.randn(parts.shape, generator=gen, device=aux.device, dtype=aux.dtype)
    return (parts + noise * rms * scale).view(B, T, H3)


def warmup_for(asked: int | None, total_steps: int) -> int:
    """Warmup steps: as asked, else a tenth of the run's optimizer steps, at most 50."""
    return asked if asked is not None else min(50, max(1, total_steps // 10))


def lr_at(step: int, lr: float, floor: float, warmup: int, total_steps: int) -> float:
    """Linear warmup, then cosine down to lr * floor at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


class Trainer:
    """The model side of training: the drafter and its optimizer, the learning-rate
    schedule, one optimizer step over a group of micro-batches, evaluation and checkpoints.
    Which samples make the batches is the data source's business (`StoreSource`,
    `FollowSource`); the trainer only loads the batches it is given."""

    def __init__(
        self,
        cfg,
        meta: dict,
        rank: int,
        world: int,
        device: torch.device,
        out: Path,
        reader: SampleReader,
    ):
        self.cfg, self.rank, self.world, self.device, self.out = cfg, rank, world, device, out
        self.reader = reader
        self.kind = kind(cfg.kind)
        self.positions = self.kind.positions(cfg)
        self.layers = len(meta["aux_layers"])  # target layers side by side in each sample's aux
        self.drafter, lm_head = build_drafter(cfg, meta)
        if cfg.init_from:
            initial_weights(Path(cfg.init_from), self.drafter, self.kind)
        self.drafter.to(device)
        # the target's head, its argmax kept per sample after the first epoch
        self.lm_head = (
            TargetHead(lm_head.to(device), self.drafter.draft_ids) if lm_head is not None else None
        )
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.drafter, cfg)
        self.autocast = torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"
        )
        self.total_steps = self.warmup = 1

    def schedule(self, total_steps: int) -> None:
        self.total_steps = max(1, total_steps)
        self.warmup = warmup_for(self.cfg.warmup_steps, self.total_steps)

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.cfg.lr, self.cfg.min_lr_ratio, self.warmup, self.total_steps)

    def load(self, idx_all: list[int]) -> dict:
        """This rank's share of a global micro-batch, on the device (the prefetch thread)."""
        mine_idx = idx_all[self.rank :: self.world]
        # end to end in one row, whichever plan made the batch: no padding is computed
        host = self.reader.batch(mine_idx or idx_all[:1], packed=True)
        batch = to_device(host, self.device)
        batch["_spans"] = self._spans(mine_idx, host)
        if self.device.type == "cuda":
            batch["_copied"] = torch.cuda.Event()
            batch["_copied"].record()
        batch["_host"] = host  # its buffers go back to the reader after the step (`_done`)
        if not mine_idx:  # this rank has no share: contribute zero loss and zero counts
            batch["valid"] = torch.zeros_like(batch["valid"])
        return batch

    def _spans(self, idx: list[int], host: dict) -> list[tuple[int, int, int, int]]:
        """Where each valid sample of the (packed) batch lies: (sample, row, start, tokens)."""
        out, at = [], 0
        for i in idx:
            n = self.reader.entries[i]["tokens"]
            if host["valid"][0, at]:
                out.append((i, 0, at, n))
            at += n
        return out

    def _done(self, batch: dict) -> None:
        self.reader.release(batch.pop("_host"), batch.pop("_copied", None))

    def _micro(
        self, batch: dict, noise_key: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Loss (normalised by the global token counts per step), stats and tokens. In
        training (`noise_key` given), every position is scored under `--loss-positions all`,
        and the fused states get `--feature-noise` (after the targets, which come from the
        clean final state), drawn from a generator seeded by the key: a resumed training
        draws the same noise as an unbroken one."""
        batch["_key"] = noise_key  # in training, what varies from step to step derives from it
        if noise_key is not None and self.cfg.loss_positions == "all":
            batch["loss_mask"] = batch["valid"].clone()
        self.kind.prepare_batch(self.drafter, batch, self.lm_head, self.cfg)
        if noise_key is not None and self.cfg.feature_noise > 0:
            gen = torch.Generator(device=batch["aux"].device)
            gen.manual_seed(noise_key)
            batch["aux"] = noisy(batch["aux"], self.cfg.feature_noise, gen, self.layers)
        counts = torch.tensor(self.kind.counts(batch, self.cfg), dtype=torch.float64)
        if self.world > 1:
            all_reduce_cpu(counts)
        with self.autocast:
            loss, st = self.kind.loss(self.drafter, batch, self.cfg, counts.tolist())
        return loss, st, int(batch["valid"].sum())

    def step(
        self, loaded, n: int, lr: float, stops: StopSignals | None = None
    ) -> tuple[torch.Tensor, int]:
        """One optimizer step over the next `n` loaded micro-batches; (stats, tokens). With
        one process, a stop (`stops`) before the optimizer moves abandons the step at once
        (StepAbandoned): the model and optimizer stay as the last complete step left them.
        With several, every rank finishes the step and they stop together after it."""
        for g in self.opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        self.opt.zero_grad(set_to_none=True)
        stats, tokens = torch.zeros(self.positions, 6, dtype=torch.float64), 0
        done = self._steps_done()  # restored with the optimizer on a resume
        abandon = stops.abandoning(StepAbandoned) if stops and self.world == 1 else nullcontext()
        try:
            with abandon:
                for micro in range(n):
                    batch = next(loaded)[1]
                    key = hash((self.cfg.seed, done, micro, self.rank)) & (
                        2**63 - 1
                    )  # ints: stable
                    loss, st, tok = self._micro(batch, noise_key=key)
                    (
                        loss * self.world / n
                    ).backward()  # all_reduce averages: undo it: grads are sums
                    self._done(batch)
                    stats += st
                    tokens += tok
        except StepAbandoned:
            self.opt.zero_grad(set_to_none=True)
            raise
        if self.world > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= self.world
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        return stats, tokens

    def _steps_done(self) -> int:
        """Optimizer steps taken so far, as AdamW counts them (0 before the first)."""
        for p in self.params:
            if "step" in (state := self.opt.state.get(p, {})):
                return int(state["step"])
        return 0

    def evaluate(self, batches: list[list[int]]) -> dict:
        """Validation summary over `batches` (every rank takes its share of each)."""
        self.drafter.eval()
        acc = torch.zeros(self.positions, 6, dtype=torch.float64)
        with torch.no_grad(), prefetch(batches, self.load) as loaded:
            for _, batch in loaded:
                acc += self._micro(batch)[1]
                self._done(batch)
        if self.world > 1:
            all_reduce_cpu(acc)
        self.drafter.train()
        return summarize(acc)

    def save(self, state: dict) -> None:
        if self.rank == 0:
            save_checkpoint(self.out, self.drafter, self.opt, state, self.cfg.keep_checkpoints)

    def resume(self, log) -> dict | None:
        found = resume_checkpoint(self.out, self.drafter, self.opt, log)
        if found is None:
            return None
        state, ckpt = found
        log(f"resuming from {ckpt} (epoch {state['epoch']}, batch {state['batch']})")
        return state


def build_optimizer(drafter: torch.nn.Module, cfg) -> torch.optim.Optimizer | Optimizers:
    """AdamW over every trainable parameter, or with `--optimizer muon` Muon over the 2-D
    matrices of `fc` and the decoder layer (momentum 0.95, weight decay 0.1, its update
    scaled to the RMS of AdamW's so one learning rate serves both; `--muon-lr-scale` times
    it) and AdamW over the rest: norms, the head and any embedding table, whose rows are
    per-token vectors, not a map Muon should orthogonalise."""
    adamw = dict(lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in named], **adamw)
    # A linear map's weight; not a table of per-token rows (an embedding, the head).
    maps = {
        id(m.weight)
        for n, m in drafter.named_modules()
        if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")
    }
    matrices = [p for _, p in named if id(p) in maps and min(p.shape) > 1]
    rest = [p for n, p in named if not any(p is q for q in matrices)]
    muon = Muon(
        [{"params": matrices, "lr_scale": cfg.muon_lr_scale}],
        lr=cfg.lr * cfg.muon_lr_scale,
        momentum=0.95,
        weight_decay=0.1,
    )
    return Optimizers([muon, torch.optim.AdamW(rest, **adamw)] if rest else [muon])


class Optimizers:
    """Several optimizers over disjoint parameters, stepped as one. Its state dict numbers
    the parameters across all of them in order, as a single optimizer's does, so a
    checkpoint stores and restores it the same way."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.parts for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.parts for p, s in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.parts:
            o.step()

    def _sizes(self) -> list[int]:
        return [sum(len(g["params"]) for g in o.param_groups) for o in self.parts]

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for o, n in zip(self.parts, self._sizes(), strict=True):
            sd = o.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [
                {**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]
            ]
            offset += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        offset = 0
        for o, n in zip(self.parts, self._sizes(), strict=True):
            own = o.state_dict()
            own["state"] = {
                i - offset: s for i, s in sd["state"].items() if offset <= i < offset + n
            }
            o.load_state_dict(own)
            offset += n


class StepAbandoned(Exception):
    """A stop came in the middle of an optimizer step; nothing of it was applied."""


def all_reduce_cpu(t: torch.Tensor) -> None:
    """Sum a small CPU tensor over ranks in place (NCCL only reduces GPU tensors)."""
    if dist.get_backend() == "nccl":
        x = t.to(f"cuda:{torch.cuda.current_device()}")
        dist.all_reduce(x)
        t.copy_(x.cpu())
    else:
        dist.all_reduce(t)

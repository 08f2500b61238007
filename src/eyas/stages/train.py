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
- `--follow` trains on a run while it is extracted (`follow`): every sample once per pass,
  across kills of either side; which samples were consumed is part of every checkpoint.

The parts: a data source says which samples make each optimizer step (`StoreSource` for a
finished run, `FollowSource` for a followed one); the `Trainer` owns the drafter, the
optimizer and the schedule, and does a step, an evaluation or a checkpoint when told;
`_loop` ties them together with metrics and signals. The loss lives in `loss`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

from eyas.drafters import kind, options_class
from eyas.drafters.loss import add_targets, loss_masks, summarize, target_view, ttt_loss
from eyas.errors import EyasError, ProblemError, Stopped, UsageError
from eyas.host.cpu import choose_threads, configure_threads
from eyas.host.ui import Reporter, console, still_working
from eyas.run.fsutil import (
    DiskFullError,
    atomic_write_bytes,
    atomic_write_json,
    human_duration,
    is_disk_full,
    read_json,
)
from eyas.run.lock import WriterLock
from eyas.run.runmeta import is_run, read_run_meta
from eyas.stop import StopSignals
from eyas.training.checkpoint import latest_checkpoint, remove_stale_temp, save_final
from eyas.training.config import SHARED_RULE, TrainConfig, resume_rule, saved_flat
from eyas.training.train_data import (
    SampleReader,
    StopRequested,
    StoreSource,
    prefetch,
    split_samples,
    usable_samples,
)
from eyas.training.trainer import (
    StepAbandoned,
    Trainer,
    all_reduce_cpu,
    build_drafter,
    draft_vocab_for,
)

# The shared fields' resume rule (each kind's options add theirs: training.config.resume_rule).
RESUME_RULE = SHARED_RULE


class TrainStopped(Stopped):
    """Training stopped by a signal at a checkpoint; `train --resume` continues it."""


__all__ = [
    "TrainConfig",
    "TrainStopped",
    "train",
    "add_targets",
    "ttt_loss",
    "loss_masks",
    "summarize",
    "target_view",
    "build_drafter",
    "draft_vocab_for",
]


# ---------------------------------------------------------------------------- the run


def _dist() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():  # one GPU per rank; "cuda" then means this rank's
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _identity(meta: dict) -> dict:
    return {
        "dataset_fingerprint": meta["dataset_fingerprint"],
        "model_fingerprint": meta["model_fingerprint"],
    }


# The schedule's anchors. Small: on the real target (SmolLM2-135M, 100 to 2,000 of its own
# answers) and the demo, 2,048-token batches at lr 3e-3 learn, where 8,192 at 1e-4 give a
# few hundred conversations a handful of steps and learn nothing; 1,000 conversations over
# 6 epochs are ~850 such steps. A run that would make fewer than ANCHOR_STEPS of them
# learns more from twice as many steps of half the size (docs/recipe.md). Large: published
# drafters trained on hundreds of thousands of samples use 5e-5 to 1e-4. lr falls as
# 1/sqrt(steps) between them, which meets both.
SHORT_BATCH, SMALL_BATCH, LARGE_BATCH, LARGE_FROM_STEPS = 1024, 2048, 8192, 2000
ANCHOR_LR, ANCHOR_STEPS, MIN_AUTO_LR = 3e-3, 800, 5e-5


def lr_for_steps(steps: float) -> float:
    """The peak learning rate for a run of `steps` optimizer steps: ANCHOR_LR up to
    ANCHOR_STEPS, then falling as 1/sqrt(steps), never under MIN_AUTO_LR."""
    lr = min(ANCHOR_LR, max(MIN_AUTO_LR, ANCHOR_LR * math.sqrt(ANCHOR_STEPS / max(steps, 1.0))))
    return float(f"{lr:.2g}")


def auto_schedule(
    tokens: int, epochs: int, grad_accum: int = 1, batch: int | None = None
) -> tuple[int, float]:
    """(batch tokens, peak lr) for a run of `tokens` tokens trained `epochs` times: small
    batches until large ones would still make LARGE_FROM_STEPS optimizer steps, halved where
    small ones would make fewer than ANCHOR_STEPS, and the learning rate for the steps the
    batch makes (padding ignored). A given `batch` is kept."""
    seen = max(1, tokens) * max(1, epochs)
    if batch is None:
        if seen / (LARGE_BATCH * grad_accum) >= LARGE_FROM_STEPS:
            batch = LARGE_BATCH
        elif seen / (SMALL_BATCH * grad_accum) < ANCHOR_STEPS:
            batch = SHORT_BATCH
        else:
            batch = SMALL_BATCH
    return batch, lr_for_steps(seen / (batch * grad_accum))


def _resolve_schedule(cfg: TrainConfig, meta: dict, rank: int) -> TrainConfig:
    """Fill a left-out --batch-tokens or --lr from the run's size, and say what was chosen."""
    if cfg.batch_tokens is not None and cfg.lr is not None:
        return cfg
    tokens = int(meta.get("tokens") or 0) * int((meta.get("config") or {}).get("passes") or 1)
    batch, lr = auto_schedule(tokens, cfg.epochs, cfg.grad_accum, cfg.batch_tokens)
    chosen = {k: v for k, v in (("batch_tokens", batch), ("lr", lr)) if getattr(cfg, k) is None}
    if rank == 0 and cfg.progress:
        said = ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in chosen.items())
        console.print(
            f"{said}: chosen for {tokens:,} tokens x {cfg.epochs} epoch(s); pass them to choose",
            markup=False,
            highlight=False,
        )
    return replace(cfg, **chosen)


@dataclass(frozen=True)
class TrainSummary:
    """What a training did: its steps (in all, and in this invocation), its rate, the last
    validation summary (None without one), the seconds it ran and waited for samples."""

    out: str
    resumed: bool
    val: dict | None
    steps: int
    steps_now: int
    tokens_per_s: float
    seconds: float
    waited_s: float = 0.0

    def render(self) -> str:
        """One line: steps, speed, the last validation, where the drafter is."""
        out = self.out
        if self.resumed and self.steps_now == 0:
            return (
                f"already trained: {self.steps} steps, nothing left to do; the drafter is in "
                f"{out} (eyas export {out} --format vllm --out DRAFTER_DIR)"
            )
        v = self.val
        tail = (
            f"; val acc/step {[round(a, 3) for a in v['acc']]}, est. acceptance "
            f"{v['accept_len'][-1]:.2f}"
            if v
            else ""
        )
        waited = f"; waited {human_duration(self.waited_s)} for samples" if self.waited_s else ""
        skipped = len(_skipped_indices(Path(out) / "skipped_samples.jsonl"))
        left_out = (
            f"; {skipped} damaged sample(s) left out, never trained on "
            f"({Path(out) / 'skipped_samples.jsonl'}; `eyas verify --repair` of the run, then "
            "`eyas extract --resume`, brings them back)"
            if skipped
            else ""
        )
        return (
            f"trained {self.steps} steps at {self.tokens_per_s:.0f} tokens/s{tail} -> {out}"
            f"{waited}{left_out}"
        )


def train(cfg: TrainConfig, *, resume: bool = False) -> TrainSummary:
    """Train (or resume) a drafter. Rank 0 holds the training directory's writer lock
    throughout: one training per directory. Under torchrun the ranks leave together and the
    process group is closed once training is done."""
    res = _train_rank(cfg, resume)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return TrainSummary(out=cfg.out, resumed=resume, **res)


def resume_options(out: str | Path, opts: dict, given: dict) -> dict:
    """The options a `train --resume` runs with: those its training was started with (its
    train.json, read by the resume rule), replaced only where this invocation `given`
    another. A change the training cannot take is refused when the config is checked,
    naming both values."""
    saved = Path(out) / "train.json"
    if not saved.is_file():
        return opts
    try:
        prev = saved_flat(read_json(saved)["config"])
    except (OSError, ValueError, KeyError) as exc:
        raise EyasError(f"{saved}: unreadable ({exc}); give every option again") from None
    own = {f.name for f in fields(options_class(prev.get("kind")))}  # the kind's options
    kept = {k: prev[k] for k in own if k in prev and k not in given}
    return {**kept, **{k: prev[k] if k in prev and k not in given else v for k, v in opts.items()}}


def _train_rank(cfg: TrainConfig, resume: bool) -> dict:
    if why := kind(cfg.kind).unservable(cfg):  # before hours of training, not at the export
        raise UsageError(why)
    rank, world = _dist()
    out, run = Path(cfg.out), Path(cfg.data)
    if cfg.follow:
        _wait_for_run(run)
    meta = read_run_meta(run)
    auto = cfg.batch_tokens is None and cfg.lr is None  # the few-steps advice differs
    done = None if cfg.follow else _check_complete(run, meta, cfg.allow_partial)
    cfg = _resolve_schedule(cfg, meta, rank)  # said once the run is known to be trainable
    if rank != 0:
        return _train(cfg, resume, rank, world, run, out, meta, done, auto)
    new_dir, fresh = not out.exists(), not (out / "train.json").exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = WriterLock(out, 0, 1, what="train").acquire()
    try:
        lock.set_phase("training")
        for p in remove_stale_temp(out):
            console.print(
                f"removed {p}, left by a killed checkpoint save", markup=False, highlight=False
            )
        return _train(cfg, resume, rank, world, run, out, meta, done, auto)
    except OSError as exc:
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            raise DiskFullError(exc.errno, f"no space left writing to {out} ({exc})") from exc
        raise
    except ValueError:
        # A start refused before its first checkpoint leaves nothing that would block the
        # corrected command (train.json would make it "config differs").
        if fresh and latest_checkpoint(out) is None:
            (out / "train.json").unlink(missing_ok=True)
            fresh = "refused"
        raise
    finally:
        lock.release()
        if fresh == "refused" and new_dir:
            shutil.rmtree(out, ignore_errors=True)


def _wait_for_run(run: Path) -> None:
    """A follower may start before its extractor has written the run's intent."""
    if is_run(run):
        return
    console.print(
        f"waiting for {run} to be created by `eyas extract` (Ctrl-C stops; if nothing is "
        "extracting there, check the path)",
        markup=False,
        highlight=False,
    )
    while not is_run(run):
        time.sleep(0.5)


def _check_complete(run: Path, meta: dict, allow_partial: bool) -> dict[int, dict]:
    """Refuse a run whose extraction is unfinished unless asked: hours spent on part of
    the data should be a choice, never a surprise."""
    from eyas.run.journal import ledger, read_errors

    led = ledger(run)
    if led.passes_seen() > 1 or any(led.retired):
        raise UsageError(
            f"{run} is streamed (--max-store or --passes): its consumed samples are deleted as "
            f"training goes. Train it while it is extracted: eyas train --follow --data {run} --out DIR"
        )
    done = led.present
    failed = {e["index"] for e in read_errors(run)} - set(done)
    left = meta["samples"] - len([i for i in done if i < meta["samples"]]) - len(failed)
    if left > 0 and not allow_partial:
        raise UsageError(
            f"{run}: extraction is not finished ({meta['samples'] - left}/{meta['samples']} samples "
            f"done or failed, {left} remaining). Finish it first: eyas extract --resume {run} "
            "(or pass --allow-partial to train on what is committed; --follow trains as it is extracted)"
        )
    return done  # the committed samples: training reads the journals once


def _record_config(
    cfg: TrainConfig, resume: bool, rank: int, world: int, run: Path, out: Path, meta: dict
) -> None:
    """Write train.json for a new training directory; check a resumed one's against it."""
    ident = _identity(meta)
    saved = out / "train.json"
    if saved.exists():
        prev = read_json(saved)
        if _identity(prev["data"]) != ident:
            raise UsageError(
                f"{saved}: this training directory was made from other data ({prev['data'].get('run')})"
            )
        if diff := resume_rule(cfg.kind).differences(saved_flat(prev["config"]), cfg.flat()):
            raise UsageError(
                f"{saved}: config differs ({', '.join(diff)}); leave the option out to resume "
                "with the saved value, or use another --out"
            )
        if not resume and latest_checkpoint(out) is not None:
            raise UsageError(
                f"{out} already has checkpoints; pass --resume to continue, or use another --out"
            )
    elif rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            saved,
            {
                "config": cfg.flat(),
                "data": {"run": str(run.resolve()), **ident},
                "rendering": _rendering(meta),
                "aux_layers": meta["aux_layers"],
                "aux_layers_hf": meta["aux_layers_hf"],
                "model_path": str(Path(cfg.model or meta["model_path"]).resolve()),
                "world": world,
                "threads": choose_threads() if not torch.cuda.is_available() else None,
            },
        )


def _rendering(meta: dict) -> dict:
    """How the training data was rendered, for `evaluate` to render its prompts alike: the
    tokenizer (and chat template) fingerprint, the template variables of the dataset, and the
    template itself where `prepare --chat-template` gave one."""
    ds = Path(meta["dataset_path"]) / "dataset.json"
    made = read_json(ds) if ds.is_file() else {}
    kwargs = (meta.get("dataset_prepare") or {}).get("chat_template_kwargs")
    return {
        "tokenizer_fingerprint": made.get("tokenizer_fingerprint"),
        "chat_template_kwargs": kwargs,
        "chat_template": made.get("chat_template"),
        "longest_sample": (made.get("tokens") or {}).get("max"),
    }


def _train(
    cfg: TrainConfig,
    resume: bool,
    rank: int,
    world: int,
    run: Path,
    out: Path,
    meta: dict,
    done: dict[int, dict] | None,
    auto: bool = False,
) -> dict:
    _record_config(cfg, resume, rank, world, run, out, meta)
    saved = out / "train.json"
    device = torch.device(
        "cuda"
        if cfg.device == "auto" and torch.cuda.is_available()
        else ("cpu" if cfg.device == "auto" else cfg.device)
    )
    # Training batches are thousands of tokens: wide enough to use every CPU, unlike decoding.
    threads = configure_threads() if device.type == "cpu" else None
    if rank == 0 and threads and (was := read_json(saved).get("threads")) != threads:
        console.print(
            f"note: {threads} CPU thread(s) now, {was} before: float sums change order, so the "
            "weights will differ from an uninterrupted run in the last bits",
            markup=False,
            highlight=False,
        )
    log = (
        (lambda m: console.print(m, markup=False, highlight=False))
        if rank == 0
        else (lambda m: None)
    )
    listed = _skipped_indices(out / "skipped_samples.jsonl") if rank == 0 else set()

    unreadable: set[int] = set()  # a follower never counts these as consumed

    def skipped(index: int, problem: str, when: str = "while training") -> None:
        unreadable.add(index)
        if when == "while training":
            console.print(
                f"warning: damaged sample left out of training: {problem}",
                markup=False,
                highlight=False,
            )
        if rank != 0 or index in listed:
            return
        listed.add(index)
        with open(out / "skipped_samples.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"index": index, "problem": problem, "found": when}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    if cfg.follow:
        from eyas.training.follow import FollowSource

        reader = SampleReader(run, {}, cfg.verify_data, pin=device.type == "cuda", report=skipped)
        source = FollowSource(cfg, run, out, meta, rank, world, reader, log)
        source.unreadable = unreadable
    else:
        assert done is not None
        entries, rejected = usable_samples(run, meta["hidden_size"], log, done)
        if not entries:
            raise UsageError(f"{run}: no committed samples to train on")
        for index, problem in rejected.items():
            skipped(index, problem, "at start-up (file against its journal entry)")
        reader = SampleReader(
            run, entries, cfg.verify_data, pin=device.type == "cuda", report=skipped
        )
        source = StoreSource(cfg, entries, *split_samples(sorted(entries), cfg.val_fraction))
    try:
        trainer = Trainer(cfg, meta, rank, world, device, out, reader)
        return _loop(cfg, trainer, source, resume, rank, world, run, out, log, auto)
    finally:
        reader.close()


def _loop(
    cfg: TrainConfig,
    trainer: Trainer,
    source,
    resume: bool,
    rank: int,
    world: int,
    run: Path,
    out: Path,
    log,
    auto: bool = False,
) -> dict:
    """Epochs of windows of optimizer steps, from `source`; metrics, evaluation, checkpoints,
    and a clean stop on SIGTERM/SIGINT."""
    trainer.schedule(cfg.epochs * source.steps_per_epoch() // cfg.grad_accum)
    _schedule_warnings(cfg, trainer, source, rank, log, auto)
    return _Loop(cfg, trainer, source, rank, world, out).run(resume, log)


def _schedule_warnings(
    cfg: TrainConfig, trainer: Trainer, source, rank: int, log, auto: bool
) -> None:
    """The schedule, said once; and a warning where it cannot train well."""
    total_steps, warmup = trainer.total_steps, trainer.warmup
    log(
        f"training on {source.describe()}: {total_steps} optimizer steps, warmup {warmup}, "
        f"{trainer.kind.describe(cfg)}"
    )
    if rank != 0 or not cfg.progress:
        return
    if warmup >= total_steps:
        log(
            f"warning: --warmup-steps {warmup} >= the run's {total_steps} optimizer steps: the learning "
            "rate never reaches --lr; train longer (--epochs) or lower --warmup-steps"
        )
    if total_steps < 20:
        how = (
            "add epochs (--epochs) or data: --lr and --batch-tokens were already chosen for this run's size"
            if auto
            else "lower --batch-tokens (more steps per epoch; 2048 suits a few hundred conversations) with "
            "--lr 3e-3 (or leave both out: train picks them from the run's size), or add epochs or data"
        )
        log(
            f"warning: only {total_steps} optimizer steps ({source.describe()}, --batch-tokens "
            f"{cfg.batch_tokens}): the drafter will learn little; {how}"
        )


class _Loop:
    """One training run's loop in named steps: `run` goes over the epochs, each a sequence of
    windows of optimizer steps from the data source; after each step `_after_step` logs,
    evaluates, checkpoints and stops where asked; `_end_epoch` evaluates the epoch. `state`
    (step, epoch, batch) is what a checkpoint saves and a resume restores."""

    def __init__(
        self, cfg: TrainConfig, trainer: Trainer, source, rank: int, world: int, out: Path
    ):
        self.cfg, self.trainer, self.source = cfg, trainer, source
        self.rank, self.world, self.out = rank, world, out
        self.state = {"step": 0, "epoch": 0, "batch": 0}
        self.saved_step = self.start_step = 0
        self.last_val: dict = {}
        self.tokens_seen = 0
        self.window = torch.zeros(trainer.positions, 6, dtype=torch.float64)
        self.shown: dict = {}
        self.board = None

    # ------------------------------------------------------------------ the run

    def run(self, resume: bool, log) -> dict:
        cfg, rank = self.cfg, self.rank
        self.stop = StopSignals(enabled=rank == 0 or self.world > 1, on_first=self._announce)
        with self.stop:
            if resume and (found := self.trainer.resume(log)) is not None:
                self.state = found
            self.source.restore(self.state)
            if rank == 0:  # metrics and consumption logged after the state we start from are redone
                _truncate_metrics(self.out / "metrics.jsonl", self.state["step"])
                _truncate_metrics(self.out / "consumed.jsonl", self.state["step"])
            self.saved_step = self.start_step = self.state["step"]
            self.t0 = time.monotonic()
            self.rep = Reporter(
                "train",
                self.trainer.total_steps,
                unit="steps",
                enabled=cfg.progress and rank == 0,
                extra=self._extra,
            )
            self.rep.__enter__()
            self.rep.skip(self.state["step"])
            if cfg.report_to == "tensorboard" and rank == 0:
                self.board = _TensorBoard(self.out / "tensorboard")
            self.first = still_working(
                "the first optimizer step (on a CPU, minutes at a real size)",
                enabled=cfg.progress and rank == 0,
            ).__enter__()
            try:
                loop_seconds = self._epochs()
            finally:
                self.first.stop()
                if self.board is not None:
                    self.board.close()
                self.rep.__exit__(None, None, None)
        return {
            "val": self.last_val,
            "steps": self.state["step"],
            "steps_now": self.state["step"] - self.start_step,
            "tokens_per_s": self.tokens_seen * self.world / max(loop_seconds, 1e-9),
            "seconds": time.monotonic() - self.t0,
            "waited_s": getattr(self.source, "waited", 0.0),
        }

    def _epochs(self) -> float:
        """Every epoch from the state on, then the final save; the seconds of training."""
        hooks = _Hooks(
            before_wait=lambda: (
                self.checkpoint(self.state)
                if self.state["step"] > self.saved_step
                else self.source.caught_up()
            ),
            stopping=lambda: self.stop.requested,
            note=lambda msg: (self.first.stop(), self.rep.note(msg)),  # a wait is said as a wait
        )
        for epoch in range(self.state["epoch"], self.cfg.epochs):
            try:
                for groups in self.source.windows(epoch, self.state, hooks):
                    self._window(epoch, groups)
            except StopRequested:
                raise self.stopped() from None
            self._end_epoch(epoch)
        loop_seconds = time.monotonic() - self.t0  # the training itself, without the final saves
        if (
            self.state["step"] == 0
        ):  # an untrained drafter is no result: say why instead of saving one
            raise ProblemError(
                f"no optimizer step was taken on {self.source.describe()}: no training sample could be "
                "read (see the warnings above; a follower that comes after the extractor deleted "
                "its passes' samples has nothing to train: follow a run from its start)"
            )
        self.checkpoint(self.state)
        if self.rank == 0:
            save_final(self.out, self.trainer.drafter, self.trainer.kind)
            plot_metrics(self.out)
        self.source.finished(self.state)
        return loop_seconds

    def _window(self, epoch: int, groups: list) -> None:
        """One window of optimizer steps (a group of micro-batches each), loaded ahead."""
        if (left := self.source.steps_after(epoch, groups)) is not None:
            self.rep.retotal(self.state["step"] + len(groups) + left)
        trainer = self.trainer
        with prefetch([b for g in groups for b in g], trainer.load) as loaded:
            for n, group in enumerate(groups, 1):
                try:
                    lr = trainer.lr_at(self.state["step"])
                    stats, tokens = trainer.step(loaded, len(group), lr, stops=self.stop)
                except StepAbandoned:
                    raise self.stopped() from None
                self.first.stop()
                self.state = self.source.advance(self.state, epoch, group)
                self._after_step(epoch, group, stats, tokens, last=n == len(groups))

    def _after_step(
        self, epoch: int, group: list, stats: torch.Tensor, tokens: int, last: bool
    ) -> None:
        """Progress, the consumed samples (a follower), train metrics every 10 steps and at a
        window's end, evaluation and checkpoints at their intervals, and a stop where asked."""
        cfg, state = self.cfg, self.state
        self.window += stats
        self.tokens_seen += tokens
        s = summarize(self.window)
        self.shown.update(loss=s["loss"][0], acc=s["acc"][0])
        self.rep.advance()
        if self.rank == 0 and cfg.follow:
            samples = sorted(i for b in group for i in b if i not in self.source.unreadable)
            _log(
                self.out,
                self.rank,
                {"step": state["step"], "pass": epoch, "samples": samples},
                "consumed.jsonl",
            )
        if state["step"] % 10 == 0 or last:
            if self.world > 1:
                all_reduce_cpu(self.window)
            self._metric(
                {
                    "split": "train",
                    **_plain(state),
                    "lr": self.trainer.lr_at(state["step"] - 1),
                    "tokens_per_s": self._tokens_per_s(),
                    **summarize(self.window),
                }
            )
            self.window.zero_()
        if cfg.eval_every and state["step"] % cfg.eval_every == 0 and self.source.has_val(epoch):
            self.last_val = self.trainer.evaluate(self.source.val_batches(epoch))
            self._metric({"split": "val", **_plain(state), **self.last_val})
        if state["step"] % cfg.save_every == 0:
            self.checkpoint(state)
        if _should_stop(self.stop.requested, self.world):
            raise self.stopped()

    def _end_epoch(self, epoch: int) -> None:
        has_val = self.source.has_val(epoch)
        val_batches = self.source.val_batches(epoch) if has_val else []
        self.state = self.source.end_epoch(self.state, epoch)
        if has_val:
            self.last_val = self.trainer.evaluate(val_batches)
            self._metric({"split": "val", **_plain(self.state), **self.last_val})
            if self.rank == 0 and self.cfg.progress:
                _print_summary(epoch, self.last_val)
        if self.source.saves_each_epoch:
            self.checkpoint(self.state)  # the extractor may delete this pass once it is durable

    # ------------------------------------------------------------------ checkpoints and stops

    def checkpoint(self, st: dict) -> None:
        self.trainer.save(self.source.stamp(st))
        self.saved_step = st["step"]
        self.source.saved(st)

    def stopped(self) -> TrainStopped:
        self.checkpoint(self.state)
        return TrainStopped(
            f"stopped by {self.stop.name or 'another rank'} at step {self.state['step']}; checkpoint "
            f"saved. Resume with: eyas train --resume --out {self.out}"
        )

    def _announce(self, name: str) -> None:  # at once: a scheduler's grace period is short
        if self.rank == 0:
            print(
                f"{name}: stopping at the next micro-batch; the last complete step is saved",
                file=sys.stderr,
                flush=True,
            )

    # ------------------------------------------------------------------ what is shown

    def _tokens_per_s(self) -> float:
        return self.tokens_seen * self.world / max(time.monotonic() - self.t0, 1e-9)

    def _extra(self) -> str:
        if (w := self.source.waiting()) is not None:
            return w
        speed = f"{self._tokens_per_s():,.0f} tok/s" if self.tokens_seen else ""
        vals = f"loss0 {self.shown['loss']:.3f} acc0 {self.shown['acc']:.2f} " if self.shown else ""
        return vals + speed

    def _metric(self, rec: dict) -> None:
        _log(self.out, self.rank, rec)
        if self.board is not None:
            self.board.write(rec)


def _plain(state: dict) -> dict:
    return {k: state[k] for k in ("step", "epoch", "batch")}


@dataclass
class _Hooks:
    """What a data source may ask of the loop while it waits for samples."""

    before_wait: Callable[[], None]
    stopping: Callable[[], bool]
    note: Callable[[str | None], None]


def _should_stop(requested: bool, world: int) -> bool:
    """Whether to stop after this step: this process was asked to, or (several) any rank was."""
    if world == 1:
        return requested
    flag = torch.tensor([1.0 if requested else 0.0])
    all_reduce_cpu(flag)
    return bool(flag.item())


class _TensorBoard:
    """metrics.jsonl's records as TensorBoard scalars, with TensorBoard's own writer:
    `{split}/loss/pos{i}`, `{split}/acc/pos{i}` (a TTT step or a block position), `{split}/accept_len`, `train/lr`,
    `train/tokens_per_s`, at the optimizer step. A resume appends to the same directory;
    TensorBoard shows the latest value of a step written twice."""

    def __init__(self, path: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(path))

    def write(self, rec: dict) -> None:
        split, step = rec["split"], int(rec["step"])
        for key in ("loss", "acc"):
            for i, v in enumerate(rec.get(key) or []):
                self.w.add_scalar(f"{split}/{key}/pos{i}", float(v), step)
        if rec.get("accept_len"):
            self.w.add_scalar(f"{split}/accept_len", float(rec["accept_len"][-1]), step)
        for key in ("lr", "tokens_per_s"):
            if key in rec:
                self.w.add_scalar(f"{split}/{key}", float(rec[key]), step)
        if split == "val":
            self.w.flush()

    def close(self) -> None:
        self.w.close()


def _log(out: Path, rank: int, rec: dict, name: str = "metrics.jsonl") -> None:
    if rank != 0:
        return
    with open(out / name, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics logged after the checkpoint we resume from (they are recomputed), and
    a line torn by a kill or a full disk."""
    if not path.exists():
        return
    keep, damaged = [], []
    lines = path.read_bytes().splitlines()
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if n < len(lines) and line.strip():  # a torn last line is a kill's; others are damage
                damaged.append((n, line))
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            keep.append(line.decode())
    if damaged:  # named, and kept aside whole, as the journals' damaged lines are
        aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
        atomic_write_bytes(aside, path.read_bytes())
        console.print(
            f"warning: {path}: {len(damaged)} damaged line(s) (first: line {damaged[0][0]}) left "
            f"out; the file as it was is kept in {aside}",
            markup=False,
            highlight=False,
        )
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
    console.print(
        f"epoch {epoch + 1}: val loss0 {s['loss'][0]:.3f}, acc/step [{accs}], "
        f"est. acceptance length (k={len(s['acc'])}) {s['accept_len'][-1]:.2f}",
        markup=False,
        highlight=False,
    )


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
                ax.plot(
                    [r["step"] for r in rs],
                    [r[key][i] for r in rs],
                    style,
                    label=f"{split} step {i}",
                    color=f"C{i}",
                    alpha=0.5 if split == "train" else 1.0,
                    markersize=3,
                )
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

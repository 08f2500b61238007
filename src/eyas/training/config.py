"""`TrainConfig`: what `eyas train` is asked to do, one field per option shared by every
drafter kind, each with its default and (as its docstring) the help the command line shows,
and the kind's own options (`options`: the dataclass in the kind's folder, refused on another
kind). Imports nothing heavy, so the command line can build its options without loading
torch.

A training's config is written flat (`flat()`: the shared fields and the kind's, side by
side), as `train.json` and the command line hold it; `TrainConfig.of(**flat)` reads one back,
and `resume_rule(kind)` is how a resume meets it."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

from eyas.errors import UsageError
from eyas.resume import ResumeRule

OPTIMIZERS = ("adamw", "muon")
LOSS_AVERAGES = ("token", "sequence")  # drafters.loss: sample_ids
LOSS_POSITIONS = ("assistant", "all")

# How a resume meets train.json (eyas.resume) for the shared fields: paths may change (a
# moved run or training directory resumes: the data and the target are identified by their
# fingerprints, not where they live), and so may what only affects how this invocation runs;
# the rest is fixed. A training directory made before an option existed was trained with its
# `before` value. Each kind's options add their own (`Options.may_change`, `Options.before`).
SHARED_RULE = ResumeRule(
    may_change=frozenset(
        {
            "progress",
            "device",
            "verify_data",
            "eval_every",
            "save_every",
            "keep_checkpoints",
            "data",
            "out",
            "model",
            "allow_partial",
            "report_to",
        }
    ),
    before={
        "pack": False,
        "follow": False,
        "feature_noise": 0.0,
        "kind": "eagle3",
        "optimizer": "adamw",
        "loss": "kl",
        "muon_lr_scale": 1.0,
        "init_from": None,
        "attention_window": None,
        "loss_average": "token",
        "loss_positions": "assistant",
    },
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    data: str
    """Extraction run directory (from `eyas extract`)."""
    out: str
    """Training directory: checkpoints, metrics.jsonl, plots, train.json."""
    model: str | None = None
    """Target model directory for lm_head/embeddings; default: the run's recorded model."""
    kind: str = "eagle3"
    """The drafter kind: eagle3 (a chain drafter: one decoder layer over the target layers,
    unrolled over TTT steps), dflash (a block drafter: a few layers that propose
    --block-size - 1 tokens in one pass) or dspark (DFlash's blocks, every slot drafting,
    with a Markov head over the token before each slot and a confidence head). Each kind has
    options of its own, refused on another."""
    options: Any = None
    """The kind's own options: its `Options` dataclass, or a dict of its fields; None: its
    defaults."""
    epochs: int = 3
    """Passes over the training samples."""
    loss: str = "kl"
    """kl (soft cross-entropy against the target's distribution), tv (total variation: one
    minus speculative sampling's acceptance), mix (0.1 x cross-entropy of the target's argmax
    + 0.9 x tv), lk (a blend of kl and tv, more tv as acceptance grows), nla (-log of the
    acceptance), hass (kl plus the cross-entropy over the target's 10 likeliest ids), hard
    (the cross-entropy of the target's argmax alone: what greedy verification accepts), kd
    (kl with both distributions softened at temperature 2, times 4: the rest of the target's
    ranking weighs more), or opd (on-policy distillation: forward KL where the drafts so far
    match the target, decayed reverse KL after the first miss; for a fine-tune with
    --init-from)."""
    loss_average: str = "token"
    """token (every counted position weighs the same: long samples weigh more) or sequence
    (each sample's positions are averaged first, then the samples: every sample weighs the
    same), per TTT step or block position."""
    loss_positions: str = "all"
    """Which positions training scores: assistant (those the loss mask marks: the replies a
    served drafter drafts) or all (every position of a sample: the target's predictions of
    the user's and system's text too, more of its signal from the same data; what measured
    best for every kind, docs/recipe.md). Validation scores the assistant's either way."""
    lr: float | None = None
    """Peak learning rate; default: chosen from the run's size (train prints it)."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int | None = None
    """Linear warmup steps; default: a tenth of the run's optimizer steps, at most 50."""
    muon_lr_scale: float = 1.0
    """--optimizer muon: Muon's learning rate is this times --lr (AdamW, for the norms and the
    head, keeps --lr)."""
    init_from: str | None = None
    """Start from this drafter's weights (a training directory or an export of the same kind,
    target and draft vocabulary) instead of random ones."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (of the norms and head only with --optimizer muon)."""
    optimizer: str = "muon"
    """muon: Muon for the matrices of fc and the decoder layers (momentum 0.95, its own weight
    decay 0.1, update scaled to AdamW's RMS, at --lr x --muon-lr-scale), AdamW (with
    --weight-decay) for the norms and the head; or adamw for all (docs/recipe.md: with EAGLE-3's
    three norms, Muon trains the better drafter)."""
    feature_noise: float = 0.0
    """Training only: Gaussian noise on each of the three fused target states, its standard
    deviation this fraction of that state's RMS at its token (0: none)."""
    grad_clip: float = 0.5
    """Largest gradient norm of an optimizer step (larger ones are scaled down to it)."""
    batch_tokens: int | None = None
    """Tokens of one micro-batch, summed over ranks; default: chosen from the run's size
    (2048; 1024 where 2048 would make fewer than 800 steps; 8192 where that still makes
    2,000)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    val_fraction: float = 0.05
    """Share of the samples held out for validation (at the end of every epoch)."""
    eval_every: int = 0
    """Also evaluate every N optimizer steps (0: once per epoch only)."""
    save_every: int = 100
    """Checkpoint every N optimizer steps (and at the end)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept; a damaged newest one falls back to an older one."""
    draft_vocab_size: int | None = None
    """Draft vocabulary size D; default: the dataset's (--draft-vocab-size of prepare)."""
    dtype: str = "float32"
    """float32 or bfloat16 (autocast on a GPU; the weights stay float32)."""
    device: str = "auto"
    """auto (the GPU where there is one), cpu, cuda or cuda:K."""
    seed: int = 0
    """Seed of the drafter's initial weights and the batch order."""
    verify_data: bool = True
    """Check every sample's tensor checksums on its first read (files are always checked
    against their journal entries)."""
    intermediate_size: int | None = None
    """The drafter's MLP width; default: the target's."""
    attention_window: int | None = None
    """A sliding window for the drafter's attention, in training and when drafting: an
    eagle3 position attends to the W latest positions (itself included) and its own chain, a
    dflash block position to the context above its position - W and its whole block;
    default: all of them. For targets served at far longer contexts than the training data's
    (docs/recipe.md). eagle3: SGLang serves it (--speculative-draft-window-size), vLLM does
    not; dflash: vLLM serves it (dflash_config.use_swa), SGLang does not."""
    allow_partial: bool = False
    """Train on a run whose extraction is not finished (only the samples committed so far)."""
    pack: bool = False
    """Fill each batch with --batch-tokens tokens of samples, whatever their lengths, instead
    of grouping samples of like length so that padding each to the longest stays within
    --batch-tokens (fewer, fuller batches: another schedule). Either way a batch's samples
    are laid end to end in one row, attention and positions per sample, so no padding is
    computed."""
    follow: bool = False
    """Train while the run is extracted: committed samples as they appear, each once per
    extraction pass; the extractor's --max-store deletes what every follower has passed."""
    report_to: str = "none"
    """tensorboard: the metrics also as TensorBoard events in OUT/tensorboard (needs
    pip install -e '.[tensorboard]')."""
    progress: bool = True
    """Progress lines and summaries on the console."""

    def __post_init__(self) -> None:
        self._own_options()
        if self.report_to not in ("none", "tensorboard"):
            raise UsageError(f"--report-to must be none or tensorboard, got {self.report_to!r}")
        if self.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            raise UsageError(
                "--report-to tensorboard needs the tensorboard package: "
                "pip install -e '.[tensorboard]' (or pip install tensorboard)"
            )
        from eyas.drafters.loss import LOSSES  # the registry of losses

        for name, allowed in (
            ("loss", tuple(LOSSES)),
            ("loss_average", LOSS_AVERAGES),
            ("loss_positions", LOSS_POSITIONS),
            ("optimizer", OPTIMIZERS),
            ("dtype", ("float32", "bfloat16")),
        ):
            if getattr(self, name) not in allowed:
                raise UsageError(
                    f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                    f"got {getattr(self, name)!r}"
                )
        if self.attention_window is not None and self.attention_window < 1:
            raise UsageError(f"--attention-window must be at least 1, got {self.attention_window}")
        if self.muon_lr_scale <= 0:
            raise UsageError(f"--muon-lr-scale must be positive, got {self.muon_lr_scale}")
        if self.feature_noise < 0 or self.weight_decay < 0:
            raise UsageError("--feature-noise and --weight-decay must not be negative")
        if self.epochs < 1 or self.grad_accum < 1:
            raise UsageError("--epochs and --grad-accum must be at least 1")
        if not 0 <= self.val_fraction < 1:
            raise UsageError(f"--val-fraction must lie in [0, 1), got {self.val_fraction}")

    def _own_options(self) -> None:
        """`options` as the kind's dataclass; an option of another kind is refused, naming
        the kinds that read it."""
        from eyas.drafters import KINDS, option_owners, options_class

        if self.kind not in KINDS:
            raise UsageError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        cls, given = options_class(self.kind), self.options
        if isinstance(given, cls):
            return
        if given is not None and not isinstance(given, dict):
            raise UsageError(f"--kind {self.kind}: options {given!r} are another kind's")
        given = dict(given or {})
        own = {f.name for f in dataclasses.fields(cls)}
        owners = option_owners()
        for name in given.keys() - own:
            flag = f"--{name.replace('_', '-')}"
            if name in owners:
                raise UsageError(
                    f"{flag} is an option of --kind {' and '.join(owners[name])}, "
                    f"not of --kind {self.kind}"
                )
            raise UsageError(f"{flag} is not an option of eyas train")
        object.__setattr__(self, "options", cls(**given))

    # ------------------------------------------------------------ the flat form

    @classmethod
    def of(cls, **flat) -> TrainConfig:
        """A config from its flat form: the shared fields, and the kind's options beside
        them (what `flat()`, train.json and the command line hold)."""
        shared = {f.name for f in dataclasses.fields(cls)} - {"options"}
        own = {k: v for k, v in flat.items() if k not in shared}
        return cls(**{k: v for k, v in flat.items() if k in shared}, options=own or None)

    def flat(self) -> dict:
        """The shared fields and the kind's options side by side."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        own = dataclasses.asdict(shared.pop("options"))
        return {**shared, **own}

    def replace(self, **changes) -> TrainConfig:
        """This config with `changes` (flat names); a change of kind keeps the shared fields
        alone."""
        base = self.flat()
        if changes.get("kind", self.kind) != self.kind:
            base = {k: v for k, v in base.items() if k not in self.own_fields()}
        return TrainConfig.of(**{**base, **changes})

    def own_fields(self) -> set[str]:
        """The names of the kind's own options."""
        return {f.name for f in dataclasses.fields(self.options)}


def resume_rule(kind: str | None) -> ResumeRule:
    """The resume rule of a training of that kind: the shared one and the kind's own."""
    from eyas.drafters import options_class

    own = options_class(kind)
    return ResumeRule(
        may_change=SHARED_RULE.may_change | own.may_change,
        before={**SHARED_RULE.before, **own.before},
    )


def saved_flat(config: dict) -> dict:
    """A saved train.json config as this version reads it (the resume rule's `saved`),
    without the options of other kinds (a training saved before kinds owned their options
    wrote every kind's)."""
    from eyas.drafters import option_owners, options_class

    kind = config.get("kind", SHARED_RULE.before["kind"])
    mine = {f.name for f in dataclasses.fields(options_class(kind))}
    foreign = set(option_owners()) - mine
    return {k: v for k, v in resume_rule(kind).saved(config).items() if k not in foreign}

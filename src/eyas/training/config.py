"""`TrainConfig`: what `eyas train` is asked to do, one field per option, each with its
default and (as its docstring) the help the command line shows. Imports nothing heavy, so
the command line can build its options without loading torch."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

ATTENTIONS = (
    "reference",
    "chunked",
    "flex",
)  # TTT attention implementations (drafters.eagle3.attention)
OPTIMIZERS = ("adamw", "muon")
HEAD_INITS = ("random", "target", "target-frozen")
LOSSES = ("kl", "tv", "mix", "lk", "nla", "hass", "hard", "kd", "opd")  # training.loss
LOSS_AVERAGES = ("token", "sequence")  # training.loss_average
LOSS_POSITIONS = ("assistant", "all")


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
    unrolled over TTT steps) or dflash (a block drafter: a few layers that propose
    --block-size - 1 tokens in one pass)."""
    epochs: int = 3
    """Passes over the training samples."""
    ttt_steps: int = 3
    """eagle3: unrolled training-time-test steps k, the chain of drafts trained for (3: the
    chain serving engines draft by default)."""
    block_size: int = 4
    """dflash: the block's length S (the last verified token and S-1 drafts)."""
    drafter_layers: int = 2
    """dflash: decoder layers of the drafter."""
    block_decay: float = 4.0
    """dflash: loss weight of block position j is exp(-(j-1)/block_decay)."""
    anchor_stride: int = 1
    """dflash: a training block starts at every this many positions of a trainable span (1:
    at each; --block-size: each position is predicted once per step, at one block position)."""
    step_decay: float = 0.8
    """Weight of TTT step i's loss: step_decay ** i."""
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
    align_topk: int = 0
    """eagle3, training: GRIFFIN's alignment mask. TTT step i scores a position only where
    the target's argmax was among the drafter's K likeliest ids at every earlier step (the
    chains a K-wide draft tree could still hold; 1: the chain served); 0: every step scores
    every position."""
    loss_average: str = "token"
    """token (every counted position weighs the same: long samples weigh more) or sequence
    (each sample's positions are averaged first, then the samples: every sample weighs the
    same), per TTT step or block position."""
    loss_positions: str | None = None
    """Which positions training scores: assistant (those the loss mask marks: the replies a
    served drafter drafts) or all (every position of a sample: the target's predictions of
    the user's and system's text too, more of its signal from the same data). Validation
    scores the assistant's either way. Default: all, for both kinds (docs/recipe.md)."""
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
    --weight-decay) for the norms and the head; or adamw for all (docs/recipe.md: with the
    three norms below, Muon trains the better drafter)."""
    serve_with: str = "vllm"
    """eagle3: the engine the drafter will be served by. vllm: eyas's recipe (the three norms
    below); sglang: the network SGLang's EAGLE-3 model runs, which has none of them (they are
    turned off), so that `export --format sglang` serves what was trained."""
    norm_before_fc: bool = True
    """An RMSNorm over the concatenated target states before fc (SGLang's EAGLE-3 model has
    none of the three norms: --serve-with sglang turns them off)."""
    norm_before_residual: bool = True
    """The decoder layer's residual is the normed fused state, not the raw one."""
    norm_output: bool = True
    """The next TTT step and the head read the drafter's normed state, not its raw one."""
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
    attention: str = "auto"
    """TTT attention: reference (full score matrices), chunked (blockwise, O(T) memory, any
    device), flex (fused kernel, GPU); auto: flex on a GPU, chunked on a CPU."""
    allow_partial: bool = False
    """Train on a run whose extraction is not finished (only the samples committed so far)."""
    head_init: str | None = None
    """eagle3: the drafter's head at the start: random, target (the target's own lm_head rows
    for the draft vocabulary; still trained) or target-frozen (the same, never trained).
    Default: target-frozen served by vLLM (--serve-with vllm), random by SGLang
    (docs/recipe.md)."""
    layer_init: str = "random"
    """eagle3: the drafter's decoder layer at the start: random, or target (the target's last
    layer: its attention's projections of the state, output projection, MLP and norms; the
    projections of the token embedding stay random). Trained either way."""
    pack: bool = False
    """Pack samples one after another into rows of --batch-tokens (attention and positions
    per sample) instead of padding each to its batch's longest."""
    follow: bool = False
    """Train while the run is extracted: committed samples as they appear, each once per
    extraction pass; the extractor's --max-store deletes what every follower has passed."""
    report_to: str = "none"
    """tensorboard: the metrics also as TensorBoard events in OUT/tensorboard (needs
    pip install -e '.[tensorboard]')."""
    progress: bool = True
    """Progress lines and summaries on the console."""

    def __post_init__(self) -> None:
        if self.report_to not in ("none", "tensorboard"):
            raise ValueError(f"--report-to must be none or tensorboard, got {self.report_to!r}")
        if self.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                "--report-to tensorboard needs the tensorboard package: "
                "pip install -e '.[tensorboard]' (or pip install tensorboard)"
            )
        from eyas.drafters import KINDS, kind

        if self.kind not in KINDS:
            raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.serve_with not in ("vllm", "sglang"):
            raise ValueError(f"--serve-with must be vllm or sglang, got {self.serve_with!r}")
        for name, value in kind(self.kind).recipe_defaults(self.serve_with).items():
            if getattr(self, name) is None:  # left out: the kind's measured choice
                object.__setattr__(self, name, value)
        if self.head_init not in HEAD_INITS:
            raise ValueError(
                f"--head-init must be one of {', '.join(HEAD_INITS)}, got {self.head_init!r}"
            )
        if self.layer_init not in ("random", "target"):
            raise ValueError(f"--layer-init must be random or target, got {self.layer_init!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.loss_average not in LOSS_AVERAGES:
            raise ValueError(
                f"--loss-average must be one of {', '.join(LOSS_AVERAGES)}, got {self.loss_average!r}"
            )
        if self.loss_positions not in LOSS_POSITIONS:
            raise ValueError(
                f"--loss-positions must be one of {', '.join(LOSS_POSITIONS)}, got {self.loss_positions!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.serve_with == "sglang":  # SGLang's EAGLE-3 network: none of the three norms
            for name in ("norm_before_fc", "norm_before_residual", "norm_output"):
                object.__setattr__(self, name, False)
        if self.attention_window is not None and self.attention_window < 1:
            raise ValueError(f"--attention-window must be at least 1, got {self.attention_window}")
        if self.muon_lr_scale <= 0:
            raise ValueError(f"--muon-lr-scale must be positive, got {self.muon_lr_scale}")
        if self.feature_noise < 0 or self.weight_decay < 0:
            raise ValueError("--feature-noise and --weight-decay must not be negative")
        if (
            self.block_size < 2
            or self.drafter_layers < 1
            or self.block_decay <= 0
            or self.anchor_stride < 1
        ):
            raise ValueError(
                "--block-size must be at least 2, --drafter-layers at least 1, --block-decay positive"
            )
        if self.align_topk < 0:
            raise ValueError(f"--align-topk must not be negative, got {self.align_topk}")
        for name, off in (("align_topk", 0), ("layer_init", "random")):
            if getattr(self, name) != off and name not in kind(self.kind).own_options:
                raise ValueError(
                    f"--{name.replace('_', '-')} is not an option of --kind {self.kind}"
                )
        if self.ttt_steps < 1 or self.epochs < 1 or self.grad_accum < 1:
            raise ValueError("--ttt-steps, --epochs and --grad-accum must be at least 1")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must lie in [0, 1), got {self.val_fraction}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.attention not in ("auto", *ATTENTIONS):
            raise ValueError(
                f"--attention must be auto, {', '.join(ATTENTIONS)}; got {self.attention!r}"
            )

"""The `train` options every block drafter kind has (DFlash's, and those built on its
backbone): the block, the drafter's depth, the block's loss decay and where blocks start. A
kind's `Options` extends this class. Imports nothing heavy, so the command line can offer
them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eyas.drafters.formats import DEFAULT, format_named
from eyas.errors import UsageError

POSITION_WEIGHTS = ("decay", "dpace")


@dataclass(frozen=True, kw_only=True)
class BlockOptions:
    block_size: int = 4
    """The block's length S (the last verified token and S-1 drafts)."""
    drafter_layers: int = 2
    """Decoder layers of the drafter."""
    block_decay: float = 4.0
    """Loss weight of block position j is exp(-(j-1)/block_decay)."""
    anchor_stride: int = 1
    """A training block starts at every this many positions of a trainable span (1: at each;
    --block-size: each position is predicted once per step, at one block position)."""
    position_weights: str = "decay"
    """How a block position's loss is weighted: `decay` (exp(-(j-1)/--block-decay)) or
    `dpace` (D-PACE: the number of the block's drafts expected to be accepted from that
    position on, from the drafter's own probability of the target's token at each position
    of the block, smoothed to 0.5 q + 0.5; not differentiated)."""
    loss_until_miss: bool = False
    """Spec-AUF: in training, a block position's loss counts only where every earlier
    position of its block drafted the target's token (the first miss counts, what follows
    it, which serving never verifies, does not)."""

    serve_with: str = DEFAULT.name
    """The engine the drafter will be served by, checked before the training starts: vllm
    (any draft vocabulary); sglang (SGLang's block models draft over the target's whole
    head: the draft vocabulary is every id, and what its network lacks is refused)."""

    may_change: ClassVar[frozenset[str]] = frozenset()
    before: ClassVar[dict] = {
        "block_size": 4,
        "drafter_layers": 2,
        "block_decay": 4.0,
        "anchor_stride": 1,
        "position_weights": "decay",
        "loss_until_miss": False,
        "serve_with": "vllm",
    }

    def __post_init__(self) -> None:
        format_named(self.serve_with, "--serve-with")
        if self.block_size < 2:
            raise UsageError(f"--block-size must be at least 2, got {self.block_size}")
        if self.drafter_layers < 1:
            raise UsageError(f"--drafter-layers must be at least 1, got {self.drafter_layers}")
        if self.block_decay <= 0:
            raise UsageError(f"--block-decay must be positive, got {self.block_decay}")
        if self.position_weights not in POSITION_WEIGHTS:
            raise UsageError(
                f"--position-weights must be one of {', '.join(POSITION_WEIGHTS)}, "
                f"got {self.position_weights!r}"
            )
        if self.anchor_stride < 1:
            raise UsageError(f"--anchor-stride must be at least 1, got {self.anchor_stride}")

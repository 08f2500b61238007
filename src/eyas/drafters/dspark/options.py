"""DSpark's own `train` options: the block drafter's (the block, the depth, the decay, the
anchors, `drafters.block_options`; Spec-AUF on by default) and its two heads. Imports nothing
heavy, so the command line can offer them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.drafters.block_options import BlockOptions
from eyas.errors import UsageError

MARKOV_HEADS = ("vanilla", "gated")


@dataclass(frozen=True, kw_only=True)
class Options(BlockOptions):
    markov_rank: int = 256
    """Rank r of the Markov head: a bias on a block position's logits from the token before
    it (W1: target vocabulary x r, W2: r x draft vocabulary), chained left to right when
    drafting; 0: no Markov head."""
    markov_head: str = "vanilla"
    """vanilla (the bias from the previous token alone) or gated (that token's rank-r code
    scaled by a gate over it and the position's state)."""
    loss_until_miss: bool = True
    """Spec-AUF: in training, a block position's loss counts only where every earlier
    position of its block drafted the target's token (the first miss counts, what follows
    it, which serving never verifies, does not). On for DSpark: x1.017 tokens per target
    forward on MT-Bench over two seeds (docs/recipe.md)."""
    confidence_weight: float = 1.0
    """Weight of the confidence head's loss: the binary cross-entropy of its predicted
    acceptance against each position's 1 - TV(drafter, target); 0: no confidence head."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 0:
            raise UsageError(f"--markov-rank must not be negative, got {self.markov_rank}")
        if self.markov_head not in MARKOV_HEADS:
            raise UsageError(
                f"--markov-head must be one of {', '.join(MARKOV_HEADS)}, got {self.markov_head!r}"
            )
        if self.confidence_weight < 0:
            raise UsageError(
                f"--confidence-weight must not be negative, got {self.confidence_weight}"
            )

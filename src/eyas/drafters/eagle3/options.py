"""EAGLE-3's own `train` options: the TTT chain, the engine it is trained for, its norms, how
its head and layer start, and the TTT attention. Imports nothing heavy, so the command line
can offer them without loading torch. `TrainConfig.options` holds one of these when
`--kind eagle3`; another kind refuses them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eyas.drafters.eagle3.serving import SERVING
from eyas.drafters.formats import DEFAULT, format_named
from eyas.errors import UsageError

ATTENTIONS = ("reference", "chunked", "flex")  # drafters.eagle3.attention
HEAD_INITS = ("random", "target", "target-frozen")


@dataclass(frozen=True, kw_only=True)
class Options:
    ttt_steps: int = 3
    """Unrolled training-time-test steps k, the chain of drafts trained for (3: the chain
    serving engines draft by default)."""
    step_decay: float = 0.8
    """Weight of TTT step i's loss: step_decay ** i."""
    align_topk: int = 0
    """GRIFFIN's alignment mask, in training: TTT step i scores a position only where the
    target's argmax was among the drafter's K likeliest ids at every earlier step (the chains
    a K-wide draft tree could still hold; 1: the chain served); 0: every step scores every
    position."""
    serve_with: str = DEFAULT.name
    """The engine the drafter will be served by: the training trains the network it runs.
    EAGLE-3: vllm, eyas's recipe (the three norms below); sglang, SGLang's EAGLE-3 network,
    which has none of them (they are turned off). A block drafter for sglang drafts every id
    of the target's vocabulary (the block kinds' own field says why)."""
    norm_before_fc: bool = True
    """An RMSNorm over the concatenated target states before fc (SGLang's EAGLE-3 model has
    none of the three norms: --serve-with sglang turns them off)."""
    norm_before_residual: bool = True
    """The decoder layer's residual is the normed fused state, not the raw one."""
    norm_output: bool = True
    """The next TTT step and the head read the drafter's normed state, not its raw one."""
    head_init: str | None = None
    """The drafter's head at the start: random, target (the target's own lm_head rows for the
    draft vocabulary; still trained) or target-frozen (the same, never trained). Default:
    target-frozen served by vLLM (--serve-with vllm), random by SGLang (docs/recipe.md)."""
    layer_init: str = "random"
    """The drafter's decoder layer at the start: random, or target (the target's last layer:
    its attention's projections of the state, output projection, MLP and norms; the
    projections of the token embedding stay random). Trained either way."""
    attention: str = "auto"
    """TTT attention: reference (full score matrices), chunked (blockwise, O(T) memory, any
    device), flex (fused kernel, GPU); auto: flex on a GPU, chunked on a CPU."""

    # How a resume meets a saved training (eyas.resume): the implementation of the same
    # attention may change; a training made before an option existed had its `before` value.
    may_change: ClassVar[frozenset[str]] = frozenset({"attention"})
    before: ClassVar[dict] = {
        "head_init": "random",
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "serve_with": "vllm",
        "align_topk": 0,
        "layer_init": "random",
    }

    def __post_init__(self) -> None:
        served = SERVING.get(format_named(self.serve_with, "--serve-with"))
        if served is None:
            names = ", ".join(f.name for f in SERVING)
            raise UsageError(f"--serve-with: an EAGLE-3 drafter is served by {names}")
        if self.head_init is None:  # left out: what measured best for that engine's network
            object.__setattr__(self, "head_init", served.defaults["head_init"])
        if self.head_init not in HEAD_INITS:
            raise UsageError(
                f"--head-init must be one of {', '.join(HEAD_INITS)}, got {self.head_init!r}"
            )
        if self.layer_init not in ("random", "target"):
            raise UsageError(f"--layer-init must be random or target, got {self.layer_init!r}")
        for name, value in served.trains.items():  # what that engine's network is
            object.__setattr__(self, name, value)
        if self.ttt_steps < 1:
            raise UsageError(f"--ttt-steps must be at least 1, got {self.ttt_steps}")
        if self.align_topk < 0:
            raise UsageError(f"--align-topk must not be negative, got {self.align_topk}")
        if self.attention not in ("auto", *ATTENTIONS):
            raise UsageError(
                f"--attention must be auto, {', '.join(ATTENTIONS)}; got {self.attention!r}"
            )

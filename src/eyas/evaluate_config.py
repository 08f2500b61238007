"""The configuration of `evaluate`: every scalar option of the judge, with its default and
what it does, in one torch-free dataclass; the command line takes its options from it and
the library's `evaluate` and `evaluate_vllm` their defaults."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EvaluateConfig", "ENGINES"]

ENGINES = ("hf", "vllm")


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    draft_tokens: int | None = None
    """Tokens drafted a round, K (default: what the export serves: a chain's
    --speculative-tokens, a block's size - 1)."""
    max_new_tokens: int = 64
    """Tokens generated per prompt (each reply stops earlier at its end)."""
    limit: int = 1000
    """Prompts to use at most (0: all)."""
    precision: float = 0.05
    """Stop once tokens per forward is known to +- this (95% interval; 0: use every prompt)."""
    engine: str = "hf"
    """hf (eyas's own decoder) or vllm (vLLM as the judge)."""
    tensor_parallel_size: int = 1
    """vllm: GPUs for the target."""
    trust_remote_code: bool = False
    """Let the model directory's code run."""
    device: str = "auto"
    """hf: auto (a GPU where there is one), cpu, cuda or cuda:K."""
    chat_template: str | None = None
    """Jinja chat template file to render the prompts with (default: the one the drafter's
    data was prepared with, else the tokenizer's)."""
    max_error_rate: float = 0.01
    """Share of --data records that cannot be prompts above which nothing is evaluated
    (exit 1)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be {' or '.join(ENGINES)}, got {self.engine!r}")
        if self.limit < 0 or self.max_new_tokens < 1 or self.precision < 0:
            raise ValueError("--limit must be >= 0, --max-new-tokens >= 1 and --precision >= 0")
        if self.draft_tokens is not None and self.draft_tokens < 1:
            raise ValueError(f"--draft-tokens must be at least 1, got {self.draft_tokens}")

"""The configuration of `extract`: every option of the stage, with its default and what it
does, in one dataclass the command line takes its options from. Imports no torch (the
checks that need the registries import them when a config is made), so that the command
line starts at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from eyas.run.fsutil import parse_size

if TYPE_CHECKING:
    from eyas.run.store import Layout

__all__ = ["ExtractConfig"]


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    model: str
    """Target model directory (transformers format)."""
    data: str
    """Prepared dataset directory (from `eyas prepare`)."""
    out: str
    """Run directory; created if new."""
    backend: str = "hf"
    """`hf` (transformers in this process) or `vllm` (vLLM engine, tensor parallel)."""
    aux_layers: tuple[int, ...] | None = None
    """Aux layers as outputs of 0-based decoder layers; default [1, n//2-1, n-4]."""
    device: str = "auto"
    """`auto` (cuda if present), `cpu`, `cuda`, `cuda:K`, or `multi` (hf: device_map=auto)."""
    dtype: str = "auto"
    """Compute dtype: `auto` (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16."""
    store_dtype: str | None = None
    """Dtype of stored hidden states; default: the compute dtype."""
    storage: str = "dense"
    """Aux states on disk: `dense` (store dtype) or `fp8` (e4m3, a scale per token and layer)."""
    target: str = "last"
    """The target on disk: `last` (final hidden state) or `topk:K` (top-K log-probs)."""
    batch_tokens: int = 8192
    """Token budget per batch (batch size x longest sample, padding included)."""
    trust_remote_code: bool = False
    """Let the model directory's own Python code run (never read from run.json on resume)."""
    rank: int = 0
    """This process's share of the samples: index % world == rank."""
    world: int = 1
    """Number of shares the run is split into (one writer each; 1: the whole run)."""
    min_free: str = "2%"
    """Stop when free space falls below this (bytes, K/M/G suffix, or % of the filesystem;
    a percentage is at least 1 GiB, or 5% of a filesystem smaller than 20 GiB)."""
    allow_partial: bool = False
    """Start even when the projected size does not fit on the disk."""
    queue_depth: int = 4
    """Batches waiting for the writer before the forward loop blocks."""
    max_foreign_gpu_mem: str = "2GiB"
    """Refuse to start when another process holds more than this on a GPU we use."""
    ignore_busy_gpus: bool = False
    """Start even though other processes hold GPU memory (this invocation only)."""
    tensor_parallel_size: int = 1
    """vllm backend: GPUs the target is split over."""
    gpu_memory_utilization: float = 0.9
    """vllm backend: fraction of each GPU's memory vLLM may take."""
    max_model_len: int | None = None
    """vllm backend: context length (default: the longest sample + 1)."""
    staging_dir: str | None = None
    """vllm backend: scratch directory for states in flight (default: the system temp dir)."""
    max_store: str | None = None
    """Keep the run's sample bytes under this (K/M/G suffix): consumed samples are deleted
    once every trainer following the run (`train --follow`) has checkpointed past them."""
    passes: int = 1
    """Run the dataset this many times, each pass in its own order (needs --max-store): a
    trainer that follows the run trains one epoch per pass."""
    progress: bool = True
    """Progress lines and summaries on the console."""

    def __post_init__(self) -> None:
        from eyas.run.store import Layout  # torch: only once a config is made
        from eyas.targets.backends import BACKENDS
        from eyas.targets.target import DTYPES

        if not 0 <= self.rank < self.world:
            raise ValueError(
                f"--rank {self.rank} is outside 0..{self.world - 1} (--world {self.world})"
            )
        if self.batch_tokens < 1:
            raise ValueError(f"--batch-tokens must be positive, got {self.batch_tokens}")
        if self.aux_layers is not None and not self.aux_layers:
            raise ValueError("--aux-layers needs one or more layers")
        for d in (self.dtype, self.store_dtype or "auto"):
            if d not in ("auto", *DTYPES):
                raise ValueError(f"unknown dtype {d!r}; choose from auto, {', '.join(DTYPES)}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.tensor_parallel_size < 1 or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                "--tensor-parallel-size must be >= 1 and --gpu-memory-utilization in (0, 1]"
            )
        if self.backend == "hf" and self.tensor_parallel_size > 1:
            raise ValueError(
                "--tensor-parallel-size needs --backend vllm (the hf backend uses --device multi)"
            )
        Layout(self.storage, self.target)  # raises for unknown modes
        parse_size(self.min_free, 1)
        if self.passes < 1:
            raise ValueError(f"--passes must be at least 1, got {self.passes}")
        if self.max_store is not None and (
            self.max_store.strip().endswith("%") or parse_size(self.max_store, 1) <= 0
        ):
            raise ValueError(f"--max-store needs a size such as 200G, got {self.max_store!r}")
        if self.passes > 1 and self.max_store is None:
            raise ValueError(
                "--passes runs the target over the data again for each epoch: it is for a disk "
                "smaller than the data, with --max-store; with room for the whole run, extract "
                "once and train --epochs N"
            )
        parse_size(self.max_foreign_gpu_mem, 1)

    @property
    def layout(self) -> Layout:
        from eyas.run.store import Layout

        return Layout(self.storage, self.target, len(self.aux_layers) if self.aux_layers else 3)

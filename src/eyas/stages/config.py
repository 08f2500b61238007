"""The commands' configs (prepare, generate, extract, evaluate, export, demo, estimate,
tiny-target): torch-free, so the CLI builds its options from their fields without loading a
model. Training's config is the training layer's own (`eyas.training.config`)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eyas.errors import UsageError
from eyas.run.fsutil import parse_size

if TYPE_CHECKING:
    from eyas.run.store import Layout


__all__ = [
    "DemoConfig",
    "EstimateConfig",
    "EvaluateConfig",
    "ExportConfig",
    "ExtractConfig",
    "GenerateConfig",
    "PrepareConfig",
    "TinyTargetConfig",
]


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    model: str
    """Model directory whose tokenizer and chat template render the conversations."""
    data: tuple[str, ...]
    """Input files: JSONL or JSON, records in OpenAI `messages`, ShareGPT `conversations` or `text` form."""
    out: str
    """Dataset directory to write."""
    max_length: int | None = None
    """Longest sample in tokens; longer ones are truncated or skipped (--overlong); default:
    no limit."""
    overlong: str = "truncate"
    """truncate keeps the first --max-length tokens of a longer sample; skip drops it."""
    last_turn_only: bool = False
    """Train only on the last assistant turn of each conversation."""
    draft_vocab_size: int = 32000
    """Size D of the draft vocabulary (capped at the target vocabulary size)."""
    max_error_rate: float = 0.01
    """Fraction of failed records above which the run counts as failed (exit 1)."""
    num_workers: int = 1
    """Processes that tokenize in parallel."""
    chat_template_kwargs: dict | None = None
    """Extra variables for the chat template (e.g. {"thinking": false}); kept in dataset.json."""
    chat_template: str | None = None
    """A Jinja chat template file to render the conversations with instead of the tokenizer's
    (a base target has none); kept in dataset.json, so extract, train and evaluate render and
    check alike."""
    per_turn_samples: bool = False
    """One sample per assistant turn (the conversation up to and including it, trained on that
    turn only), so every turn's reasoning is trained as the target produced it, even where the
    template drops earlier turns' reasoning from the history."""
    trust_remote_code: bool = False
    """Let the model directory's tokenizer code run (Kimi's tokenizer is such code)."""
    allow_dropped_fields: bool = False
    """Write the dataset even where the chat template leaves out assistant turns' tool calls
    or reasoning for more than --max-error-rate of the records (they are counted either way)."""
    force: bool = False
    """Replace an existing dataset at --out (extraction runs made from it can then no longer
    resume unless it is rebuilt identically)."""
    progress: bool = True
    """Progress lines and summaries on the console."""

    def __post_init__(self) -> None:
        if self.overlong not in ("truncate", "skip"):
            raise UsageError(f"--overlong must be truncate or skip, got {self.overlong!r}")
        if self.max_length is not None and self.max_length < 2:
            raise UsageError(f"--max-length must be at least 2, got {self.max_length}")
        if not self.data:
            raise UsageError("no input files given (--data)")
        if self.draft_vocab_size < 1:
            raise UsageError(f"--draft-vocab-size must be positive, got {self.draft_vocab_size}")
        if not 0 <= self.max_error_rate <= 1:
            raise UsageError(f"--max-error-rate must lie in [0, 1], got {self.max_error_rate}")


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    endpoint: str
    """Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (or .../v1)."""
    model: str
    """The model name the endpoint serves."""
    data: tuple[str, ...]
    """Input files: the record forms `prepare` reads."""
    out: str
    """Output JSONL: every successful record once, in input order, with provenance."""
    concurrency: int = 8
    """Requests in flight."""
    max_tokens: int = 2048
    """Longest answer in tokens (longer ones are cut and marked)."""
    temperature: float = 0.0
    """0 is greedy."""
    seed: int | None = None
    """Sampling seed sent with every request (default: none)."""
    timeout: float = 600.0
    """Seconds one request may take before it is retried."""
    retries: int = 6
    """Retries per request after 429/5xx, timeouts and dropped connections."""
    backoff: float = 1.0
    """Seconds before the first retry; each further retry waits twice as long (with jitter, at most 60)."""
    turns: str = "last"
    """`last`: regenerate the last assistant turn; `all`: every assistant turn, in order."""
    api_key_env: str | None = None
    """Name of an environment variable holding the API key (the key is never written)."""
    max_response_bytes: int = 64 << 20
    """Largest answer accepted; a larger one is a failed request (it cannot be a sane reply)."""
    chat_template: str | None = None
    """A Jinja chat template file whose text is sent with every request (`chat_template`, as
    vLLM's chat API takes it), for a target served without a template of its own."""
    progress: bool = True
    """Progress lines and summaries on the console."""

    def __post_init__(self) -> None:
        if self.turns not in ("last", "all"):
            raise UsageError(f"--turns must be last or all, got {self.turns!r}")
        if (
            self.concurrency < 1
            or self.retries < 0
            or self.max_tokens < 1
            or self.timeout <= 0
            or self.backoff < 0
            or self.max_response_bytes < 1024
        ):
            raise UsageError(
                "--concurrency and --max-tokens must be >= 1, --retries >= 0, --timeout > 0, "
                "--max-response-bytes >= 1024"
            )
        if not self.endpoint.startswith(("http://", "https://")):
            raise UsageError(f"--endpoint must be an http(s) URL, got {self.endpoint!r}")
        if self.api_key_env and self.api_key_env not in os.environ:
            raise UsageError(f"--api-key-env {self.api_key_env}: no such environment variable")
        from eyas.targets.target import read_chat_template  # torch: once a config is made

        object.__setattr__(self, "_template", read_chat_template(self.chat_template))

    def sampling(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "turns": self.turns,
            # Another template is another rendering of every prompt: fixed for the run.
            **(
                {"chat_template": hashlib.sha256(self._template.encode()).hexdigest()[:16]}
                if self._template
                else {}
            ),
        }


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
    """The target layers whose states are stored: their ids as outputs of 0-based decoder
    layers (1,15,28), or one number N for N layers spread evenly from the second to the
    fourth-last (5: what DFlash and DSpark recipes read); default the three [1, n//2-1, n-4].
    EAGLE-3 exports read three, the block kinds any number."""
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
        from eyas.targets.backends import BACKENDS, registered
        from eyas.targets.target import DTYPES

        if not 0 <= self.rank < self.world:
            raise UsageError(
                f"--rank {self.rank} is outside 0..{self.world - 1} (--world {self.world})"
            )
        if self.batch_tokens < 1:
            raise UsageError(f"--batch-tokens must be positive, got {self.batch_tokens}")
        if self.aux_layers is not None and not self.aux_layers:
            raise UsageError("--aux-layers needs two or more layer ids, or a count N")
        if self.aux_layers is not None and len(self.aux_layers) == 1 and self.aux_layers[0] < 2:
            raise UsageError(
                f"--aux-layers {self.aux_layers[0]}: one number is a count of layers spread over "
                "the depth, at least 2 (give two or more ids for particular layers)"
            )
        for d in (self.dtype, self.store_dtype or "auto"):
            if d not in ("auto", *DTYPES):
                raise UsageError(f"unknown dtype {d!r}; choose from auto, {', '.join(DTYPES)}")
        if self.backend not in BACKENDS:
            raise UsageError(
                f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.tensor_parallel_size < 1 or not 0 < self.gpu_memory_utilization <= 1:
            raise UsageError(
                "--tensor-parallel-size must be >= 1 and --gpu-memory-utilization in (0, 1]"
            )
        if self.tensor_parallel_size > 1 and not registered(self.backend).tensor_parallel:
            shards = [n for n in BACKENDS if registered(n).tensor_parallel]
            raise UsageError(
                f"--tensor-parallel-size needs --backend {' or '.join(shards)} (the "
                f"{self.backend} backend uses --device multi)"
            )
        Layout(self.storage, self.target)  # raises for unknown modes
        parse_size(self.min_free, 1)
        if self.passes < 1:
            raise UsageError(f"--passes must be at least 1, got {self.passes}")
        if self.max_store is not None and (
            self.max_store.strip().endswith("%") or parse_size(self.max_store, 1) <= 0
        ):
            raise UsageError(f"--max-store needs a size such as 200G, got {self.max_store!r}")
        if self.passes > 1 and self.max_store is None:
            raise UsageError(
                "--passes runs the target over the data again for each epoch: it is for a disk "
                "smaller than the data, with --max-store; with room for the whole run, extract "
                "once and train --epochs N"
            )
        parse_size(self.max_foreign_gpu_mem, 1)

    @property
    def aux_count(self) -> int:
        """How many target layers are stored (ids given, or a count)."""
        if not self.aux_layers:
            return 3
        return self.aux_layers[0] if len(self.aux_layers) == 1 else len(self.aux_layers)

    @property
    def layout(self) -> Layout:
        """A new run's layout (`targets.backends.new_layout`)."""
        from eyas.targets.backends import new_layout

        return new_layout(self.backend, self.storage, self.target, self.aux_count)


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    model: str
    """The target model directory."""
    drafters: tuple[str, ...]
    """Exported drafters (any format eyas reads), judged on the same prompts."""
    data: str
    """JSONL prompts."""
    chat_template_kwargs: dict | None = None
    """Chat-template variables (default: those the drafter's training data was prepared with)."""
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
        from eyas.stages.evaluate import JUDGES  # (torch, which an evaluation loads anyway)

        if self.engine not in JUDGES:
            raise UsageError(f"--engine must be {' or '.join(JUDGES)}, got {self.engine!r}")
        if self.limit < 0 or self.max_new_tokens < 1 or self.precision < 0:
            raise UsageError("--limit must be >= 0, --max-new-tokens >= 1 and --precision >= 0")
        if self.draft_tokens is not None and self.draft_tokens < 1:
            raise UsageError(f"--draft-tokens must be at least 1, got {self.draft_tokens}")


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    run: str
    """The extraction run directory."""
    quick: bool = False
    """Headers, shapes and sizes only; skip checksums."""
    repair: bool = False
    """Quarantine bad files and drop their journal entries."""
    progress: bool = False
    """The samples checked so far, the rate and the time left, as extract shows."""


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    train_dir: str
    """The training directory (from eyas train)."""
    format: str
    """The serving format to write (drafters.formats: vllm, sglang)."""
    out: str
    """The directory to write config.json and model.safetensors to."""
    dtype: str = "float32"
    """The weights' dtype in the export: float32, bfloat16 or float16."""
    speculative_tokens: int | None = None
    """Tokens a chain (EAGLE-3) drafts a round when served (default 3); a DFlash block drafts
    its block."""
    verifier: str | None = None
    """The target's name or path on the serving machine (default: its local path)."""
    force: bool = False
    """Replace --out even if it holds files that are not an export."""

    def __post_init__(self) -> None:
        if self.speculative_tokens is not None and self.speculative_tokens < 1:
            raise UsageError(
                f"--speculative-tokens must be at least 1, got {self.speculative_tokens}"
            )


@dataclass(frozen=True, kw_only=True)
class TinyTargetConfig:
    """`eyas tiny-target`: a small random target of a real architecture (`eyas.demo_target.tiny`)."""

    arch: str = "llama"
    """llama, qwen3, qwen2, deepseek_v3 or kimi_k25 (a Kimi-K2.5-shaped wrapper)."""
    like: str | None = None
    """Real model dir (config + tokenizer) to imitate."""
    layers: int = 8
    """Decoder layers."""
    hidden_size: int = 64
    """Hidden size H (4 heads of H/4; vLLM's CPU kernels need heads of 64: --hidden-size 256)."""
    seed: int = 0
    """Seed of the random weights."""
    trust_remote_code: bool = False
    """Let --like's tokenizer code run."""
    base: bool = False
    """A base checkpoint: its tokenizer has no chat template."""

    def sizes(self):
        """The TinySizes these options give: 4 heads of H/4 (1 where H is not a multiple of 4)."""
        from eyas.demo_target.tiny import TinySizes

        heads = 4 if self.hidden_size % 4 == 0 else 1
        return TinySizes(
            num_hidden_layers=self.layers,
            hidden_size=self.hidden_size,
            num_attention_heads=heads,
            intermediate_size=2 * self.hidden_size,
            num_key_value_heads=min(2, heads) if heads % 2 == 0 else 1,
        )


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """`eyas demo`: the whole pipeline on the built-in target (`eyas.ops.demo`)."""

    workdir: str = "eyas-demo"
    """Where the demo writes everything (rebuilt each time)."""
    epochs: int = 10
    """Training epochs of the demo's drafter."""
    ttt_steps: int | None = None
    """TTT steps of the demo's EAGLE-3 drafter; default: the kind's demo recipe (5)."""
    kind: str = "eagle3"
    """The drafter kind (eagle3, dflash or dspark)."""
    eval_prompts: int = 1000
    """Held-out conversations the drafter is evaluated on."""

    def __post_init__(self) -> None:
        if self.epochs < 1 or (self.ttt_steps or 1) < 1 or self.eval_prompts < 1:
            raise UsageError("--epochs, --ttt-steps and --eval-prompts must be at least 1")


@dataclass(frozen=True, kw_only=True)
class EstimateConfig:
    """`eyas estimate`: the disk an extraction run will take (`eyas.ops.estimate`)."""

    samples: int
    """Number of samples."""
    tokens_per_sample: float
    """Mean tokens per sample."""
    hidden_size: int | None = None
    """Target hidden size H."""
    model: str | None = None
    """Target model directory (for H)."""
    store_dtype: str = "auto"
    """float32, bfloat16 or float16; auto: what extract stores on --device (its compute dtype)."""
    device: str = "auto"
    """Where the extraction will run: cuda (bfloat16 by default), cpu (float32) or auto (this
    machine)."""
    storage: str = "dense"
    """dense or fp8."""
    target: str = "last"
    """last or topk:K."""
    backend: str = "hf"
    """The extract backend the run will use (hf stores the target's argmax beside its final
    state, 4 bytes a token; vllm does not)."""
    draft_vocab_size: int = 32000
    """Draft vocabulary size D (sizes --target topk:K's ids)."""
    aux_layers: int = 3
    """Target layers stored per token, as `extract --aux-layers` gives them (3: EAGLE-3's; the
    DFlash and DSpark recipes read 5)."""
    batch_tokens: int = 8192
    """Tokens of a training batch, for the training memory of the head's logits (8,192: what
    `eyas train` takes for a run of millions of tokens)."""

    def __post_init__(self) -> None:
        if self.batch_tokens < 1:
            raise UsageError(f"--batch-tokens must be at least 1, got {self.batch_tokens}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.store_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise UsageError(
                f"--store-dtype must be auto, float32, bfloat16 or float16, got {self.store_dtype!r}"
            )
        if self.samples < 1 or self.tokens_per_sample <= 0:
            raise UsageError(
                f"--samples and --tokens-per-sample must be positive, got {self.samples} and "
                f"{self.tokens_per_sample}"
            )
        if self.aux_layers < 1:
            raise UsageError(f"--aux-layers must be at least 1, got {self.aux_layers}")
        from eyas.targets.backends import registered

        registered(self.backend)  # a usage error naming the backends
        if self.hidden_size is None and self.model is None:
            raise UsageError("need the target's hidden size: --model MODEL_DIR or --hidden-size H")

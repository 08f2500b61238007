"""`PrepareConfig` and `GenerateConfig`: what `eyas prepare` and `eyas generate` are asked to
do, one field per option, each with its default and (as its docstring) the help the command
line shows. Imports nothing heavy."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass


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
            raise ValueError(f"--overlong must be truncate or skip, got {self.overlong!r}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"--max-length must be at least 2, got {self.max_length}")
        if not self.data:
            raise ValueError("no input files given (--data)")
        if self.draft_vocab_size < 1:
            raise ValueError(f"--draft-vocab-size must be positive, got {self.draft_vocab_size}")
        if not 0 <= self.max_error_rate <= 1:
            raise ValueError(f"--max-error-rate must lie in [0, 1], got {self.max_error_rate}")


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
            raise ValueError(f"--turns must be last or all, got {self.turns!r}")
        if (
            self.concurrency < 1
            or self.retries < 0
            or self.max_tokens < 1
            or self.timeout <= 0
            or self.backoff < 0
            or self.max_response_bytes < 1024
        ):
            raise ValueError(
                "--concurrency and --max-tokens must be >= 1, --retries >= 0, --timeout > 0, "
                "--max-response-bytes >= 1024"
            )
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint must be an http(s) URL, got {self.endpoint!r}")
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ValueError(f"--api-key-env {self.api_key_env}: no such environment variable")
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

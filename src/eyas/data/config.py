"""`PrepareConfig`: what `eyas prepare` is asked to do, one field per option, each with its
default and (as its docstring) the help the command line shows. Imports nothing heavy."""

from __future__ import annotations

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

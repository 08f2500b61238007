"""What a serving format is, and what a drafter kind says about being served in one.

A format (`Format`) is what one engine family loads and how it is started: its name (the
`--format` and `--serve-with` value), the engine's name as users read it, and the command
line that serves an export. A kind says, per format it can be written in, a `Served`: the
engine's name for the kind, the flags that make the engine run the drafter as trained, what
the format cannot run, and what a training for it must be."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _no_flags(_export_config: dict, _tokens: int) -> list[str]:
    return []


def _refuses_nothing(_config: Any) -> str | None:
    return None


@dataclass(frozen=True)
class Served:
    """How a kind is served in one format (an entry of the kind's `serving`)."""

    method: str
    """The engine's name for the kind (vLLM's speculative method, SGLang's algorithm)."""
    flags: Callable[[dict, int], list[str]] = _no_flags
    """(export config, drafts a round) -> the engine's options that make it run the drafter
    as it was trained and evaluated (its defaults may run another shape, a tree)."""
    refuses: Callable[[Any], str | None] = _refuses_nothing
    """A drafter's config (or a training's, asked before it starts) -> why this format would
    run another network than the one trained; None where it runs it."""
    trains: dict = field(default_factory=dict)
    """Options a training for this format must have (its network has no others)."""
    defaults: dict = field(default_factory=dict)
    """Options a training for this format takes where the user leaves them out."""
    writer: Any = None
    """The kind's own writer of this format's files, where its formats differ."""
    whole_vocabulary: bool = False
    """The engine drafts over the target's whole head (it loads no head of the drafter's): a
    training for it drafts every id of the target's vocabulary."""


class Format:
    """One serving format; `FORMATS` (eyas.drafters.formats) holds each once."""

    name: str
    """The `--format` / `--serve-with` value."""
    engine: str
    """The engine, as its users name it."""

    def serve_line(
        self, target: str, path: str, served: Served, config: dict, tokens: int, render: list[str]
    ) -> list[str]:
        """The command that serves the export at `path` (its config.json `config`) for
        `target`, drafting `tokens` a round, its prompts rendered by `render`'s options."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<format {self.name}>"

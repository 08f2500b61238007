"""The serving formats an export is written in: one adapter a format (its module here) and
one line in `FORMATS`. A kind lists the formats it can be written in, with how (`Served`), in
its `serving`; nothing outside these adapters tells one format from another by its name."""

from __future__ import annotations

from eyas.drafters.formats.base import Format, Served
from eyas.drafters.formats.sglang import SGLANG
from eyas.drafters.formats.vllm import VLLM
from eyas.errors import UsageError

__all__ = ["DEFAULT", "FORMATS", "SGLANG", "VLLM", "Format", "Served", "format_named"]

FORMATS: dict[str, Format] = {f.name: f for f in (VLLM, SGLANG)}
DEFAULT = VLLM  # what `eyas demo` serves, and `--serve-with` left out


def format_named(name: str, flag: str = "--format") -> Format:
    """The format called `name`; a name no adapter has is a usage error naming `flag`."""
    if name not in FORMATS:
        raise UsageError(f"{flag} must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]

"""The one resume rule: how each field of a stage's saved config meets a later invocation.

Every field of a stage's config is one of three kinds:

- **fixed by the run** (the default): a resume keeps the saved value; a different value
  given is refused (a usage error, exit 2) naming both values.
- **may change** on a resume (`may_change`): a value given is used and saved for later
  resumes; otherwise the saved one is taken.
- **per invocation** (`per_invocation`): never saved, never taken from the saved config
  (where this process stands in a split, what it may do to this machine, whether a model's
  own code may run).

A directory written before a field existed reads it as `before[field]`: the value it was
made with. Each stage owns one `ResumeRule` beside its config; this module is the only
place that applies one. Below every other module except `errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from eyas.errors import UsageError

__all__ = ["ResumeRule", "ResumeRefused"]

_ABSENT = object()


class ResumeRefused(UsageError):
    """A field fixed by the run was given another value (exit 2)."""


@dataclass(frozen=True)
class ResumeRule:
    may_change: frozenset[str] = frozenset()
    per_invocation: frozenset[str] = frozenset()
    before: Mapping[str, object] = field(default_factory=dict)

    def fixed(self, name: str) -> bool:
        return name not in self.may_change and name not in self.per_invocation

    def stored(self, config: Mapping) -> dict:
        """What a stage writes: every field but the per-invocation ones."""
        return {k: v for k, v in config.items() if k not in self.per_invocation}

    def saved(self, config: Mapping) -> dict:
        """A saved config as this version reads it: fields it lacks take their `before`
        values; per-invocation fields are dropped."""
        return {**self.before, **self.stored(config)}

    def differing(self, saved: Mapping, mine: Mapping) -> list[str]:
        """The fixed fields whose value in a whole config `mine` is not the saved one."""
        theirs = self.saved(saved)
        return [
            k
            for k in sorted(theirs.keys() | mine.keys())
            if self.fixed(k) and mine.get(k, _ABSENT) != theirs.get(k)
        ]

    def differences(self, saved: Mapping, mine: Mapping) -> list[str]:
        """`differing`, each as '--name SAVED saved, MINE given' (a field this version does
        not have says so)."""
        theirs = self.saved(saved)
        return [
            _describe(k, theirs.get(k), mine.get(k, _ABSENT)) for k in self.differing(saved, mine)
        ]

    def resume(self, saved: Mapping, given: Mapping, where: str) -> dict:
        """The config a resume runs with: the saved one, with what this invocation `given`
        says applied. A fixed field given another value is refused (ResumeRefused naming
        `where`, the field and both values)."""
        theirs = self.saved(saved)
        changed = [
            _describe(k, theirs.get(k), v)
            for k, v in sorted(given.items())
            if self.fixed(k) and v != theirs.get(k)
        ]
        if changed:
            raise ResumeRefused(
                f"{where}: {'; '.join(changed)}: fixed by the run, it cannot "
                "change on resume (leave the option out, or start a new run)"
            )
        return {**theirs, **given}


def _describe(name: str, saved, given) -> str:
    flag = f"--{name.replace('_', '-')}"
    if given is _ABSENT:
        return f"{flag} {saved} saved, an option this eyas does not have"
    return f"{flag} {saved} saved, {given} given"

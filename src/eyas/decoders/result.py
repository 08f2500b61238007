"""What an evaluation measures: `EvalResult`, its counts, intervals and
per-length buckets, filled by every judge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eyas.errors import ProblemError

LENGTH_BUCKETS = (0, 512, 2048, 4096, 8192, 16384)
"""Lower edges, in prompt tokens, of the context-length buckets every evaluation reports."""


def length_bucket(n: int) -> int:
    """The index in LENGTH_BUCKETS of the bucket a prompt of `n` tokens falls in."""
    return max(i for i, lo in enumerate(LENGTH_BUCKETS) if n >= lo)


def _bucket_name(lo: int, hi: int | None) -> str:
    k = lambda n: f"{n // 1024}K" if n >= 1024 else str(n)  # noqa: E731
    return f"< {k(hi)}" if lo == 0 else (f">= {k(lo)}" if hi is None else f"{k(lo)}-{k(hi)}")


@dataclass
class EvalResult:
    prompts: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    per_position: list[list[int]] = field(default_factory=list)  # [accepted, drafted] per position
    per_prompt: list[list[int]] = field(
        default_factory=list
    )  # [rounds, accepted, emitted] per prompt
    spec_tokens: int = 0
    spec_seconds: float = 0.0
    base_tokens: int = 0
    base_seconds: float = 0.0
    mismatches: list[dict] = field(default_factory=list)
    categories: list[str | None] = field(
        default_factory=list
    )  # per prompt, where the data names one
    stopped_by: str | None = None  # a signal's name: a partial result over the prompts done
    planned: int = 0  # the prompts asked for
    drafter: dict = field(default_factory=dict)  # what was judged: path, kind, drafts a round
    lengths: list[int] = field(default_factory=list)  # per prompt, its length in tokens
    positions: list[list[int]] = field(default_factory=list)  # per prompt, accepted per position
    inputs: dict = field(default_factory=dict)  # records read, used, left out and why
    groups: list[list[int]] = field(default_factory=list)
    """Where a judge counts groups of prompts, not each (vLLM's counters are totals: it runs
    one length bucket at a time), the prompts each row of `per_prompt` and `positions`
    counts, all of one bucket; empty: row i is prompt i. Groups have no interval."""

    @classmethod
    def merged(cls, parts: list[EvalResult]) -> EvalResult:
        """One result from the results of consecutive slices of one prompt file, judged apart
        (in other processes, say) with the same drafter and drafts a round: the same figures
        as judging the whole file at once. Mismatches keep their place in the whole file;
        `inputs` keeps each slice's account of its records."""
        if not parts:
            raise ProblemError("nothing to merge")
        widths = {len(p.per_position) for p in parts}
        if len(widths) != 1 or len({str(p.drafter) for p in parts}) != 1:
            raise ProblemError("the parts judged different drafters or drafted different lengths")
        if any(p.prompts != p.planned for p in parts[:-1]):
            raise ProblemError(
                "a part before the last ended early: the slices after it would shift"
            )
        out = cls(
            per_position=[[0, 0] for _ in range(widths.pop())],
            drafter=parts[0].drafter,
            inputs={"slices": [p.inputs for p in parts]} if any(p.inputs for p in parts) else {},
        )
        for p in parts:
            out.mismatches += [{**m, "prompt": m["prompt"] + out.prompts} for m in p.mismatches]
            out.groups += [[i + out.prompts for i in g] for g in p.groups]
            for name in (
                "prompts",
                "rounds",
                "drafted",
                "accepted",
                "spec_tokens",
                "base_tokens",
                "spec_seconds",
                "base_seconds",
                "planned",
            ):
                setattr(out, name, getattr(out, name) + getattr(p, name))
            for name in ("per_prompt", "lengths", "positions"):
                getattr(out, name).extend(getattr(p, name))
            out.categories.extend(p.categories[: len(p.per_prompt)])  # named for every prompt asked
            for total, (a, d) in zip(out.per_position, p.per_position, strict=True):
                total[0] += a
                total[1] += d
            out.stopped_by = out.stopped_by or p.stopped_by
        return out

    def compare(self, prompt: int, spec: list[int], base: list[int], tok) -> None:
        """Record where speculative decoding's output first differs from greedy's, if it does."""
        if spec != base:
            first = next(
                (j for j, (a, b) in enumerate(zip(spec, base, strict=False)) if a != b),
                min(len(spec), len(base)),
            )
            self.mismatches.append(
                {
                    "prompt": prompt,
                    "first_difference_at": first,
                    "greedy": tok.decode(base),
                    "speculative": tok.decode(spec),
                }
            )

    @property
    def acceptance_length(self) -> float:
        """Engine-style acceptance length: 1 + accepted drafts per round, counting drafts the
        target accepted after the reply's end too (vLLM's and SGLang's counters' figure)."""
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens emitted per verifying target forward, cut where the reply ends (end of
        sequence or the token limit): what speculative decoding saves. The headline."""
        return sum(p[2] for p in self.per_prompt) / self.rounds if self.rounds else 0.0

    def precise_to(self, half_width: float) -> bool:
        ci = self.intervals(500)["tokens_per_forward"]
        return ci is not None and (ci[1] - ci[0]) / 2 <= half_width

    def intervals(self, n: int = 2000, seed: int = 0) -> dict:
        """95% bootstrap intervals over prompts for both figures (prompts resampled whole:
        the rounds of one prompt are not independent)."""
        import numpy as np

        a = np.array(self.per_prompt, dtype=np.float64).reshape(-1, 3)
        a = a[a[:, 0] > 0]
        if len(a) < 2 or self.groups:  # totals over groups of prompts: nothing to resample
            return {"acceptance_length": None, "tokens_per_forward": None}
        idx = np.random.default_rng(seed).integers(0, len(a), (n, len(a)))
        rounds = a[idx, 0].sum(1)
        acc = 1 + a[idx, 1].sum(1) / rounds
        tpf = a[idx, 2].sum(1) / rounds
        q = lambda x: [round(float(v), 3) for v in np.percentile(x, [2.5, 97.5])]  # noqa: E731
        return {"acceptance_length": q(acc), "tokens_per_forward": q(tpf)}

    def by_category(self) -> dict[str, dict]:
        """Tokens per forward and acceptance length of each category's prompts, with
        intervals: a drafter that helps code and not roleplay shows it here."""
        groups: dict[str, list[list[int]]] = {}
        for cat, row in zip(self.categories, self.per_prompt, strict=False):
            if cat is not None:
                groups.setdefault(cat, []).append(row)
        out = {}
        for cat, rows in sorted(groups.items()):
            sub = EvalResult(
                prompts=len(rows),
                per_prompt=rows,
                rounds=sum(r[0] for r in rows),
                accepted=sum(r[1] for r in rows),
            )
            ci = sub.intervals()
            out[cat] = {
                "prompts": len(rows),
                "tokens_per_forward": round(sub.tokens_per_forward, 3),
                "tokens_per_forward_ci95": ci["tokens_per_forward"],
                "acceptance_length": round(sub.acceptance_length, 3),
                "acceptance_length_ci95": ci["acceptance_length"],
            }
        return out

    def by_length(self) -> dict[str, dict]:
        """Tokens per forward, acceptance length and per-position acceptance of the prompts
        in each context-length bucket (LENGTH_BUCKETS; empty ones left out), with intervals
        where each prompt was counted: a drafter that holds at short context and not at long
        shows it here."""
        rows = self.groups or [[i] for i in range(len(self.per_prompt))]
        if not rows or len(self.lengths) != sum(len(g) for g in rows):
            return {}
        out = {}
        for b, (lo, hi) in enumerate(
            zip(LENGTH_BUCKETS, LENGTH_BUCKETS[1:] + (None,), strict=True)
        ):
            pick = [r for r, g in enumerate(rows) if length_bucket(self.lengths[g[0]]) == b]
            if not pick:
                continue
            members = [i for r in pick for i in rows[r]]
            sub = EvalResult(
                prompts=len(members),
                per_prompt=[self.per_prompt[r] for r in pick],
                rounds=sum(self.per_prompt[r][0] for r in pick),
                accepted=sum(self.per_prompt[r][1] for r in pick),
                groups=[rows[r] for r in pick] if self.groups else [],
            )
            ci = sub.intervals()
            pos = [sum(self.positions[r][j] for r in pick) for j in range(len(self.per_position))]
            out[_bucket_name(lo, hi)] = {
                "prompts": len(members),
                "mean_prompt_tokens": round(sum(self.lengths[i] for i in members) / len(members)),
                "tokens_per_forward": round(sub.tokens_per_forward, 3),
                "tokens_per_forward_ci95": ci["tokens_per_forward"],
                "acceptance_length": round(sub.acceptance_length, 3),
                "acceptance_length_ci95": ci["acceptance_length"],
                "per_position_acceptance": [
                    round(a / sub.rounds, 3) if sub.rounds else None for a in pos
                ],
            }
        return out

    def _rows(self) -> dict:
        """`per_prompt` for the JSON: each prompt's length and, where it was counted alone,
        its rounds; `per_group` where the judge counted groups of prompts."""
        if not self.lengths:
            return {}
        if self.groups:
            return {
                "per_prompt": [{"prompt_tokens": n} for n in self.lengths],
                "per_group": [
                    {"prompts": g, "rounds": r[0], "accepted": r[1], "emitted": r[2]}
                    for g, r in zip(self.groups, self.per_prompt, strict=True)
                ],
            }
        return {
            "per_prompt": [
                {"prompt_tokens": n, "rounds": r[0], "accepted": r[1], "emitted": r[2]}
                for n, r in zip(self.lengths, self.per_prompt, strict=False)
            ]
        }

    def to_dict(self) -> dict:
        ci = self.intervals()
        return {
            **({"drafter": self.drafter} if self.drafter else {}),
            "prompts": self.prompts,
            "rounds": self.rounds,
            "draft_tokens": self.drafted,
            "accepted": self.accepted,
            "tokens_per_forward": round(self.tokens_per_forward, 3),
            "tokens_per_forward_ci95": ci["tokens_per_forward"],
            "acceptance_length": round(self.acceptance_length, 3),
            "acceptance_length_ci95": ci["acceptance_length"],
            "per_position_acceptance": [
                round(a / d, 3) if d else None for a, d in self.per_position
            ],
            "spec_tokens_per_s": round(self.spec_tokens / self.spec_seconds, 1)
            if self.spec_seconds
            else 0.0,
            "greedy_tokens_per_s": round(self.base_tokens / self.base_seconds, 1)
            if self.base_seconds
            else 0.0,
            "speedup": round(
                (self.spec_tokens / self.spec_seconds) / (self.base_tokens / self.base_seconds), 3
            )
            if self.spec_seconds and self.base_seconds and self.base_tokens
            else None,
            "lossless": not self.mismatches,
            "mismatches": self.mismatches,
            **(
                {"partial": True, "stopped_by": self.stopped_by, "prompts_planned": self.planned}
                if self.stopped_by
                else {}
            ),
            **(
                {"by_category": self.by_category()}
                if any(c is not None for c in self.categories)
                else {}
            ),
            **({"by_length": self.by_length()} if self.lengths else {}),
            **self._rows(),
            **({"inputs": self.inputs} if self.inputs else {}),
        }

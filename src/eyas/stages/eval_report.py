"""How an evaluation reads on a console: what was judged, the headline figures with their
intervals, the per-category and per-length tables, what was left out, and, for several
drafters judged on the same prompts, their paired differences. The JSON form is
`EvalResult.to_dict`; this module only renders it."""

from __future__ import annotations

from rich.table import Table


def _say(out, text: str) -> None:
    out.print(text, markup=False, highlight=False)


def _iv(v) -> str:
    return f"{v[0]:.2f}-{v[1]:.2f}" if v else "-"


def _positions(values) -> str:
    return ", ".join(f"{a:.2f}" if a is not None else "-" for a in values)


def render_inputs(out, d: dict, data) -> None:
    """What of --data was used: records left out and why, prompts given as raw text."""
    inputs = d.get("inputs") or {}
    if inputs.get("skipped"):
        why = "; ".join(
            f"{v['count']} {v['reason']} (first at line {v['first_lines'][0]})"
            for v in inputs["skipped"].values()
        )
        _say(
            out,
            f"{data}: {inputs['used']} of {inputs['records']} records used as prompts; left out: {why}",
        )
    if inputs.get("raw_text"):
        _say(
            out,
            f"{inputs['raw_text']} of {inputs['used']} prompts are raw text, tokenized as they are and "
            "continued (no chat template)",
        )


_BUCKET_COLUMNS = ("prompts", "tokens/forward", "95% interval", "acceptance length")


def _bucket_cells(c: dict) -> tuple[str, ...]:
    """A bucket's (a category's, a length's) cells under _BUCKET_COLUMNS."""
    return (
        str(c["prompts"]),
        f"{c['tokens_per_forward']:.2f}",
        _iv(c["tokens_per_forward_ci95"]),
        f"{c['acceptance_length']:.2f}",
    )


def render_result(out, d: dict) -> None:
    """One drafter's evaluation (`EvalResult.to_dict` with its engine)."""
    judged = d.get("drafter") or {}
    k = judged.get("draft_tokens", len(d["per_position_acceptance"]))

    def ci(key: str) -> str:
        return f" (95% interval {_iv(d[key])} over prompts)" if d[key] else ""

    if judged:
        _say(
            out,
            f"{judged['kind']} drafter {judged['path']}, {k} drafts a round (it serves {judged['serves']}):",
        )
    _say(
        out,
        f"{d['prompts']} prompts, {d['rounds']} rounds (K={k}):\n"
        f"  tokens emitted per target forward {d['tokens_per_forward']:.2f}{ci('tokens_per_forward_ci95')}, "
        "cut where each reply ends\n"
        f"  acceptance length {d['acceptance_length']:.2f}{ci('acceptance_length_ci95')}, engine-style "
        f"(counts drafts accepted past the reply's end); per-position acceptance "
        f"[{_positions(d['per_position_acceptance'])}]\n"
        f"speculative {d['spec_tokens_per_s']:.1f} tok/s vs greedy {d['greedy_tokens_per_s']:.1f} tok/s "
        f"(x{d['speedup']}); lossless: {'yes' if d['lossless'] else 'NO'}",
    )
    if d.get("by_category"):
        t = Table("category", *_BUCKET_COLUMNS)
        for cat, c in d["by_category"].items():
            t.add_row(cat, *_bucket_cells(c))
        out.print(t)
    if d.get("by_length"):
        t = Table("prompt tokens", *_BUCKET_COLUMNS, "per-position acceptance")
        for name, c in d["by_length"].items():
            t.add_row(name, *_bucket_cells(c), _positions(c["per_position_acceptance"]))
        out.print(t)
    longest = judged.get("longest_training_sample")
    lengths = [p["prompt_tokens"] for p in d.get("per_prompt", [])]
    if longest and (over := sum(n > longest for n in lengths)):
        _say(
            out,
            f"note: {over} of {len(lengths)} prompts are longer than the longest sample the drafter was "
            f"trained on ({longest} tokens; prompts up to {max(lengths)}): past it, its figures are "
            "extrapolation (see docs/recipe.md on long context)",
        )
    ctx = judged.get("target_context")
    if ctx and lengths and (past := sum(n > ctx for n in lengths)):
        _say(
            out,
            f"note: {past} of {len(lengths)} prompts are longer than the target's context ({ctx} "
            "tokens, max_position_embeddings): the target itself runs past what it was made for "
            "there, drafter or not",
        )
    for m in d["mismatches"][:3]:
        _say(out, f"  prompt {m['prompt']} differs at token {m['first_difference_at']}")


def render_paired(out, pairs: list[dict]) -> None:
    """Each drafter against the first, on the same prompts."""
    for p in pairs:
        iv = (
            f" [95% interval {p['difference_ci95'][0]:+.3f}, {p['difference_ci95'][1]:+.3f}]"
            if p["difference_ci95"]
            else ""
        )
        _say(
            out,
            f"{p['b']} against {p['a']}: tokens per forward {p['tokens_per_forward'][1]:.3f} vs "
            f"{p['tokens_per_forward'][0]:.3f}, difference {p['difference']:+.3f}{iv} "
            f"(paired over the same {p['prompts']} prompts)",
        )


def stopped_line(ds: list[dict], asked: int) -> str | None:
    """Where a judge stopped early (by a signal), or None: the figures above are over the
    prompts done before it, and of the drafters judged so far of the `asked`."""
    if len(ds) == asked and not ds[-1].get("partial"):
        return None
    d = ds[-1]
    of = "" if asked == 1 else f" of drafter {len(ds)} of {asked}"
    return (
        f"stopped: by {d.get('stopped_by')} after {d['prompts']} of "
        f"{d.get('prompts_planned', d['prompts'])} prompts{of}; the figures are over those alone"
    )

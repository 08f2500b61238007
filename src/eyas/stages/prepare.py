"""Stage 1, `prepare`: conversations -> token ids and an assistant-only loss mask.

The rendering is the model's own chat template (what a serving engine renders), and the
loss mask is derived from the template itself: for each assistant turn the conversation is
rendered up to the turn's generation prompt and up to the end of the turn; the characters
in between are what the assistant produced (content and end-of-turn token), and the tokens
covering them are trainable. No per-family regexes.

Bad records never stop the run: each goes to `errors.jsonl` with file, line, id and
reason. The dataset directory is updated atomically: data files carry the content
fingerprint in their names and `dataset.json`, written last, is the commit point; a crash
leaves the previous dataset or the complete new one. `PreparedDataset` is the only reader.
"""

from __future__ import annotations

import re
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from eyas.data.chat import assistant_spans, tokenize_with_mask
from eyas.data.dataset import Prepared, foreign_entries, write_dataset, write_errors_only
from eyas.data.records import (
    REASONS,
    RawRecord,
    RecordError,
    iter_records,
    parse_record,
    read_conversation,
    record_id,
)
from eyas.errors import ProblemError, UsageError
from eyas.host.ui import Reporter
from eyas.stages.config import PrepareConfig
from eyas.targets.target import (
    load_tokenizer,
    past_context,
    read_chat_template,
    require_chat_template,
)


@dataclass
class PrepareSummary:
    out: str
    records: int = 0
    prepared: int = 0
    samples: int = 0  # more than `prepared` with per-turn samples
    failed: int = 0
    skipped_overlong: int = 0
    truncated: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    fingerprint: str = ""
    unknown_roles: dict[str, int] = field(default_factory=dict)
    emptied: list[int] = field(default_factory=list)
    """Records left without a trainable token by --max-length: each one's first assistant
    token position (a longer --max-length keeps them)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Assistant turns whose tool calls (`tool_calls`) or reasoning (`reasoning`) the chat
    template did not render, so training never sees them."""
    dropped_records: int = 0
    dropped_in: dict[str, int] = field(default_factory=dict)
    """Per name in `dropped`, the records where it happens."""
    notes: list[str] = field(default_factory=list)
    """What was changed from what was asked, in words (printed under the summary)."""

    def max_length_keeping(self, share: float = 0.9) -> int | None:
        """The --max-length that would keep `share` of the records truncation emptied."""
        if not self.emptied:
            return None
        pos = sorted(self.emptied)
        return pos[min(len(pos) - 1, int(share * len(pos)))] + 64  # room for some answer

    @property
    def error_rate(self) -> float:
        return self.failed / self.records if self.records else 0.0

    def render(self, written: bool = True) -> str:
        """The summary line, then one line per kind of turn or record left out and why."""
        lines = [
            f"prepared {self.prepared}/{self.records} records"
            + (
                f" into {self.samples} samples (one per assistant turn)"
                if self.samples != self.prepared
                else ""
            )
            + f", {self.tokens} tokens ({self.trainable_tokens} trainable), {self.truncated} truncated, "
            f"{self.skipped_overlong} skipped as overlong, {len(self.emptied)} emptied by truncation, "
            f"{self.failed} failed" + (f" -> {self.out}" if written else "")
        ]
        for f, n in sorted(self.dropped.items()):
            lines.append(
                f"  {n:6d}  {_dropped_turns(f, self.dropped_in.get(f, self.dropped_records))}"
            )
        for code, n in self.reasons.items():
            extra = ""
            if code == "unknown-role" and self.unknown_roles:
                extra = ": " + ", ".join(
                    f"{r} ({k})" for r, k in sorted(self.unknown_roles.items())
                )
            lines.append(f"  {n:6d}  {REASONS.get(code, code)}{extra}")
        if self.emptied:
            lines.append(
                f"  {len(self.emptied)} record(s) begin their first answer past --max-length; "
                f"--max-length {self.max_length_keeping()} would keep 90% of them"
            )
        lines += [f"note: {note}" for note in self.notes]
        if written and (self.failed or self.emptied or self.skipped_overlong):
            lines.append(f"  details: {Path(self.out) / 'errors.jsonl'}")
        return "\n".join(lines)


def _dropped_turns(what: str, records: int) -> str:
    """Why turns whose `what` (tool_calls, reasoning, a role) the template drops are not trained on."""
    where = f"(in {records} records)"
    if what in ("tool_calls", "reasoning"):
        return (
            f"assistant turns whose {what.replace('_', ' ')} the chat template does not render "
            f"{where}: not trained on"
        )
    if what == "reasoning_in_history":
        return (
            f"earlier assistant turns whose reasoning the chat template drops from the history "
            f"{where}: not trained on; --per-turn-samples trains each turn with its reasoning"
        )
    return (
        f"{what} turns the chat template does not render {where}: the drafter learns the "
        f"answers without them, as the served target sees them; a template that renders {what} "
        "turns (--chat-template FILE) keeps them"
    )


# ---------------------------------------------------------------------------- loss mask


# ---------------------------------------------------------------------------- workers

_TOK = None


def _init_worker(model: str, trust_remote_code: bool, chat_template: str | None) -> None:
    global _TOK
    _TOK = load_tokenizer(model, trust_remote_code, chat_template)


def _prepare_one(rec: RawRecord, cfg: PrepareConfig) -> list[Prepared] | tuple[str, str, str]:
    """The record's samples (one, or one per assistant turn), or (id, code, reason) for a
    bad record."""
    rid = f"{Path(rec.file).name}:{rec.line}"
    try:
        obj = parse_record(rec)
        rid = record_id(obj, rec)
        conv = read_conversation(obj)
        fmt, content, tools = conv.form, conv.messages, conv.tools
        if fmt == "text":
            return [_sample(rid, rec, fmt, *tokenize_with_mask(_TOK, conv.text, None), cfg)]
        if not cfg.per_turn_samples:
            ids, mask, dropped = _render_masked(content, cfg.last_turn_only, tools, cfg)
            return [_sample(rid, rec, fmt, ids, mask, cfg, dropped)]
        out = []
        for i in (i for i, m in enumerate(content) if m["role"] == "assistant"):
            ids, mask, dropped = _render_masked(content[: i + 1], True, tools, cfg)
            out.append(_sample(f"{rid}/turn-{i}", rec, fmt, ids, mask, cfg, dropped))
        return out
    except RecordError as exc:
        return rid, exc.code, str(exc), getattr(exc, "first_trainable", None)


def _render_masked(messages: list[dict], last_only: bool, tools, cfg: PrepareConfig):
    """(ids, mask, dropped fields) of a conversation."""
    dropped: list[str] = []
    try:
        text, spans = assistant_spans(
            _TOK, messages, last_only, tools, cfg.chat_template_kwargs, dropped
        )
    except RecordError:
        raise
    except Exception as exc:  # the template itself raised (e.g. it rejects a role order)
        raise RecordError(f"chat template failed: {exc}", "template") from exc
    return (*tokenize_with_mask(_TOK, text, spans), tuple(dropped))


def _sample(
    rid: str,
    rec: RawRecord,
    fmt: str,
    ids: list[int],
    mask: list[int],
    cfg: PrepareConfig,
    dropped: tuple[str, ...] = (),
) -> Prepared:
    """One sample, cut to --max-length (or refused as overlong) and with trainable tokens."""
    n, truncated, full_mask = len(ids), False, mask
    if cfg.max_length is not None and n > cfg.max_length:
        if cfg.overlong == "skip":
            raise RecordError(
                f"overlong: {n} tokens > --max-length {cfg.max_length} (skipped)", "overlong"
            )
        ids, mask, truncated = ids[: cfg.max_length], mask[: cfg.max_length], True
    if not any(mask):
        if truncated:  # the conversation is fine; its first answer starts past the cut
            exc = RecordError(
                f"no trainable tokens within --max-length {cfg.max_length}: the first "
                f"assistant token is at position {full_mask.index(1)} of {n}",
                "emptied-by-truncation",
            )
            exc.first_trainable = full_mask.index(1)
            raise exc
        raise RecordError("zero trainable tokens", "zero-trainable")
    return Prepared(rid, rec.file, rec.line, fmt, ids, mask, n, truncated, dropped)


def _prepare_chunk(args: tuple[list[RawRecord], PrepareConfig]) -> list:
    recs, cfg = args
    return [_prepare_one(r, cfg) for r in recs]


# ---------------------------------------------------------------------------- the stage


def _error_line(raw, rid: str, reason: str, code: str, kind: str) -> dict:
    """One line of errors.jsonl: the record (file, line, id), what was wrong, and whether it
    was an error or a record skipped as asked (--max-length)."""
    return {
        "file": raw.file,
        "line": raw.line,
        "id": rid,
        "reason": reason,
        "code": code,
        "kind": kind,
    }


def prepare(cfg: PrepareConfig) -> PrepareSummary:
    """Run the prepare stage; returns counts. Raises only for problems with the whole run."""
    out = Path(cfg.out)
    _check_paths(cfg, out)
    template = read_chat_template(cfg.chat_template)
    tok = load_tokenizer(cfg.model, cfg.trust_remote_code, template)
    global _TOK
    _TOK = tok
    raws: list[RawRecord] = []
    for f in cfg.data:
        raws.extend(iter_records(Path(f)))
    if not tok.chat_template:
        require_chat_template(tok, cfg.model, _conversations(raws), len(raws), "--data")
    if not raws:
        raise UsageError(f"no records in {', '.join(cfg.data)}: the input is empty")

    summary = PrepareSummary(out=str(out), records=len(raws))
    samples, errors = _tally(raws, _render_all(raws, cfg, template), summary)
    if note := past_context(cfg.model, [len(s.input_ids) for s in samples], "samples"):
        summary.notes.append(note)
    _refuse_if_lost(cfg, out, samples, errors, summary)
    summary.fingerprint = write_dataset(out, samples, errors, cfg, tok, summary)
    return summary


def _check_paths(cfg: PrepareConfig, out: Path) -> None:
    """--out must be new, empty or prepare's own (with --force); every --data a file."""
    if out.exists() and not out.is_dir():
        raise FileNotFoundError(f"--out {out} is a file; give a directory for the dataset")
    if foreign := foreign_entries(out):
        raise FileNotFoundError(
            f"--out {out} holds files prepare did not write ({', '.join(foreign[:3])}"
            f"{' ...' if len(foreign) > 3 else ''}); give an empty or new directory"
        )
    if (out / "dataset.json").exists() and not cfg.force:
        raise UsageError(
            f"{out} already holds a prepared dataset; extraction runs made from it need it "
            "to resume. Choose another --out, or pass --force to replace it"
        )
    for f in cfg.data:
        if Path(f).is_dir():
            raise FileNotFoundError(f"--data {f} is a directory; give JSONL or JSON files")
        if not Path(f).is_file():
            raise FileNotFoundError(f"input file not found: {f}")


def _render_all(raws: list[RawRecord], cfg: PrepareConfig, template) -> list:
    """Each record through the template, in chunks (in worker processes with --num-workers)."""
    chunks = [(raws[i : i + 256], cfg) for i in range(0, len(raws), 256)]
    results: list = []
    with Reporter("prepare", len(raws), unit="records", enabled=cfg.progress) as rep:
        if cfg.num_workers > 1 and len(chunks) > 1:
            with ProcessPoolExecutor(
                cfg.num_workers,
                initializer=_init_worker,
                initargs=(cfg.model, cfg.trust_remote_code, template),
            ) as ex:
                for res in ex.map(_prepare_chunk, chunks):
                    results.extend(res)
                    rep.advance(len(res))
        else:
            for ch in chunks:
                res = _prepare_chunk(ch)
                results.extend(res)
                rep.advance(len(res))
    return results


def _tally(raws: list[RawRecord], results: list, summary: PrepareSummary):
    """The samples and error lines, with every skip, failure and dropped field counted."""
    samples: list[Prepared] = []
    errors: list[dict] = []
    seen: dict[str, str] = {}  # id -> where it was first seen (good records and bad ones)
    reasons: Counter = Counter()
    for raw, res in zip(raws, results, strict=True):
        where = f"{raw.file}:{raw.line}"
        rid = res[0] if isinstance(res, tuple) else res[0].id.split("/turn-")[0] if res else ""
        first = seen.setdefault(rid, where)
        if isinstance(res, tuple):
            _, code, reason, first_trainable = res
            if code in ("overlong", "emptied-by-truncation"):  # what --max-length asked for
                if code == "overlong":
                    summary.skipped_overlong += 1
                else:
                    summary.emptied.append(first_trainable)
                errors.append(_error_line(raw, rid, reason, code, "skipped"))
                continue
        elif first != where:
            code, reason = "duplicate-id", f"duplicate id {rid!r}: line {first} has the same id"
        else:
            samples.extend(res)
            summary.prepared += 1
            continue
        reasons[code] += 1
        if code == "unknown-role" and (m := re.search(r"unknown role (.+)$", reason)):
            summary.unknown_roles[m.group(1)] = summary.unknown_roles.get(m.group(1), 0) + 1
        errors.append(_error_line(raw, rid, reason, code, "error"))

    summary.failed = sum(reasons.values())
    summary.reasons = dict(reasons.most_common())
    if summary.emptied:
        summary.reasons["emptied-by-truncation"] = len(summary.emptied)
    summary.samples = len(samples)
    for smp in samples:
        for f in smp.dropped:
            summary.dropped[f] = summary.dropped.get(f, 0) + 1
    summary.dropped_records = len({(smp.file, smp.line) for smp in samples if smp.dropped})
    for f in summary.dropped:
        summary.dropped_in[f] = len({(s.file, s.line) for s in samples if f in s.dropped})
    summary.truncated = sum(s.truncated for s in samples)
    summary.tokens = sum(len(s.input_ids) for s in samples)
    summary.trainable_tokens = sum(sum(s.loss_mask) for s in samples)
    return samples, errors


def _refuse_if_lost(cfg, out: Path, samples, errors, summary: PrepareSummary) -> None:
    """Refuse the dataset when too many records failed or lost what training needs."""
    # Trained turns that lose their tool calls or reasoning train on something the target never
    # wrote: refused above --max-error-rate. The rest (history a template rewrites, turns it
    # leaves out) is as the served target sees it: counted and named, not refused.
    refused = {f: n for f, n in summary.dropped.items() if f in ("tool_calls", "reasoning")}
    refused_records = len({(s.file, s.line) for s in samples if set(s.dropped) & refused.keys()})
    lost = refused_records / summary.records if summary.records else 0.0
    if samples and lost > cfg.max_error_rate and not cfg.allow_dropped_fields:
        what = " and ".join(
            f"{n} assistant turn(s)' {f.replace('_', ' ')}" for f, n in sorted(refused.items())
        )
        raise PrepareFailed(
            f"the chat template of {cfg.model} does not render {what} ({refused_records} "
            f"of {summary.records} records, > --max-error-rate {cfg.max_error_rate:.1%}): training "
            "would never see them. Use a model whose template renders them, or pass "
            "--allow-dropped-fields to train without them; no dataset was written",
            summary,
        )
    if not samples or summary.error_rate > cfg.max_error_rate:
        why = (
            "no record gave a sample"
            if not samples
            else f"{summary.error_rate:.1%} of records failed (> --max-error-rate {cfg.max_error_rate:.1%})"
        )
        raise PrepareFailed(
            f"{why}; no dataset was written (errors in {write_errors_only(out, errors)})", summary
        )


def _conversations(raws: list[RawRecord]) -> int:
    """How many records are conversations (need a chat template); unreadable ones are left
    to the per-record errors."""
    n = 0
    for rec in raws:
        try:
            n += read_conversation(parse_record(rec)).form != "text"
        except RecordError:
            pass
    return n


class PrepareFailed(ProblemError):
    """Too many records failed: the errors are written, the dataset is not."""

    def __init__(self, message: str, summary: PrepareSummary):
        super().__init__(message)
        self.summary = summary


# ---------------------------------------------------------------------------- reading output

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

import hashlib
import json
import os
import re
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save as np_save

from eyas import __version__
from eyas.data.config import PrepareConfig
from eyas.data.records import (
    RawRecord,
    RecordError,
    iter_records,
    parse_record,
    read_conversation,
    record_id,
)
from eyas.errors import UsageError
from eyas.host.ui import Reporter
from eyas.run.fsutil import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    is_temp_file,
    read_json,
    sha256_file,
)
from eyas.targets.target import (
    ModelDirError,
    load_tokenizer,
    read_chat_template,
    require_chat_template,
)

FORMAT_VERSION = 1


@dataclass
class Prepared:
    id: str
    file: str
    line: int
    format: str
    input_ids: list[int]
    loss_mask: list[int]
    original_tokens: int
    truncated: bool
    dropped: tuple[str, ...] = ()
    """Per assistant turn whose tool calls or reasoning the template left out: which field."""


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


# ---------------------------------------------------------------------------- loss mask


def _prefix_before(render, messages: list[dict], i: int, upto: str) -> str:
    """What the template renders before assistant turn i's content: the conversation so far
    with a generation prompt. For a first turn that is the template's own preamble (a default
    system prompt, say), rendered from no messages; a template that cannot render an empty
    conversation gets the text before the turn's content instead."""
    try:
        before = render(messages[:i], gen=True)
    except Exception:  # noqa: BLE001 - templates raise anything on an empty conversation
        before = None
    if before is not None and upto.startswith(before):
        return before
    if i == 0:
        text = messages[0]["content"].strip()
        at = upto.rfind(text) if text else -1
        if at >= 0:
            return upto[:at]
    return before if before is not None else ""


def chat_text(
    tokenizer,
    messages: list[dict],
    *,
    tools: list | None = None,
    template_kwargs: dict | None = None,
    generation_prompt: bool = False,
) -> str:
    """A conversation as the model's chat template renders it, with the record's tools and
    the dataset's template variables: the one rendering of `prepare` and `evaluate`, so a
    prompt in evaluation is, token for token, the prefix training saw."""
    extra = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
    )


def assistant_spans(
    tokenizer,
    messages: list[dict],
    last_turn_only: bool = False,
    tools: list | None = None,
    template_kwargs: dict | None = None,
    dropped: list[str] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans the assistant produced: each
    assistant turn as the template renders it inside the whole conversation (its reasoning,
    content, tool-call markup and end of turn), from after its generation prompt.

    A turn normally renders the same whether or not more follows, and the conversation before
    it as it renders on its own. Templates that rewrite history (dropping the reasoning of
    turns before the last user turn, as Kimi's and Qwen3's do) break that; there each turn is
    placed by the template's own markers: it starts after the k-th assistant header and ends
    at the first end-of-turn marker after it, and must hold the turn's text. A turn that
    cannot be placed is an error naming it, never a guess.

    `dropped`, where given, receives a name for each part of the conversation the template
    leaves out: `tool_calls` or `reasoning` for a trained turn's that it does not render even
    as the last turn, `reasoning_in_history` for a trained turn's reasoning that it renders
    only as the last turn (it rewrites history), and a role (`developer`, `system`, ...) for
    each other turn whose content it does not render."""

    def render(msgs, gen=False):
        return chat_text(
            tokenizer, msgs, tools=tools, template_kwargs=template_kwargs, generation_prompt=gen
        )

    full = render(messages)
    spans = []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    marks: list = []
    for k, i in enumerate(turns):
        if last_turn_only and i != turns[-1]:
            continue
        upto = render(messages[: i + 1])
        before = _prefix_before(render, messages, i, upto)
        turn_drops = len(dropped) if dropped is not None else 0
        if dropped is not None:
            dropped.extend(
                _unrendered(messages[i], upto[len(before) :] if upto.startswith(before) else upto)
            )
        if full.startswith(before) and upto.startswith(before) and full.startswith(upto):
            start, end = len(before), len(upto.rstrip())  # trailing newlines are template glue
        else:
            if not marks:
                marks.append(_turn_marks(render))
            start, end = _place_by_marks(full, marks[0], k, len(turns), messages[i], i)
        if end > start:
            spans.append((start, end))
            if dropped is not None and "reasoning" not in dropped[turn_drops:]:
                reasoning = (messages[i].get("reasoning_content") or "").strip()
                if reasoning and reasoning not in full:
                    dropped.append("reasoning_in_history")
    if dropped is not None:
        dropped.extend(_unrendered_turns(messages, full))
    return full, spans


def _unrendered_turns(messages: list[dict], full: str) -> list[str]:
    """The role of each turn other than the assistant's whose content the rendering lacks."""
    out = []
    for m in messages:
        text = m.get("content")
        if m["role"] == "assistant" or not isinstance(text, str) or not text.strip():
            continue
        if text.strip() not in full and json.dumps(text.strip())[1:-1] not in full:  # or as JSON
            out.append(m["role"])
    return out


def _unrendered(message: dict, rendered: str) -> list[str]:
    """The fields of an assistant turn its rendering leaves out: a tool call whose function
    name is nowhere in it, or reasoning whose text is not."""
    out = []
    names = [(c.get("function") or {}).get("name") for c in message.get("tool_calls") or []]
    if any(isinstance(n, str) and n and n not in rendered for n in names):
        out.append("tool_calls")
    reasoning = (message.get("reasoning_content") or "").strip()
    if reasoning and reasoning not in rendered:
        out.append("reasoning")
    return out


def _turn_marks(render) -> tuple[str, str] | None:
    """(assistant header, end-of-turn marker) of a template, from probe conversations: the
    header is what the generation prompt and a rendered assistant turn (with and without
    reasoning) begin with; the marker is what closes the turn (`<|im_end|>`, `<|eot_id|>`)."""
    probe, user = "\u2063eyas-probe\u2063", [{"role": "user", "content": "hi"}]
    try:
        base = render(user)
        gen = render(user, gen=True)
        plain = render([*user, {"role": "assistant", "content": probe}])
        thought = render([*user, {"role": "assistant", "content": probe, "reasoning_content": "r"}])
    except Exception:  # noqa: BLE001 - a template may refuse the probes
        return None
    if not all(t.startswith(base) for t in (gen, plain, thought)) or probe not in plain:
        return None
    header = os.path.commonprefix([gen[len(base) :], plain[len(base) :], thought[len(base) :]])
    eot = plain[plain.rfind(probe) + len(probe) :].rstrip()
    return (header, eot) if header and eot else None


def _place_by_marks(full: str, marks, k: int, n: int, message: dict, i: int) -> tuple[int, int]:
    def fail(why: str) -> RecordError:
        return RecordError(
            f"assistant turn {i} renders differently inside the whole conversation and {why}, "
            "so its tokens cannot be located",
            "template",
        )

    if marks is None:
        raise fail("the template's turn markers cannot be found")
    header, eot = marks
    starts = [m.end() for m in re.finditer(re.escape(header), full)]
    if len(starts) != n:
        raise fail(f"its assistant header appears {len(starts)} times for {n} assistant turns")
    start = starts[k]
    at = full.find(eot, start)
    if at < 0 or (k + 1 < n and at + len(eot) > starts[k + 1] - len(header)):
        raise fail("its end-of-turn marker is not where the next turn begins")
    if message["content"].strip() not in full[start:at]:
        raise fail("its text is not inside the place found for it")
    return start, at + len(eot)


def tokenize_with_mask(
    tokenizer, text: str, spans: list[tuple[int, int]] | None
) -> tuple[list[int], list[int]]:
    """Token ids of `text`; a token is trainable when it overlaps an assistant span (all if None)."""
    if spans is None:
        ids = _encode(tokenizer, text)
        return ids, [1] * len(ids)
    if not tokenizer.is_fast:
        return _mask_without_offsets(tokenizer, text, spans)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    mask = [0] * len(ids)
    j = 0
    for k, (s, e) in enumerate(enc["offset_mapping"]):
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        if j < len(spans) and s < spans[j][1] and e > spans[j][0]:
            mask[k] = 1
    return ids, mask


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _mask_without_offsets(
    tokenizer, text: str, spans: list[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """The mask for a tokenizer that gives no character offsets (one that is Python code only).

    A tokenizer cuts the text at its added (special) tokens and tokenizes the pieces between
    them on their own, so each piece's ids are known, and chat templates start and end the
    assistant's turns at or near such tokens. An edge at a piece's start is exact; one inside
    a piece is placed by `_tokens_before` within that piece. Where the pieces do not add up
    to the whole text's ids (a token that swallows the spaces beside it), the edges are
    placed within the whole text instead, which is slower but the same.
    """
    ids = _encode(tokenizer, text)
    cuts = sorted({0, len(text)} | _added_token_edges(tokenizer, text))
    pieces = list(zip(cuts[:-1], cuts[1:], strict=True))
    parts = [_encode(tokenizer, text[a:b]) for a, b in pieces]
    edges = {e for span in spans for e in span}
    at: dict[int, tuple[int, bool]] = {}  # edge -> (tokens wholly before it, next one straddles)
    if [t for part in parts for t in part] == ids:
        first = 0  # token index of the piece's first token
        for (a, b), part in zip(pieces, parts, strict=True):
            for edge in edges:
                if edge == a:
                    at[edge] = (first, False)
                elif a < edge < b:
                    j, straddles = _tokens_before(tokenizer, text[a:b], part, edge - a)
                    at[edge] = (first + j, straddles)
            first += len(part)
        if len(text) in edges:
            at[len(text)] = (len(ids), False)
    else:
        at = {edge: _tokens_before(tokenizer, text, ids, edge) for edge in edges}
    mask = [0] * len(ids)
    for s, e in spans:
        end = at[e][0] + (1 if at[e][1] else 0)  # a token that straddles the end overlaps
        for k in range(at[s][0], min(end, len(ids))):
            mask[k] = 1
    return ids, mask


def _added_token_edges(tokenizer, text: str) -> set[int]:
    """Character positions where an added token (a chat template's markers) starts or ends."""
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    if not added:
        return set()
    edges = set()
    for m in re.finditer("|".join(map(re.escape, added)), text):
        edges.update(m.span())
    return edges


def _tokens_before(tokenizer, text: str, ids: list[int], edge: int) -> tuple[int, bool]:
    """How many of `ids` lie wholly before character `edge`, and whether the next one starts
    before it. The ids that the text before the edge tokenizes to agree with `ids` up to some
    point, and those lie before the edge; from there, tokens are added while the decoded
    prefix stays within the edge (decoding is checked against the text)."""
    before = _encode(tokenizer, text[:edge])
    j = 0
    while j < min(len(before), len(ids)) and before[j] == ids[j]:
        j += 1
    diverged = j < len(before)

    def decoded(n: int) -> str:
        return tokenizer.decode(
            ids[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    while j < len(ids):
        t = decoded(j + 1)
        if len(t) > edge or not text.startswith(t):
            break
        j += 1
    t = decoded(j)
    if j < len(ids) and text.startswith(t):
        return j, len(t) < edge
    return j, diverged and j < len(ids)


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


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    if tokenizer.is_fast:
        h.update(tokenizer.backend_tokenizer.to_str().encode())
    else:  # Python code: its class, vocabulary and special tokens
        h.update(type(tokenizer).__name__.encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        h.update(json.dumps(sorted(str(t) for t in tokenizer.all_special_tokens)).encode())
    h.update(b"\0" + (tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]


class TokenizerMismatch(ModelDirError):
    """Data tokenized for another model than the one given: a usage error (exit 2)."""


def check_tokenizer(
    ds_path, ds_meta: dict, model: str, tokenizer=None, trust_remote_code: bool = False
) -> None:
    """Refuse to pair a dataset with a model whose tokenizer (or chat template) is not the
    one it was prepared with: its token ids would be read as other text. A dataset from
    before fingerprints were kept is not checked."""
    want = ds_meta.get("tokenizer_fingerprint")
    if not want:
        return
    tok = (
        tokenizer
        if tokenizer is not None
        else load_tokenizer(model, trust_remote_code, ds_meta.get("chat_template"))
    )
    got = tokenizer_fingerprint(tok)
    if got != want:
        made_with = ds_meta.get("model") or "another model"
        raise TokenizerMismatch(
            f"{ds_path} was prepared with the tokenizer of {made_with} (fingerprint {want}), "
            f"but {model} has another tokenizer or chat template (fingerprint {got}): its token "
            f"ids would be read as other text. Prepare the data again with --model {model}, "
            "or give the model it was prepared for"
        )


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
    template = read_chat_template(cfg.chat_template)
    tok = load_tokenizer(cfg.model, cfg.trust_remote_code, template)
    global _TOK
    _TOK = tok
    raws: list[RawRecord] = []
    for f in cfg.data:
        p = Path(f)
        if not p.is_file():
            raise FileNotFoundError(f"input file not found: {p}")
        raws.extend(iter_records(p))
    if not tok.chat_template:
        require_chat_template(tok, cfg.model, _conversations(raws), len(raws), "--data")

    summary = PrepareSummary(out=str(out), records=len(raws))
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
    # Trained turns that lose their tool calls or reasoning train on something the target never
    # wrote: refused above --max-error-rate. The rest (history a template rewrites, turns it
    # leaves out) is as the served target sees it: counted and named, not refused.
    refused = {f: n for f, n in summary.dropped.items() if f in ("tool_calls", "reasoning")}
    refused_records = len({(s.file, s.line) for s in samples if set(s.dropped) & refused.keys()})
    summary.truncated = sum(s.truncated for s in samples)
    summary.tokens = sum(len(s.input_ids) for s in samples)
    summary.trainable_tokens = sum(sum(s.loss_mask) for s in samples)
    if not raws:
        raise ValueError(f"no records in {', '.join(cfg.data)}: the input is empty")
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
    summary.fingerprint = write_dataset(out, samples, errors, cfg, tok, summary)
    return summary


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


class PrepareFailed(ValueError):
    """Too many records failed: the errors are written, the dataset is not."""

    def __init__(self, message: str, summary: PrepareSummary):
        super().__init__(message)
        self.summary = summary


def write_dataset(
    out: Path, samples: list[Prepared], errors: list[dict], cfg: PrepareConfig, tok, summary
) -> str:
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter(
        (t for s in samples for t in s.input_ids), dtype=np.int32, count=int(offsets[-1])
    )
    mask = np.fromiter(
        (t for s in samples for t in s.loss_mask), dtype=np.uint8, count=int(offsets[-1])
    )
    vocab = len(tok)
    if cfg.draft_vocab_size > vocab:
        summary.notes.append(
            f"--draft-vocab-size {cfg.draft_vocab_size} is more than the target's vocabulary "
            f"({vocab} tokens): the draft vocabulary is all {vocab}"
        )
    if ids.size and int(ids.max()) >= vocab:
        raise ValueError(f"tokenizer produced id {int(ids.max())} >= its vocabulary size {vocab}")
    counts = np.bincount(ids[mask.astype(bool)], minlength=vocab).astype(np.int64)

    tensor_bytes = np_save({"input_ids": ids, "loss_mask": mask, "offsets": offsets})
    records = [
        {
            "index": i,
            "id": s.id,
            "file": s.file,
            "line": s.line,
            "format": s.format,
            "tokens": len(s.input_ids),
            "trainable": int(sum(s.loss_mask)),
            "original_tokens": s.original_tokens,
            "truncated": s.truncated,
        }
        for i, s in enumerate(samples)
    ]
    records_bytes = "".join(json.dumps(r) + "\n" for r in records).encode()
    fp = hashlib.sha256(tensor_bytes + records_bytes).hexdigest()[:16]

    out.mkdir(parents=True, exist_ok=True)
    files = {
        "tokens": f"tokens-{fp}.safetensors",
        "records": f"records-{fp}.jsonl",
        "vocab_freq": f"vocab_freq-{fp}.safetensors",
        "errors": f"errors-{fp}.jsonl",
    }
    atomic_write_bytes(out / files["tokens"], tensor_bytes)
    atomic_write_bytes(out / files["records"], records_bytes)
    atomic_write_bytes(out / files["vocab_freq"], np_save({"counts": counts}))
    atomic_write(
        out / files["errors"],
        lambda f: f.write("".join(json.dumps(e) + "\n" for e in errors).encode()),
    )
    n = max(len(samples), 1)
    meta = {
        "format_version": FORMAT_VERSION,
        "eyas_version": __version__,
        "fingerprint": fp,
        "model": str(Path(cfg.model).resolve()),
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "chat_template": tok.chat_template if cfg.chat_template else None,
        "vocab_size": vocab,
        "draft_vocab_size": min(cfg.draft_vocab_size, vocab),
        "files": {k: {"name": v, "sha256": sha256_file(out / v)} for k, v in files.items()},
        "counts": {
            "records": summary.records,
            "samples": len(samples),
            "failed": summary.failed,
            "skipped_overlong": summary.skipped_overlong,
            "truncated": summary.truncated,
            "emptied_by_truncation": len(summary.emptied),
            "dropped_fields": dict(summary.dropped),
            "records_with_dropped_fields": summary.dropped_records,
        },
        "tokens": {
            "total": int(offsets[-1]),
            "trainable": int(mask.sum()),
            "mean": float(lengths.mean()) if len(samples) else 0.0,
            "max": int(lengths.max()) if len(samples) else 0,
            "min": int(lengths.min()) if len(samples) else 0,
            "p50": float(np.percentile(lengths, 50)) if len(samples) else 0.0,
            "p95": float(np.percentile(lengths, 95)) if len(samples) else 0.0,
            "mean_trainable": float(mask.sum() / n),
        },
        "error_reasons": summary.reasons,
        "config": {
            **{
                k: (list(v) if isinstance(v, tuple) else v)
                for k, v in asdict(cfg).items()
                if k not in ("progress", "force")
            },
            "cwd": os.getcwd(),
        },
    }
    atomic_write_json(out / "dataset.json", meta)
    # The new dataset is committed; files of earlier versions are no longer referenced.
    keep = set(files.values()) | {"dataset.json"}
    for p in out.iterdir():
        if (
            p.is_file()
            and p.name not in keep
            and p.name.split("-")[0] in ("tokens", "records", "vocab_freq", "errors")
        ):
            p.unlink()
    _link_errors(out, files["errors"])
    return fp


def _link_errors(out: Path, name: str) -> None:
    link = out / "errors.jsonl.tmp-link"
    link.unlink(missing_ok=True)
    os.symlink(name, link)
    os.replace(link, out / "errors.jsonl")  # a stable name for the latest errors
    fsync_dir(out)


def write_errors_only(out: Path, errors: list[dict]) -> Path:
    """A failed prepare's report: the errors, and no dataset (nothing for a rerun to refuse)."""
    data = "".join(json.dumps(e) + "\n" for e in errors).encode()
    name = f"errors-{hashlib.sha256(data).hexdigest()[:16]}.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / name, data)
    _link_errors(out, name)
    return out / "errors.jsonl"


OWN_FILES = ("dataset.json", "errors.jsonl")
OWN_PREFIXES = ("tokens-", "records-", "vocab_freq-", "errors-")


def foreign_entries(out: Path) -> list[str]:
    """What in `out` a prepare did not write: a user's files, which it never replaces."""
    if not out.is_dir():
        return []
    bad = []
    for p in sorted(out.iterdir()):
        own = p.name == "dataset.json" or p.name.startswith(OWN_PREFIXES) or is_temp_file(p)
        own = own or (p.name == "errors.jsonl" and p.is_symlink())
        if not own or p.is_dir():
            bad.append(p.name)
    return bad


# ---------------------------------------------------------------------------- reading output


class DatasetError(ValueError):
    pass


@dataclass
class PreparedDataset:
    """Read side of a prepared dataset directory (validated against dataset.json)."""

    path: Path
    meta: dict
    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    records: list[dict]

    @classmethod
    def open(cls, path: str | Path, *, check: bool = True) -> PreparedDataset:
        """Open and validate a dataset: every violation is a DatasetError naming the file
        and what is wrong. `check` adds the sha256 of every file against dataset.json."""
        path = Path(path)
        mpath = path / "dataset.json"
        if not mpath.is_file():
            raise DatasetError(
                f"{path}: not a prepared dataset (no dataset.json); run `eyas prepare` first"
            )
        try:
            meta = read_json(mpath)
        except (OSError, ValueError) as exc:
            raise DatasetError(f"{mpath}: unreadable ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise DatasetError(
                f"{mpath}: format_version {meta.get('format_version') if isinstance(meta, dict) else '?'} "
                f"is not {FORMAT_VERSION}"
            )
        _check_meta(mpath, meta)
        files = meta["files"]
        for k in ("tokens", "records", "vocab_freq"):
            f = path / files[k]["name"]
            if not f.is_file():
                raise DatasetError(f"{f}: missing (listed in {mpath})")
            if check and sha256_file(f) != files[k]["sha256"]:
                raise DatasetError(f"{f}: checksum does not match {mpath}; re-run `eyas prepare`")
        tpath = path / files["tokens"]["name"]
        t = _load_tensors(
            tpath, {"input_ids": np.int32, "loss_mask": np.uint8, "offsets": np.int64}
        )
        rpath = path / files["records"]["name"]
        records = []
        with open(rpath, "rb") as f:
            for n, line in enumerate(f, start=1):
                try:
                    records.append(json.loads(line))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise DatasetError(f"{rpath}:{n}: not a JSON record") from None
        ds = cls(path, meta, t["input_ids"], t["loss_mask"], t["offsets"], records)
        ds._validate(tpath, rpath)
        return ds

    def _validate(self, tpath: Path, rpath: Path) -> None:
        n, ids, mask, off = (
            self.meta["counts"]["samples"],
            self.input_ids,
            self.loss_mask,
            self.offsets,
        )
        if len(self.records) != n:
            raise DatasetError(
                f"{rpath}: {len(self.records)} records, dataset.json says {n} samples"
            )
        if len(off) != n + 1 or (n and (off[0] != 0 or np.any(np.diff(off) < 0))):
            raise DatasetError(f"{tpath}: offsets are not {n + 1} non-decreasing values from 0")
        if off[-1] != len(ids) or len(mask) != len(ids):
            raise DatasetError(
                f"{tpath}: offsets end at {int(off[-1])}, but there are {len(ids)} ids "
                f"and {len(mask)} mask values"
            )
        vocab = self.meta["vocab_size"]
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise DatasetError(
                f"{tpath}: token id {bad} is outside the vocabulary (0..{vocab - 1})"
            )
        if len(mask) and int(mask.max()) > 1:
            raise DatasetError(f"{tpath}: loss mask value {int(mask.max())} (masks are 0 or 1)")
        lengths = np.diff(off)
        for i, r in enumerate(self.records):
            if not isinstance(r, dict) or r.get("index") != i or r.get("tokens") != int(lengths[i]):
                raise DatasetError(
                    f"{rpath}:{i + 1}: record does not describe sample {i} of "
                    f"{int(lengths[i])} tokens"
                )
            if not all(
                isinstance(r.get(k), t) for k, t in (("id", str), ("file", str), ("line", int))
            ):
                raise DatasetError(f"{rpath}:{i + 1}: record lacks its id, file or line")

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def __len__(self) -> int:
        return len(self.records)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def vocab_counts(self) -> np.ndarray:
        vpath = self.path / self.meta["files"]["vocab_freq"]["name"]
        counts = _load_tensors(vpath, {"counts": np.int64})["counts"]
        if counts.shape != (self.meta["vocab_size"],) or (len(counts) and int(counts.min()) < 0):
            raise DatasetError(
                f"{vpath}: counts are not {self.meta['vocab_size']} non-negative values"
            )
        return counts

    def draft_vocab(self, size: int | None = None):
        """Ids of the `size` most frequent trainable tokens (ties by id), ascending."""
        return draft_vocab_from_counts(self.vocab_counts(), size or self.meta["draft_vocab_size"])


def prepare_command(config: dict) -> str:
    """The `eyas prepare` command that rebuilds a dataset from its recorded config (the same
    inputs give the same fingerprint, so a run made from it resumes)."""
    import shlex

    cmd = ["eyas", "prepare", "--model", config["model"]]
    # Records name their input files as given: relative names must be given from the same place.
    cd = (
        f"cd {shlex.quote(config['cwd'])} && "
        if config.get("cwd") and not all(Path(f).is_absolute() for f in config["data"])
        else ""
    )
    for f in config["data"]:
        cmd += ["--data", f]
    cmd += ["--out", config["out"]]
    if config.get("max_length") is not None:
        cmd += ["--max-length", str(config["max_length"])]
    for key, default in (("overlong", "truncate"), ("draft_vocab_size", 32000)):
        if config.get(key, default) != default:
            cmd += [f"--{key.replace('_', '-')}", str(config[key])]
    for key in ("last_turn_only", "trust_remote_code", "per_turn_samples"):
        if config.get(key):
            cmd.append(f"--{key.replace('_', '-')}")
    if config.get("chat_template_kwargs"):
        cmd += ["--chat-template-kwargs", json.dumps(config["chat_template_kwargs"])]
    if config.get("chat_template"):
        cmd += ["--chat-template", config["chat_template"]]
    return cd + shlex.join(cmd)


def _check_meta(mpath: Path, meta: dict) -> None:
    """dataset.json's own fields: the sizes every later check relies on."""
    files = meta.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(files.get(k), dict)
        and isinstance(files[k].get("name"), str)
        and "/" not in files[k]["name"]
        and isinstance(files[k].get("sha256"), str)
        for k in ("tokens", "records", "vocab_freq")
    ):
        raise DatasetError(
            f"{mpath}: 'files' does not name the tokens, records and vocab_freq files"
        )
    vocab, dv = meta.get("vocab_size"), meta.get("draft_vocab_size")
    samples = (
        (meta.get("counts") or {}).get("samples") if isinstance(meta.get("counts"), dict) else None
    )
    if not isinstance(vocab, int) or not 0 < vocab <= 1 << 24:
        raise DatasetError(f"{mpath}: vocab_size {vocab!r} is not a vocabulary size")
    if not isinstance(dv, int) or not 0 < dv <= vocab:
        raise DatasetError(
            f"{mpath}: draft_vocab_size {dv!r} is not within 1..vocab_size ({vocab})"
        )
    if not isinstance(samples, int) or samples < 0:
        raise DatasetError(f"{mpath}: counts.samples {samples!r} is not a sample count")


def _load_tensors(path: Path, want: dict[str, type]) -> dict[str, np.ndarray]:
    """The named 1-D arrays of a safetensors file, of the expected dtypes."""
    try:
        t = np_load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors' errors for damaged headers vary
        raise DatasetError(f"{path}: unreadable ({exc})") from None
    for name, dtype in want.items():
        a = t.get(name)
        if a is None or a.dtype != dtype or a.ndim != 1:
            raise DatasetError(
                f"{path}: tensor {name!r} missing or not a 1-D {np.dtype(dtype).name} array"
            )
    return t


def draft_vocab_from_counts(counts: np.ndarray, size: int):
    """torch int64 (size,) ids, ascending."""
    import torch  # here: `generate` and `prepare` load without torch

    size = min(size, len(counts))
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    return torch.from_numpy(np.sort(order[:size]).astype(np.int64))

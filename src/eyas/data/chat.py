"""The chat template's rendering and the assistant-only loss mask derived from it.

The rendering is the model's own chat template (what a serving engine renders), and the
loss mask is derived from the template itself: for each assistant turn the conversation is
rendered up to the turn's generation prompt and up to the end of the turn; the characters
in between are what the assistant produced (content and end-of-turn token), and the tokens
covering them are trainable. No per-family regexes.
"""

from __future__ import annotations

import json
import os
import re

from eyas.data.records import RecordError


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

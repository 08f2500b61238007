"""Input records as people have them: JSONL or JSON arrays of OpenAI `messages` (string
or text-part content, with reasoning, tool calls and tool results, and per-record `tools`),
ShareGPT `conversations`, pre-rendered `text`, or (as prompts) `{"prompt": ...}`; a UTF-8
byte-order mark is fine. `read_conversation` is the one reader: a record becomes a
`Conversation` (its form, messages, tools), the same for `prepare`, `generate` and
`evaluate`. A record that cannot be read raises RecordError with a message that says what
was wrong and a `code` for the kind of problem (summaries group by it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import ProblemError

ROLES = {"system", "user", "assistant", "tool", "developer"}
# Other names of the roles, read alike in every form: ShareGPT dumps name the assistant
# after the service the answer came from.
ROLE_ALIASES = {
    "human": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


class RecordError(ProblemError):
    """A record that cannot be prepared; the message says what was wrong, `code` which
    kind of problem it is (the summary groups by it)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


# What each kind of bad record is called in the summary.
REASONS = {
    "invalid-utf8": "invalid UTF-8",
    "malformed-json": "malformed JSON",
    "not-an-object": "record is not a JSON object",
    "bad-id": "id is not a string or an integer",
    "duplicate-id": "id repeats an earlier record's",
    "no-conversation": "no 'messages', 'conversations' or 'text' field",
    "bad-text": "'text' is not a non-empty string",
    "bad-turns": "turns are not a list of objects",
    "no-role": "a turn has no role",
    "unknown-role": "a turn has an unknown role",
    "bad-content": "a turn's content is not text",
    "empty-assistant": "an assistant turn is empty (no text, reasoning or tool calls)",
    "no-assistant": "no assistant turn",
    "template": "the chat template failed on the conversation",
    "zero-trainable": "no trainable tokens",
    "emptied-by-truncation": "no trainable tokens left within --max-length (not counted as failed)",
    "overlong": "longer than --max-length (skipped)",
    "text": "plain text has no turns to prompt with",
    "no-user": "no user turn to answer",
    "incomplete-file": "the file's last line is cut off (the file looks incomplete)",
}


@dataclass
class RawRecord:
    file: str
    line: int
    raw: bytes | object  # bytes of one JSONL line, or an already-parsed JSON element
    cut: bool = False  # the file's last line, cut off in the middle


def _whole_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def iter_records(path: Path) -> Iterator[RawRecord]:
    """Records of one input file; JSON arrays and JSONL are told apart by the first byte."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is no content
    head = data.lstrip()[:1]
    if path.suffix == ".json" or head == b"[":
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RecordError(f"{path}: not valid JSON: {exc}", "malformed-json") from exc
        items = (
            doc
            if isinstance(doc, list)
            else doc.get("data", [doc])
            if isinstance(doc, dict)
            else [doc]
        )
        for i, item in enumerate(items):
            yield RawRecord(str(path), i + 1, item)  # "line" = 1-based element index
        return
    lines = data.split(b"\n")
    for n, line in enumerate(lines, start=1):
        if line.strip():
            # A last line with no newline after it that is not a whole JSON value: the file
            # was cut off while it was written (a copy or a writer stopped), not a bad record.
            cut = n == len(lines) and not _whole_json(line)
            yield RawRecord(str(path), n, line, cut)


def parse_record(rec: RawRecord) -> dict:
    if rec.cut:
        raise RecordError(
            f"{rec.file} looks incomplete: its last line ({rec.line}) is cut off "
            "and has no newline after it; was the file still being written?",
            "incomplete-file",
        )
    if isinstance(rec.raw, bytes):
        try:
            text = rec.raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RecordError(f"invalid UTF-8 at byte {exc.start}", "invalid-utf8") from exc
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            what = exc.msg.removesuffix(" starting at").lower()
            raise RecordError(
                f"malformed JSON at column {exc.colno}: {what}", "malformed-json"
            ) from exc
    else:
        obj = rec.raw
    if not isinstance(obj, dict):
        raise RecordError(
            f"record is a JSON {type(obj).__name__}, expected an object", "not-an-object"
        )
    return obj


def record_id(obj: dict, rec: RawRecord) -> str:
    rid = obj.get("id")
    if rid is None:
        return f"{Path(rec.file).name}:{rec.line}"
    if not isinstance(rid, (str, int)):
        raise RecordError(f"id must be a string or integer, got {type(rid).__name__}", "bad-id")
    return str(rid)


def _text_of(content, i: int, role: str) -> str:
    """A turn's text: a string, or OpenAI content parts whose text parts are joined in order
    (with newlines, as serving engines render them for text-only templates)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RecordError(
                    f"turn {i} ({role}) content part {j} is of type {kind!r}; only text parts "
                    "can be trained on",
                    "bad-content",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise RecordError(
        f"turn {i} ({role}) content must be a string or a list of text parts, "
        f"got {type(content).__name__}",
        "bad-content",
    )


def to_messages(obj: dict, prompt: bool = False) -> tuple[str, list[dict] | str]:
    """(format, messages) or ("text", text); raises RecordError naming what is wrong.
    With `prompt`, a conversation without an assistant turn is accepted (a prompt)."""
    if "messages" in obj:
        fmt, turns, rkey, ckey = "openai", obj["messages"], "role", "content"
    elif "conversations" in obj:
        fmt, turns, rkey, ckey = "sharegpt", obj["conversations"], "from", "value"
    elif "text" in obj:
        if not isinstance(obj["text"], str):
            raise RecordError(
                f"'text' must be a string, got {type(obj['text']).__name__}", "bad-text"
            )
        if not obj["text"].strip():
            raise RecordError("'text' is empty", "bad-text")
        return "text", obj["text"]
    else:
        raise RecordError("no 'messages', 'conversations' or 'text' field", "no-conversation")
    if not isinstance(turns, list):
        raise RecordError(
            f"'{'messages' if fmt == 'openai' else 'conversations'}' must be a list, got {type(turns).__name__}",
            "bad-turns",
        )
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RecordError(f"turn {i} is a {type(t).__name__}, expected an object", "bad-turns")
        role, content = t.get(rkey), t.get(ckey)
        if not isinstance(role, str):
            raise RecordError(f"turn {i} has no '{rkey}' string", "no-role")
        role = ROLE_ALIASES.get(role.lower(), role.lower())
        if role not in ROLES:
            raise RecordError(f"turn {i} has unknown role {t.get(rkey)!r}", "unknown-role")
        content = _text_of(content, i, role) if content is not None or role != "assistant" else ""
        m = {"role": role, "content": content, **_extras(t, i, role)}
        if role == "assistant" and not (
            content.strip() or m.get("reasoning_content") or m.get("tool_calls")
        ):
            raise RecordError(
                f"turn {i} is an empty assistant turn (no text, reasoning or tool calls)",
                "empty-assistant",
            )
        messages.append(m)
    if not prompt and not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no assistant turn", "no-assistant")
    return fmt, messages


def _extras(t: dict, i: int, role: str) -> dict:
    """What a turn carries besides its text, as chat templates read it: the reasoning
    (`reasoning_content`, or `reasoning` as some servers name it), tool calls, and on a tool
    result the call it answers and the tool's name."""
    out = {}
    reasoning = t.get("reasoning_content", t.get("reasoning"))
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise RecordError(f"turn {i} ({role}) reasoning is not text", "bad-content")
        if reasoning:
            out["reasoning_content"] = reasoning
    calls = t.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise RecordError(
                f"turn {i} ({role}) tool_calls is not a list of objects", "bad-content"
            )
        if calls:
            out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if isinstance(t.get(key), str):
            out[key] = t[key]
    return out


def record_tools(obj: dict) -> list | None:
    """The tools a record declares (OpenAI `tools`), for the chat template; None if none."""
    tools = obj.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(x, dict) for x in tools):
        raise RecordError("'tools' is not a list of objects", "bad-turns")
    return tools or None


@dataclass(frozen=True)
class Conversation:
    """One input record as every stage reads it."""

    form: str
    """openai, sharegpt, text, or prompt (`{"prompt": ...}`)."""
    messages: list[dict]
    """The turns, roles and fields normalised (empty for the text form)."""
    tools: list | None = None
    """The tools the record declares, which the chat template renders."""
    text: str | None = None
    """The text form's text, rendered as it is."""


def read_conversation(obj: dict, prompt: bool = False) -> Conversation:
    """A parsed record as a Conversation; RecordError names what is wrong. With `prompt`,
    a record without an assistant turn is accepted, and so is `{"prompt": "..."}`."""
    if (
        prompt
        and isinstance(obj.get("prompt"), str)
        and not ({"messages", "conversations"} & obj.keys())
    ):
        return Conversation(
            "prompt", [{"role": "user", "content": obj["prompt"]}], record_tools(obj)
        )
    form, content = to_messages(obj, prompt=prompt)
    if form == "text":
        return Conversation("text", [], None, content)
    return Conversation(form, content, record_tools(obj))


def prompt_of(conv: Conversation) -> Conversation:
    """What a model is asked: the conversation as it is when its last turn is the user's (or a
    tool's result), else cut before its last assistant turn."""
    if conv.form == "text":
        raise RecordError("plain text has no turns to prompt with", "text")
    msgs = conv.messages
    if msgs[-1]["role"] not in ("user", "tool"):
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=0)
        msgs = msgs[:last]
    if not msgs or msgs[-1]["role"] not in ("user", "tool"):
        raise RecordError("no user turn to answer", "no-user")
    return Conversation(conv.form, msgs, conv.tools)

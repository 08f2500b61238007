"""Generated conversations with learnable structure, for the demo target and the tests.

Every conversation is drawn from a seeded generator: a system prompt that sets a style
(terse or chatty), then one to three user turns of small tasks (arithmetic, counting,
reversing, spelling, repeating) whose answers follow from the question. A model trained on
them predicts much of each answer, so a drafter's acceptance on them means something.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "hawk falcon eagle kestrel osprey owl heron crane swift robin wren finch lark raven "
    "river stone cloud ember maple cedar willow meadow harbor canyon summit valley forest "
    "amber silver copper cobalt scarlet violet golden ivory"
).split()

SYSTEMS = {
    "terse": [
        "You are a terse assistant. Answer with the result only.",
        "Be brief. Reply with just the answer.",
    ],
    "chatty": [
        "You are a friendly assistant who answers in full sentences.",
        "You are a helpful assistant. Explain the answer in a sentence.",
    ],
}


def _task(rng: random.Random, style: str) -> tuple[str, str, dict]:
    kind = rng.choice(["add", "count", "reverse", "spell", "repeat", "upper", "sub"])
    if kind in ("add", "sub"):
        a, b = rng.randint(1, 60), rng.randint(1, 40)
        op, res = ("plus", a + b) if kind == "add" else ("minus", a - b)
        q = f"What is {a} {op} {b}?"
        a_ = str(res) if style == "terse" else f"{a} {op} {b} is {res}."
        return q, a_, {"kind": "arith", "value": res}
    if kind == "count":
        start = rng.randint(1, 20)
        end = start + rng.randint(3, 9)
        seq = " ".join(str(i) for i in range(start, end + 1))
        q = f"Count from {start} to {end}."
        a_ = seq if style == "terse" else f"Counting from {start} to {end}: {seq}."
        return q, a_, {"kind": "count", "value": end}
    word = rng.choice(WORDS)
    if kind == "reverse":
        q, res = f"Write the word {word} backwards.", word[::-1]
        a_ = res if style == "terse" else f"The word {word} written backwards is {res}."
    elif kind == "spell":
        q, res = f"Spell the word {word}.", " ".join(word)
        a_ = res if style == "terse" else f"The word {word} is spelled {res}."
    elif kind == "upper":
        q, res = f"Write {word} in capital letters.", word.upper()
        a_ = res if style == "terse" else f"In capital letters, {word} is {res}."
    else:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        q, res = f"Repeat after me: {words}", words
        a_ = res if style == "terse" else f"Sure, here it is: {res}"
    return q, a_, {"kind": "word", "value": None}


def _follow_up(rng: random.Random, style: str, meta: dict) -> tuple[str, str] | None:
    if meta["kind"] == "arith":
        d = rng.randint(1, 9)
        res = meta["value"] + d
        meta["value"] = res
        return f"Now add {d} to that.", str(res) if style == "terse" else f"Adding {d} gives {res}."
    if meta["kind"] == "count":
        nxt = meta["value"] + 1
        meta["value"] = nxt
        return "What number comes next?", str(
            nxt
        ) if style == "terse" else f"The next number is {nxt}."
    return None


def generate_conversations(n: int, seed: int = 0) -> list[dict]:
    """`n` OpenAI-style conversations (`id`, `messages`), reproducible from `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        style = rng.choice(sorted(SYSTEMS))
        messages = [{"role": "system", "content": rng.choice(SYSTEMS[style])}]
        for _ in range(rng.randint(1, 3)):
            q, a, meta = _task(rng, style)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if rng.random() < 0.5 and (f := _follow_up(rng, style, meta)):
                messages += [
                    {"role": "user", "content": f[0]},
                    {"role": "assistant", "content": f[1]},
                ]
        out.append({"id": f"demo-{seed}-{i:05d}", "messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def corpus_text(conversations: list[dict]) -> list[str]:
    """Plain text of every message, for training a tokenizer."""
    return [m["content"] for c in conversations for m in c["messages"]]

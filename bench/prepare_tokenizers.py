"""`prepare`'s masking with a fast tokenizer and with one that is Python code only, in one run.

A tokenizer shipped as Python code (Kimi's kind) gives no character offsets, so `prepare`
places the edges of assistant turns by tokenizing pieces of the text again. This times the
render + tokenize + mask step on the same long multi-turn conversations with both kinds on
the same vocabulary (the Python one is the tests' stand-in, `tests/slow_tokenizer.py`), for
a Llama-3 and a ChatML template. The two alternate; medians of `--rounds` pairs and their
ratio are printed, with a check that ids and masks are identical. Run from the repo root:

    python bench/prepare_tokenizers.py [--rounds 5] [--conversations 200]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def rate(tok, conversations) -> tuple[float, list]:
    from eyas.data.chat import assistant_spans, tokenize_with_mask

    out, n, t0 = [], 0, time.perf_counter()
    for messages in conversations:
        text, spans = assistant_spans(tok, messages)
        ids, mask = tokenize_with_mask(tok, text, spans)
        n += len(ids)
        out.append((ids, mask))
    return n / (time.perf_counter() - t0), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=200)
    args = ap.parse_args()

    from test_python_tokenizer import python_tokenizer_copy
    from transformers import AutoTokenizer

    from eyas.demo_target.data import generate_conversations
    from eyas.demo_target.tiny import build_tiny_target

    work = Path(tempfile.mkdtemp(prefix="eyas-bench-"))
    try:
        convs = generate_conversations(args.conversations, seed=4)
        # ten conversations end to end: 20 assistant turns each
        long = [
            sum((c["messages"] for c in convs[i : i + 10]), []) for i in range(0, len(convs), 10)
        ]
        for arch, template in (("llama", "Llama-3"), ("qwen3", "ChatML")):
            model = build_tiny_target(work / arch, arch)
            fast = AutoTokenizer.from_pretrained(model)
            slow = AutoTokenizer.from_pretrained(
                python_tokenizer_copy(model, work / f"{arch}-python"), trust_remote_code=True
            )
            pairs = []
            for _ in range(args.rounds):
                a, ref = rate(fast, long)
                b, got = rate(slow, long)
                assert got == ref, "the Python tokenizer's ids or masks differ"
                pairs.append((a, b))
            med = statistics.median
            print(f"{template:8s} {len(long)} conversations, {sum(len(i) for i, _ in ref):,} tokens: "
                  f"fast {med(a for a, _ in pairs):,.0f} tok/s, Python code {med(b for _, b in pairs):,.0f} tok/s, "
                  f"ratio {med(b / a for a, b in pairs):.2f} (median of {args.rounds} pairs); "
                  "ids and masks identical")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

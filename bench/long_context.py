"""Acceptance against context length on real data: the same final user turns, preceded by
more and more real conversation, judged with every drafter given.

    python bench/long_context.py --real REAL --drafter NAME=EXPORT [--drafter ...] \
        [--lengths 1024,2048,4096,8000] [--turns 20] [--from-turn 0] [--jobs 2] [--work DIR]

The target is `scripts/real_target.py`'s SmolLM2-135M-Instruct (8,192 positions). Final
turns are ShareGPT user turns (from record `--skip` on, past the conversations the drafters
were trained on) that are answered in the record and no longer than 200 tokens. Each is
given at each length L: its own conversation's earlier turns first, then whole earlier
ShareGPT conversations before them, as many as keep the rendered prompt within L tokens
(at least 3/4 of L; a final turn that cannot reach that is left out at every length, so the
same turns are judged at all of them; `--from-turn F` judges only the turns after the first F,
to extend an earlier call's figures to more turns). `eyas evaluate` (hf, greedy, K drafts, 128 new
tokens, every prompt) judges every drafter on the same prompts, cut into `--jobs` slices
judged at once on one CPU thread each (bench/judging.py: every drafter of a slice in one
process, the greedy pass kept in REAL/greedy for later calls), and checks it lossless; the
table gives, per drafter and length, tokens per target forward with its 95% interval over
prompts and its ratio to the shortest length. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def _conversations(path: Path, skip: int):
    """(index, messages) of ShareGPT records from `skip` on, normalised as eyas reads them."""
    from eyas.data.records import RecordError, iter_records, parse_record, read_conversation

    for i, rec in enumerate(iter_records(path)):
        if i < skip:
            continue
        try:
            conv = read_conversation(parse_record(rec))
        except RecordError:
            continue
        if conv.messages:
            yield i, [m for m in conv.messages if m["role"] in ("user", "assistant")]


def build_prompts(
    tok, sharegpt: Path, lengths: list[int], turns: int, skip: int
) -> dict[int, list[dict]]:
    """Per length, the prompts: the same `turns` final user turns, each preceded by real
    conversation up to about that length."""
    from eyas.data.chat import chat_text

    def size(msgs: list[dict]) -> int:
        return len(
            tok(chat_text(tok, msgs, generation_prompt=True), add_special_tokens=False)["input_ids"]
        )

    pool = list(_conversations(sharegpt, skip))
    before = [m for _, msgs in pool[:400] for m in msgs]  # the conversations prepended, in order
    finals, out = [], {n: [] for n in lengths}
    for idx, msgs in pool[400:]:
        # the last user turn that the record answers, with its own earlier turns
        last = max(
            (j for j, m in enumerate(msgs) if m["role"] == "user" and j + 1 < len(msgs)),
            default=None,
        )
        if last is None or size(msgs[last : last + 1]) > 200:
            continue
        own = msgs[: last + 1]
        got = {}
        for n in lengths:
            ctx = own
            if size(ctx) > n:  # its own turns alone are too long: keep the latest of them
                while len(ctx) > 1 and size(ctx) > n:
                    ctx = ctx[2:] if ctx[0]["role"] == "user" else ctx[1:]
            else:  # prepend whole turn pairs of earlier conversations while they fit
                k = len(before)
                while k >= 2 and size(before[k - 2 :] + ctx) <= n:
                    k -= 2
                ctx = before[k:] + ctx
                # the history must open with a user turn, as a conversation does
                ctx = ctx if ctx[0]["role"] == "user" else ctx[1:]
            if not 0.75 * n <= size(ctx) <= n:
                break
            got[n] = ctx
        if len(got) == len(lengths):
            finals.append(idx)
            for n in lengths:
                out[n].append({"id": f"sharegpt-{idx}", "messages": got[n]})
        if len(finals) == turns:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", type=Path, required=True, help="scripts/real_target.py's --out")
    ap.add_argument("--drafter", action="append", required=True, help="NAME=EXPORT_DIR; repeat")
    ap.add_argument("--lengths", default="1024,2048,4096,8000", help="context lengths in tokens")
    ap.add_argument(
        "--turns", type=int, default=20, help="final user turns, the same at every length"
    )
    ap.add_argument(
        "--from-turn", type=int, default=0, help="judge only the final turns after this many"
    )
    ap.add_argument(
        "--skip", type=int, default=3000, help="ShareGPT records to pass over (training's)"
    )
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="slices of prompts judged at once")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path("/tmp/eyas-long-context"))
    ap.add_argument("--json", type=Path, default=None, help="write every figure here too")
    args = ap.parse_args()

    from judging import judge

    from eyas.targets.target import load_tokenizer

    model = str(args.real / "model")
    lengths = [int(x) for x in args.lengths.split(",")]
    drafters = dict(d.split("=", 1) for d in args.drafter)
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(
        load_tokenizer(model), args.real / "sharegpt.jsonl", lengths, args.turns, args.skip
    )
    if not 0 <= args.from_turn < args.turns:
        ap.error(f"--from-turn {args.from_turn} leaves none of the {args.turns} turns")
    prompts = {length: p[args.from_turn :] for length, p in prompts.items()}
    n = len(prompts[lengths[0]])
    print(
        f"{n} final turns (after the first {args.from_turn}) at {', '.join(map(str, lengths))} tokens of context",
        flush=True,
    )
    rows = {}
    for length in lengths:
        path = args.work / f"prompts-{length}.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in prompts[length]))
        judged = judge(model, drafters, path, args.work / f"slices-{length}", jobs=args.jobs, k=args.k,
                       max_new_tokens=args.max_new_tokens, greedy_store=args.real / "greedy")  # fmt: skip
        for name, r in judged.items():
            d = r.to_dict()
            if r.stopped_by:  # evaluate ends a stopped run with what it did: say so, go no further
                sys.exit(
                    f"stopped by {r.stopped_by} in {name} at {length} tokens, after {r.prompts} prompts"
                )
            rows[(name, length)] = d
            mean_len = sum(r.lengths) / max(len(r.lengths), 1)
            print(f"{name:>16}  {length:>5} ({mean_len:,.0f} tokens)  tokens/forward {d['tokens_per_forward']:.3f} "
                  f"{d['tokens_per_forward_ci95']}  lossless {d['lossless']}", flush=True)  # fmt: skip
    print(
        f"\ntokens per target forward, {n} final turns, K={args.k}, greedy, {args.max_new_tokens} new tokens"
    )
    print(f"{'drafter':>16}  " + "  ".join(f"{x:>17}" for x in lengths) + "   last/first")
    for name in drafters:
        first = rows[(name, lengths[0])]["tokens_per_forward"]
        cells = []
        for length in lengths:
            d = rows[(name, length)]
            lo, hi = d["tokens_per_forward_ci95"] or (float("nan"),) * 2
            cells.append(f"{d['tokens_per_forward']:.3f} [{lo:.2f},{hi:.2f}]")
        print(f"{name:>16}  " + "  ".join(f"{c:>17}" for c in cells)
              + f"   {rows[(name, lengths[-1])]['tokens_per_forward'] / first:.3f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({f"{k[0]}@{k[1]}": v for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()

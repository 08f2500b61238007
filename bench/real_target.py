"""Drafter quality on a real target: SmolLM2-135M-Instruct, ShareGPT, MT-Bench.

Builds (or reuses) the real target and data with `scripts/real_target.py`'s library, takes
the first N ShareGPT records (`--sizes`) that open with a user turn and hold an assistant
turn (in a seeded order), and runs prepare -> extract -> train -> export ->
evaluate on MT-Bench's first turns (K drafts, greedy, `--max-new-tokens`). With
`--sizes 250,500,1000` it repeats prepare..evaluate on nested subsets (the first N of the
same order) and prints the curve of tokens per forward against conversations. Prints every
stage's wall time, tokens per target forward and acceptance length with their 95%
intervals, and the per-category table. Run from the repo root:

    python bench/real_target.py --real /data/real [--sizes 500] [--epochs 3] [--train-args '...']
    python bench/real_target.py --real /data/real --endpoint http://127.0.0.1:8000 --served-model smol
    python bench/real_target.py --real /data/real --answers bench/data/smol-own-first-2000.jsonl.gz --sizes 1000,2000

With `--endpoint` (a vLLM server of the target: `python -m vllm.entrypoints.openai.api_server
--model REAL/model --served-model-name smol --dtype float32`), first turns are answered by the
target itself through `eyas generate` and those answers are trained on; `--save-answers`
keeps them (gzipped, with their sha256 and command) and `--answers` starts from such a file,
so a rerun on a new machine skips the hours of generating. Training takes eyas's own choices
unless `--lr`, `--batch-tokens` or `--train-args` say otherwise. It prints how many
conversations it kept and why it left any out, and stops at the first stage that fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path


def _role(t: dict) -> str:
    from eyas.data.records import ROLE_ALIASES

    r = str(t.get("from", "")).lower()
    return ROLE_ALIASES.get(r, r)


def pick_conversations(
    sharegpt: Path,
    n: int,
    seed: int | None,
    first_turn: bool = False,
    tokenizer=None,
    max_prompt_tokens: int = 0,
) -> list[dict]:
    """ShareGPT records that open with a user turn and hold an assistant turn, shuffled;
    with `first_turn`, cut after the first answer; with `max_prompt_tokens`, only records
    whose first user turn is at most that long (ShareGPT is full of pasted documents)."""
    keep = []
    for line in sharegpt.read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        r = json.loads(line)
        if "messages" in r:  # eyas generate's output: the same turns in the messages form
            r = {"id": r.get("id"), "conversations": [{"from": m["role"], "value": m["content"]}
                                                      for m in r["messages"]]}  # fmt: skip
        turns = r.get("conversations") or []
        if turns and _role(turns[0]) == "user" and any(_role(t) == "assistant" for t in turns):
            if first_turn:
                a = next(i for i, t in enumerate(turns) if _role(t) == "assistant")
                r = {**r, "conversations": turns[: a + 1]}
            keep.append(r)
    if seed is not None:  # None: in the file's order
        random.Random(seed).shuffle(keep)
    if max_prompt_tokens:
        short = []
        for r in keep:
            if len(tokenizer(r["conversations"][0]["value"])["input_ids"]) <= max_prompt_tokens:
                short.append(r)
            if len(short) == n:
                break
        keep = short
    return keep[:n]


def regenerate(
    recs: list[dict], work: Path, endpoint: str, served: str, max_tokens: int
) -> list[dict]:
    """The target's own answers in place of ShareGPT's, through `eyas generate` (resumable:
    a rerun asks only for what is missing)."""
    import subprocess
    import sys

    work.mkdir(parents=True, exist_ok=True)
    src, out = work / "to_generate.jsonl", work / "generated.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "eyas.cli", "generate", "--endpoint", endpoint, "--model", served,
                        "--data", str(src), "--out", str(out), "--max-tokens", str(max_tokens),
                        "--concurrency", "16"], check=False)  # fmt: skip
    if r.returncode != 0 and not out.is_file():  # its own message, above, says why
        raise SystemExit(
            f"stopped: eyas generate failed (exit {r.returncode}), so there are no answers to train on"
        )
    if r.returncode != 0:
        print(
            f"warning: eyas generate exited {r.returncode} (above); training on the answers it made",
            flush=True,
        )
    got = {}
    for line in out.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            r = json.loads(line)
            got[r["id"]] = r
    print(f"generate: {len(got)}/{len(recs)} answers in {time.monotonic() - t0:.0f} s", flush=True)
    return [got[r["id"]] for r in recs if r["id"] in got]


def save_answers(recs: list[dict], path: Path, settings: dict) -> None:
    """The target's answers, gzipped, with their sha256 and the command that made them beside
    (PATH.json): hours of generating that a new machine need not redo."""
    import gzip
    import hashlib
    import sys

    body = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in recs).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(body, mtime=0))
    meta = {"records": len(recs), "sha256_of_jsonl": hashlib.sha256(body).hexdigest(),
            "command": " ".join(["python", *sys.argv]),
            "settings": {k: str(v) for k, v in settings.items()}}  # fmt: skip
    path.with_name(path.name + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(
        f"answers: {len(recs)} saved to {path} (sha256 of the JSONL {meta['sha256_of_jsonl'][:16]}...)",
        flush=True,
    )


def read_answers(path: Path) -> list[dict]:
    """Answers saved by `save_answers`, checked against the sha256 recorded beside them."""
    import gzip
    import hashlib

    body = gzip.decompress(path.read_bytes())
    meta_path = path.with_name(path.name + ".json")
    if meta_path.is_file():
        want = json.loads(meta_path.read_text())["sha256_of_jsonl"]
        if hashlib.sha256(body).hexdigest() != want:
            raise SystemExit(
                f"{path}: its content is not what {meta_path} says (sha256); fetch it again"
            )
    return [json.loads(x) for x in body.decode("utf-8").split("\n") if x.strip()]


def generate_hf(
    recs: list[dict],
    model_dir: str,
    out: Path,
    turns: str,
    max_new: int,
    batch: int,
    max_prompt: int,
    device: str,
) -> list[dict]:
    """The target's own greedy answers in place of ShareGPT's, with transformers in this
    process (batched, left-padded; a GPU where there is one): the first answer of each
    conversation, or with `turns="all"` every answer, turn by turn, each asked with the
    target's own earlier answers in the history. A conversation ends at the first turn whose
    prompt is over `max_prompt` tokens. Written to `out` and reused when it is complete."""
    import torch

    from eyas.targets.target import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    if out.is_file():  # written whole at the end: a file there is complete
        got = [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n") if x.strip()]
        print(f"generate: {len(got)} conversations from {out}", flush=True)
        return got
    dev = torch.device(resolve_device(device))
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, resolve_dtype("auto", dev.type)).eval().to(dev)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = model.generation_config.eos_token_id
    stop = {pad, *(eos if isinstance(eos, list) else [eos])}
    users = []  # per conversation: its user turns, up to the first assistant turn or all
    for r in recs:
        us, answered = [], 0
        for t in r["conversations"]:
            role = _role(t)
            if role == "user":
                us.append(t["value"])
            elif role == "assistant" and us and len(us) > answered:
                answered = len(us)
                if turns == "first":
                    break
        users.append(us[:answered])
    history = [[] for _ in recs]  # messages so far, the target answering
    alive = list(range(len(recs)))
    t0, made = time.monotonic(), 0
    for turn in range(max(len(u) for u in users)):
        todo = []
        for i in alive:
            if turn < len(users[i]):
                msgs = history[i] + [{"role": "user", "content": users[i][turn]}]
                text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                ids = tok(text, add_special_tokens=False)["input_ids"]
                if len(ids) <= max_prompt:
                    todo.append((i, msgs, list(ids)))
        alive = [i for i, _, _ in todo]
        todo.sort(key=lambda x: len(x[2]))
        for a in range(0, len(todo), batch):
            part = todo[a : a + batch]
            width = max(len(x[2]) for x in part)
            ids = torch.tensor([[pad] * (width - len(x[2])) + x[2] for x in part], device=dev)
            mask = torch.tensor(
                [[0] * (width - len(x[2])) + [1] * len(x[2]) for x in part], device=dev
            )
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                     do_sample=False, eos_token_id=eos, pad_token_id=pad)  # fmt: skip
            for (i, msgs, _), row in zip(part, gen[:, width:].tolist(), strict=True):
                row = row[: next((j for j, x in enumerate(row) if x in stop), len(row))]
                made += len(row)
                history[i] = msgs + [
                    {"role": "assistant", "content": tok.decode(row, skip_special_tokens=True)}
                ]
        print(f"generate: turn {turn + 1}: {len(todo)} answers, {made:,} tokens so far, "
              f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
    got = []
    for r, h in zip(recs, history, strict=True):
        if h:
            conv = [
                {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                for m in h
            ]
            got.append({"id": r.get("id"), "conversations": conv})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in got))
    tmp.replace(out)
    print(
        f"generate: {len(got)} conversations, {made:,} answer tokens in {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    del model
    return got


STARTED = time.monotonic()
GREEDY: dict = {}  # plain greedy decoding does not depend on the drafter: once per prompt


def train_options(text: str) -> dict:
    """`--train-args` as TrainConfig fields, read by eyas train's own option parser."""
    import shlex

    import typer

    from eyas.cli import app

    if not text.strip():
        return {}
    cmd = typer.main.get_command(app).commands["train"]
    ctx = cmd.make_context("train", ["--out", "x", *shlex.split(text)])
    return {k: v for k, v in ctx.params.items()
            if ctx.get_parameter_source(k).name == "COMMANDLINE" and k not in ("out",)}  # fmt: skip


def run_size(args, work: Path, real: Path, recs: list[dict]) -> dict:
    from eyas.stages.config import ExportConfig
    from eyas.stages.evaluate import evaluate
    from eyas.stages.export import export
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare
    from eyas.stages.train import TrainConfig, train

    model = str(real / "model")
    n = len(recs)
    w = work / f"n{n}"
    w.mkdir(parents=True, exist_ok=True)
    data = w / "conversations.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    t = {}

    def timed(name, fn):
        t0 = time.monotonic()
        out = fn()
        t[name] = round(time.monotonic() - t0, 1)
        print(f"[n={n}] {name}: {t[name]:.0f} s", flush=True)
        return out

    p = timed("prepare", lambda: prepare(PrepareConfig(
        model=model, data=(str(data),), out=str(w / "ds"), max_length=args.max_length,
        draft_vocab_size=args.draft_vocab, max_error_rate=1.0, force=True, progress=False)))  # fmt: skip
    left = {k: v for k, v in p.reasons.items()}
    print(f"[n={n}] conversations {n}: {p.samples} samples kept, {n - p.prepared} left out"
          + (f" ({', '.join(f'{v} {k}' for k, v in left.items())})" if left else ""), flush=True)  # fmt: skip
    x = timed("extract", lambda: extract(ExtractConfig(
        model=model, data=str(w / "ds"), out=str(w / "run"), batch_tokens=args.extract_batch_tokens,
        store_dtype="bfloat16", min_free="1G", progress=False)))  # fmt: skip
    tr = timed("train", lambda: train(TrainConfig.of(
        data=str(w / "run"), out=str(w / "train"), epochs=args.epochs, ttt_steps=args.ttt_steps,
        lr=args.lr, warmup_steps=args.warmup_steps, batch_tokens=args.batch_tokens,
        val_fraction=0.05, save_every=200, dtype=args.train_dtype, **train_options(args.train_args),
        progress=True)))  # fmt: skip
    drafter = timed(
        "export",
        lambda: (
            export(
                ExportConfig(train_dir=str(w / "train"), format="vllm", out=str(w / "drafter"))
            ).path
        ),
    )
    if args.engine == "vllm":  # vLLM as the judge: far faster than the hf loop on a CPU
        from eyas.stages.evaluate import evaluate_vllm

        e = timed("evaluate", lambda: evaluate_vllm(
            model, str(drafter), str(real / "mtbench.jsonl"), k=args.k, max_new_tokens=args.max_new_tokens,
            limit=args.eval_prompts, progress=False))  # fmt: skip
    else:
        left = args.deadline - (time.monotonic() - STARTED) if args.deadline else 0
        if args.deadline and left < 30:
            raise SystemExit(f"--deadline {args.deadline} s: no time left to evaluate n={n}")
        if left:  # SIGTERM at the deadline: evaluate returns the prompts done, marked partial
            signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
            signal.alarm(int(left))
        e = timed("evaluate", lambda: evaluate(
            model, str(drafter), str(real / "mtbench.jsonl"), k=args.k, max_new_tokens=args.max_new_tokens,
            limit=args.eval_prompts, precision=args.precision or None, progress=False,
            greedy_cache=GREEDY, device=args.device))  # fmt: skip
    signal.alarm(0)
    d = e.to_dict()
    return {
        "conversations": n, "samples_kept": p.samples, "left_out": dict(p.reasons), "tokens": p.tokens, "trainable_tokens": p.trainable_tokens,
        "samples": x.done_before + x.committed, "val_acc": [round(a, 3) for a in tr.val["acc"]],
        "tokens_per_forward": d["tokens_per_forward"], "tokens_per_forward_ci95": d["tokens_per_forward_ci95"],
        "acceptance_length": d["acceptance_length"], "acceptance_length_ci95": d["acceptance_length_ci95"],
        "per_position_acceptance": d["per_position_acceptance"], "prompts": d["prompts"],
        "speculative_tok_s": d["spec_tokens_per_s"], "greedy_tok_s": d["greedy_tokens_per_s"],
        "lossless": d["lossless"], "partial": d.get("partial", False), "by_category": d.get("by_category", {}), "seconds": t,
        "extract_tok_s": round(x.tokens / t["extract"], 1) if t["extract"] else None,
        "train_tok_s": tr.get("tokens_per_s"),
    }  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", type=Path, required=True, help="scripts/real_target.py's --out")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: REAL/bench)")
    ap.add_argument(
        "--sizes", default="500", help="conversations, comma-separated (nested subsets)"
    )
    ap.add_argument("--max-length", type=int, default=512, help="prepare --max-length")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="prepare --draft-vocab-size")
    ap.add_argument("--epochs", type=int, default=3, help="train --epochs")
    ap.add_argument("--ttt-steps", type=int, default=3, help="train --ttt-steps")
    ap.add_argument("--lr", type=float, default=None, help="train --lr (default: eyas's choice)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="train --warmup-steps")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="train --batch-tokens (default: eyas's choice)")  # fmt: skip
    ap.add_argument("--extract-batch-tokens", type=int, default=8192, help="extract --batch-tokens")
    ap.add_argument("--train-args", default="",
                    help="more train options as on its command line, e.g. '--head-init target'")  # fmt: skip
    ap.add_argument("--k", type=int, default=3, help="evaluate --draft-tokens (drafts per round)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="evaluate --max-new-tokens")
    ap.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench first turns to judge on")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                    help="the judge: eyas's hf decoder, or vLLM (where it is installed)")  # fmt: skip
    ap.add_argument(
        "--precision", type=float, default=0.0, help="stop evaluating at +- this (0: all)"
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="order in which ShareGPT records are picked"
    )
    ap.add_argument(
        "--data",
        type=Path,
        default=None,
        help="ShareGPT-form conversations (default: REAL/sharegpt.jsonl)",
    )
    ap.add_argument("--first-turn", action="store_true", help="train on first turns only")
    ap.add_argument(
        "--max-prompt-tokens", type=int, default=0, help="only first user turns this short"
    )
    ap.add_argument(
        "--endpoint",
        default=None,
        help="OpenAI-compatible server of the target: train on its own answers",
    )
    ap.add_argument("--served-model", default="target", help="the model name the endpoint serves")
    ap.add_argument("--answers", type=Path, default=None,
                    help="the target's own answers saved by --save-answers (JSONL.gz): used instead of generating")  # fmt: skip
    ap.add_argument("--save-answers", type=Path, default=None,
                    help="with --endpoint: save the answers there (JSONL.gz, sha256 and command beside)")  # fmt: skip
    ap.add_argument("--generate-only", action="store_true", help="stop after the answers are made")
    ap.add_argument(
        "--gen-max-tokens", type=int, default=320, help="longest answer the target gives"
    )
    ap.add_argument("--generate", choices=("none", "hf"), default="none",
                    help="hf: the target's own greedy answers, made in this process with "
                         "transformers (a GPU where there is one)")  # fmt: skip
    ap.add_argument("--turns", choices=("first", "all"), default="first",
                    help="--generate hf: answer the first user turn or every one")  # fmt: skip
    ap.add_argument(
        "--gen-batch", type=int, default=64, help="--generate hf: prompts answered at once"
    )
    ap.add_argument("--gen-max-prompt", type=int, default=1536,
                    help="--generate hf: a conversation ends at a longer prompt")  # fmt: skip
    ap.add_argument("--device", default="auto", help="evaluate (hf) and --generate hf")
    ap.add_argument("--train-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--deadline", type=int, default=0,
                    help="seconds from the start: the hf evaluation then stops and reports "
                         "the prompts done (partial); 0: none")  # fmt: skip
    return ap


def main() -> None:
    run(parser().parse_args())


def run(args) -> list[dict]:
    from real_fixture import build

    build(args.real)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    tok = None
    if args.max_prompt_tokens:
        from eyas.targets.target import load_tokenizer

        tok = load_tokenizer(str(args.real / "model"))
    first = args.first_turn or bool(args.endpoint) or (args.generate, args.turns) == ("hf", "first")
    recs = pick_conversations(args.data or args.real / "sharegpt.jsonl", sizes[-1], args.seed,
                              first_turn=first, tokenizer=tok, max_prompt_tokens=args.max_prompt_tokens)  # fmt: skip
    work = args.work or args.real / "bench"
    if args.answers:
        recs = read_answers(args.answers)
        print(
            f"answers: {len(recs)} conversations in the target's own words from {args.answers}",
            flush=True,
        )
    elif args.endpoint:
        recs = regenerate(
            recs, work / "generate", args.endpoint, args.served_model, args.gen_max_tokens
        )
        if args.save_answers:
            save_answers(recs, args.save_answers, vars(args))
    elif args.generate == "hf":
        name = f"hf-{args.turns}-{len(recs)}-{args.gen_max_tokens}.jsonl"
        recs = generate_hf(recs, str(args.real / "model"), work / "generate" / name, args.turns,
                           args.gen_max_tokens, args.gen_batch, args.gen_max_prompt, args.device)  # fmt: skip
    if args.generate_only:
        return []
    sizes = [min(n, len(recs)) for n in sizes]
    print(f"settings: {json.dumps(vars(args), default=str)}", flush=True)
    rows = []
    for n in sizes:
        rows.append(run_size(args, work, args.real, recs[:n]))
        print(json.dumps(rows[-1]), flush=True)
    print(
        "\nconversations  tokens   val acc@0  tokens/forward [95%]     acceptance [95%]      stage seconds"
    )
    for r in rows:
        tpf, acc = r["tokens_per_forward_ci95"] or [0, 0], r["acceptance_length_ci95"] or [0, 0]
        print(f"{r['conversations']:>13}  {r['tokens']:>7}  {r['val_acc'][0]:>9.3f}  "
              f"{r['tokens_per_forward']:.2f} [{tpf[0]:.2f}, {tpf[1]:.2f}]     "
              f"{r['acceptance_length']:.2f} [{acc[0]:.2f}, {acc[1]:.2f}]     {r['seconds']}")  # fmt: skip
    for r in rows:
        print(f"\nn={r['conversations']}: per category (tokens/forward)")
        for cat, c in r["by_category"].items():
            print(f"  {cat:<12} {c['tokens_per_forward']:.2f} {c['tokens_per_forward_ci95']}")
    return rows


if __name__ == "__main__":
    main()

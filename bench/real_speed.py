"""Speed at a real size: SmolLM2-135M-Instruct and a drafter of its real shape.

In one run, each part alternating the two things it compares and giving the median of pairs:

1. extract: `eyas extract` against a bare batched forward of the same model over the same
   batches of ShareGPT conversations (target >= 0.95).
2. train: `eyas train` against a bare loop of the same drafter (H 576, draft vocabulary
   `--draft-vocab`, `--ttt-steps` TTT steps) over the same batches held in memory
   (target >= 0.9), on part 1's extraction.
3. decode: `eyas evaluate`'s hf decoder on MT-Bench prompts: the time of one speculative
   round against one greedy step, and what a round is made of (the target's forward of K+1
   tokens, the drafter's K drafts, its prefix update, the rest). With `--drafter` a trained
   export is used, else one trained in part 2 (its acceptance is then low; the costs per
   round and per step do not depend on it).

Each part ends with the arithmetic: FLOPs per token against what one float32 matmul of a
similar shape delivers on this machine with the same threads; for decoding, also the
target's linear layers alone at 1 row and at K+1 rows (what a verifying forward adds). Run from the repo root:

    python bench/real_speed.py --real /data/real [--samples 50] [--drafter DIR] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from extract_overhead import bare_loop
from real_target import pick_conversations
from train_step import bare_train


def matmul_gflops(m: int, k: int, n: int, threads: int, repeats: int = 20) -> float:
    """GFLOP/s of a float32 (m, k) @ (k, n) on `threads` threads, best of `repeats`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(before)
    return 2 * m * k * n / best / 1e9


def stream_gbs(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of reading a float32 tensor of `gib` GiB once (a sum), best of `repeats`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(before)
    return x.numel() * 4 / best / 1e9


def linear_ms(shapes: list[tuple[int, int]], rows: list[int], threads: int, repeats: int = 7):
    """Milliseconds of one pass of `rows`-row inputs through float32 weights of `shapes`
    ((in, out) each, as the target's linear layers and head), per row count: the median of
    `repeats` passes, the row counts alternated within each."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    weights = [torch.randn(o, i) for i, o in shapes]
    xs = {m: [torch.randn(m, i) for i, _ in shapes] for m in rows}
    times: dict[int, list[float]] = {m: [] for m in rows}
    for _ in range(repeats + 1):  # the first pass warms up
        for m in rows:
            t0 = time.perf_counter()
            for x, w in zip(xs[m], weights, strict=True):
                torch.nn.functional.linear(x, w)
            times[m].append(time.perf_counter() - t0)
    torch.set_num_threads(before)
    return {m: round(statistics.median(t[1:]) * 1e3, 2) for m, t in times.items()}


def _median_pairs(ours: list[float], bare: list[float]) -> float:
    return statistics.median(o / b for o, b in zip(ours, bare, strict=True))


def part_extract(args, work: Path, model: str) -> dict:
    from eyas.data.dataset import PreparedDataset
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare

    recs = pick_conversations(args.real / "sharegpt.jsonl", args.samples, seed=0)
    (work / "conv.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
    )
    prepare(PrepareConfig(model=model, data=(str(work / "conv.jsonl"),), out=str(work / "ds"),
                          max_length=args.max_length, draft_vocab_size=args.draft_vocab, max_error_rate=1.0,
                          progress=False))  # fmt: skip
    ds = PreparedDataset.open(work / "ds")
    bare, ours = [], []
    for r in range(args.repeats):
        cfg = ExtractConfig(model=model, data=str(work / "ds"), out=str(work / f"run{r}"),
                            batch_tokens=args.extract_batch_tokens, progress=False, min_free="1G")  # fmt: skip
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                secs, tokens = bare_loop(cfg, ds)
                bare.append(tokens / secs)
            else:
                s = extract(cfg)
                ours.append(s.tokens / s.seconds)
        if r < args.repeats - 1:
            shutil.rmtree(work / f"run{r}")
        else:
            (work / f"run{r}").rename(work / "run")
        print(f"  extract round {r + 1}: eyas {ours[-1]:,.0f} tok/s, bare forward {bare[-1]:,.0f} tok/s",
              file=sys.stderr, flush=True)  # fmt: skip
    return {"samples": len(ds), "tokens": int(ds.lengths().sum()),
            "eyas_tok_s": round(statistics.median(ours), 1), "bare_tok_s": round(statistics.median(bare), 1),
            "ratio_median_of_pairs": round(_median_pairs(ours, bare), 3), "target": 0.95}  # fmt: skip


def part_train(args, work: Path) -> dict:
    from eyas.stages.train import TrainConfig, train

    cfg = TrainConfig.of(data=str(work / "run"), out=str(work / "train"), epochs=1, ttt_steps=args.ttt_steps,
                      lr=3e-3, batch_tokens=args.batch_tokens, val_fraction=0.0, save_every=10**9,
                      draft_vocab_size=args.draft_vocab, device="cpu", progress=False)  # fmt: skip
    bare, ours = [], []
    for r in range(args.repeats):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            if which == 0:
                bare.append(bare_train(cfg, work / "run", 1, args.batch_tokens, args.ttt_steps))
            else:
                shutil.rmtree(work / "train", ignore_errors=True)
                ours.append(train(cfg).tokens_per_s)
        print(f"  train round {r + 1}: eyas {ours[-1]:,.0f} tok/s, bare loop {bare[-1]:,.0f} tok/s",
              file=sys.stderr, flush=True)  # fmt: skip
    return {"ttt_steps": args.ttt_steps, "draft_vocab": args.draft_vocab, "batch_tokens": args.batch_tokens,
            "eyas_tok_s": round(statistics.median(ours), 1), "bare_tok_s": round(statistics.median(bare), 1),
            "ratio_median_of_pairs": round(_median_pairs(ours, bare), 3), "target": 0.9}  # fmt: skip


def train_flops_per_token(args, work: Path) -> float:
    """Matmul FLOPs of one trained token: the target's logits from its stored last state
    (forward only), the fc once and, per TTT step, the drafter's layer and head (forward and
    backward: 3x); attention scores are left out (small at these lengths)."""
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import TrainConfig, build_drafter

    cfg = TrainConfig.of(data=str(work / "run"), out="-", draft_vocab_size=args.draft_vocab)
    meta = read_run_meta(work / "run")
    d, lm_head = build_drafter(cfg, meta)
    n = {name: p.numel() for name, p in d.named_parameters() if p.requires_grad and p.dim() == 2}
    fc = sum(v for k, v in n.items() if k.startswith("fc."))
    per_step = sum(v for k, v in n.items() if not k.startswith("fc."))
    return 2 * lm_head.numel() + 6 * fc + args.ttt_steps * 6 * per_step


def _timed(fn, now: list[dict], name: str, longest: int | None = None):
    """`fn`, adding its wall time to `now[0][name]`, or to `now[0]["prefill"]` for a call on
    more than `longest` tokens (a prompt's first pass); its signature stays visible (evaluate
    picks the cache argument's name from it)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        ids = None if longest is None else (a[0] if a else kw["input_ids"])
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        key, into = "prefill" if ids is not None and ids.shape[-1] > longest else name, now[0]
        into[key] = into.get(key, 0.0) + time.perf_counter() - t0
        return out

    return wrapper


def part_decode(args, model_dir: str, drafter_dir: str) -> dict:
    """Per greedy step and per speculative round, prompts' prefills left out of both (the speedup, end to end, keeps them)."""
    from eyas.decoders.hf import AuxTap, greedy, speculative
    from eyas.decoders.result import EvalResult
    from eyas.host.cpu import configure_threads
    from eyas.stages.evaluate import read_prompts, render_prompts
    from eyas.stages.export import export_kind, load_export
    from eyas.targets.target import load_causal_lm, load_tokenizer

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, torch.float32).eval()
    threads = configure_threads(model.config.hidden_size)  # as evaluate runs
    drafter, aux_hf = load_export(drafter_dir)
    eos = {tok.eos_token_id} - {None}
    prompts = render_prompts(tok, read_prompts(args.real / "mtbench.jsonl", args.decode_prompts))
    k = args.k
    g: dict[str, float] = {}  # greedy's forwards
    r: dict[str, float] = {}  # the rounds' parts
    now = [r]  # where the wrappers add: greedy's or the rounds'
    # nn.Module.__call__ finds these instance attributes before the class's methods
    model.forward = _timed(model.forward, now, "target forward", k + 1)
    drafter.draft = _timed(drafter.draft, now, "drafter drafts")
    drafter.prefix_kv = _timed(drafter.prefix_kv, now, "drafter prefix", k + 1)
    tap = AuxTap(model, aux_hf)
    proposer = export_kind(drafter_dir).proposer(drafter, aux_hf)
    res = EvalResult(prompts=len(prompts), per_position=[[0, 0] for _ in range(k)])
    g_sec, g_tok, s_sec, s_tok = 0.0, 0, 0.0, 0
    try:
        for i, p in enumerate(prompts):
            for which in (0, 1) if i % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                if which == 0:
                    now[0] = g
                    g_tok += len(greedy(model, p, args.max_new_tokens, eos))
                    g_sec += time.perf_counter() - t0
                else:
                    now[0] = r
                    s_tok += len(
                        speculative(model, tap, proposer, p, args.max_new_tokens, k, eos, res)
                    )
                    s_sec += time.perf_counter() - t0
    finally:
        tap.remove()
    rounds, n = res.rounds, len(prompts)
    step = (g_sec - g.get("prefill", 0.0)) / (g_tok - n)  # the first token comes from the prefill
    rnd = (s_sec - r.get("prefill", 0.0)) / rounds
    split = {name: round(v / rounds * 1e3, 2) for name, v in r.items() if name != "prefill"}
    split["rest (Python, cache crop, concatenation)"] = round(
        (s_sec - sum(r.values())) / rounds * 1e3, 2
    )
    g_fwd = g.get("target forward", 0.0) / (g_tok - n)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    return {
        "prompts": n, "k": k, "threads": threads, "max_new_tokens": args.max_new_tokens,
        "greedy_ms_per_step": round(step * 1e3, 2), "greedy_forward_ms_per_step": round(g_fwd * 1e3, 2),
        "speculative_ms_per_round": round(rnd * 1e3, 2), "round_over_step": round(rnd / step, 3),
        "round_ms_by_part": split, "tokens_per_forward": round(res.tokens_per_forward, 3),
        "speedup_measured": round(s_tok / s_sec / (g_tok / g_sec), 3),
        "speedup_at_1.8_tokens_per_forward": round(1.8 / (rnd / step), 3),
        "break_even_tokens_per_forward": round(rnd / step, 3),
        "weights_gb": round(weights / 1e9, 3), "greedy_weights_gb_per_s": round(weights / g_fwd / 1e9, 1),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--real", type=Path, required=True, help="scripts/real_target.py's --out")
    ap.add_argument(
        "--samples", type=int, default=50, help="ShareGPT conversations for parts 1 and 2"
    )
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--extract-batch-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3, help="alternated pairs per part")
    ap.add_argument("--drafter", type=Path, default=None, help="an exported drafter for part 3")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--decode-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--parts", default="extract,train,decode")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    from eyas.host.cpu import choose_threads
    from eyas.stages.config import ExportConfig
    from eyas.stages.export import export

    hf_logging.disable_progress_bar()
    model = str(args.real / "model")
    parts = set(args.parts.split(","))
    if "decode" in parts and "train" not in parts and args.drafter is None:
        ap.error("--parts decode needs --drafter (or the train part, whose drafter it then uses)")
    work = Path(tempfile.mkdtemp(prefix="eyas-realspeed-", dir=args.workdir))
    out: dict = {"model": "SmolLM2-135M-Instruct, float32", "cpus": torch.get_num_threads()}
    try:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model)
        H, inter, hd = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
        attn = 2 * H * H + 2 * H * c.num_key_value_heads * hd  # q and o; k and v
        base_flops = 2 * c.num_hidden_layers * (attn + 3 * H * inter)  # and the gated MLP
        if parts & {"extract", "train"}:
            out["extract"] = e = part_extract(args, work, model)
            threads = torch.get_num_threads()
            peak = matmul_gflops(args.extract_batch_tokens, H, inter, threads)
            e["gflop_per_token"] = round(base_flops / 1e9, 3)
            e["bare_gflops"] = round(e["bare_tok_s"] * base_flops / 1e9, 1)
            e["matmul_gflops_same_threads"] = round(peak, 1)
            if not args.json:
                show(out, "extract")
        if "train" in parts:
            out["train"] = t = part_train(args, work)
            d = args.draft_vocab
            flops = train_flops_per_token(args, work)
            t["gflop_per_token"] = round(flops / 1e9, 3)
            t["bare_gflops"] = round(t["bare_tok_s"] * flops / 1e9, 1)
            t["matmul_gflops_same_threads"] = round(
                matmul_gflops(args.batch_tokens, H, d, choose_threads()), 1
            )
            if not args.json:
                show(out, "train")
        if "decode" in parts:
            drafter = args.drafter
            if drafter is None:
                drafter = export(
                    ExportConfig(
                        train_dir=str(work / "train"), format="vllm", out=str(work / "drafter")
                    )
                ).path
            out["decode"] = part_decode(args, model, str(drafter))
            torch.set_num_threads(out["decode"]["threads"])
            out["decode"]["one_token_matvec_gflops"] = round(
                matmul_gflops(1, H, inter, out["decode"]["threads"], 200), 1
            )
            out["decode"]["stream_gb_per_s"] = round(stream_gbs(out["decode"]["threads"]), 1)
            kv = c.num_key_value_heads * hd
            layer = [(H, H), (H, kv), (H, kv), (H, H), (H, inter), (H, inter), (inter, H)]
            shapes = layer * c.num_hidden_layers + [(H, c.vocab_size)]
            rows = linear_ms(shapes, [1, args.k + 1], out["decode"]["threads"])
            out["decode"]["linear_ms_by_rows"] = rows
            out["decode"]["linear_gflops_at_k1_rows"] = round(
                2 * (args.k + 1) * sum(i * o for i, o in shapes) / rows[args.k + 1] / 1e6, 1
            )
            if not args.json:
                show(out, "decode")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))


def show(out: dict, part: str) -> None:
    """Print one part's lines as soon as it is measured (a later part that fails keeps them)."""
    if part == "extract":
        e = out["extract"]
        print(
            f"extract: {e['samples']} samples, {e['tokens']:,} tokens: eyas {e['eyas_tok_s']:,.0f} tok/s, bare forward "
            f"{e['bare_tok_s']:,.0f} tok/s, ratio {e['ratio_median_of_pairs']:.3f} (median of pairs; target >= 0.95)"
        )
        print(f"  {e['gflop_per_token']} GFLOP/token -> the bare forward runs at {e['bare_gflops']} GFLOP/s; one "
              f"(batch, 576) x (576, 1536) matmul reaches {e['matmul_gflops_same_threads']} GFLOP/s")  # fmt: skip
    if part == "train":
        t = out["train"]
        print(
            f"train: TTT {t['ttt_steps']}, draft vocab {t['draft_vocab']:,}, batch {t['batch_tokens']:,}: eyas "
            f"{t['eyas_tok_s']:,.0f} tok/s, bare loop {t['bare_tok_s']:,.0f} tok/s, ratio "
            f"{t['ratio_median_of_pairs']:.3f} (median of pairs; target >= 0.9)"
        )
        print(
            f"  {t['gflop_per_token']} GFLOP/token -> the bare loop runs at {t['bare_gflops']} GFLOP/s; one "
            f"(batch, 576) x (576, {t['draft_vocab']}) matmul reaches {t['matmul_gflops_same_threads']} GFLOP/s"
        )
    if part == "decode":
        d = out["decode"]
        print(
            f"decode (hf, {d['threads']} thread(s), K={d['k']}, {d['prompts']} prompts x {d['max_new_tokens']} tokens): "
            f"greedy {d['greedy_ms_per_step']} ms/step ({d['greedy_forward_ms_per_step']} in the forward), "
            f"speculative {d['speculative_ms_per_round']} ms/round = {d['round_over_step']:.2f} steps"
        )
        print("  a round: " + ", ".join(f"{k} {v} ms" for k, v in d["round_ms_by_part"].items()))
        print(
            f"  tokens/forward {d['tokens_per_forward']:.2f}: speedup {d['speedup_measured']:.2f} measured; it breaks "
            f"even at {d['break_even_tokens_per_forward']:.2f} tokens/forward, and 1.8 would give "
            f"{d['speedup_at_1.8_tokens_per_forward']:.2f}"
        )
        print(f"  a greedy step reads the {d['weights_gb']} GB of weights at {d['greedy_weights_gb_per_s']} GB/s; "
              f"reading 1 GiB runs at {d['stream_gb_per_s']} GB/s, a one-token matvec at "
              f"{d['one_token_matvec_gflops']} GFLOP/s")  # fmt: skip
        r = d["linear_ms_by_rows"]
        k1 = d["k"] + 1
        print(f"  the target's linear layers and head alone: {r[1]} ms for 1 row, {r[k1]} ms for {k1} rows "
              f"(x{r[k1] / r[1]:.2f}; {d['linear_gflops_at_k1_rows']} GFLOP/s at {k1} rows): "
              "what verifying K drafts costs over one greedy step")  # fmt: skip


if __name__ == "__main__":
    main()

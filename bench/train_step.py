"""One training step at long context: tokens/s and peak memory of each TTT attention, and
`eyas train` against a bare loop.

1. For T in --lengths and each attention (`reference`, `chunked`; `flex` on a GPU), one
   drafter training step (TTT forward over --ttt-steps, soft cross-entropy, backward) on
   random data: tokens/s (median of --repeats) and the step's peak memory. Each row runs in
   a fresh process, so a CPU peak is the rise of the process's high-water RSS over the step;
   on a GPU it is `max_memory_allocated`.
2. `eyas train` on a small extraction run against a bare loop of the same drafter, batches
   and math over tensors already in memory: the ratio of their tokens/s (target >= 0.9)
   is the cost of reading, checking and bookkeeping. Like for like: the same thread
   count, attention, batches and counted tokens, and `eyas train`'s rate covers its
   training loop only (not its final saves).
3. `eyas train --pack` against padded batches on the same run and token budget: tokens/s
   of each (alternating rounds) and their ratio: the padded compute packing removes.

Defaults fit a 2-core CPU; `--device cuda --hidden 7168 --heads 64` is a Kimi-class drafter.
Run from the repo root:

    python bench/train_step.py [--lengths 1024 2048 4096 8192] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _drafter(args, device):
    from eyas.drafters.eagle3.model import Drafter, DrafterConfig

    H = args.hidden
    c = DrafterConfig(hidden_size=H, intermediate_size=2 * H, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), head_dim=H // args.heads, vocab_size=4096,
                      draft_vocab_size=1024)  # fmt: skip
    torch.manual_seed(0)
    d = Drafter(c)
    d.set_draft_vocab(torch.arange(0, 4096, 4))
    return d.to(device)


def one_row(args) -> dict:
    """Runs in its own process: one (attention, T) row."""
    from eyas.stages.train import add_targets, ttt_loss

    device = torch.device(args.device)
    attention, T = args.one[0], int(args.one[1])
    d = _drafter(args, device)
    d.attention = attention
    H = args.hidden
    g = torch.Generator().manual_seed(1)
    lm_head = torch.randn(4096, H, generator=g).to(device) / H**0.5
    batch = {
        "input_ids": torch.randint(0, 4096, (1, T), generator=g), "aux": torch.randn(1, T, 3 * H, generator=g),
        "last": torch.randn(1, T, H, generator=g), "loss_mask": torch.ones(1, T, dtype=torch.bool),
        "valid": torch.ones(1, T, dtype=torch.bool),
    }  # fmt: skip
    batch = {k: v.to(device) for k, v in batch.items()}
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = torch.autocast(device.type, dtype=dt, enabled=dt != torch.float32)

    def step():
        b = dict(batch)
        add_targets(b, d, lm_head)
        with autocast:
            loss, _ = ttt_loss(d, b, args.ttt_steps, 0.8)
        loss.backward()
        d.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up (and compilation for flex)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # fmt: skip
    return {
        "attention": attention,
        "T": T,
        "tokens_per_s": T / statistics.median(times),
        "peak_bytes": int(peak),
    }


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def bare_train(cfg, run: Path, epochs: int, batch_tokens: int, ttt_steps: int) -> float:
    """tokens/s of a bare training loop: `eyas train`'s drafter, batches and math over
    batches already collated in memory, without its reading, checks and bookkeeping."""
    from eyas.host.cpu import configure_threads
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import add_targets, build_drafter, ttt_loss
    from eyas.training.train_data import (
        SampleReader,
        epoch_batches,
        split_samples,
        to_device,
        usable_samples,
    )

    meta = read_run_meta(run)
    device = torch.device(cfg.device if cfg.device != "auto" else "cpu")
    d, lm_head = build_drafter(cfg, meta)
    d.attention = "chunked" if device.type == "cpu" else "flex"
    d.to(device)
    lm_head = lm_head.to(device)
    entries, _ = usable_samples(run, meta["hidden_size"], lambda m: None)
    reader = SampleReader(run, entries, False)
    lengths = {i: e["tokens"] for i, e in entries.items()}
    idx, _ = split_samples(sorted(entries), 0.0)
    batches = [
        reader.batch(b)
        for ep in range(epochs)
        for b in epoch_batches(lengths, idx, batch_tokens, 0, ep)
    ]
    batches = [to_device(b, device) for b in batches]
    if device.type == "cpu":
        configure_threads()  # the thread count `eyas train` runs with: like for like
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-4)
    tokens, t0 = 0, time.perf_counter()
    for b in batches:
        add_targets(b, d, lm_head)
        loss, _ = ttt_loss(d, b, ttt_steps, 0.8)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(d.parameters(), 0.5)
        opt.step()
        tokens += int(b["valid"].sum())
    return tokens / (time.perf_counter() - t0)


def train_vs_bare(args) -> float:
    """Ratio of `eyas train`'s tokens/s to a bare loop over the same batches in memory."""
    from eyas.stages.train import TrainConfig, train

    work = Path(tempfile.mkdtemp(prefix="eyas-trainbench-", dir=args.workdir))
    try:
        _small_run(work, args)
        cfg = TrainConfig.of(data=str(work / "run"), out=str(work / "out"), epochs=2, ttt_steps=args.ttt_steps,
                          batch_tokens=2048, val_fraction=0.0, save_every=10**9, device=args.device, progress=False)  # fmt: skip
        ratios = []
        for r in range(args.repeats):
            shutil.rmtree(work / "out", ignore_errors=True)
            eyas_tps = train(cfg)["tokens_per_s"]
            bare_tps = bare_train(cfg, work / "run", 2, 2048, args.ttt_steps)
            ratios.append(eyas_tps / bare_tps)
            print(f"  round {r + 1}: eyas train {eyas_tps:,.0f} tok/s, bare loop {bare_tps:,.0f} tok/s, ratio "
                  f"{eyas_tps / bare_tps:.2f}", file=sys.stderr, flush=True)  # fmt: skip
        return statistics.median(ratios)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def packed_vs_padded(args) -> float:
    """tokens/s of `eyas train --pack` over padded batches, same run, budget and steps."""
    from eyas.stages.train import TrainConfig, train

    work = Path(tempfile.mkdtemp(prefix="eyas-packbench-", dir=args.workdir))
    try:
        _small_run(work, args, lengths_spread=True)
        ratios = []
        for r in range(args.repeats):
            tps = {}
            for pack in (False, True) if r % 2 == 0 else (True, False):
                shutil.rmtree(work / "out", ignore_errors=True)
                cfg = TrainConfig.of(data=str(work / "run"), out=str(work / "out"), epochs=1, ttt_steps=args.ttt_steps,
                                  batch_tokens=4096, val_fraction=0.0, save_every=10**9, device=args.device,
                                  pack=pack, progress=False)  # fmt: skip
                tps[pack] = train(cfg)["tokens_per_s"]
            ratios.append(tps[True] / tps[False])
            print(f"  round {r + 1}: padded {tps[False]:,.0f} tok/s, packed {tps[True]:,.0f} tok/s, ratio "
                  f"{ratios[-1]:.2f}", file=sys.stderr, flush=True)  # fmt: skip
        return statistics.median(ratios)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _small_run(work: Path, args, lengths_spread: bool = False) -> None:
    """A tiny target's extraction run over generated conversations (their lengths spread
    widely with `lengths_spread`: padding's cost shows)."""
    from eyas.demo_target.data import generate_conversations, write_jsonl
    from eyas.demo_target.tiny import TinySizes, build_tiny_target
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare

    sizes = TinySizes(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
                      intermediate_size=2 * args.hidden)  # fmt: skip
    model = build_tiny_target(work / "t", "llama", sizes=sizes)
    convs = generate_conversations(200, seed=2)
    if lengths_spread:  # a few turns to many: lengths from tens to a thousand tokens
        for i, c in enumerate(convs):
            c["messages"] = c["messages"] * (1 + i % 12)
    write_jsonl(work / "c.jsonl", convs)
    prepare(
        PrepareConfig(
            model=str(model), data=(str(work / "c.jsonl"),), out=str(work / "ds"), progress=False
        )
    )
    extract(
        ExtractConfig(
            model=str(model),
            data=str(work / "ds"),
            out=str(work / "run"),
            progress=False,
            min_free="0",
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attention", nargs="+", default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip-train", action="store_true", help="Only the attention rows.")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_row(args)))
        return
    impls = args.attention or (
        ["reference", "chunked", "flex"]
        if args.device.startswith("cuda")
        else ["reference", "chunked"]
    )
    rows = []
    base = [sys.executable, __file__, "--hidden", str(args.hidden), "--heads", str(args.heads), "--ttt-steps",
            str(args.ttt_steps), "--repeats", str(args.repeats), "--device", args.device]  # fmt: skip
    # A fixed mmap threshold makes glibc return large freed blocks at once, so a process's
    # high-water RSS follows the tensors that were alive, not heap fragmentation.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for T in args.lengths:
        for impl in impls:
            p = subprocess.run(
                [*base, "--one", impl, str(T)], capture_output=True, text=True, env=env
            )
            if p.returncode != 0:
                why = (p.stderr.strip().splitlines() or ["?"])[-1]
                rows.append(
                    {
                        "attention": impl,
                        "T": T,
                        "tokens_per_s": None,
                        "peak_bytes": None,
                        "error": why,
                    }
                )
            else:
                rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            if not args.json:
                print(f"{impl:10s} T={T:6d}  " + (f"{r['tokens_per_s']:10,.0f} tok/s  peak {r['peak_bytes'] / 2**20:9.1f} MiB"
                      if r["tokens_per_s"] else f"failed: {r['error']}"), flush=True)  # fmt: skip
    growth = {}
    for impl in impls:
        peaks = {
            r["T"]: r["peak_bytes"] for r in rows if r["attention"] == impl and r["peak_bytes"]
        }
        if 4096 in peaks and 8192 in peaks and peaks[4096] > 0:
            growth[impl] = peaks[8192] / peaks[4096]
    ratio = None if args.skip_train else train_vs_bare(args)
    packed = None if args.skip_train else packed_vs_padded(args)
    if args.json:
        print(json.dumps({"rows": rows, "train_vs_bare": ratio, "packed_over_padded": packed,
                          "peak_8k_over_4k": growth}))  # fmt: skip
    else:
        for impl, g in growth.items():
            print(
                f"peak memory T=8k / T=4k, {impl}: {g:.2f}x (target for the memory-efficient path: <= 2.5x)"
            )
        if ratio is not None:
            print(f"eyas train / bare loop tokens/s: {ratio:.2f} (target >= 0.9)")
        if packed is not None:
            print(f"eyas train --pack / padded tokens/s: {packed:.2f}")


if __name__ == "__main__":
    main()

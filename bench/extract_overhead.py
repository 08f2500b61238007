"""How close is `eyas extract` to the speed of the target's bare forward pass?

In one run, on the same model, data and batch plan, times
  1. a bare loop: the base model's forward over every batch, outputs discarded;
  2. eyas extract: the same forward plus hooks, device-to-host copies, checksums, atomic
     fsynced writes and the journal (overlapped by the writer thread);
and prints both tokens/s (best of `--repeats` alternating runs) and their ratio, as best of
each and as the median of back-to-back pairs (target: >= 0.95). Run from the repo root:

    python bench/extract_overhead.py [--hidden 512] [--layers 8] [--samples 200]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eyas.data.dataset import PreparedDataset
from eyas.demo_target.data import generate_conversations, write_jsonl
from eyas.demo_target.tiny import TinySizes, build_tiny_target
from eyas.stages.extract import ExtractConfig, extract
from eyas.stages.prepare import PrepareConfig, prepare
from eyas.targets.backends.hf import Capture, load_target
from eyas.targets.target import plan_batches, resolve_device, resolve_dtype


def bare_loop(cfg: ExtractConfig, ds: PreparedDataset) -> tuple[float, int]:
    device = resolve_device(cfg.device)
    model, device = load_target(cfg.model, device, resolve_dtype(cfg.dtype, device))
    base = Capture(model, (1, 2, 3)).base  # the decoder stack without the lm_head, as extract uses
    lengths = ds.lengths().tolist()
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in plan_batches(lengths, list(range(len(ds))), cfg.batch_tokens):
            T = max(lengths[i] for i in batch)
            ids = torch.zeros((len(batch), T), dtype=torch.long)
            att = torch.zeros((len(batch), T), dtype=torch.long)
            for r, i in enumerate(batch):
                x = ds.sample(i)[0]
                ids[r, : len(x)] = torch.from_numpy(x.astype("int64"))
                att[r, : len(x)] = 1
            base(input_ids=ids.to(device), attention_mask=att.to(device), use_cache=False)
            tokens += sum(lengths[i] for i in batch)
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument(
        "--workdir", default=".", help="where the run is written (its disk is part of the cost)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="alternate bare/eyas this many times")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix="eyas-bench-", dir=args.workdir))
    try:
        model = build_tiny_target(work / "model", "llama", sizes=TinySizes(
            num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=3 * args.hidden))  # fmt: skip
        write_jsonl(work / "conv.jsonl", generate_conversations(args.samples, seed=11))
        prepare(
            PrepareConfig(
                model=str(model),
                data=(str(work / "conv.jsonl"),),
                out=str(work / "ds"),
                progress=False,
            )
        )
        ds = PreparedDataset.open(work / "ds")
        bare, ours = [], []
        for r in range(args.repeats):
            cfg = ExtractConfig(model=str(model), data=str(work / "ds"), out=str(work / f"run{r}"),
                                batch_tokens=args.batch_tokens, progress=False, min_free="1M")  # fmt: skip
            secs, tokens = bare_loop(cfg, ds)
            bare.append(tokens / secs)
            s = extract(cfg)
            ours.append(s.tokens / s.seconds)
            shutil.rmtree(work / f"run{r}")
        b, o = max(bare), max(ours)
        paired = sorted(x / y for x, y in zip(ours, bare, strict=True))
        print(json.dumps({
            "model": f"llama H={args.hidden} layers={args.layers} fp32 on {torch.get_num_threads()} threads",
            "samples": len(ds), "tokens": int(ds.lengths().sum()), "batch_tokens": args.batch_tokens,
            "bare_forward_tokens_per_s": round(b, 1), "eyas_extract_tokens_per_s": round(o, 1),
            "ratio_best_of_each": round(o / b, 3),
            "ratio_median_of_pairs": round(paired[len(paired) // 2], 3),
            "ratios_per_pair": [round(x, 3) for x in paired], "target": 0.95,
        }, indent=2))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

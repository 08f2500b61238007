"""CPU threads on a quiet and on a busy machine: why eyas picks one thread for small models.

Greedy decoding of the demo target (8 layers, H=128), the inner loop of `eyas evaluate`,
timed at 1 thread and at torch's default (one per core), first on a quiet machine, then
with `--hogs` busy processes competing for the cores (what other jobs on a shared box do).
Settings alternate within each condition; the medians of `--repeats` runs are printed with
their ratio. Run from the repo root:

    python bench/threads.py [--repeats 5] [--hogs 2] [--tokens 48]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from eyas.decoders.hf import greedy
from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
from eyas.stages.evaluate import read_prompts, render_prompts


def timed(model, prompts, tokens: int, eos: set[int]) -> float:
    n, t0 = 0, time.perf_counter()
    for p in prompts:
        n += len(greedy(model, p, tokens, eos))
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    prompts = render_prompts(tok, read_prompts(DEMO_CONVERSATIONS, args.prompts))
    eos = {tok.eos_token_id}
    default = torch.get_num_threads()
    print(f"demo target greedy decoding, {args.prompts} prompts x {args.tokens} tokens; "
          f"{os.cpu_count()} CPUs, torch default {default} threads")  # fmt: skip
    for label, hogs in (("quiet", 0), (f"busy ({args.hogs} competing processes)", args.hogs)):
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        try:
            time.sleep(0.5 if hogs else 0)
            one, many = [], []
            for _ in range(args.repeats):
                torch.set_num_threads(1)
                one.append(timed(model, prompts, args.tokens, eos))
                torch.set_num_threads(default)
                many.append(timed(model, prompts, args.tokens, eos))
        finally:
            for p in procs:
                p.kill()
        a, b = statistics.median(one), statistics.median(many)
        print(
            f"{label:32s} 1 thread {a:8.1f} tok/s   {default} threads {b:8.1f} tok/s   ratio 1/{default}: {a / b:.2f}"
        )


if __name__ == "__main__":
    main()

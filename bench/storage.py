"""Bytes per token on disk for each storage mode, and what they come to at H = 4096 and 7168.

Extracts the same conversations from tiny llama targets of two or more hidden sizes in every
storage mode, measures everything the run directory holds (sample files with their headers,
journal, run.json and its backup, locks) per token, fits bytes/token = a*H + b per mode (the
part that grows with H and the fixed part) and prints the ratio to the 8H + 16 bytes per token
of the pickle layouts other tools write (bf16 final + 3 aux states, int64 ids), measured and
extrapolated. Dense modes store bfloat16. Run from the repo root:

    python bench/storage.py [--hidden 64 256] [--conversations 200]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

MODES = [("dense", "last"), ("fp8", "last"), ("dense", "topk:64"), ("fp8", "topk:64")]


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    from eyas.demo_target.data import generate_conversations, write_jsonl
    from eyas.demo_target.tiny import TinySizes, build_tiny_target
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare

    work = Path(tempfile.mkdtemp(prefix="eyas-storage-", dir=args.workdir))
    try:
        conv = work / "conv.jsonl"
        write_jsonl(conv, generate_conversations(args.conversations, seed=11))
        per_token: dict[tuple, dict[int, float]] = {m: {} for m in MODES}
        for H in args.hidden:
            sizes = TinySizes(
                hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * H
            )
            model = build_tiny_target(work / f"t{H}", "llama", sizes=sizes)
            ds = work / f"ds{H}"
            s = prepare(PrepareConfig(model=str(model), data=(str(conv),), out=str(ds), draft_vocab_size=1024,
                                      progress=False))  # fmt: skip
            for storage, target in MODES:
                run = work / f"run{H}-{storage}-{target.replace(':', '')}"
                extract(ExtractConfig(model=str(model), data=str(ds), out=str(run), storage=storage, target=target,
                                      store_dtype="bfloat16", progress=False, min_free="0"))  # fmt: skip
                per_token[(storage, target)][H] = dir_bytes(run) / s.tokens
                shutil.rmtree(run)
        print(f"{args.conversations} conversations; bytes per token of the whole run directory")
        head = "".join(f"{'H=' + str(H):>10}" for H in args.hidden)
        print(f"{'mode':28s}{head}   {'a (per H)':>10} {'b (fixed)':>10}   "
              f"{'ratio to 8H+16 at':>18} {'H=4096':>8} {'H=7168':>8}")  # fmt: skip
        for (storage, target), pts in per_token.items():
            hs = sorted(pts)
            a = (pts[hs[-1]] - pts[hs[0]]) / (hs[-1] - hs[0])
            b = pts[hs[0]] - a * hs[0]
            measured = " ".join(f"{pts[H] / (8 * H + 16):.2f}" for H in hs)
            ext = [(a * H + b) / (8 * H + 16) for H in (4096, 7168)]
            print(f"{'aux=' + storage + ', target=' + target:28s}" + "".join(f"{pts[H]:10.0f}" for H in hs)
                  + f"   {a:10.3f} {b:10.1f}   {measured:>18} {ext[0]:8.2f} {ext[1]:8.2f}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

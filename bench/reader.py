"""Training input speed: eyas's path from sample files to a batch ready for the step, against
a plain read of the same files, in one run, alternating, with the page cache warm.

Builds two stores of real sample files (the store's own encoding, checksums and journal;
random states of a target with H=--hidden): lossless (bfloat16 aux and final states, as a GPU
run stores them) and compact (float8 aux with scales, top-64 target). For each, rounds of
(a) a plain sequential read of every file, (b) `SampleReader.batch` over one epoch's batches
without checksums, (c) the same with every tensor checksum (a fresh reader: first reads).
Prints MB/s, the ratio (c)/(a), and how many GPUs training at 12k tokens/s each the rate
(c) would feed at H=7168. On a GPU the path ends on the device in the compute dtype (the
stored bytes copied, then upcast there); on a CPU it ends at the host batch a GPU would
receive (stored dtypes, checked), and the CPU's own upcast is timed apart. Run from the repo
root:

    python bench/reader.py [--samples 300] [--hidden 1024] [--rounds 3] [--threads 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

GPU_TOKENS_PER_S = 12_000  # one H200 training an H=7168 drafter (the estimate)
BYTES_PER_TOKEN_7168 = {"lossless": 57_349, "compact": 21_781}  # `eyas estimate` at H=7168


def build(run: Path, samples: int, H: int, compact: bool, seed: int = 0) -> list[int]:
    """A run directory of `samples` committed sample files; returns their token counts."""
    from eyas.run.journal import Journal, journal_path
    from eyas.run.store import Layout, Sample, commit_samples, quantize_fp8

    layout = Layout("fp8", "topk:64") if compact else Layout()
    meta = {"aux_layers": [1, 3, 4], "aux_layers_hf": [2, 4, 5], "last_hidden_state": "post_norm",
            "model_fingerprint": "bench", "layout": layout.name()}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(200, 1400, (samples,), generator=g).tolist()
    journal = Journal(journal_path(run, 0))
    for start in range(0, samples, 16):
        batch = []
        for i in range(start, min(start + 16, samples)):
            T = lengths[i]
            t = {"input_ids": torch.randint(0, 32000, (T,), dtype=torch.int32, generator=g),
                 "loss_mask": torch.ones(T, dtype=torch.uint8)}  # fmt: skip
            aux = torch.randn(T, 3 * H, generator=g)
            if compact:
                t["aux_hidden_states"], t["aux_scales"] = quantize_fp8(aux)
                t["target_topk_ids"] = torch.randint(
                    0, 32000, (T, 64), dtype=torch.int32, generator=g
                )
                t["target_topk_logprobs"] = torch.randn(T, 64, generator=g).to(torch.bfloat16)
                t["target_argmax"] = torch.randint(0, 32000, (T,), dtype=torch.int32, generator=g)
            else:
                t["aux_hidden_states"] = aux.to(torch.bfloat16)
                t["last_hidden_states"] = torch.randn(T, H, generator=g).to(torch.bfloat16)
            batch.append(Sample(i, f"s{i}", "bench", t))
        for e in commit_samples(run, batch, meta):
            journal.append(e)
    journal.close()
    return lengths


def plain(files: list[Path]) -> int:
    n = 0
    for f in files:
        n += len(f.read_bytes())
    return n


def through_reader(reader, batches: list, device) -> None:
    """One epoch through `reader`, as training reads it: each batch to the device, its host
    buffers given back once the step is done. A reader lives as long as the training run
    (its buffers are reused); a checksummed epoch is made of first reads."""
    from eyas.training.train_data import to_device

    if reader.checksums:
        reader._summed.clear()  # every sample read again is a first read: all checksums
    for b in batches:
        host = reader.batch(b)
        if device.type == "cuda":  # on the device, upcast there: what the step gets
            to_device(host, device)
            torch.cuda.synchronize()
        reader.release(host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    from eyas.run.journal import committed
    from eyas.run.store import sample_relpath
    from eyas.training.train_data import epoch_batches

    work = Path(tempfile.mkdtemp(prefix="eyas-reader-", dir=args.workdir))
    results = {}
    try:
        for name in ("lossless", "compact"):
            run = work / name
            lengths = build(run, args.samples, args.hidden, name == "compact")
            entries = committed(run)
            files = [run / sample_relpath(i) for i in sorted(entries)]
            total = sum(f.stat().st_size for f in files)
            tokens = sum(lengths)
            batches = epoch_batches(
                dict(enumerate(lengths)), sorted(entries), args.batch_tokens, 0, 0
            )
            plain(files)  # warm the page cache
            from eyas.training.train_data import SampleReader

            readers = {what: SampleReader(run, entries, what == "eyas_checksums", threads=args.threads,
                                          pin=device.type == "cuda") for what in ("eyas", "eyas_checksums")}  # fmt: skip
            rows = {"plain": [], "eyas": [], "eyas_checksums": []}
            for r in range(args.rounds):
                order = ["plain", "eyas", "eyas_checksums"]
                for what in order if r % 2 == 0 else reversed(order):  # alternating
                    t0 = time.perf_counter()
                    if what == "plain":
                        plain(files)
                    else:
                        through_reader(readers[what], batches, device)
                    rows[what].append(total / 1e6 / (time.perf_counter() - t0))
            for rd in readers.values():
                rd.close()
            med = {k: statistics.median(v) for k, v in rows.items()}
            results[name] = med
            if device.type == "cpu":  # what a CPU step adds on the host: the upcast
                from eyas.training.train_data import SampleReader, to_device

                reader = SampleReader(run, entries, False, threads=args.threads)
                hosts = [reader.batch(b) for b in batches]
                t0 = time.perf_counter()
                for h in hosts:
                    to_device(h, device)
                med["cpu_upcast"] = total / 1e6 / (time.perf_counter() - t0)
                reader.close()
            bpt = total / tokens
            gpus = med["eyas_checksums"] * 1e6 / BYTES_PER_TOKEN_7168[name] / GPU_TOKENS_PER_S
            print(f"{name:8s} {args.samples} samples, H={args.hidden}, {total / 1e6:,.0f} MB, {bpt:,.0f} B/token; "
                  f"medians of {args.rounds} alternated rounds:", flush=True)  # fmt: skip
            for k, v in rows.items():
                print(
                    f"  {k:15s} {med[k]:8,.0f} MB/s   rounds: {', '.join(f'{x:,.0f}' for x in v)}"
                )
            if "cpu_upcast" in med:
                print(f"  (the CPU's upcast of those batches to float32, a GPU's work on a GPU host: "
                      f"{med['cpu_upcast']:,.0f} MB/s)")  # fmt: skip
            print(f"  ratio eyas (checksums) / plain read: {med['eyas_checksums'] / med['plain']:.2f}; "
                  f"without checksums {med['eyas'] / med['plain']:.2f}")  # fmt: skip
            print(f"  at H=7168 ({BYTES_PER_TOKEN_7168[name]:,} B/token) that rate feeds {gpus:.1f} GPUs "
                  f"training at {GPU_TOKENS_PER_S:,} tokens/s each")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    m = results["lossless"]
    if args.json:
        print(json.dumps({"plain_mb_s": round(m["plain"], 1), "eyas_mb_s": round(m["eyas"], 1),
                          "eyas_checksums_mb_s": round(m["eyas_checksums"], 1),
                          "ratio": round(m["eyas_checksums"] / m["plain"], 3),
                          "compact": {k: round(v, 1) for k, v in results["compact"].items()}}))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()

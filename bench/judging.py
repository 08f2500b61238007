"""Judging on every core: the prompts of a file cut into consecutive slices, each slice
judged by `eyas.stages.evaluate.evaluate` (hf, greedy, every prompt) in a process of its own
on one CPU thread, every drafter of the call on that slice in the same process (the target
loaded once, its greedy pass shared), and each drafter's slices merged in prompt order
(`EvalResult.merged`): the figures of one process judging the whole file, in about 1/jobs
of the time.

bench/peer.py and bench/long_context.py judge through `judge`; `python bench/judging.py
slice ...` is the process it starts for a slice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_thread_env() -> dict:
    """The environment of a bench child: one CPU thread, this checkout's eyas."""
    return {**os.environ, "EYAS_THREADS": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO / "src")}  # fmt: skip


def slices(n: int, jobs: int) -> list[tuple[int, int]]:
    """`n` prompts cut into at most `jobs` consecutive, non-empty slices of near-equal size."""
    jobs = max(1, min(jobs, n))
    bounds = [round(i * n / jobs) for i in range(jobs + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def judge(model: str, exports: dict[str, str], prompts: Path, work: Path, *, jobs: int, k: int,
          max_new_tokens: int, limit: int | None = None) -> dict:  # fmt: skip
    """Every export of `exports` (name -> directory) judged on the first `limit` records of
    `prompts` (a JSON-lines file; all of them for None), the records cut into `jobs` slices
    judged at once; name -> EvalResult. A slice whose process fails raises with its log's end."""
    from eyas.decoders.result import EvalResult

    lines = [x for x in prompts.read_text().splitlines() if x.strip()][:limit]
    work.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, (a, b) in enumerate(slices(len(lines), jobs)):
        part = work / f"slice-{i}.jsonl"
        part.write_text("".join(x + "\n" for x in lines[a:b]))
        out, log = part.with_suffix(".json"), part.with_suffix(".log")
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "slice", "--model", model, "--prompts", str(part),
               "--out", str(out), "--k", str(k), "--max-new-tokens", str(max_new_tokens),
               *[f"--drafter={n}={d}" for n, d in exports.items()]]  # fmt: skip
        with open(log, "w") as f:
            procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                           env=one_thread_env()), out, log))  # fmt: skip
    parts = []
    for proc, out, log in procs:
        if proc.wait() != 0 or not out.is_file():
            tail = "\n".join(log.read_text().splitlines()[-5:])
            for p, _, _ in procs:
                p.kill()
            raise RuntimeError(f"judging {out.stem} failed (exit {proc.returncode}):\n{tail}")
        parts.append(json.loads(out.read_text()))
    return {n: EvalResult.merged([EvalResult(**p[n]) for p in parts]) for n in exports}


def _slice(args) -> None:
    """One slice: every drafter on it, one process, greedy decoding shared."""
    from eyas.stages.evaluate import evaluate

    greedy, targets, out = {}, {}, {}
    for spec in args.drafter:
        name, export = spec.split("=", 1)
        t0 = time.monotonic()
        r = evaluate(args.model, export, args.prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                     limit=None, precision=None, progress=False, greedy_cache=greedy,
                     target_cache=targets)  # fmt: skip
        out[name] = dataclasses.asdict(r)
        print(f"{name}: {r.prompts} prompts, tokens/forward {r.tokens_per_forward:.3f}, "
              f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="role", required=True)
    s = sub.add_parser("slice", help="(internal) judge every drafter on one slice of prompts")
    s.add_argument("--model", required=True)
    s.add_argument("--prompts", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--k", type=int, required=True)
    s.add_argument("--max-new-tokens", type=int, required=True)
    s.add_argument("--drafter", action="append", required=True, help="NAME=EXPORT_DIR")
    _slice(ap.parse_args())


if __name__ == "__main__":
    main()

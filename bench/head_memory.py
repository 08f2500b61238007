"""Peak memory of one training step at a real vocabulary: the head applied whole against in
parts (eyas.drafters.loss.by_rows), per kind.

    python bench/head_memory.py [--hidden 1024] [--vocab 163840] [--tokens 2048] \
        [--kinds eagle3,dflash,dspark] [--anchor-stride 8] [--pairs 2]

Each measurement is a process of its own on one thread: a drafter of the kind at eyas's
default shape for a target of `--hidden` and `--vocab` (the draft vocabulary the whole
vocabulary, the case chunking is for), one packed row of `--tokens` random tokens and target
states, the target's soft labels from a random head, then one forward, loss and backward
(no optimizer: its state is the same either way). It reports the peak resident memory the
step added (the process's peak minus its resident memory before the step), and the step's
seconds. "whole" sets HEAD_ELEMENTS above the batch's logits, "parts" leaves eyas's default
(or `--part-elements`).
Kimi-K2.5's shape (hidden 7,168, vocabulary 163,840, 4,096-token batches) is out of a 2-core
CPU's reach in time; the logits' share scales as tokens x vocabulary, which this bench keeps
at a real vocabulary; bench/gpu.py runs it at the full shape with `--device cuda` (bfloat16
autocast, torch's allocated peak).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one(kind_name: str, hidden: int, vocab: int, tokens: int, stride: int, whole: bool,
        part: int | None, device: str = "cpu") -> dict:  # fmt: skip
    import torch

    import eyas.drafters.loss as L
    from eyas.drafters import kind
    from eyas.drafters.block_kind import choose_anchors
    from eyas.training.config import TrainConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if whole:
        L.HEAD_ELEMENTS = 2**62
    elif part:
        L.HEAD_ELEMENTS = part
    heads = max(1, hidden // 128)
    target = {"hidden_size": hidden, "intermediate_size": hidden * 3, "num_attention_heads": heads,
              "num_key_value_heads": heads, "head_dim": hidden // heads, "vocab_size": vocab,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192,
              "hidden_act": "silu", "num_hidden_layers": 8, "model_type": "llama"}  # fmt: skip
    cfg = TrainConfig.of(data="unused", out="unused", kind=kind_name, loss="kl")
    k = kind(kind_name)
    dev = torch.device(device)
    model = _drafter(k, cfg, target, vocab).train().to(dev)
    T = tokens
    ids = torch.randint(0, vocab, (1, T), device=dev)
    b = {"input_ids": ids, "aux": torch.randn(1, T, 3 * hidden, device=dev),
         "valid": torch.ones(1, T, dtype=torch.bool, device=dev),
         "loss_mask": torch.ones(1, T, dtype=torch.bool, device=dev)}  # fmt: skip
    head = torch.randn(vocab, hidden, device=dev) * hidden**-0.5
    b["tgt_logits"] = torch.randn(1, T, hidden, device=dev) @ head.T  # the whole vocabulary
    b["tgt_top"] = b["tgt_logits"].argmax(-1)
    b["in_vocab"] = model.t2d[b["tgt_top"]]
    del head
    if kind_name != "eagle3":
        b["anchors"] = choose_anchors(b["loss_mask"], b["valid"], stride, 0)
    gpu = dev.type == "cuda"
    if gpu:  # as `eyas train` runs on a GPU: bfloat16 autocast, float32 weights
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = rss_mb()
    t0 = time.monotonic()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=gpu):
        loss, _ = k.loss(model, b, cfg, None)
    loss.backward()
    if gpu:
        torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    if gpu:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    logits_mb = T * vocab * 4 / 2**20
    return {"kind": kind_name, "whole": whole, "added_mb": peak - before, "seconds": seconds, "device": device,
            "logits_mb": logits_mb, "blocks": int((b["anchors"] >= 0).sum()) if "anchors" in b else None}  # fmt: skip


def _drafter(k, cfg, t: dict, vocab: int):
    """A drafter of kind `k` at eyas's default shape for the target `t`, its draft vocabulary
    the whole vocabulary."""
    if k.name == "eagle3":
        from eyas.drafters.eagle3.model import Drafter, DrafterConfig

        d = Drafter(DrafterConfig.from_target(_Cfg(t), vocab))
        d.attention = "chunked"  # what `eyas train` runs on a CPU
        return d
    base = {n: t[n] for n in ("hidden_size", "intermediate_size", "num_attention_heads",
                              "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                              "rope_theta", "max_position_embeddings", "hidden_act")}  # fmt: skip
    own = k.own_config(cfg, _Cfg(t), vocab)
    c = k.config_class(**base, **own, draft_vocab_size=vocab, target_layers=3, mask_token_id=0)
    return k.model_class(c)


class _Cfg:
    """A target config object, as the drafters' constructors read one."""

    def __init__(self, d: dict):
        self.__dict__.update(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=163840, help="Kimi-K2.5's vocabulary")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--kinds", default="eagle3,dflash,dspark")
    ap.add_argument("--anchor-stride", type=int, default=8, help="block kinds: a block every N")
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument(
        "--device", default="cpu", help="cpu (peak RSS) or cuda (torch's allocated peak)"
    )
    ap.add_argument("--part-elements", type=int, default=None,
                    help="elements of a part (default: eyas's HEAD_ELEMENTS)")  # fmt: skip
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        k, whole = args.one.split(":")
        r = one(k, args.hidden, args.vocab, args.tokens, args.anchor_stride, whole == "whole",
                args.part_elements, args.device)  # fmt: skip
        print(json.dumps(r))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    rows = {}
    for k in args.kinds.split(","):
        got = {"whole": [], "parts": []}
        for _ in range(args.pairs):
            for how in ("whole", "parts"):
                cmd = [sys.executable, __file__, "--one", f"{k}:{how}", "--hidden", str(args.hidden),
                       "--vocab", str(args.vocab), "--tokens", str(args.tokens),
                       "--anchor-stride", str(args.anchor_stride), "--device", args.device]  # fmt: skip
                if args.part_elements:
                    cmd += ["--part-elements", str(args.part_elements)]
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"{k} {how}: exit {r.returncode}\n{r.stderr[-2000:]}")
                got[how].append(json.loads(r.stdout.strip().splitlines()[-1]))
        rows[k] = got
        w = statistics.median(x["added_mb"] for x in got["whole"])
        p = statistics.median(x["added_mb"] for x in got["parts"])
        ws = statistics.median(x["seconds"] for x in got["whole"])
        ps = statistics.median(x["seconds"] for x in got["parts"])
        blocks = got["whole"][0]["blocks"]
        print(f"{k}: one step's added peak {w:,.0f} MB whole, {p:,.0f} MB in parts (x{w / p:.1f} "
              f"less); {ws:.1f} s against {ps:.1f} s; one (T, V) float32 tensor "
              f"{got['whole'][0]['logits_mb']:,.0f} MB" + (f"; {blocks} blocks" if blocks else ""),
              flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()

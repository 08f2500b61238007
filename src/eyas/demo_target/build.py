"""The demo target: a small Llama trained on generated conversations, plus the demo data.

A random network's next-token predictions are nearly noise, so a drafter's accuracy on one
means little. The demo target is trained briefly (a few minutes on 2 CPU cores) on
conversations from `demo_data`, whose answers follow from their questions, so it predicts
real structure and a drafter that imitates it earns real acceptance.

The trained target and the demo conversation set ship inside the package
(`eyas/assets/`); `scripts/build_demo_assets.py` rebuilds them from scratch.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from eyas.demo_target.data import corpus_text, generate_conversations, write_jsonl
from eyas.demo_target.tiny import LLAMA3_TEMPLATE, TinySizes, build_tiny_target, train_tokenizer

ASSETS = Path(__file__).parent / "assets"  # the package's data
DEMO_TARGET = ASSETS / "demo-target"
DEMO_CONVERSATIONS = ASSETS / "demo_conversations.jsonl"
DEMO_SIZES = TinySizes(
    num_hidden_layers=8,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
)


def build_demo_target(
    out: Path, *, steps: int = 1500, batch: int = 32, seed: int = 0, log=print
) -> dict:
    """Train the demo target into `out`; returns training facts (loss, time, size)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    train = generate_conversations(20000, seed=1000 + seed)
    tok = train_tokenizer(corpus_text(train[:4000]), vocab_size=1024, template=LLAMA3_TEMPLATE)
    build_tiny_target(out, "llama", sizes=DEMO_SIZES, tokenizer=tok, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    texts = [tok.apply_chat_template(c["messages"], tokenize=False) for c in train]
    seqs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    pad = tok.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    warm = 50
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)),
    )
    g = torch.Generator().manual_seed(seed)
    model.train()
    t0, losses = time.time(), []
    for step in range(steps):
        idx = torch.randint(len(seqs), (batch,), generator=g).tolist()
        T = max(len(seqs[i]) for i in idx)
        x = torch.full((batch, T), pad, dtype=torch.long)
        att = torch.zeros((batch, T), dtype=torch.long)
        for r, i in enumerate(idx):
            x[r, : len(seqs[i])] = torch.tensor(seqs[i])
            att[r, : len(seqs[i])] = 1
        labels = x.masked_fill(att == 0, -100)
        loss = model(input_ids=x, attention_mask=att, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log(
                f"step {step:5d} loss {sum(losses[-100:]) / len(losses[-100:]):.3f} ({time.time() - t0:.0f}s)"
            )
    model.eval()
    model.save_pretrained(out)
    size = sum(p.stat().st_size for p in Path(out).iterdir())
    return {
        "steps": steps,
        "final_loss": sum(losses[-100:]) / len(losses[-100:]),
        "seconds": time.time() - t0,
        "bytes": size,
    }


def write_demo_conversations(path: Path, n: int = 300, seed: int = 7) -> None:
    """The shipped demo set: held apart from the target's training data by its seed."""
    write_jsonl(path, generate_conversations(n, seed=seed))

"""The TTT loss and its metrics: what a drafter is trained on, step by step.

Step i at root t predicts the target's distribution at position t+1+i, on positions whose
predicted token is the assistant's and whose target argmax lies in the draft vocabulary.
The loss per position is one of `LOSSES`: `kl`, the soft cross-entropy against the target's
distribution over the draft vocabulary (forward KL up to a constant); `tv`, the total
variation 1 - sum(min(p, q)), which is one minus the chance that speculative sampling
accepts the draft; `mix`, 0.1 x the cross-entropy of the target's argmax plus 0.9 x TV.
Pure functions of a batch and a drafter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import LOSSES  # noqa: F401 - the kinds position_loss computes
from .drafter import Drafter


def target_view(
    last: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, chunk: int = 2048
):
    """Target logits restricted to the draft vocab (B, T, D) and the full-vocab argmax (B, T),
    computed in row chunks so the (B*T, V) logits never exist at once."""
    B, T, H = last.shape
    flat = last.reshape(-1, H)
    sel, top = [], []
    for a in range(0, flat.shape[0], chunk):
        logits = flat[a : a + chunk] @ lm_head.T  # (c, V)
        sel.append(logits[:, draft_ids])
        top.append(logits.argmax(-1))
    return torch.cat(sel).view(B, T, -1), torch.cat(top).view(B, T)


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at position t, `fill` past the end; x (B, T, ...)."""
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], 1)


def add_targets(batch: dict, drafter: Drafter, lm_head: torch.Tensor | None) -> None:
    """Add the target's soft labels over the draft vocabulary, its full-vocabulary argmax
    and whether that argmax is in the draft vocabulary. From a stored final state the
    logits are recomputed; top-K storage brings its log-probabilities and argmax."""
    if "last" in batch:
        batch["tgt_logits"], batch["tgt_top"] = target_view(
            batch["last"], lm_head, drafter.draft_ids
        )
    batch["in_vocab"] = drafter.t2d[batch["tgt_top"]]  # (B, T)


def soft_ce(batch: dict, logits: torch.Tensor, n: int) -> torch.Tensor:
    """Cross-entropy (B, T) of the drafter's logits (B, T, D) against the target's
    distribution at position t+n: the full draft-vocabulary softmax, or the renormalised
    top-K (whose ids index the draft vocabulary)."""
    logp = F.log_softmax(logits.float(), -1)  # (B, T, D)
    if "tgt_logits" in batch:
        p = torch.softmax(shift(batch["tgt_logits"], n).float(), -1)  # (B, T, D)
        return -(p * logp).sum(-1)
    p = torch.softmax(shift(batch["topk_lp"], n, -1e4), -1)  # (B, T, K)
    return -(p * logp.gather(-1, shift(batch["topk_ids"], n))).sum(-1)


def _target_probs(batch: dict, logits: torch.Tensor, n: int):
    """The drafter's log-probabilities and the target's probabilities at position t+n, on
    the same ids: (logq, p), both (B, T, D) for a full-vocabulary store, (B, T, K) for top-K."""
    logq = F.log_softmax(logits.float(), -1)  # (B, T, D)
    if "tgt_logits" in batch:
        return logq, torch.softmax(shift(batch["tgt_logits"], n).float(), -1)
    p = torch.softmax(shift(batch["topk_lp"], n, -1e4), -1)  # (B, T, K)
    return logq.gather(-1, shift(batch["topk_ids"], n)), p


def position_loss(batch: dict, logits: torch.Tensor, n: int, kind: str = "kl") -> torch.Tensor:
    """The loss (B, T) of the drafter's logits (B, T, D) against the target at position t+n."""
    if kind == "kl":
        return soft_ce(batch, logits, n)
    logq, p = _target_probs(batch, logits, n)
    tv = 1 - torch.minimum(p, logq.exp()).sum(-1)  # (B, T)
    if kind == "tv":
        return tv
    hard = -logq.gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1)  # the target's argmax
    return 0.1 * hard + 0.9 * tv


def loss_masks(batch: dict, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: (scored, loss mask). Scored: the predicted token x_{t+2+i} is trainable;
    the loss additionally needs the target's argmax at t+1+i in the draft vocabulary."""
    m = batch["valid"] & batch["loss_mask"]
    seg = batch.get("segments")  # packed rows: a prediction never reaches into the next sample
    out = []
    for i in range(steps):
        scored = shift(m, 2 + i, False)
        if seg is not None:
            scored = scored & (shift(seg, 2 + i, -1) == seg)
        out.append((scored, scored & shift(batch["in_vocab"], 1 + i, False)))
    return out


def ttt_loss(
    drafter: Drafter, batch: dict, steps: int, decay: float, norm: list[float] | None = None,
    kind: str = "kl",
):  # fmt: skip
    """Weighted TTT loss and per-step sums (steps, 6) for metrics.

    Step i at root t predicts the target's distribution at position t+1+i (`kind`: one of
    LOSSES). `norm` gives per-step token counts to divide by (global ones under data
    parallel); default: this batch's.
    """
    dids = drafter.draft_ids
    outs = drafter.forward_ttt(
        batch["input_ids"], batch["aux"], steps, batch.get("segments"), batch.get("positions")
    )
    total = torch.zeros((), device=batch["aux"].device)
    all_right = torch.ones_like(batch["valid"])
    stats = []
    for i, ((logits, _), (scored, lmask)) in enumerate(
        zip(outs, loss_masks(batch, steps), strict=True)
    ):
        ce = position_loss(batch, logits, 1 + i, kind)  # (B, T)
        loss_sum = (ce * lmask).sum()
        n = norm[i] if norm is not None else float(lmask.sum())
        total = total + decay**i * loss_sum / max(n, 1.0)
        right = dids[logits.argmax(-1)] == shift(batch["tgt_top"], 1 + i, -1)  # (B, T)
        cond = scored & all_right
        all_right = all_right & right
        stats.append([float(loss_sum.detach()), float(lmask.sum()), float((right & scored).sum()), float(scored.sum()),
                      float((right & cond).sum()), float(cond.sum())])  # fmt: skip
    return total, torch.tensor(stats, dtype=torch.float64)


def summarize(stats: torch.Tensor) -> dict:
    """Per-step loss, accuracy, conditional accuracy and estimated acceptance lengths."""
    s = stats.double()
    loss = (s[:, 0] / s[:, 1].clamp(min=1)).tolist()
    acc = (s[:, 2] / s[:, 3].clamp(min=1)).tolist()
    cond = (s[:, 4] / s[:, 5].clamp(min=1)).tolist()
    accept, run, prod = [], 1.0, 1.0
    for c in cond:
        prod *= c
        run += prod
        accept.append(run)
    return {"loss": loss, "acc": acc, "cond_acc": cond, "accept_len": accept}

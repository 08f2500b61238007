"""The TTT loss and its metrics: what a drafter is trained on, step by step.

Step i at root t predicts the target's distribution at position t+1+i, on positions whose
predicted token is the assistant's and whose target argmax lies in the draft vocabulary.
The loss per position is one of `LOSSES`: `kl`, the soft cross-entropy against the target's
distribution over the draft vocabulary (forward KL up to a constant); `tv`, the total
variation 1 - alpha, alpha = sum(min(p, q)) being the chance that speculative sampling
accepts the draft; `mix`, 0.1 x the cross-entropy of the target's argmax plus 0.9 x TV;
`lk`, lambda KL + (1 - lambda) TV with lambda = exp(-3 alpha), alpha the mean over the
counted positions, not differentiated; `nla`, -log alpha; `hass`, kl plus the cross-entropy
restricted to the target's 10 likeliest ids (HASS's top-K term, weight 1: the ids a draft
is accepted on weigh twice); `hard`, the cross-entropy of the target's argmax alone (greedy
verification accepts a draft exactly when it is that argmax); `kd`, kl between both
distributions softened at temperature KD_T, times KD_T^2 (Hinton's distillation; over the ids
a top-K store holds); `opd`, on-policy distillation
from stored states, for a fine-tune of a trained drafter (`on_policy`). A step's loss is the
mean over its counted positions, or over samples of each sample's mean (`sample_ids`).
`align` K (GRIFFIN's alignment mask, in training): step i scores a root only where the
target's argmax was among the drafter's K likeliest ids at every earlier step, the chains a
K-wide draft tree could still hold.
Pure functions of a batch and a drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from eyas.errors import ProblemError

LK_ETA = 3.0  # lk: the blend weight of KL is exp(-LK_ETA x the mean acceptance)
HASS_TOP = 10  # hass: the target's likeliest ids whose cross-entropy is counted twice
HASS_WEIGHT = 1.0  # hass: that term's weight against kl's
KD_T = 2.0  # kd: the temperature both distributions are softened at
OPD_DECAY = 0.8  # opd: reverse KL at the k-th step after the chain's first miss is weighted 0.8^k


def target_view(
    last: torch.Tensor,
    lm_head: torch.Tensor,
    draft_ids: torch.Tensor,
    chunk: int = 2048,
    top: torch.Tensor | None = None,
):
    """Target logits restricted to the draft vocab (B, T, D) and the full-vocab argmax (B, T),
    computed in row chunks so the (B*T, V) logits never exist at once; an argmax `top` the
    sample files hold is taken as it is (the draft vocabulary's rows alone are multiplied)."""
    B, T, H = last.shape
    flat = last.reshape(-1, H)
    if top is not None:
        W = lm_head[draft_ids]
        sel = [flat[a : a + chunk] @ W.T for a in range(0, flat.shape[0], chunk)]
        return torch.cat(sel).view(B, T, -1), top
    sel, top = [], []
    for a in range(0, flat.shape[0], chunk):
        logits = flat[a : a + chunk] @ lm_head.T  # (c, V)
        sel.append(logits[:, draft_ids])
        top.append(logits.argmax(-1))
    return torch.cat(sel).view(B, T, -1), torch.cat(top).view(B, T)


def shift(x: torch.Tensor, n: int, fill=0, rows: slice | None = None) -> torch.Tensor:
    """x[:, t + n] at position t, `fill` past the end; x (B, T, ...). With `rows`, those
    positions t only (the rest is never copied)."""
    T = x.shape[1]
    a, b = (0, T) if rows is None else (rows.start, rows.stop)
    part = x[:, min(a + n, T) : min(b + n, T)]
    pad = x.new_full((x.shape[0], (b - a) - part.shape[1], *x.shape[2:]), fill)
    return torch.cat([part, pad], 1)


def take(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The rows of x (B, T, ...) at the positions `at` (B, r): (B, r, ...)."""
    idx = at.view(*at.shape, *(1,) * (x.dim() - 2)).expand(*at.shape, *x.shape[2:])
    return x.gather(1, idx)


# Elements (B x rows x D) of the head's output one part of a loss computes at once: 2^28, 1 GiB
# in float32. Below it a batch's logits are computed whole (8,192 tokens over a draft vocabulary
# of 32,000 still are); above it (a whole vocabulary of 100,000s, long batches) in parts of
# rows, each recomputed for the backward pass (`by_rows`), which costs a head multiplication.
HEAD_ELEMENTS = 2**28


def head_rows(batch: int, n: int, vocab: int, local: bool = True) -> int:
    """Rows of a (batch, n, vocab) head output to compute at once: all of them where they fit
    in HEAD_ELEMENTS, or where the loss of a row is not the row's alone (`local`)."""
    return n if not local else max(1, min(n, HEAD_ELEMENTS // max(1, batch * vocab)))


def at_rows(t: torch.Tensor, rows) -> torch.Tensor:
    """t (B, n, ...) at `rows`: a slice of n, read in every batch row (B, r, ...), or listed
    (b, j) index pairs, read as one row (1, M, ...)."""
    return t[:, rows] if isinstance(rows, slice) else t[rows][None]


def take_rows(x: torch.Tensor, at: torch.Tensor, rows) -> torch.Tensor:
    """x (B, T, ...) at the positions `at` (B, n) holds at `rows` (as `at_rows` reads them)."""
    if isinstance(rows, slice):
        return take(x, at[:, rows])
    b, j = rows
    return x[b, at[b, j]][None]


def by_rows(x: torch.Tensor, head: Callable, per_rows: Callable, rows: int, also=None, live=None):
    """A loss per row of the head's logits of the states x (B, n, H): `head(xs, sl)` gives the
    logits of the rows `sl` (`at_rows`), `per_rows(logits, sl)` their loss. Computed `rows`
    rows of every batch row at a time; where that is a part of them, each part under
    activation checkpointing, so its logits exist only while it is computed (and again in the
    backward pass) and never all at once. Returns the loss (B, n), the argmax (B, n) and,
    with `also`, what `also(logits, sl)` reads from the rows' detached logits (B, n, ...),
    for all rows.

    `live` (B, n), a mask holding every row whose loss is counted: the loss is computed at
    those rows alone, listed as (b, j) pairs, and is 0 at the others, whose logits are
    computed once without gradient for the argmax (and `also`). Where a block's loss stops at
    its first miss, most rows of its later slots are not live."""

    def part(xs: torch.Tensor, sl):
        logits = head(xs, sl)
        extra = also(logits.detach(), sl) if also is not None else None
        return per_rows(logits, sl), logits.detach().argmax(-1), extra

    def look(xs: torch.Tensor, sl):
        with torch.no_grad():
            logits = head(xs, sl)
            return None, logits.argmax(-1), also(logits, sl) if also is not None else None

    B, n = x.shape[:2]
    if live is None:
        parts = [slice(a, min(a + rows, n)) for a in range(0, n, rows)]
        outs = _in_parts(part, [(x[:, sl], sl) for sl in parts], True)
        loss, arg, extra = zip(*outs, strict=True)
        return torch.cat(loss, 1), torch.cat(arg, 1), torch.cat(extra, 1) if also else None
    at, (loss, arg, extra) = _listed(part, x, live, rows * B, True)
    loss = loss.new_zeros(B, n).index_put(at, loss)  # the loss lies at the live rows alone
    arg = arg.new_zeros(B, n).index_put_(at, arg)
    extra = extra.new_zeros(B, n, *extra.shape[1:]).index_put_(at, extra) if also else None
    if not live.all():
        at, (_, other_arg, other_extra) = _listed(look, x, ~live, rows * B, False)
        arg[at] = other_arg
        if also is not None:
            extra[at] = other_extra
    return loss, arg, extra


def _listed(fn: Callable, x: torch.Tensor, mask: torch.Tensor, step: int, grad: bool):
    """fn(xs, sl) over the rows of x (B, n, H) where `mask`, listed as (b, j) pairs, `step`
    of them a part: the pairs, and fn's outputs joined over the parts (M, ...) (None where
    fn gives None)."""
    b, j = mask.nonzero(as_tuple=True)
    picks = [(b[a : a + step], j[a : a + step]) for a in range(0, max(len(b), 1), step)]
    outs = _in_parts(fn, [(x[sl][None], sl) for sl in picks], grad)
    return (b, j), [None if t[0] is None else torch.cat(t, 1)[0] for t in zip(*outs, strict=True)]


def _in_parts(fn: Callable, parts: list, grad: bool) -> list:
    """fn(xs, sl) of each part; under activation checkpointing where there are several and
    `grad` (a loss's gradients) is on."""
    if len(parts) == 1 or not (grad and torch.is_grad_enabled()):
        return [fn(xs, sl) for xs, sl in parts]
    from torch.utils.checkpoint import checkpoint

    return [checkpoint(fn, xs, sl, use_reentrant=False) for xs, sl in parts]


class TargetHead:
    """The target's head as a training reads it, split in two: the draft vocabulary's rows,
    whose logits are the soft labels, and the other rows, read only for the argmax over the
    whole vocabulary. That argmax is kept per sample (int32 on the host) the first time a
    sample comes, so from its second epoch a batch multiplies D of the V rows, not all of
    them. A batch says where its samples lie in `_spans` ((sample, row, start, tokens) of
    each valid one); the soft labels are the same products whether or not the argmax was
    kept, so a resumed training computes what an unbroken one did."""

    def __init__(self, lm_head: torch.Tensor, draft_ids: torch.Tensor, chunk: int = 2048):
        keep = torch.zeros(len(lm_head), dtype=torch.bool, device=lm_head.device)
        keep[draft_ids] = True
        self.draft_ids, self.rest_ids = draft_ids, torch.nonzero(~keep).squeeze(1)
        self.draft, self.rest = lm_head[draft_ids].contiguous(), lm_head[self.rest_ids].contiguous()
        self.chunk = chunk
        self.tops: dict[int, torch.Tensor] = {}

    def view(
        self, last: torch.Tensor, spans: list | None, stored: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`target_view` of the final states `last` (B, T, H) of a batch whose samples lie at
        `spans` (None: not said; nothing kept). Positions outside the spans get argmax 0. An
        argmax the sample files hold (`stored`, (B, T)) is the answer as it is."""
        B, T, H = last.shape
        flat = last.reshape(-1, H)
        parts = range(0, flat.shape[0], self.chunk)
        sel = torch.cat([flat[a : a + self.chunk] @ self.draft.T for a in parts])  # (B*T, D)
        if stored is not None:
            return sel.view(B, T, -1), stored
        if spans and all(s in self.tops for s, *_ in spans):
            top = torch.zeros(B, T, dtype=torch.long, device=last.device)
            for s, r, a, n in spans:
                top[r, a : a + n] = self.tops[s].to(top.device, torch.long)
            return sel.view(B, T, -1), top
        best, at = sel.max(-1)
        top = self.draft_ids[at]
        if len(self.rest_ids):
            other, oat = torch.cat([flat[a : a + self.chunk] @ self.rest.T for a in parts]).max(-1)
            oid = self.rest_ids[oat]
            # the first of equal maxima, as an argmax over the whole vocabulary takes it
            top = torch.where((other > best) | ((other == best) & (oid < top)), oid, top)
        top = top.view(B, T)
        if spans is not None:
            covered = torch.zeros(B, T, dtype=torch.bool, device=last.device)
            for s, r, a, n in spans:
                covered[r, a : a + n] = True
                self.tops[s] = top[r, a : a + n].to("cpu", torch.int32)
            top = top.masked_fill(~covered, 0)
        return sel.view(B, T, -1), top


def add_targets(
    batch: dict, drafter: torch.nn.Module, lm_head: torch.Tensor | TargetHead | None
) -> None:
    """Add the target's soft labels over the draft vocabulary, its full-vocabulary argmax
    and whether that argmax is in the draft vocabulary. From a stored final state the
    logits are recomputed (with a `TargetHead`, the argmax of a sample seen before is
    read back, as is one the sample files hold); top-K storage brings its log-probabilities
    and argmax."""
    stored = batch.get("tgt_top")
    if "last" in batch and isinstance(lm_head, TargetHead):
        batch["tgt_logits"], batch["tgt_top"] = lm_head.view(
            batch["last"], batch.get("_spans"), stored
        )
    elif "last" in batch:
        batch["tgt_logits"], batch["tgt_top"] = target_view(
            batch["last"], lm_head, drafter.draft_ids, top=stored
        )
    batch["in_vocab"] = drafter.t2d[batch["tgt_top"]]  # (B, T)


class SoftCrossEntropy(torch.autograd.Function):
    """kl's loss (..., ) -sum(p log softmax(z)) from the drafter's logits z (..., D) and the
    target's probabilities p, in two passes over the logits and one back: the value is
    lse(z) sum(p) - p.z, the gradient (softmax(z) sum(p) - p) x the incoming one. Neither
    the drafter's log-probabilities nor a product with p is ever materialised."""

    @staticmethod
    def forward(ctx, z, p, p_sum):
        with torch.autocast(z.device.type, enabled=False):  # the dot product stays float32
            top = z.amax(-1, keepdim=True)  # (..., 1)
            e = torch.exp(z - top)  # (..., D)
            s = e.sum(-1, keepdim=True)  # (..., 1)
            dot = (p.unsqueeze(-2) @ z.unsqueeze(-1)).squeeze(-1).squeeze(-1)  # (...)
            ctx.save_for_backward(e, s, p, p_sum)
            return (top + s.log()).squeeze(-1) * p_sum - dot

    @staticmethod
    def backward(ctx, grad):
        e, s, p, p_sum = ctx.saved_tensors
        dz = e.mul_((grad * p_sum).unsqueeze(-1) / s)  # softmax(z) sum(p) g, in e's memory
        return dz.addcmul_(p, grad.unsqueeze(-1), value=-1), None, None


class TargetDist:
    """The target's distribution over the draft vocabulary at every position of a batch,
    from its logits (B, T, D): each form normalised once a batch, where a loss first reads
    it, not once a TTT step or block slot."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    @cached_property
    def logp(self) -> torch.Tensor:
        return F.log_softmax(self.logits.float(), -1)  # (B, T, D)

    @cached_property
    def p(self) -> torch.Tensor:
        return F.softmax(self.logits.float(), -1)  # (B, T, D)

    @cached_property
    def p_sum(self) -> torch.Tensor:
        return self.p.sum(-1)  # (B, T): 1 up to rounding


def target_dist(batch: dict) -> TargetDist:
    """The batch's `TargetDist` (made on first use, kept with the batch)."""
    if "_target" not in batch:
        batch["_target"] = TargetDist(batch["tgt_logits"])
    return batch["_target"]


class Scores:
    """What a loss reads at some rows: the drafter's logits there (B, r, D) and the target's
    distribution at the positions they predict, which `pick` takes from a batch-wide (B, T,
    ...) tensor; each form computed once, where a loss first asks for it. Made from a top-K
    store's log-probabilities, `given` (logq, logp) stands for both."""

    def __init__(self, logits: torch.Tensor, target: TargetDist | None, pick: Callable, given=()):
        self.logits, self.target, self.pick = logits, target, pick
        if given:
            self.logq, self.logp = given

    @cached_property
    def logq(self) -> torch.Tensor:
        return F.log_softmax(self.logits.float(), -1)  # (B, r, D)

    @cached_property
    def logp(self) -> torch.Tensor:
        return self.pick(self.target.logp)  # (B, r, D)

    @cached_property
    def p(self) -> torch.Tensor:
        return self.logp.exp() if self.target is None else self.pick(self.target.p)

    def loss(self, kind: str, mask: torch.Tensor) -> torch.Tensor:
        """The per-position loss (B, r) `kind` (one of LOSSES); kl from the logits directly
        (`SoftCrossEntropy`) where the whole draft vocabulary's distribution is at hand."""
        if kind == "kl" and self.target is not None and "logq" not in self.__dict__:
            p_sum = self.pick(self.target.p_sum)
            return SoftCrossEntropy.apply(self.logits.float(), self.p, p_sum)
        return divergence(self.logq, self.logp, kind, mask)

    def acceptance(self) -> torch.Tensor:
        """Speculative sampling's acceptance sum(min(p, q)) (B, r), not differentiated."""
        with torch.no_grad():
            q = self.logq.exp() if "logq" in self.__dict__ else F.softmax(self.logits.float(), -1)
            return torch.minimum(self.p, q).sum(-1)


def step_scores(batch: dict, logits: torch.Tensor, n: int, rows: slice | None = None) -> Scores:
    """`Scores` of the drafter's logits (B, r, D) at the positions t (`rows`, default all)
    against the target at t+n."""
    if "tgt_logits" in batch:
        return Scores(logits, target_dist(batch), lambda x: shift(x, n, rows=rows))
    return Scores(logits, None, None, given=target_logprobs(batch, logits, n, rows))


def target_logprobs(batch: dict, logits: torch.Tensor, n: int, rows: slice | None = None):
    """The drafter's and the target's log-probabilities at position t+n, on the same ids:
    (logq, logp), both (B, T, D) for a full-vocabulary store, (B, T, K) for top-K; with
    `rows`, the drafter's logits are those positions' and so is the result."""
    logq = F.log_softmax(logits.float(), -1)  # (B, T, D)
    if "tgt_logits" in batch:
        return logq, F.log_softmax(shift(batch["tgt_logits"], n, rows=rows).float(), -1)
    logp = F.log_softmax(shift(batch["topk_lp"], n, -1e4, rows).float(), -1)  # (B, T, K)
    return logq.gather(-1, shift(batch["topk_ids"], n, rows=rows)), logp


def _alpha(logq: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's acceptance: sum over ids of min(p, q)."""
    return torch.minimum(logp.exp(), logq.exp()).sum(-1)


def _kl(logq, logp, mask):
    return -(logp.exp() * logq).sum(-1)  # the cross-entropy: KL up to the target's entropy


def _hard(logq, logp, mask):
    return -logq.gather(-1, logp.argmax(-1, keepdim=True)).squeeze(-1)


def _hass(logq, logp, mask):
    plogq = logp.exp() * logq
    top = logp.topk(min(HASS_TOP, logp.shape[-1]), -1).indices  # (..., 10)
    return -plogq.sum(-1) - HASS_WEIGHT * plogq.gather(-1, top).sum(-1)


def _kd(logq, logp, mask):
    soft_q, soft_p = F.log_softmax(logq / KD_T, -1), F.softmax(logp / KD_T, -1)
    return -(soft_p * soft_q).sum(-1) * KD_T**2


def _lk(logq, logp, mask):
    alpha, m = _alpha(logq, logp), mask.float()
    kl = (logp.exp() * (logp - logq)).sum(-1)
    mean_alpha = (alpha.detach() * m).sum() / m.sum().clamp(min=1.0)
    lam = torch.exp(-LK_ETA * mean_alpha)  # KL's strong gradient while acceptance is low
    return lam * kl + (1 - lam) * (1 - alpha)


@dataclass(frozen=True)
class Loss:
    """A per-position loss: `fn(logq, logp, mask)` over the drafter's and the target's
    log-probabilities (..., D), and `reference(p, q, mask)`, the same value written plainly
    from the two distributions, which the tests hold every registered loss to (None for a
    loss of the whole chain, which has a test of its own)."""

    fn: Callable | None
    reference: Callable | None
    per_position: bool = True
    """Whether a position's loss is its own alone (lk's weight is a mean over the batch):
    such a loss may be computed a part of the rows at a time (`by_rows`)."""


def _ref_lk(p, q, mask):
    alpha = torch.minimum(p, q).sum(-1)
    lam = torch.exp(-LK_ETA * alpha[mask].mean())
    return lam * (p * (p.log() - q.log())).sum(-1) + (1 - lam) * (1 - alpha)


# The one place a loss is named: `train --loss` offers these, `divergence` runs them.
LOSSES: dict[str, Loss] = {
    "kl": Loss(_kl, lambda p, q, m: -(p * q.log()).sum(-1)),
    "tv": Loss(
        lambda lq, lp, m: 1 - _alpha(lq, lp), lambda p, q, m: 1 - torch.minimum(p, q).sum(-1)
    ),
    "mix": Loss(
        lambda lq, lp, m: 0.1 * _hard(lq, lp, m) + 0.9 * (1 - _alpha(lq, lp)),
        lambda p, q, m: (
            -0.1 * q.log().gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1)
            + 0.9 * (1 - torch.minimum(p, q).sum(-1))
        ),
    ),
    "lk": Loss(_lk, _ref_lk, per_position=False),
    "nla": Loss(
        lambda lq, lp, m: -torch.log(_alpha(lq, lp).clamp_min(1e-6)),
        lambda p, q, m: -torch.minimum(p, q).sum(-1).log(),
    ),
    "hass": Loss(
        _hass,
        lambda p, q, m: (
            -(p * q.log()).sum(-1)
            - (p * q.log()).gather(-1, p.topk(min(10, p.shape[-1]), -1).indices).sum(-1)
        ),
    ),
    "hard": Loss(
        _hard, lambda p, q, m: -q.log().gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1)
    ),
    "kd": Loss(
        _kd,
        lambda p, q, m: (
            -(torch.softmax(p.log() / 2, -1) * torch.log_softmax(q.log() / 2, -1)).sum(-1) * 4
        ),
    ),
    "opd": Loss(
        None, None, per_position=False
    ),  # the chain's: `on_policy`, read by the kinds' loss loops
}


def divergence(
    logq: torch.Tensor, logp: torch.Tensor, kind: str, mask: torch.Tensor
) -> torch.Tensor:
    """The loss (...) of the drafter's log-probabilities against the target's, both (..., D),
    for `kind` in LOSSES (not opd, which needs the chain: `ttt_loss`). `mask` (...) marks the
    positions the loss counts: lk's blend weight is their mean acceptance."""
    loss = LOSSES.get(kind)
    if loss is None or loss.fn is None:
        raise ProblemError(f"no per-position loss {kind!r}")
    return loss.fn(logq, logp, mask)


def position_loss(
    batch: dict, logits: torch.Tensor, n: int, kind: str = "kl", mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The loss (B, T) of the drafter's logits (B, T, D) against the target at position t+n."""
    mask = mask if mask is not None else torch.ones_like(logits[..., 0], dtype=torch.bool)
    return step_scores(batch, logits, n).loss(kind, mask)


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


def sample_ids(batch: dict) -> torch.Tensor:
    """Which sample each position (B, T) belongs to, distinct across the batch: a row is one
    sample, or several packed ones told apart by their segments."""
    B, T = batch["input_ids"].shape
    rows = torch.arange(B, device=batch["input_ids"].device)[:, None] * T  # (B, 1)
    seg = batch.get("segments")
    return rows.expand(B, T) if seg is None else rows + seg.clamp(min=0)  # (B, T)


def counted(mask: torch.Tensor, ids: torch.Tensor | None = None) -> float:
    """What a step's loss is divided by: its counted positions (`mask`), or, averaging per
    sample (`ids`, the sample of each position), the samples with a counted position."""
    return float(mask.sum()) if ids is None else float(ids[mask].unique().numel())


def ttt_loss(
    drafter: torch.nn.Module,
    batch: dict,
    steps: int,
    decay: float,
    norm: list[float] | None = None,
    kind: str = "kl",
    average: str = "token",
    align: int = 0,
):
    """Weighted TTT loss and per-step sums (steps, 6) for metrics.

    Step i at root t predicts the target's distribution at position t+1+i (`kind`: one of
    LOSSES), averaged over the counted positions or, with `average="sequence"`, within each
    sample first. `norm` gives per-step counts to divide by (`counted`'s; global ones under
    data parallel); default: this batch's. `align` K > 0, while the drafter trains: a step
    counts a root only while the target's argmax was among its K likeliest drafts at every
    earlier step (the denominator stays `norm`'s: a masked position adds zero).
    """
    dids = drafter.draft_ids
    outs = drafter.forward_ttt(
        batch["input_ids"],
        batch["aux"],
        steps,
        batch.get("segments"),
        batch.get("positions"),
        head=False,
    )  # per step: the state the head reads (B, T, H), and the next step's
    B, T = batch["input_ids"].shape
    rows = head_rows(B, T, dids.numel(), LOSSES[kind].per_position)
    ids = sample_ids(batch) if average == "sequence" else None
    chain = Chain(batch["input_ids"], ids)
    aligned = torch.ones_like(batch["input_ids"], dtype=torch.bool) if align else None
    for i, ((state, _), (scored, lmask)) in enumerate(
        zip(outs, loss_masks(batch, steps), strict=True)
    ):
        want = shift(batch["tgt_top"], 1 + i, -1)  # (B, T)
        aligning = aligned is not None and drafter.training
        if aligning:
            lmask = lmask & aligned

        def per_rows(logits, sl, i=i, lmask=lmask):
            s = step_scores(batch, logits, 1 + i, sl)
            if kind == "opd":
                return on_policy(s.logq, s.logp, chain.all_right[:, sl], chain.since(i)[:, sl])
            return s.loss(kind, lmask[:, sl])

        likeliest = (lambda logits, _sl: logits.topk(align, -1).indices) if aligning else None
        ce, arg, top = by_rows(
            state, lambda xs, _sl: drafter.lm_head(xs), per_rows, rows, likeliest
        )
        right = dids[arg] == want
        if aligning:
            aligned = aligned & (dids[top] == want[..., None]).any(-1)
        n = norm[i] if norm is not None else counted(lmask, ids)
        chain.add(i, ce, lmask, scored, right, decay**i, n)
    return chain.result()


class Chain:
    """The running sums of one chain of predictions (TTT steps, or a block's positions), each
    position of the chain scored in turn: the weighted loss, which roots' drafts are all right
    so far and at which step each first missed (what serving would verify; `opd` needs both),
    and per step the six metric sums `summarize` reads (loss, counted, right, scored, right
    with all before right, all before right). With `ids` (the sample of each root), each
    sample's counted positions share a weight of one in the loss; the metrics stay per
    position."""

    def __init__(self, roots: torch.Tensor, ids: torch.Tensor | None = None):
        self.ids = ids
        self.total = torch.zeros((), device=roots.device)
        self.all_right = torch.ones_like(roots, dtype=torch.bool)
        self.missed_at = torch.full_like(roots, -1)
        self.stats: list[list[float]] = []

    def since(self, step: int) -> torch.Tensor:
        """Steps since each root's first miss (meaningless where none missed)."""
        return step - self.missed_at

    def add(self, step, per, lmask, scored, right, weight: float | None, n: float, over=None):
        """Step `step`: its per-position loss `per`, counted where `lmask`, divided by `n`
        and weighted (None: `add_loss` adds it later, once its weights are known); `right`
        where the drafter's argmax is the target's. `over`: see `add_loss`."""
        loss_sum = (per * lmask).sum()
        if weight is not None:
            self.add_loss(per, lmask, weight, n, over)
        cond = scored & self.all_right
        self.missed_at = torch.where(self.all_right & ~right, step, self.missed_at)
        self.all_right = self.all_right & right
        self.stats.append(
            [
                float(loss_sum.detach()),
                float(lmask.sum()),
                float((right & scored).sum()),
                float(scored.sum()),
                float((right & cond).sum()),
                float(cond.sum()),
            ]
        )

    def add_loss(self, per, lmask, weight: float | torch.Tensor, n: float, over=None) -> None:
        """A step's loss `per` into the total: counted where `lmask`, divided by `n`, weighted
        by `weight` (one number, or one per position). Averaged per sample, a sample's weight
        of one is shared over its positions in `over` (a mask holding `lmask`; by default
        `lmask` itself): where a loss leaves out positions the batch's counts include
        (Spec-AUF's after a miss), they weigh as in a per-token average, not more."""
        part = per * weight if isinstance(weight, torch.Tensor) else per
        scale = 1.0 if isinstance(weight, torch.Tensor) else weight
        counted = lmask if self.ids is None else self._per_sample(lmask, over)
        self.total = self.total + scale * (part * counted).sum() / max(n, 1.0)

    def _per_sample(self, lmask: torch.Tensor, over: torch.Tensor | None = None) -> torch.Tensor:
        """Weights (...): 1 / the sample's positions in `over` (default: `lmask`) where
        counted, else 0."""
        per = torch.bincount(self.ids[lmask if over is None else over])  # covers lmask's ids
        w = torch.zeros(lmask.shape, device=lmask.device)
        w[lmask] = 1.0 / per[self.ids[lmask]].float()
        return w

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weighted loss, the per-step sums (steps, 6))."""
        return self.total, torch.tensor(self.stats, dtype=torch.float64)


def on_policy(logq: torch.Tensor, logp: torch.Tensor, matched: torch.Tensor, since: torch.Tensor):
    """opd's loss (...) at one position of a chain or block, from log-probabilities (..., D):
    forward KL where the drafts before it all matched the target's argmax (the drafts serving
    would verify), reverse KL weighted OPD_DECAY^k at the k-th position after the first miss
    (mode-seeking where serving would have stopped)."""
    fwd = (logp.exp() * (logp - logq)).sum(-1)
    rev = (logq.exp() * (logq - logp)).sum(-1)
    weight = OPD_DECAY ** since.clamp(min=0).float()
    return torch.where(matched, fwd, weight * rev)


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

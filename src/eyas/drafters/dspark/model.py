"""The DSpark drafter: DFlash's backbone (`drafters.dflash.model`) and two small heads.

Shapes as there: B batch, N blocks per row, S block size, H hidden size, r Markov rank,
D draft vocabulary, V target vocabulary.

    a block at anchor a: [x_a, MASK, ..., MASK] -> the backbone's normed states h (B, N, S, H)
    slot j (0 .. S-1) predicts x_{a+j+1}; every slot drafts, so one pass drafts S tokens
    Markov head: the token before slot j's (x_{a+j}; the slot before's draft when drafting)
        -> W1 (V, r) -> e (B, N, S, r) [gated: e * sigmoid(gate([h ; e]))] -> W2 -> (.., D),
        added to the head's logits
    confidence head: [h ; e] -> one logit per slot, the predicted chance it is accepted

When drafting, the one backbone pass is followed by a walk over the block: slot j's argmax
is taken after the bias of slot j-1's draft (slot 0's: the verified token x_a).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.drafters.block_drafter import DFlashConfig, DFlashDrafter
from eyas.drafters.loss import HEAD_ELEMENTS, at_rows


@dataclass(frozen=True, kw_only=True)
class DSparkConfig(DFlashConfig):
    markov_rank: int = 256
    """r: the Markov head's rank; 0: none."""
    markov_head: str = "vanilla"
    """vanilla or gated."""
    confidence_head: bool = True
    """Whether the drafter predicts each slot's acceptance."""


class MarkovHead(nn.Module):
    """A low-rank bias on a slot's logits from the token before it."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        r = c.markov_rank
        self.markov_w1 = nn.Embedding(c.vocab_size, r)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # starts near DFlash's logits
        self.markov_w2 = nn.Linear(r, c.draft_vocab_size, bias=False)
        self.gate_proj = nn.Linear(c.hidden_size + r, r) if c.markov_head == "gated" else None

    def forward(self, prev: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev (...) token ids, h (..., H) states -> the bias (..., D) and the code e (..., r)."""
        e = self.markov_w1(prev)  # (..., r)
        code = e
        if self.gate_proj is not None:
            code = e * torch.sigmoid(self.gate_proj(torch.cat([h, e], -1)))
        return self.markov_w2(code), e


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).squeeze(-1)  # (...,): a logit of acceptance


class DSparkDrafter(DFlashDrafter):
    def __init__(self, c: DSparkConfig):
        super().__init__(c)
        r = c.markov_rank
        self.markov_head = MarkovHead(c) if r > 0 else None
        self.confidence_head = ConfidenceHead(c.hidden_size + r) if c.confidence_head else None

    def heads(
        self, h: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """States h (..., H) and the tokens before their slots prev (...) -> logits (..., D)
        with the Markov bias, and the confidence logits (...) (None without the head)."""
        return self.slot_logits(h, prev), self.confidence(h, prev)

    def slot_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        return logits if self.markov_head is None else logits + self.markov_head(prev, h)[0]

    def slot_head(self, prev: torch.Tensor):
        """`head(xs, i, rows)`: slot i's logits (B, r, D) of the blocks `rows` from their
        states xs, for the tokens before the slots prev (B, N, S). The vanilla Markov bias
        depends on the token alone, so it is computed once for each distinct token of the
        batch and read for every slot: a batch of 1,024 real tokens held 115-350 distinct ones
        against 4 x 220-780 slots (a DSpark training step 1.14 x faster at a draft vocabulary
        of 32,000). The gated bias reads each slot's state and is computed per slot."""

        def per_slot(xs, i, rows):
            return self.slot_logits(xs, at_rows(prev[..., i], rows))

        mh = self.markov_head
        if mh is None or mh.gate_proj is not None:
            return per_slot
        ids, at = torch.unique(prev, return_inverse=True)
        if ids.numel() * self.config.draft_vocab_size > HEAD_ELEMENTS:  # as loss.by_rows bounds
            return per_slot
        bias = mh.markov_w2(mh.markov_w1(ids))  # (U, D): one row per distinct token
        return lambda xs, i, rows: self.lm_head(xs) + F.embedding(at_rows(at[..., i], rows), bias)

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        if self.markov_head is None:
            return self.confidence_head(h)
        e = self.markov_head.markov_w1(prev)
        return self.confidence_head(torch.cat([h, e.to(h.dtype)], -1))

    # -------------------------------------------------------------- training

    def training_states(
        self,
        input_ids: torch.Tensor,
        states: torch.Tensor,
        anchors: torch.Tensor,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' states (B, N, S, H) of N blocks per row, as `forward_blocks` places
        them, and the token before each slot (B, N, S): slot j's is the true x_{a+j}."""
        B, T = input_ids.shape
        N, S = anchors.shape[1], self.config.block_size
        inputs = self.training_blocks(input_ids, states, anchors, segments, positions)
        h = self.block_states(*inputs).view(B, N, S, -1)  # (B, N, S, H)
        j = torch.arange(S, device=input_ids.device)
        at = (anchors.clamp(min=0)[:, :, None] + j).clamp(max=T - 1)  # (B, N, S)
        return h, input_ids.gather(1, at.view(B, N * S)).view(B, N, S)

    def forward_heads(
        self,
        input_ids: torch.Tensor,
        states: torch.Tensor,
        anchors: torch.Tensor,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, N, S, D) and confidence logits (B, N, S) of N blocks per row."""
        return self.heads(*self.training_states(input_ids, states, anchors, segments, positions))

    def forward_blocks(self, input_ids, states, anchors, segments=None, positions=None):
        return self.forward_heads(input_ids, states, anchors, segments, positions)[0]

    # -------------------------------------------------------------- inference

    def drafts_per_block(self) -> int:
        return self.config.block_size  # every slot drafts, the anchor's too

    @torch.no_grad()
    def draft_block(self, kv, n_ctx: int, first_token: int) -> list[int]:
        """The S tokens drafted after `first_token` at position n_ctx: one backbone pass, then
        each slot's argmax after the Markov bias of the token before it."""
        h = self.block_states(*self.inference_block(kv, n_ctx, first_token))[0]  # (S, H)
        prev, out = torch.tensor(first_token, device=h.device), []
        for j in range(self.config.block_size):
            logits, _ = self.heads(h[j], prev)  # (D,)
            prev = self.draft_ids[logits.argmax()]
            out.append(int(prev))
        return out

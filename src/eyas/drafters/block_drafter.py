"""The block drafter, top to bottom: config, blocks, the model, training over many blocks
at once, and drafting a block at inference. DFlash is this network; DSpark adds its heads to
it (`drafters.dspark.model`).

Shapes: B batch, T tokens, H hidden size, L target layers read, N blocks (anchors) per row,
S block size, D draft vocabulary, V target vocabulary.

    target states (B, T, L*H) --fc--> --hidden_norm--> context c (B, T, H)
    a block at anchor a: [x_a, MASK, ..., MASK] (S tokens) at positions a .. a+S-1,
        embedded with the target's own table -> h (B, N*S, H)
    each layer: x = input_layernorm(h); queries and keys per head q_norm / k_norm'd, RoPE;
        the block's queries attend to the context's keys at positions < a (k_proj/v_proj of
        c, the same projections; with a window W, those above the query's position - W) and,
        both ways, to the block's own keys; h += o_proj(...);
        h += mlp(post_attention_layernorm(h))
    -> norm -> the target's own head rows for the draft vocabulary (frozen) -> logits (B, N*S, D)

Block position j >= 1 predicts the token at position a+j, so its label is the target's
distribution at a+j-1. One drafter pass proposes S-1 tokens; at inference the context
keys/values are kept and extended by the verified tokens' target states after each round.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.drafters.blocks import MLP, DraftVocab, RMSNorm, rope, upcast
from eyas.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    hidden_size: int
    """H: the target's hidden size."""
    intermediate_size: int
    """Width of each layer's MLP."""
    num_hidden_layers: int
    """Drafter layers."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """V: the target vocabulary (the block is embedded with the target's table)."""
    draft_vocab_size: int
    """D: the head's rows, the target's own for the draft vocabulary."""
    target_layers: int
    """L: target layers whose states make the context (fc takes L*H)."""
    block_size: int = 4
    """S: the block's length; one pass drafts S-1 tokens."""
    mask_token_id: int = 0
    """The id whose embedding fills the block's masked positions."""
    attention_window: int | None = None
    """W: a sliding window. A block position at p attends to the context positions above
    p - W and to its whole block, as an engine's sliding-window attention serves it; None: to
    the whole context before the block."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UsageError(
                f"{self.num_attention_heads} heads not divisible by {self.num_key_value_heads} kv heads"
            )
        if self.block_size < 2:
            raise UsageError(f"a block needs at least 2 positions, got {self.block_size}")
        if self.attention_window is not None and self.attention_window < self.block_size:
            raise UsageError(
                f"--attention-window {self.attention_window} is shorter than the block "
                f"({self.block_size}): a block must see itself whole"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise UsageError(
                f"mask token id {self.mask_token_id} is outside the vocabulary ({self.vocab_size})"
            )

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    """Per-head normed queries and keys (as Qwen3's), shared by the context and the block."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        H, h, kv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(H, h * d, bias=False)
        self.k_proj = nn.Linear(H, kv * d, bias=False)
        self.v_proj = nn.Linear(H, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm = RMSNorm(d, c.rms_norm_eps)
        self.k_norm = RMSNorm(d, c.rms_norm_eps)

    def keys(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, H) at positions pos (B, T) -> k, v (B, kv, T, d), k normed and rotated."""
        B, T, _ = x.shape
        c = self.c
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)).transpose(
            1, 2
        )
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return rope(k, pos, c.rope_theta), v

    def query(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.c
        q = self.q_norm(self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim)).transpose(
            1, 2
        )
        return rope(q, pos, c.rope_theta)  # (B, h, T, d)

    def attend(self, q, ctx_k, ctx_v, sees, blk_k, blk_v, parts=None) -> torch.Tensor:
        """q (B, h, N*s, d) of N blocks of S keys, s of them querying (the last s slots of a
        block), over the context's keys and values (B, kv, K, d) where `sees` (B, 1, N*s, K)
        allows, and over its own block's S keys and values (blk_k, blk_v: (B, kv, N*S, d)),
        all of them -> (B, N*s, H). One softmax over both; a block's scores against the
        other blocks are never formed (with an anchor at every position they would be most
        of the work). `parts` (`query_parts`, in slots of whole blocks): the blocks a part
        at a time, each over the context keys some query of the part sees, not the keys
        none sees (default: all at once)."""
        rep = self.c.num_attention_heads // self.c.num_key_value_heads
        B, h, Q, d = q.shape
        S = self.c.block_size
        s = Q * S // blk_k.shape[2]  # queries a block
        q = q * (1.0 / math.sqrt(d))
        kc, vc = ctx_k.repeat_interleave(rep, 1), ctx_v.repeat_interleave(rep, 1)
        kb, vb = blk_k.repeat_interleave(rep, 1), blk_v.repeat_interleave(rep, 1)
        out = []
        for b0, b1, k0, k1 in parts or [(0, blk_k.shape[2], 0, kc.shape[2])]:
            n, K = (b1 - b0) // S, k1 - k0
            q0, q1 = b0 // S * s, b1 // S * s
            qp = q[:, :, q0:q1]
            see = sees[..., q0:q1, k0:k1]
            s_ctx = (qp @ kc[:, :, k0:k1].transpose(-1, -2)).masked_fill_(~see, float("-inf"))
            kbp, vbp = (x[:, :, b0:b1].reshape(B, h, n, S, d) for x in (kb, vb))
            s_blk = (qp.reshape(B, h, n, s, d) @ kbp.transpose(-1, -2)).view(B, h, q1 - q0, S)
            p = torch.softmax(upcast(torch.cat([s_ctx, s_blk], -1)), -1).to(q.dtype)
            own = (p[..., K:].reshape(B, h, n, s, S) @ vbp).view(B, h, q1 - q0, d)
            out.append(p[..., :K] @ vc[:, :, k0:k1] + own)
        out = out[0] if len(out) == 1 else torch.cat(out, 2)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, h * d))


# Queries of a part of `query_parts`: 512 (128 blocks of 4). Small enough that a part's keys
# reach little past its own blocks' samples (blocks lie in anchor order) and a long batch's
# scores never exist whole; large enough that a part is a sizeable matrix product.
PART_QUERIES = 512


def query_parts(sees: torch.Tensor, S: int, size: int = PART_QUERIES) -> list[tuple]:
    """The queries of `sees` (B, 1, Q, K) in parts of whole blocks of S, each with the span
    of context keys any of its queries sees: [(q0, q1, k0, k1), ...] (k1 = k0: none). One
    read back from the device for all parts."""
    Q, K, step = sees.shape[2], sees.shape[3], max(1, size // S) * S
    starts = range(0, Q, step)
    if K == 0:
        return [(q0, min(Q, q0 + step), 0, 0) for q0 in starts]
    seen = sees[:, 0].any(0)  # (Q, K): a key some row's query sees
    hit = torch.stack([seen[q0 : q0 + step].any(0) for q0 in starts])  # (P, K)
    at = torch.arange(K, device=sees.device)
    k0 = torch.where(hit, at, K).amin(-1)
    k1 = torch.where(hit, at + 1, 0).amax(-1).clamp(min=k0)  # k0 = k1 = K: no key
    spans = torch.stack([k0, k1], -1).tolist()
    return [(q0, min(Q, q0 + step), a, b) for q0, (a, b) in zip(starts, spans, strict=True)]


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, h, pos, ctx_k, ctx_v, sees, parts=None, first: int = 0) -> torch.Tensor:
        """Blocks h (B, N*S, H) at pos (B, N*S); context keys/values (B, kv, K, d) of this
        layer; sees (B, 1, N*S, K): which context keys each query sees (each sees its whole
        block); `parts`: `Attention.attend`'s. `first`: the outputs of the block slots from
        this one on only (B, N*(S-first), H); the slots before it are keys and values alone,
        their queries and MLP never computed."""
        x = self.input_layernorm(h)
        a = self.self_attn
        k, v = a.keys(x, pos)
        if first:
            S = a.c.block_size
            h, x, pos = (slots(t, S, first) for t in (h, x, pos))
            sees = slots(sees, S, first, dim=2)
        h = h + a.attend(a.query(x, pos), ctx_k, ctx_v, sees, k, v, parts)
        return h + self.mlp(self.post_attention_layernorm(h))


def slots(x: torch.Tensor, S: int, first: int, dim: int = 1) -> torch.Tensor:
    """The rows of block slots `first`.. of x, whose dimension `dim` is N blocks of S."""
    return x.unflatten(dim, (-1, S)).narrow(dim + 1, first, S - first).flatten(dim, dim + 1)


class DFlashDrafter(DraftVocab):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        H = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(c.target_layers * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's rows, frozen
        self.draft_vocab_buffers(c.draft_vocab_size, c.vocab_size)

    def context(self, states: torch.Tensor) -> torch.Tensor:
        """Target states (B, T, L*H) -> the context (B, T, H) every layer's keys come from."""
        return self.hidden_norm(self.fc(states))

    def context_kv(
        self, ctx: torch.Tensor, pos: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context's keys and values (B, kv, T, d) at positions pos (B, T)."""
        return [layer.self_attn.keys(ctx, pos) for layer in self.layers]

    def block_states(self, ids: torch.Tensor, pos: torch.Tensor, kv, sees, first: int = 0):
        """Blocks' tokens ids (B, N*S) at pos (B, N*S) over the context's `kv`, each query
        seeing the context keys `sees` (B, 1, N*S, K) allows and its whole block -> the final
        normed states (B, N*(S-first), H) the head reads, of the block slots `first`.. (the
        last layer computes no other)."""
        h = self.embed_tokens(ids)  # (B, N*S, H)
        parts = query_parts(sees, self.config.block_size)  # alike in every layer
        last = len(self.layers) - 1
        for i, (layer, (k, v)) in enumerate(zip(self.layers, kv, strict=True)):
            h = layer(h, pos, k, v, sees, parts, first if i == last else 0)
        return self.norm(h)

    def blocks(self, ids: torch.Tensor, pos: torch.Tensor, kv, sees, first: int = 0):
        """`block_states`' blocks -> logits (B, N*(S-first), D)."""
        return self.lm_head(self.block_states(ids, pos, kv, sees, first))

    # -------------------------------------------------------------- training

    def forward_blocks(
        self,
        input_ids: torch.Tensor,
        states: torch.Tensor,
        anchors: torch.Tensor,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, N, S, D) of N blocks per row at once: block n of row b starts at position
        anchors[b, n] (-1: no block) with the true token there and MASK after it, and sees the
        context of the positions before its anchor and its whole self. In packed rows
        (`segments`, `positions`: each position's sample and its position in it) a block sees
        its own sample's context alone, at that sample's positions."""
        B, N, S = *anchors.shape, self.config.block_size
        inputs = self.training_blocks(input_ids, states, anchors, segments, positions)
        return self.blocks(*inputs).view(B, N, S, -1)

    def training_blocks(
        self,
        input_ids: torch.Tensor,
        states: torch.Tensor,
        anchors: torch.Tensor,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple:
        """`forward_blocks`' blocks as `blocks` takes them: ids and positions (B, N*S), the
        context's keys/values per layer, and which context keys each query sees
        (B, 1, N*S, T)."""
        B, T = input_ids.shape
        N, S = anchors.shape[1], self.config.block_size
        dev = input_ids.device
        j = torch.arange(S, device=dev)
        a = anchors.clamp(min=0)  # (B, N)
        first = input_ids.gather(1, a)  # (B, N): x_a
        ids = torch.full((B, N, S), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = first
        at = torch.arange(T, device=dev).expand(B, T)  # (B, T): where in the row
        ctx_pos = positions if positions is not None else at  # (B, T): where in its sample
        pos = (ctx_pos.gather(1, a)[:, :, None] + j).view(B, N * S)  # (B, N*S)
        kv = self.context_kv(self.context(states), ctx_pos)
        sees_ctx = at[:, None, :] < a.repeat_interleave(S, 1)[:, :, None]  # (B, N*S, T)
        if segments is not None:
            own = segments.gather(1, a).repeat_interleave(S, 1)  # (B, N*S): the block's sample
            sees_ctx = sees_ctx & (segments[:, None, :] == own[:, :, None])
        if (w := self.config.attention_window) is not None:
            sees_ctx = sees_ctx & (ctx_pos[:, None, :] > pos[:, :, None] - w)
        live = (anchors >= 0).repeat_interleave(S, 1)[:, :, None]  # padding sees its block only
        return ids.view(B, N * S), pos, kv, (sees_ctx & live)[:, None]

    # -------------------------------------------------------------- inference

    def drafts_per_block(self) -> int:
        """Tokens one block drafts: its masked positions."""
        return self.config.block_size - 1

    @torch.no_grad()
    def draft_block(self, kv, n_ctx: int, first_token: int) -> list[int]:
        """The S-1 tokens drafted after `first_token` at position n_ctx, over the cached
        context keys/values `kv` of positions 0..n_ctx-1 (a list per layer)."""
        logits = self.blocks(*self.inference_block(kv, n_ctx, first_token), first=1)[0]  # (S-1, D)
        return self.draft_ids[logits.argmax(-1)].tolist()

    def inference_block(self, kv, n_ctx: int, first_token: int) -> tuple:
        """The block [first_token, MASK...] at position n_ctx over the cached context `kv`, as
        `blocks` takes it (a batch of one)."""
        S, dev = self.config.block_size, self.fc.weight.device
        ids = torch.full((1, S), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = first_token
        pos = torch.arange(n_ctx, n_ctx + S, device=dev)[None]
        sees_ctx = torch.ones(S, n_ctx, dtype=torch.bool, device=dev)
        if (w := self.config.attention_window) is not None:
            keep = min(w, n_ctx)  # no query sees further back
            kv = [(k[:, :, n_ctx - keep :], v[:, :, n_ctx - keep :]) for k, v in kv]
            ctx_pos = torch.arange(n_ctx - keep, n_ctx, device=dev)
            sees_ctx = ctx_pos[None, :] > pos[0, :, None] - w  # (S, keep)
        return ids, pos, kv, sees_ctx[None, None]


def block_weights(size: int, gamma: float) -> torch.Tensor:
    """Loss weight of block positions 1..size-1: exp(-(j-1)/gamma)."""
    return torch.exp(-torch.arange(size - 1, dtype=torch.float64) / gamma)


def choose_anchors(
    loss_mask: torch.Tensor,
    valid: torch.Tensor,
    size: int,
    phase: int,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Anchors (B, N), -1 padded: the positions a whose next token is trainable (and of the
    same sample, in packed rows: `segments`) and that lie `phase` (mod size) after their
    sample's first such position; blocks then tile every trainable span, a packed row's
    samples each as a row of its own would. Deterministic in `phase`, so a resume draws the
    same blocks."""
    m = F.pad(loss_mask[:, 1:], (0, 1)) & valid  # (B, T): x_{a+1} trainable
    if segments is not None:
        m = m & (F.pad(segments[:, 1:], (0, 1), value=-1) == segments)
    m = m.cpu()
    seg = segments.cpu() if segments is not None else None
    rows = []
    for b, r in enumerate(m):
        idx = torch.nonzero(r).squeeze(1)
        if len(idx):
            first = idx[0]
            if seg is not None:  # each sample's own first trainable position
                _, counts = torch.unique_consecutive(seg[b, idx], return_counts=True)
                starts = idx[torch.cumsum(counts, 0) - counts]
                first = starts.repeat_interleave(counts)
            idx = idx[(idx - first) % size == phase % size]
        rows.append(idx)
    n = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), n), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out.to(loss_mask.device)

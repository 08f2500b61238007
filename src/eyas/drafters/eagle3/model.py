"""The EAGLE-3 drafter, top to bottom: config, small blocks, the model, training-time test.

Shapes: B batch, T tokens, H hidden size, D draft vocabulary, V target vocabulary.

    aux (B, T, 3H) [--input_norm-->] --fc--> fused (B, T, H)
    [input_layernorm(embed(x_{t+1})) ; hidden_norm(fused_t)]  (B, T, 2H)
        -> one Llama decoder layer (q/k/v take 2H) -> h (B, T, H)
        -> norm -> lm_head -> logits over the draft vocabulary (B, T, D)

Three switches say where the states are normalised, as the serving engines name them:
`norm_before_fc` (an RMSNorm over the concatenated 3H target states before `fc`),
`norm_before_residual` (the decoder layer's residual is the normed fused state) and
`norm_output` (the normed state, not h, is what the next TTT step and the head read).

Training-time test (TTT) unrolls k steps. Step i > 0 at root t takes [embed(x_{t+1+i}) ;
h_{i-1}(t)] at RoPE position t+i, and attends to step 0's keys at roots 0..t plus its own
chain's keys at root t (steps 1..i): exactly what the drafter sees at inference, where the
prefix is built from target states and each drafted token adds one entry.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.drafters.blocks import MLP, DraftVocab, RMSNorm, rope, upcast
from eyas.drafters.eagle3 import attention as ttt_attention
from eyas.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    hidden_size: int
    """H: the target's hidden size (the drafter works at the same width)."""
    intermediate_size: int
    """Width of the decoder layer's MLP."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """V: the target vocabulary (token embeddings are the target's, frozen)."""
    draft_vocab_size: int
    """D: the lm_head's output size."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    """If true the residual of the decoder layer is hidden_norm(fused), else fused itself.
    False trains better on a real target (SmolLM2-135M, 600 conversations: val acc/step
    after one epoch [0.232 0.184 0.162] against [0.164 0.157 0.154]; bench/RESULTS.md)."""
    norm_before_fc: bool = False
    """If true an RMSNorm (`input_norm`, width 3H) evens out the target states before `fc`."""
    norm_output: bool = False
    """If true the next TTT step and the head read norm(h), not h (then the head has no norm
    of its own before it)."""
    attention_window: int | None = None
    """A sliding window: a root attends to the step-0 keys of the W latest roots (itself
    included) and to its own chain; None: to every earlier root."""
    target_layers: int = 3
    """L: the target layers whose states (side by side, L*H wide) the drafter fuses."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UsageError(
                f"{self.num_attention_heads} heads not divisible by {self.num_key_value_heads} kv heads"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise UsageError(
                f"draft vocab {self.draft_vocab_size} > target vocab {self.vocab_size}"
            )

    @classmethod
    def from_target(cls, cfg, draft_vocab_size: int, **overrides) -> DrafterConfig:
        """Sizes from a transformers config of the target (MLA/MoE targets get a Llama layer)."""
        H, heads = cfg.hidden_size, cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        kw = dict(
            hidden_size=H,
            intermediate_size=getattr(cfg, "intermediate_size", 4 * H),
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=H // heads,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
            rope_theta=float(theta or getattr(cfg, "rope_theta", 10000.0) or 10000.0),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            hidden_act=getattr(cfg, "hidden_act", "silu"),
        )
        if kw["num_attention_heads"] % kw["num_key_value_heads"]:
            kw["num_key_value_heads"] = heads
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(
        self, x: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, 2H) -> q (B, h, T, d), k and v (B, h, T, d) with kv heads repeated."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        rep = c.num_attention_heads // c.num_key_value_heads
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def attend(
        self, q, prefix_k, prefix_v, chain_k: list, chain_v: list, prefix_mask
    ) -> torch.Tensor:
        """q (B, h, Tq, d) attends to prefix keys (B, h, Tk, d) under `prefix_mask` (Tq, Tk),
        plus, per query position, the chain keys (B, h, Tq, d) of the drafter's earlier steps."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = (q @ prefix_k.transpose(-1, -2)) * scale  # (B, h, Tq, Tk)
        s = s.masked_fill(~prefix_mask, float("-inf"))
        diag = [(q * k).sum(-1, keepdim=True) * scale for k in chain_k]  # each (B, h, Tq, 1)
        p = torch.softmax(upcast(torch.cat([s, *diag], -1)), -1).to(q.dtype)
        Tk = prefix_k.shape[2]
        out = p[..., :Tk] @ prefix_v  # (B, h, Tq, d)
        for j, v in enumerate(chain_v):
            out = out + p[..., Tk + j : Tk + j + 1] * v
        return self.project(out)

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """Heads (B, h, T, d) -> o_proj -> (B, T, H)."""
        B, h, Tq, d = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, Tq, h * d))  # (B, Tq, H)


class DecoderLayer(nn.Module):
    """The drafter's single layer. Exported as `layers.0.*` (vLLM) or `midlayer.*` (SGLang)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def inputs(self, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) x2 -> the attention input (B, T, 2H) and the residual (B, T, H)."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(emb), normed], -1)  # (B, T, 2H)
        return x, normed if self.c.norm_before_residual else hidden

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, H)


class Drafter(DraftVocab):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        H = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        L = c.target_layers
        self.input_norm = RMSNorm(L * H, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc = nn.Linear(L * H, H, bias=False)
        self.midlayer = DecoderLayer(c)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.draft_vocab_buffers(c.draft_vocab_size, c.vocab_size)
        # TTT attention: reference | chunked | flex (ttt_attention); auto: flex on a GPU, else chunked
        self.attention = "reference"

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target states (B, T, 3H) -> the fused state (B, T, H)."""
        return self.fc(self.input_norm(aux) if self.input_norm is not None else aux)

    def head(self, h: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer's output h (B, T, H) -> logits (B, T, D) (without `logits`, the
        normed state the head reads, (B, T, H)) and the state the next TTT step reads
        (B, T, H): h itself, or norm(h) with `norm_output`."""
        normed = self.norm(h)
        nxt = normed if self.config.norm_output else h
        return (self.lm_head(normed) if logits else normed), nxt

    def forward_ttt(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        steps: int,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        head: bool = True,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Unroll `steps` TTT steps over whole sequences.

        input_ids (B, T) and aux (B, T, 3H). Step i at root t consumes x_{t+1+i} (padded with
        0 past the end; such positions are masked by the loss). Returns per step the logits
        (B, T, D) and the output states h_i (B, T, H); without `head`, instead of the logits
        the normed state the head reads (B, T, H), for a loss that applies the head in parts.

        Packed rows (several samples one after another in a row): `segments` (B, T) says
        which sample each position is, `positions` (B, T) its position within it. Attention
        then stays within a sample and rope restarts per sample; what a root reads past its
        sample's end only reaches positions the loss masks, exactly as padding does.
        """
        B, T = input_ids.shape
        layer, attn = self.midlayer, self.midlayer.self_attn
        pos0 = (
            positions
            if positions is not None
            else torch.arange(T, device=input_ids.device).expand(B, T)
        )
        causal, window = None, self.config.attention_window
        attention = self._attention(input_ids.device)
        if attention == "reference":
            causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()  # (T, T)
            if window is not None:
                causal = causal.triu(-(window - 1))  # keys of the W latest roots only
            if segments is not None:
                causal = causal & (
                    segments[:, None, :, None] == segments[:, None, None, :]
                )  # (B, 1, T, T)
        hidden = self.fuse(aux)  # (B, T, H)
        prefix_k = prefix_v = None
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        out = []
        for i in range(steps):
            ids = F.pad(input_ids[:, 1 + i :], (0, 1 + i))  # (B, T): x_{t+1+i}
            x, residual = layer.inputs(self.embed_tokens(ids), hidden)  # (B, T, 2H), (B, T, H)
            q, k, v = attn.qkv(x, pos0 + i)
            if i == 0:
                prefix_k, prefix_v = k, v
            else:
                chain_k.append(k)
                chain_v.append(v)
            if attention == "reference":
                a = attn.attend(q, prefix_k, prefix_v, chain_k, chain_v, causal)
            else:
                impl = getattr(ttt_attention, attention)
                a = attn.project(
                    impl(q, prefix_k, prefix_v, chain_k, chain_v, segments=segments, window=window)
                )  # never (T, T) at once
            logits, hidden = self.head(layer.finish(a, residual), head)  # (B, T, D), (B, T, H)
            out.append((logits, hidden))
        return out

    def _attention(self, device: torch.device) -> str:
        """The TTT attention implementation that runs on `device` (auto: flex on a GPU)."""
        if self.attention == "auto":
            return "flex" if device.type == "cuda" else "chunked"
        return self.attention

    # -------------------------------------------------------------- inference

    @torch.no_grad()
    def prefix_kv(
        self, next_ids: torch.Tensor, aux: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step-0 keys/values for roots start..start+n-1: next_ids (1, n) are x_{t+1}, aux (1, n, 3H)."""
        x, _ = self.midlayer.inputs(self.embed_tokens(next_ids), self.fuse(aux))
        pos = torch.arange(start, start + next_ids.shape[1], device=next_ids.device)[None]
        _, k, v = self.midlayer.self_attn.qkv(x, pos)
        return k, v

    @torch.no_grad()
    def draft(
        self, prefix_k, prefix_v, next_id: int, last_aux: torch.Tensor, root: int, k: int
    ) -> list[int]:
        """Greedy chain of `k` draft tokens from the last root (position `root`).

        prefix_k/v (1, h, root+1, d) hold step 0 of every root so far (the last included);
        next_id is x_{root+1} (the token the target just produced); last_aux (1, 1, 3H).
        """
        layer, attn = self.midlayer, self.midlayer.self_attn
        dev = prefix_k.device
        if (w := self.config.attention_window) is not None:  # the W latest roots, as trained
            prefix_k, prefix_v = prefix_k[:, :, -w:], prefix_v[:, :, -w:]
        full = torch.ones(1, prefix_k.shape[2], dtype=torch.bool, device=dev)
        hidden = self.fuse(last_aux)  # (1, 1, H)
        tok = torch.tensor([[next_id]], device=dev)
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        drafts = []
        for i in range(k):
            x, residual = layer.inputs(self.embed_tokens(tok), hidden)  # (1, 1, 2H)
            q, kk, vv = attn.qkv(x, torch.tensor([[root + i]], device=dev))
            if i > 0:
                chain_k.append(kk)
                chain_v.append(vv)
            a = attn.attend(q, prefix_k, prefix_v, chain_k, chain_v, full)
            logits, hidden = self.head(layer.finish(a, residual))  # (1, 1, D), (1, 1, H)
            d = int(logits[0, -1].argmax())
            tok = self.draft_ids[d].view(1, 1)
            drafts.append(int(tok))
        return drafts

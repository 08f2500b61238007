"""Memory-efficient attention for the training-time test, with the reference's exact semantics.

At TTT step i, the query of root t attends to the step-0 keys of roots 0..t (causal) and
to the keys of steps 1..i at root t only (its own chain, one "diagonal" key per step). The
reference (`drafter.Attention.attend`) forms the full (B, heads, T, T) score matrix and keeps
it for the backward pass: ~17 GB per step for 64 heads at T = 8,192. Two implementations
that never hold it:

- `chunked`: flash-attention style in plain PyTorch, on any device. Queries go in blocks;
  each block's scores against the causal prefix are formed, merged with the diagonal terms
  through a running log-sum-exp, and dropped. The backward pass recomputes them block by
  block from the saved log-sum-exp. Memory: O(T) saved, O(block x T) transient.
- `flex`: PyTorch's flex attention with a block mask that says exactly this (causal prefix
  plus one diagonal per chain step); compiled into a fused kernel on GPUs.

Both compute softmax statistics in float32 and return the query's dtype.
"""

from __future__ import annotations

import math

import torch


class _ChunkedTTT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, pk, pv, block, seg, window, *chain):
        n = len(chain) // 2
        ck, cv = chain[:n], chain[n:]
        B, h, T, d = q.shape
        scale = 1.0 / math.sqrt(d)
        acc = _acc(q)
        out = torch.empty(B, h, T, pv.shape[-1], dtype=acc, device=q.device)
        lse = torch.empty(B, h, T, dtype=acc, device=q.device)
        first = _segment_starts(seg)
        for a in range(0, T, block):
            b = min(a + block, T)
            lo = _key_start(first, a, window)  # no key before the block's first sample or window
            qb = q[:, :, a:b].to(acc)  # (B, h, bq, d)
            s = (qb @ pk[:, :, lo:b].to(acc).transpose(-1, -2)) * scale  # (B, h, bq, b - lo)
            s.masked_fill_(_hidden(a, b, lo, q.device, seg, window), float("-inf"))
            diag = [(qb * k[:, :, a:b].to(acc)).sum(-1) * scale for k in ck]  # each (B, h, bq)
            m = torch.stack([s.amax(-1), *diag], -1).amax(-1)  # (B, h, bq)
            p = torch.exp(s - m[..., None])
            pd = [torch.exp(x - m) for x in diag]
            norm = p.sum(-1) + sum(pd)  # (B, h, bq)
            o = p @ pv[:, :, lo:b].to(acc)
            for w, v in zip(pd, cv, strict=True):
                o += w[..., None] * v[:, :, a:b].to(acc)
            out[:, :, a:b] = o / norm[..., None]
            lse[:, :, a:b] = m + torch.log(norm)
        ctx.save_for_backward(q, pk, pv, out, lse, *chain)
        ctx.block, ctx.n, ctx.seg, ctx.window = block, n, seg, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, pk, pv, out, lse, *chain = ctx.saved_tensors
        n, block = ctx.n, ctx.block
        ck, cv = chain[:n], chain[n:]
        B, h, T, d = q.shape
        scale = 1.0 / math.sqrt(d)
        acc = _acc(q)
        dout = dout.to(acc)
        D = (dout * out).sum(-1)  # (B, h, T)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dpk = torch.zeros(pk.shape, dtype=acc, device=q.device)
        dpv = torch.zeros(pv.shape, dtype=acc, device=q.device)
        dck = [torch.zeros(k.shape, dtype=acc, device=q.device) for k in ck]
        dcv = [torch.zeros(v.shape, dtype=acc, device=q.device) for v in cv]
        first = _segment_starts(ctx.seg)
        for a in range(0, T, block):
            b = min(a + block, T)
            lo = _key_start(first, a, ctx.window)
            qb, dob, Db, lb = q[:, :, a:b].to(acc), dout[:, :, a:b], D[:, :, a:b], lse[:, :, a:b]
            K, V = pk[:, :, lo:b].to(acc), pv[:, :, lo:b].to(acc)
            s = (qb @ K.transpose(-1, -2)) * scale
            s.masked_fill_(_hidden(a, b, lo, q.device, ctx.seg, ctx.window), float("-inf"))
            p = torch.exp(s - lb[..., None])  # (B, h, bq, b - lo)
            dpv[:, :, lo:b] += p.transpose(-1, -2) @ dob
            ds = p * ((dob @ V.transpose(-1, -2)) - Db[..., None])  # (B, h, bq, b - lo)
            dqb = ds @ K
            dpk[:, :, lo:b] += ds.transpose(-1, -2) @ qb
            for j in range(n):
                kj, vj = ck[j][:, :, a:b].to(acc), cv[j][:, :, a:b].to(acc)
                pj = torch.exp((qb * kj).sum(-1) * scale - lb)  # (B, h, bq)
                dcv[j][:, :, a:b] = pj[..., None] * dob
                dsj = pj * ((dob * vj).sum(-1) - Db)
                dqb += dsj[..., None] * kj
                dck[j][:, :, a:b] = dsj[..., None] * qb * scale
            dq[:, :, a:b] = dqb * scale
        dpk *= scale
        cast = lambda g, like: g.to(like.dtype)  # noqa: E731
        return (
            cast(dq, q),
            cast(dpk, pk),
            cast(dpv, pv),
            None,
            None,
            None,
            *[cast(g, k) for g, k in zip(dck, ck, strict=True)],
            *[cast(g, v) for g, v in zip(dcv, cv, strict=True)],
        )


def _acc(q: torch.Tensor) -> torch.dtype:
    """Accumulate in float32, or in float64 for float64 inputs (the reference tests)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _future(a: int, b: int, device, lo: int = 0) -> torch.Tensor:
    """(b - a, b - lo) mask of keys lo..b-1 later than each query of rows a..b-1."""
    rows = torch.arange(a, b, device=device)[:, None]
    return torch.arange(lo, b, device=device)[None, :] > rows


def _hidden(
    a: int, b: int, lo: int, device, seg: torch.Tensor | None, window: int | None = None
) -> torch.Tensor:
    """Keys lo..b-1 that query rows a..b-1 may not see: later ones, those `window` or more
    rows earlier, and (packed rows, `seg` (B, T)) those of another sample. (bq, b - lo), or
    (B, 1, bq, b - lo) with segments."""
    future = _future(a, b, device, lo)
    if window is not None:
        rows = torch.arange(a, b, device=device)[:, None]
        future = future | (rows - torch.arange(lo, b, device=device)[None, :] >= window)
    if seg is None:
        return future
    return future | (seg[:, None, a:b, None] != seg[:, None, None, lo:b])


def _segment_starts(seg: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) index where each position's sample begins (packed rows), or None."""
    if seg is None:
        return None
    idx = torch.arange(seg.shape[1], device=seg.device).expand_as(seg)
    new = torch.ones_like(seg, dtype=torch.bool)
    new[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return torch.where(new, idx, torch.zeros_like(idx)).cummax(1).values


def _key_start(first: torch.Tensor | None, a: int, window: int | None = None) -> int:
    """The first key any query of a block starting at row a can see: the start of the
    sample its first query belongs to (packed rows; samples are contiguous), else 0, and no
    earlier than the first query's window. This is what makes a packed row cost the sum of
    its samples' squares, not its length's, and a windowed one its length times the window."""
    lo = 0 if first is None else int(first[:, a].min())
    return lo if window is None else max(lo, a - window + 1)


def chunked(
    q,
    prefix_k,
    prefix_v,
    chain_k: list,
    chain_v: list,
    block: int = 256,
    segments=None,
    window: int | None = None,
) -> torch.Tensor:
    """(B, h, T, d) attention output of the TTT pattern, without the (T, T) matrix; with
    `segments` (B, T), packed rows: the causal prefix is restricted to the query's sample;
    with `window`, to the `window` latest prefix keys."""
    return _ChunkedTTT.apply(q, prefix_k, prefix_v, block, segments, window, *chain_k, *chain_v)


_compiled_flex = None


def flex(
    q, prefix_k, prefix_v, chain_k: list, chain_v: list, segments=None, window=None
) -> torch.Tensor:
    """The TTT pattern as a flex-attention block mask over [prefix ; chain_1 ; ... ; chain_i];
    with `segments` (B, T), the prefix keys of the query's own sample only; with `window`, the
    `window` latest prefix keys."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T = q.shape[2]
    keys = torch.cat([prefix_k, *chain_k], 2)  # (B, h, (1+i)T, d)
    values = torch.cat([prefix_v, *chain_v], 2)

    W = window if window is not None else T + 1  # a window wider than the row: all of it

    def pattern(b, h, qi, kv):
        return ((kv < T) & (kv <= qi) & (qi - kv < W)) | ((kv >= T) & ((kv - T) % T == qi))

    def packed(b, h, qi, kv):  # the chain keys (kv >= T) are the query's own root: same sample
        return pattern(b, h, qi, kv) & ((kv >= T) | (segments[b, qi] == segments[b, kv % T]))

    B = q.shape[0] if segments is not None else None
    mask = create_block_mask(
        pattern if segments is None else packed, B, None, T, keys.shape[2], device=q.device
    )
    fn = flex_attention
    if q.is_cuda:
        _compiled_flex = _compiled_flex or torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    return fn(q, keys, values, block_mask=mask)

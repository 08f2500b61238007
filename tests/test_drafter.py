"""The drafter: TTT attention against a slow explicit reference; inference matches training."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from eyas.drafters import KINDS
from eyas.drafters.eagle3.model import Drafter, DrafterConfig


def _drafter(seed=0, **kw) -> Drafter:
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=50, draft_vocab_size=20, **kw)  # fmt: skip
    d = Drafter(c)
    for p in d.parameters():  # norms away from 1, so a wrong wiring shows
        p.data.normal_(0, 0.3) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    d.embed_tokens.weight.data.normal_()
    d.set_draft_vocab(torch.sort(torch.randperm(50)[:20]).values)
    return d.double().eval()  # float64: differences from the reference are wiring, not rounding


def slow_reference(
    d: Drafter, ids: torch.Tensor, aux: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Position by position, step by step, with explicit key lists (one sequence)."""
    layer, attn = d.midlayer, d.midlayer.self_attn
    T = ids.shape[0]
    tok = lambda j: int(ids[j]) if j < T else 0  # noqa: E731
    rms = lambda x, w: w * x / (x.pow(2).mean(-1, keepdim=True) + d.config.rms_norm_eps).sqrt()  # noqa: E731
    fin = aux if d.input_norm is None else rms(aux, d.input_norm.weight)  # norm_before_fc
    hidden = {t: d.fc(fin[t])[None, None] for t in range(T)}  # step-0 input state per root
    keys: dict[tuple[int, int], tuple] = {}  # (step, root) -> (k, v), each (h, d)
    logits = []
    for i in range(steps):
        out_h, out_l, queries = {}, [], {}
        for t in range(T):
            x, res = layer.inputs(d.embed_tokens(torch.tensor([[tok(t + 1 + i)]])), hidden[t])
            q, k, v = attn.qkv(x, torch.tensor([[t + i]]))
            keys[(i, t)] = (k[0, :, 0], v[0, :, 0])
            queries[t] = (q[0, :, 0], res)
        for t in range(T):
            q, res = queries[t]
            first = (
                0
                if d.config.attention_window is None
                else max(0, t - d.config.attention_window + 1)
            )
            ks = [keys[(0, r)] for r in range(first, t + 1)] + [
                keys[(j, t)] for j in range(1, i + 1)
            ]
            K = torch.stack([k for k, _ in ks], 1)  # (h, n, d)
            V = torch.stack([v for _, v in ks], 1)
            w = torch.softmax(
                (K @ q[:, :, None]).squeeze(-1) / math.sqrt(q.shape[-1]), -1
            )  # (h, n)
            o = (w[:, :, None] * V).sum(1).reshape(1, 1, -1)  # (1, 1, h*d)
            h = layer.finish(attn.o_proj(o), res)
            normed = rms(h, d.norm.weight)
            out_h[t] = normed if d.config.norm_output else h
            out_l.append(d.lm_head(normed)[0, 0])
        hidden = out_h
        logits.append(torch.stack(out_l))
    return logits


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["reference", "chunked", "flex"])
def test_ttt_matches_slow_reference(attention):
    for norms in (dict(norm_before_residual=False), dict(norm_before_residual=True),
                  dict(norm_before_fc=True, norm_before_residual=True, norm_output=True),
                  dict(norm_output=True), dict(attention_window=3),
                  dict(norm_before_fc=True, norm_output=True, attention_window=1)):  # fmt: skip
        d = _drafter(**norms)
        d.attention = attention
        torch.manual_seed(1)
        ids, aux = torch.randint(0, 50, (2, 9)), torch.randn(2, 9, 96, dtype=torch.float64)
        with torch.no_grad():
            fast = d.forward_ttt(ids, aux, steps=4)
            for b in range(2):
                ref = slow_reference(d, ids[b], aux[b], steps=4)
                for i in range(4):
                    torch.testing.assert_close(fast[i][0][b], ref[i], atol=1e-10, rtol=1e-9)


def test_ttt_step_sees_its_chain_not_other_roots():
    """Changing the token at a later root changes nothing at earlier roots, at any step."""
    d = _drafter()
    ids, aux = torch.randint(0, 50, (1, 10)), torch.randn(1, 10, 96, dtype=torch.float64)
    ids2 = ids.clone()
    ids2[0, 8] = (ids[0, 8] + 1) % 50
    with torch.no_grad():
        a, b = d.forward_ttt(ids, aux, 3), d.forward_ttt(ids2, aux, 3)
    for i in range(3):
        # step i at root t reads x_{t+1+i}: roots t < 7 - i never see position 8
        torch.testing.assert_close(a[i][0][0, : 7 - i], b[i][0][0, : 7 - i])
        assert not torch.allclose(a[i][0][0, 7 - i], b[i][0][0, 7 - i])


@pytest.mark.parametrize(
    "norms", [{}, dict(norm_before_fc=True, norm_before_residual=True, norm_output=True),
              dict(norm_output=True, attention_window=3)]
)  # fmt: skip
def test_inference_chain_equals_training_unroll(norms):
    d = _drafter(**norms)
    M, k = 7, 4
    torch.manual_seed(3)
    ids, aux = torch.randint(0, 50, (1, M + 1)), torch.randn(1, M, 96, dtype=torch.float64)
    pk, pv = d.prefix_kv(ids[:, 1 : M + 1], aux, 0)  # step 0 of roots 0..M-1 (x_{t+1})
    drafts = d.draft(pk, pv, int(ids[0, M]), aux[:, M - 1 :], root=M - 1, k=k)
    seq = torch.cat([ids, torch.tensor([drafts[:-1]])], 1)  # teacher-force the drafts
    aux_full = torch.cat([aux, torch.randn(1, k, 96, dtype=torch.float64)], 1)
    with torch.no_grad():
        outs = d.forward_ttt(seq, aux_full, k)
    got = [int(d.draft_ids[outs[i][0][0, M - 1].argmax()]) for i in range(k)]
    assert got == drafts


def test_draft_vocab_mapping():
    d = _drafter()
    ids = d.draft_ids
    assert torch.equal(ids, torch.nonzero(d.t2d).squeeze(1))
    assert torch.equal(d.d2t, ids - torch.arange(20))


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("attention", ["chunked", pytest.param("flex", marks=pytest.mark.gpu)])
def test_memory_efficient_attention_has_the_reference_gradients(attention, window):
    """Same loss, same gradients for every parameter (float64), with a block size that
    splits the sequence unevenly so block edges are exercised."""
    from eyas.drafters.eagle3 import attention as ttt_attention

    if attention == "flex" and not torch.cuda.is_available():
        pytest.skip("flex attention has no backward pass on a CPU: a GPU check (-m gpu, which "
                    "bench/gpu.py runs); its forward is checked against the reference above")  # fmt: skip
    torch.manual_seed(3)
    ids, aux = torch.randint(0, 50, (2, 11)), torch.randn(2, 11, 96, dtype=torch.float64)
    grads = {}
    for impl in ("reference", attention):
        d = _drafter(attention_window=window).train()
        d.attention = impl
        old = ttt_attention.chunked.__defaults__
        ttt_attention.chunked.__defaults__ = (
            4,
            None,
            None,
        )  # blocks of 4 queries over 11 positions
        try:
            outs = d.forward_ttt(ids, aux, steps=3)
        finally:
            ttt_attention.chunked.__defaults__ = old
        w = torch.Generator().manual_seed(9)
        loss = sum(
            (lg * torch.randn(lg.shape, generator=w, dtype=lg.dtype)).sum() for lg, _ in outs
        )
        loss.backward()
        grads[impl] = {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}
    assert grads["reference"].keys() == grads[attention].keys()
    for k in grads["reference"]:
        torch.testing.assert_close(
            grads[attention][k], grads["reference"][k], atol=1e-10, rtol=1e-8
        )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["reference", "chunked", "flex"])
def test_packed_rows_equal_padded_rows(attention):
    """Samples packed one after another in a row (attention within each sample, positions
    restarting) give, at every position the loss can score, the logits of the same samples
    padded into rows of their own, and the same gradients (float64; flex: forward only on a
    CPU, where it has no backward)."""
    from eyas.drafters.eagle3 import attention as ttt_attention

    torch.manual_seed(5)
    lens, steps = [7, 5, 9], 3
    seqs = [torch.randint(0, 50, (n,)) for n in lens]
    auxs = [torch.randn(n, 96, dtype=torch.float64) for n in lens]
    T = max(lens)
    pad_ids = torch.stack([torch.cat([x, torch.zeros(T - len(x), dtype=torch.long)]) for x in seqs])
    pad_aux = torch.stack(
        [torch.cat([a, torch.zeros(T - len(a), 96, dtype=torch.float64)]) for a in auxs]
    )
    pack_ids, pack_aux = torch.cat(seqs)[None], torch.cat(auxs)[None]
    segments = torch.cat([torch.full((n,), r) for r, n in enumerate(lens)])[None]
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    starts = [sum(lens[:r]) for r in range(len(lens))]
    backward = attention != "flex"
    results = {}
    for name, args in (("padded", (pad_ids, pad_aux, steps)),
                       ("packed", (pack_ids, pack_aux, steps, segments, positions))):  # fmt: skip
        d = _drafter().train()
        d.attention = attention
        old = ttt_attention.chunked.__defaults__
        ttt_attention.chunked.__defaults__ = (4, None, None)  # blocks that cross the samples' edges
        try:
            with torch.set_grad_enabled(backward):
                outs = d.forward_ttt(*args)
        finally:
            ttt_attention.chunked.__defaults__ = old
        picked = []  # (step, sample, position) -> logits, where the inputs stay in the sample
        for i, (lg, _) in enumerate(outs):
            for r, n in enumerate(lens):
                for t in range(n - 1 - i):
                    picked.append(lg[r, t] if name == "padded" else lg[0, starts[r] + t])
        picked = torch.stack(picked)
        grads = {}
        if backward:
            w = torch.Generator().manual_seed(11)
            (picked * torch.randn(picked.shape, generator=w, dtype=picked.dtype)).sum().backward()
            grads = {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}
        results[name] = (picked.detach(), grads)
    torch.testing.assert_close(results["packed"][0], results["padded"][0], atol=1e-10, rtol=1e-8)
    for k, g in results["padded"][1].items():
        torch.testing.assert_close(results["packed"][1][k], g, atol=1e-10, rtol=1e-8)


def test_losses_are_what_they_say_and_topk_agrees_with_the_full_store():
    """Over the loss registry: each loss equals its reference, the same value written plainly
    from the two distributions (kl the soft cross-entropy, tv one minus their overlap alpha,
    lk's blend weight from alpha's mean over the counted positions, ...), for a full store
    and for a top-K store holding every id. A loss without a reference is the chain's (opd),
    checked by the test below."""
    from eyas.drafters.loss import LOSSES, position_loss

    torch.manual_seed(0)
    B, T, D = 2, 5, 13  # more ids than hass's 10
    tgt, mine = torch.randn(B, T, D, dtype=torch.float64), torch.randn(B, T, D, dtype=torch.float64)
    full = {"tgt_logits": tgt}
    lp = torch.log_softmax(tgt, -1)
    topk = {"topk_lp": lp, "topk_ids": torch.arange(D).expand(B, T, D)}
    n = 1
    p = torch.softmax(tgt[:, n:], -1)
    q = torch.softmax(mine[:, :-n], -1)
    counted = torch.ones(B, T, dtype=torch.bool)
    counted[:, -n:] = False  # past the end: not counted, so not in lk's mean
    counted[0, 0] = False
    assert {k for k, v in LOSSES.items() if v.reference is None} == {"opd"}
    for kind, loss in LOSSES.items():
        if loss.reference is None:
            continue
        want = loss.reference(p, q, counted[:, :-n])
        for batch in (full, topk):
            got = position_loss(batch, mine, n, kind, counted)[:, :-n]
            torch.testing.assert_close(
                got, want.float() if got.dtype == torch.float32 else want, rtol=1e-5, atol=1e-6
            )
    # lk blends by the counted positions' mean acceptance: other positions counted, another value
    other = counted.clone()
    other[1, 1] = False
    assert not torch.allclose(
        position_loss(full, mine, n, "lk", other), position_loss(full, mine, n, "lk", counted)
    )


def test_kl_from_the_logits_has_the_plain_cross_entropys_value_and_gradient():
    """`SoftCrossEntropy`, the kl loss computed without the drafter's log-probabilities, and
    `Scores`' acceptance, against the plain formulas under autograd: rows of a distribution,
    a row of zeros (what a shift puts past the end: loss and gradient 0), and p whose sum is
    not 1 (the formula's sum(p) kept as it is)."""
    from eyas.drafters.loss import Scores, SoftCrossEntropy, TargetDist

    torch.manual_seed(0)
    z = torch.randn(2, 4, 11, dtype=torch.float64) * 3
    p = torch.softmax(torch.randn(2, 4, 11, dtype=torch.float64), -1)
    p[0, 1] = 0.0
    p[1, 2] *= 0.9
    grad = torch.randn(2, 4, dtype=torch.float64)
    mine = z.clone().requires_grad_()
    got = SoftCrossEntropy.apply(mine, p, p.sum(-1))
    (got * grad).sum().backward()
    plain = z.clone().requires_grad_()
    want = -(p * torch.log_softmax(plain, -1)).sum(-1)
    (want * grad).sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(mine.grad, plain.grad)
    assert got[0, 1] == 0 and not mine.grad[0, 1].any()
    row, q = p[:1, 2:], torch.softmax(z[:1, 2:], -1)  # a distribution at each position
    s = Scores(z[:1, 2:], TargetDist(row.log()), lambda x: x)
    torch.testing.assert_close(s.acceptance(), torch.minimum(row, q).sum(-1).float())


def test_the_split_head_gives_the_whole_vocabularys_view_and_keeps_each_samples_argmax():
    """TargetHead, as training reads the target: the soft labels and the argmax over the
    whole vocabulary equal `target_view`'s (the argmax outside the draft vocabulary too, a tie
    going to the lower id), and a sample seen before gets its kept argmax with the same soft
    labels: bit for bit in the same batch (so a resume that has kept nothing computes what an
    unbroken training did), and wherever it lies in another batch."""
    from eyas.drafters.loss import TargetHead, target_view

    torch.manual_seed(0)
    V, D, H, T = 40, 12, 8, 6
    head = torch.nn.functional.normalize(torch.randn(V, H, dtype=torch.float64), dim=-1)
    draft = torch.randperm(V)[:D].sort().values
    rest = torch.tensor([i for i in range(V) if i not in set(draft.tolist())])
    last = torch.randn(2, T, H, dtype=torch.float64)
    last[0, 1] = head[rest[3]] * 50  # an argmax outside the draft vocabulary (unit rows)
    head[draft[-1]] = head[rest[0]]  # equal logits: the lower id wins, as argmax takes it
    last[1, 2] = head[rest[0]] * 50
    spans = [(7, 0, 0, T), (9, 1, 0, T - 2)]  # sample 9's last two positions are padding
    th = TargetHead(head, draft, chunk=5)
    sel, top = th.view(last, spans)
    want_sel, want_top = target_view(last, head, draft, chunk=5)
    torch.testing.assert_close(sel, want_sel)
    assert top[0].tolist() == want_top[0].tolist() and top[0, 1] == rest[3]
    assert top[1, : T - 2].tolist() == want_top[1, : T - 2].tolist()
    assert int(top[1, 2]) == min(int(rest[0]), int(draft[-1]))
    assert top[1, T - 2 :].tolist() == [0, 0]  # outside every span
    assert set(th.tops) == {7, 9}
    # a second epoch: nothing multiplies the other rows
    th.rest = torch.full_like(th.rest, float("nan"))
    again, top_again = th.view(last, spans)
    assert torch.equal(again, sel) and torch.equal(top_again, top)
    moved = torch.stack([last[1], last[0]])  # the samples in other rows of another batch
    sel2, top2 = th.view(moved, [(9, 0, 0, T - 2), (7, 1, 0, T)])
    torch.testing.assert_close(sel2, torch.stack([sel[1], sel[0]]))
    assert torch.equal(top2, torch.stack([top[1], top[0]]))


def test_an_argmax_the_samples_hold_is_the_whole_vocabularys_and_spares_its_rows():
    """Extraction's `full_argmax` (blocks of the vocabulary, float32) is the argmax over the
    whole vocabulary, a tie across blocks going to the lower id; given it, a training's
    view of the target multiplies the draft vocabulary's rows alone (the others poisoned
    with NaN change nothing) and gives the same soft labels."""
    from eyas.drafters.loss import TargetHead, target_view
    from eyas.targets.backends import full_argmax

    torch.manual_seed(0)
    V, D, H, T = 40, 12, 8, 6
    head = torch.nn.functional.normalize(torch.randn(V, H), dim=-1)
    draft = torch.randperm(V)[:D].sort().values
    last = torch.randn(2, T, H)
    head[33] = head[5]  # equal logits in different blocks of 16 ids: 5 wins
    last[1, 2] = head[5] * 50
    want_sel, want_top = target_view(last, head, draft, chunk=5)
    got = full_argmax(last.reshape(-1, H).bfloat16(), head.bfloat16(), rows=4, cols=16)
    plain = (last.reshape(-1, H).bfloat16().float() @ head.bfloat16().float().T).argmax(-1)
    assert got.dtype == torch.int32 and got.tolist() == plain.tolist() and int(got[T + 2]) == 5
    assert (
        full_argmax(last.reshape(-1, H), head, rows=4, cols=16).tolist()
        == want_top.flatten().tolist()
    )
    poisoned = head.clone()
    poisoned[[i for i in range(V) if i not in set(draft.tolist())]] = float("nan")
    sel, top = target_view(last, poisoned, draft, chunk=5, top=want_top)
    torch.testing.assert_close(sel, want_sel)  # the same products, in another shape
    assert top is want_top
    whole, _ = TargetHead(head, draft, chunk=5).view(last, None)
    sel, top = TargetHead(poisoned, draft, chunk=5).view(last, [(7, 0, 0, T)], want_top)
    assert torch.equal(sel, whole) and top is want_top  # bit for bit: a resume's too


def test_on_policy_loss_is_forward_kl_on_the_matched_chain_and_decayed_reverse_kl_after():
    """opd: where every draft before a position matched, the forward KL; at the k-th position
    after the first miss, 0.8^k x the reverse KL; and in a TTT loss, the chain's first miss
    is where the drafter's argmax first differs from the target's."""
    from eyas.drafters.loss import on_policy

    torch.manual_seed(1)
    logq = torch.log_softmax(torch.randn(4, 6, dtype=torch.float64), -1)
    logp = torch.log_softmax(torch.randn(4, 6, dtype=torch.float64), -1)
    fwd = (logp.exp() * (logp - logq)).sum(-1)
    rev = (logq.exp() * (logq - logp)).sum(-1)
    matched = torch.tensor([True, False, False, False])
    since = torch.tensor([0, 1, 2, 3])
    got = on_policy(logq, logp, matched, since)
    want = torch.stack([fwd[0], 0.8 * rev[1], 0.8**2 * rev[2], 0.8**3 * rev[3]])
    torch.testing.assert_close(got, want)
    assert (rev > 0).all() and (fwd > 0).all()


def test_muon_is_torchs_rule_with_its_iteration_in_float32():
    """eyas's Muon takes the same step as torch.optim.Muon (match_rms_adamw) when both
    orthogonalise in the same precision; the update's singular values are near one."""
    import torch.optim._muon as tm

    from eyas.training.muon import Muon, orthogonalise

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(6, 9)), torch.nn.Parameter(torch.randn(9, 4))]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    mine = Muon(a, lr=0.02, weight_decay=0.1)
    theirs = torch.optim.Muon(b, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    orig = tm._zeropower_via_newtonschulz
    tm._zeropower_via_newtonschulz = lambda g, coeffs, steps, eps: orthogonalise(g, steps, eps)
    try:
        for _ in range(3):
            grads = [torch.randn_like(x) for x in a]
            for x, y, g in zip(a, b, grads, strict=True):
                x.grad, y.grad = g.clone(), g.clone()
            mine.step()
            theirs.step()
    finally:
        tm._zeropower_via_newtonschulz = orig
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)
    s = torch.linalg.svdvals(orthogonalise(torch.randn(32, 48)))
    assert 0.5 < float(s.min()) and float(s.max()) < 1.5


def test_evaluation_by_context_length_buckets():
    """Each prompt counts in the bucket of its length, empty buckets are left out, and each
    bucket's figures are its own prompts' (rounds, accepted drafts, per position)."""
    from eyas.decoders.result import EvalResult

    # (length, rounds, accepted, emitted, accepted per position)
    rows = [(100, 10, 10, 20, [6, 3, 1]), (300, 10, 20, 30, [9, 7, 4]),
            (600, 10, 5, 15, [4, 1, 0]), (9000, 5, 0, 5, [0, 0, 0]), (20000, 4, 4, 8, [3, 1, 0])]  # fmt: skip
    res = EvalResult(prompts=5, per_position=[[0, 0]] * 3, lengths=[r[0] for r in rows],
                     per_prompt=[list(r[1:4]) for r in rows], positions=[r[4] for r in rows],
                     rounds=sum(r[1] for r in rows), accepted=sum(r[2] for r in rows))  # fmt: skip
    got = res.by_length()
    assert list(got) == ["< 512", "512-2K", "8K-16K", ">= 16K"]
    short = got["< 512"]
    assert short["prompts"] == 2 and short["tokens_per_forward"] == 2.5  # (20 + 30) / 20 rounds
    assert short["acceptance_length"] == 2.5 and short["per_position_acceptance"] == [
        0.75,
        0.5,
        0.25,
    ]
    assert (
        got["8K-16K"]["tokens_per_forward"] == 1.0
        and got["8K-16K"]["tokens_per_forward_ci95"] is None
    )
    assert got[">= 16K"]["mean_prompt_tokens"] == 20000


def test_a_judge_that_counts_groups_of_prompts_reports_each_bucket_without_an_interval():
    """vLLM's judge counts one length bucket at a time: each row of the result is a group of
    prompts. Each bucket's figures are its group's totals, its prompt count and mean length
    are its prompts', no interval is made up by resampling groups as if they were prompts,
    and the JSON keeps every prompt's length beside the groups' counts."""
    from eyas.decoders.result import EvalResult
    from eyas.stages.evaluate import paired_difference

    lengths = [100, 3000, 200, 3500, 300]  # prompts 0, 2, 4 under 512; 1 and 3 in 2K-4K
    res = EvalResult(prompts=5, per_position=[[13, 20], [5, 20]], lengths=lengths,
                     groups=[[0, 2, 4], [1, 3]], per_prompt=[[12, 16, 30], [8, 2, 9]],
                     positions=[[10, 5], [3, 0]], rounds=20, accepted=18)  # fmt: skip
    got = res.by_length()
    assert list(got) == ["< 512", "2K-4K"]
    assert got["< 512"]["prompts"] == 3 and got["< 512"]["mean_prompt_tokens"] == 200
    assert got["< 512"]["tokens_per_forward"] == 2.5 and got["< 512"]["acceptance_length"] == 2.333
    assert got["< 512"]["per_position_acceptance"] == [0.833, 0.417]
    assert got["2K-4K"]["prompts"] == 2 and got["2K-4K"]["tokens_per_forward"] == 1.125
    assert got["2K-4K"]["tokens_per_forward_ci95"] is None
    d = res.to_dict()
    assert d["tokens_per_forward"] == 1.95 and d["tokens_per_forward_ci95"] is None
    assert [p["prompt_tokens"] for p in d["per_prompt"]] == lengths
    assert [g["prompts"] for g in d["per_group"]] == [[0, 2, 4], [1, 3]]
    counted = dataclasses.replace(res, groups=[], lengths=[100, 3000])  # two rows, two prompts
    assert counted.intervals()["tokens_per_forward"] is not None
    p = paired_difference(counted, res)  # two drafters on the same prompts, one of them grouped
    assert p["prompts"] == 5 and p["difference"] == 0 and p["difference_ci95"] is None
    assert paired_difference(counted, counted)["difference_ci95"] is not None


def test_paired_difference_resamples_prompts_alike():
    """Drafter b emits one more token per round on every prompt than a: the difference is
    exactly that however the prompts are resampled, so its interval has no width."""
    from eyas.decoders.result import EvalResult
    from eyas.stages.evaluate import paired_difference

    a = EvalResult(per_prompt=[[10, 5, 10 + i] for i in range(30)], drafter={"path": "A"})
    b = EvalResult(per_prompt=[[10, 9, 20 + i] for i in range(30)], drafter={"path": "B"})
    p = paired_difference(a, b)
    assert p["a"] == "A" and p["b"] == "B" and p["prompts"] == 30 and p["difference"] == 1.0
    assert p["difference_ci95"] == [1.0, 1.0]
    c = EvalResult(
        per_prompt=[[10, 0, 10 + (i % 2) * 20] for i in range(30)], drafter={"path": "C"}
    )
    lo, hi = paired_difference(a, c)["difference_ci95"]
    assert lo < paired_difference(a, c)["difference"] < hi  # unpaired noise: a real interval


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kname", sorted(KINDS))
def test_every_kind_drafts_at_inference_what_its_training_forward_predicts(
    kname, window, demo_runs
):
    """Over the kind registry: a drafter built as training builds it (on the demo target's
    run), its proposer's drafts after a prompt are what its training forward predicts for
    those positions when the drafts are the true tokens, at two prompt lengths, after a
    round of accepted tokens too, with and without an attention window."""
    from eyas.drafters import kind
    from eyas.run.runmeta import read_run_meta
    from eyas.training.config import TrainConfig
    from eyas.training.trainer import build_drafter

    run = demo_runs(60)
    cfg = TrainConfig.of(data=str(run), out="unused", kind=kname, attention_window=window)
    torch.manual_seed(0)
    model, _ = build_drafter(cfg, read_run_meta(run))
    for p in model.parameters():  # away from the initialisation, so a wrong wiring shows
        p.data.normal_(0, 0.3) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    model = model.double().eval()
    k, T = kind(kname).positions(cfg), 24
    c = model.config
    ids = torch.randint(0, c.vocab_size, (1, T))
    states = torch.randn(1, T, c.target_layers * c.hidden_size, dtype=torch.float64)
    for n in (5, 14):
        prop = kind(kname).proposer(model, [])
        with torch.no_grad():
            prop.start(ids[0, :n].tolist(), states[:, :n], int(ids[0, n]))
            drafts = prop.propose(int(ids[0, n]), k)
            seq = torch.cat([ids[:, : n + 1], torch.tensor([drafts])], 1)
            assert kind(kname).trained_drafts(model, seq, states[:, : n + 1 + k], n, k) == drafts, n
            # the round kept three tokens (x_{n+1} .. x_{n+3}), made by the states at n .. n+2
            prop.accept(ids[0, n + 1 : n + 4].tolist(), states[:, n : n + 3])
            m = n + 3
            drafts = prop.propose(int(ids[0, m]), k)
            seq = torch.cat([ids[:, : m + 1], torch.tensor([drafts])], 1)
            assert kind(kname).trained_drafts(model, seq, states[:, : m + 1 + k], m, k) == drafts, m


@pytest.mark.parametrize("kname", sorted(KINDS))
def test_a_head_too_large_for_one_piece_is_applied_in_parts_with_the_same_loss_and_gradients(
    kname, demo_runs, monkeypatch
):
    """Over the kind registry: where a batch's logits would pass HEAD_ELEMENTS (a large
    vocabulary, long batches), the loss applies the head a part of the rows at a time, each
    part recomputed in the backward pass: the same loss, metrics and gradients as the whole
    head at once, for a per-position loss (kl, tv); a loss of the whole batch (lk) is never
    cut."""
    import torch.utils.checkpoint as ckpt

    import eyas.drafters.loss as L
    from eyas.drafters import kind
    from eyas.run.runmeta import read_run_meta
    from eyas.training.config import TrainConfig
    from eyas.training.train_data import SampleReader, to_device, usable_samples
    from eyas.training.trainer import build_drafter

    run = demo_runs(60)
    meta = read_run_meta(run)
    torch.manual_seed(0)
    model, lm_head = build_drafter(TrainConfig.of(data=str(run), out="unused", kind=kname), meta)
    for p in model.parameters():  # away from the initialisation, so a wrong wiring shows
        if p.requires_grad:
            p.data.normal_(0, 0.05) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    entries, _ = usable_samples(run, meta["hidden_size"], lambda m: None)
    reader = SampleReader(run, entries, True)
    batch = to_device(reader.batch(sorted(entries)[:3], packed=True), torch.device("cpu"))
    reader.close()
    k, D, whole_head = kind(kname), model.draft_ids.numel(), L.HEAD_ELEMENTS
    parts = []
    real = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda *a, **kw: (parts.append(1), real(*a, **kw))[1])
    for loss in ("kl", "tv", "lk"):
        cfg = TrainConfig.of(data=str(run), out="unused", kind=kname, loss=loss)
        b = dict(batch)
        k.prepare_batch(model, b, lm_head, cfg)
        got = []
        for elements in (whole_head, 7 * D):  # whole; then 7 rows a part
            monkeypatch.setattr(L, "HEAD_ELEMENTS", elements)
            parts.clear()
            model.zero_grad(set_to_none=True)
            total, stats = k.loss(model, b, cfg, None)
            total.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            got.append((total.detach(), stats, grads, len(parts)))
        (whole, s0, g0, n0), (cut, s1, g1, n1) = got
        assert n0 == 0 and (n1 > 2 if loss != "lk" else n1 == 0), (loss, n0, n1)
        torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s1[:, 1:], s0[:, 1:])  # counts: exactly
        torch.testing.assert_close(s1, s0, rtol=1e-5, atol=1e-4)
        assert g0.keys() == g1.keys() and g0
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=f"{loss} {n}")


def _tf5(layer: dict) -> dict:
    """A decoder-layer config as transformers 5 writes it: the rope in rope_parameters."""
    out = {k: v for k, v in layer.items() if k not in ("rope_theta", "rope_scaling")}
    return {**out, "rope_parameters": {"rope_type": "default", "rope_theta": layer["rope_theta"]}}


def _speculators_block(cfg: dict, kind_name: str, aux_hf: list[int]) -> dict:
    """eyas's DFlash export config as speculators 0.9 writes a DFlash one (speculators_model_type,
    a transformer_layer_config, the block and layers at the top, its anchor convention)."""
    layer = {k: v for k, v in cfg.items() if k not in ("architectures", "dflash_config", "draft_vocab_size",
                                                       "target_hidden_size", "torch_dtype", "eyas_version")}  # fmt: skip
    d = cfg["dflash_config"]
    return {"architectures": ["DFlashSpeculator"], "speculators_model_type": kind_name,
            "transformer_layer_config": _tf5(layer), "draft_vocab_size": cfg["draft_vocab_size"],
            "block_size": d["block_size"], "aux_hidden_state_layer_ids": aux_hf,
            "mask_token_id": d["mask_token_id"], "sample_from_anchor": False,
            "sliding_window_non_causal": False}  # fmt: skip


@pytest.mark.parametrize(
    "kname, fmt, foreign",
    [
        ("eagle3", "vllm", "speculators-eagle3"),
        ("eagle3", "sglang", "specforge-eagle3"),
        ("dflash", "vllm", "zlab-dflash"),
        ("dflash", "vllm", "speculators-dflash"),
        ("dspark", "vllm", "speculators-dspark"),
    ],
)
def test_drafters_saved_by_other_tools_are_read_as_those_tools_wrote_them(
    kname, fmt, foreign, demo_runs, tmp_path
):
    """Each format other tools save (speculators' save_pretrained: Eagle3DraftModel, DFlash,
    DSpark with its training-only verifier_norm and without the target's embedding table,
    which it leaves out; SpecForge's EAGLE-3; z-lab's DFlash), built from its documented
    fields with transformers 5's rope_parameters, reads back into the network eyas trained:
    the same logits (a table left out is the target's, read from it; without a target to read
    it from, one line says so). A field of a network eyas's drafter does not have
    (sliding-window layers) is refused in one line naming it."""
    from safetensors.torch import save_file

    from eyas.drafters import kind
    from eyas.drafters.formats import format_named
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.export import load_export
    from eyas.targets.weights import embed_weight
    from eyas.training.config import TrainConfig
    from eyas.training.trainer import build_drafter

    run = demo_runs(60)
    meta = read_run_meta(run)
    torch.manual_seed(0)
    how = {"serve_with": "sglang"} if fmt == "sglang" else {}  # SGLang's EAGLE-3 network
    model, _ = build_drafter(TrainConfig.of(data=str(run), out="unused", kind=kname, **how), meta)
    for p in model.parameters():  # away from the initialisation, so a wrong wiring shows
        p.data.normal_(0, 0.3) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    model.embed_tokens.weight.data.copy_(embed_weight(meta["model_path"]))  # frozen: the target's
    model.eval()
    k = kind(kname)
    tensors, cfg = k.export(format_named(fmt), model.state_dict(), k.config_dict(model), meta,
                            {"path": "target", "architectures": []}, torch.float32, 3)  # fmt: skip
    if foreign == "speculators-eagle3":
        cfg = {**cfg, "architectures": ["Eagle3DraftModel"],
               "transformer_layer_config": _tf5(cfg["transformer_layer_config"])}  # fmt: skip
    elif foreign == "specforge-eagle3":
        cfg = _tf5(cfg)
    elif foreign == "zlab-dflash":
        cfg = {**_tf5(cfg), "layer_types": ["full_attention"] * cfg["num_hidden_layers"]}
    elif foreign == "speculators-dflash":
        cfg = _speculators_block(cfg, "dflash", meta["aux_layers_hf"])
    target = None
    if foreign.startswith("speculators-d"):  # its copy of the target's final norm, for training
        tensors["verifier_norm.weight"] = torch.ones(model.config.hidden_size)
        del tensors["embed_tokens.weight"]  # the target's own, frozen: left out of its file
        target = meta["model_path"]
    out = tmp_path / foreign
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    if target is not None:
        with pytest.raises(ValueError, match="no embed_tokens.*the target's"):
            load_export(out)  # no target to read the table from
    back, layers = load_export(out, target)
    assert layers == meta["aux_layers_hf"]
    back.attention = getattr(model, "attention", None)  # EAGLE-3: the same TTT attention code
    T = 20
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    states = torch.randn(1, T, model.config.target_layers * model.config.hidden_size)
    with torch.no_grad():
        if kname == "eagle3":
            want, got = model.forward_ttt(ids, states, 3), back.forward_ttt(ids, states, 3)
            for (a, _), (b, _) in zip(want, got, strict=True):
                torch.testing.assert_close(a, b)
        else:
            anchors = torch.tensor([[3, 9]])
            torch.testing.assert_close(model.forward_blocks(ids, states, anchors),
                                       back.forward_blocks(ids, states, anchors))  # fmt: skip
    layer = cfg.get("transformer_layer_config", cfg)
    layer["layer_types"] = ["sliding_attention"] * layer.get("num_hidden_layers", 1)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layer_types.*sliding_attention"):
        load_export(out)

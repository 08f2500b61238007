"""The DFlash block drafter: many blocks at once equal each block alone, drafting at
inference equals training, and the kind trains, exports and decodes losslessly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import eyas

from eyas.drafters.block_drafter import DFlashConfig, DFlashDrafter, choose_anchors


def _model(seed=0, layers=2, S=4, window=None) -> DFlashDrafter:
    torch.manual_seed(seed)
    c = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, vocab_size=50, draft_vocab_size=20, target_layers=3,
                     block_size=S, mask_token_id=49, attention_window=window)  # fmt: skip
    m = DFlashDrafter(c)
    for p in m.parameters():  # norms away from 1, so a wrong wiring shows
        p.data.normal_(0, 0.3) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    m.set_draft_vocab(torch.sort(torch.randperm(50)[:20]).values)
    return m.double().eval()


def _one_block(m: DFlashDrafter, ids, states, a: int) -> torch.Tensor:
    """Logits (S, D) of the block at anchor a alone: the context of positions 0..a-1."""
    S = m.config.block_size
    kv = m.context_kv(m.context(states[:, :a]), torch.arange(a)[None])
    block = torch.full((1, S), m.config.mask_token_id)
    block[0, 0] = ids[0, a]
    sees = torch.ones(1, 1, S, a, dtype=torch.bool)  # the whole context before the block
    return m.blocks(block, torch.arange(a, a + S)[None], kv, sees)[0]


def test_many_blocks_at_once_equal_each_block_alone():
    m = _model()
    torch.manual_seed(1)
    ids, states = torch.randint(0, 49, (2, 13)), torch.randn(2, 13, 96, dtype=torch.float64)
    anchors = torch.tensor([[1, 4, 9, -1], [0, 3, 6, 10]])
    with torch.no_grad():
        got = m.forward_blocks(ids, states, anchors)  # (2, 4, S, D)
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            if a >= 0:
                torch.testing.assert_close(
                    got[b, n], _one_block(m, ids[b : b + 1], states[b : b + 1], a)
                )


def test_drafting_at_inference_is_the_trained_block():
    m = _model(layers=1)
    torch.manual_seed(2)
    ids, states = torch.randint(0, 49, (1, 11)), torch.randn(1, 11, 96, dtype=torch.float64)
    a = 7
    with torch.no_grad():
        logits = m.forward_blocks(ids, states, torch.tensor([[a]]))[0, 0, 1:]  # (S-1, D)
        kv = m.context_kv(m.context(states[:, :a]), torch.arange(a)[None])
    assert m.draft_block(kv, a, int(ids[0, a])) == m.draft_ids[logits.argmax(-1)].tolist()


def test_a_window_hides_the_context_behind_each_block_position():
    """With a window W, block position j (at a+j) sees the context above a+j-W and nothing
    before it: states there change no logit; one layer, so nothing leaks through the
    block's own keys."""
    m = _model(layers=1, window=5)
    torch.manual_seed(3)
    ids, states = torch.randint(0, 49, (1, 16)), torch.randn(1, 16, 96, dtype=torch.float64)
    a = 12
    with torch.no_grad():
        base = m.forward_blocks(ids, states, torch.tensor([[a]]))[0, 0]  # (S, D)

        def changed(at: int) -> list[bool]:
            other = states.clone()
            other[0, at] += 1.0
            got = m.forward_blocks(ids, other, torch.tensor([[a]]))[0, 0]
            return [not torch.allclose(got[j], base[j]) for j in range(4)]

        assert changed(7) == [False] * 4  # a - W: behind every position's window
        assert changed(8) == [True, False, False, False]  # inside position 0's window only
        assert changed(10) == [True, True, True, False]
        assert changed(11) == [True] * 4
        full = _model(layers=1).forward_blocks(ids, states, torch.tensor([[a]]))[0, 0]
    assert not torch.allclose(full, base)  # the window is what changed them
    try:
        _model(window=3)
    except ValueError as exc:
        assert "shorter than the block (4)" in str(exc)
    else:
        raise AssertionError("a window shorter than the block was accepted")


def test_drafting_with_a_window_is_the_trained_block():
    """At inference the block sees the context through the same window as in training, both
    before the context fills the window and long after."""
    m = _model(layers=2, window=5)
    torch.manual_seed(4)
    ids, states = torch.randint(0, 49, (1, 20)), torch.randn(1, 20, 96, dtype=torch.float64)
    for a in (3, 6, 15):
        with torch.no_grad():
            logits = m.forward_blocks(ids, states, torch.tensor([[a]]))[0, 0, 1:]  # (S-1, D)
            kv = m.context_kv(m.context(states[:, :a]), torch.arange(a)[None])
        assert m.draft_block(kv, a, int(ids[0, a])) == m.draft_ids[logits.argmax(-1)].tolist(), a


def test_anchors_tile_the_trainable_spans():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    valid = torch.ones_like(mask)
    a = choose_anchors(mask, valid, 3, 0)[0].tolist()
    assert a == [1, 4, 7, 10]  # each anchor's next token is trainable; one every 3 from the first
    assert choose_anchors(mask, valid, 3, 1)[0].tolist() == [2, 5, 11]
    # Two samples packed in one row: each gets the anchors it gets in a row of its own, and
    # none predicts the next sample's first token.
    one = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    two = torch.tensor([1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    packed = torch.cat([one, two])[None]
    seg = torch.tensor([[0] * 8 + [1] * 7])
    for phase in (0, 1, 2):
        alone = [choose_anchors(x[None], torch.ones_like(x)[None], 3, phase)[0] for x in (one, two)]
        want = [a for a in alone[0].tolist() if a >= 0] + [
            8 + a for a in alone[1].tolist() if a >= 0
        ]
        got = choose_anchors(packed, torch.ones_like(packed), 3, phase, seg)[0].tolist()
        assert [a for a in got if a >= 0] == want, phase


def test_dflash_trains_exports_and_decodes_losslessly(demo_runs, tmp_path):
    """eyas train --kind dflash on the demo target; the export (vLLM's DFlash format) reads
    back to the same logits, and evaluate decodes with it losslessly, drafting blocks."""
    from eyas.demo_target.build import DEMO_TARGET
    from eyas.stages.export import load_export
    from eyas.training.checkpoint import load_trained

    run = demo_runs(60)
    src, ds = run.parent / "conv.jsonl", run.parent / "ds"
    r = eyas("train", "--data", run, "--out", tmp_path / "tr", "--kind", "dflash", "--block-size", "4",
             "--epochs", "2", "--batch-tokens", "1024", "--lr", "3e-3", check=True)  # fmt: skip
    assert "DFlash, blocks of 4" in r.stderr
    cfg = json.loads((tmp_path / "tr" / "drafter_config.json").read_text())
    assert cfg["kind"] == "dflash" and cfg["block_size"] == 4
    r = eyas("export", tmp_path / "tr", "--format", "vllm", "--out", tmp_path / "ex",
             "--speculative-tokens", "5", check=True)  # fmt: skip
    # The serving line is the kind's: vLLM's dflash method, a block of 4 drafting 3 tokens;
    # a chain length asked for is said not to apply, not dropped without a word.
    assert '"method":"dflash"' in r.stderr and '"num_speculative_tokens":3' in r.stderr, r.stderr
    assert "--speculative-tokens 5 does not apply" in r.stderr and "drafts 3 tokens" in r.stderr
    ex = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert ex["architectures"] == ["DFlashDraftModel"] and ex["dflash_config"]["block_size"] == 4
    assert (
        ex["dflash_config"]["target_layer_ids"]
        == json.loads((run / "run.json").read_text())["aux_layers"]
    )
    trained, _ = load_trained(tmp_path / "tr")
    back, layers = load_export(tmp_path / "ex")
    torch.manual_seed(0)
    ids, states = torch.randint(0, 1000, (1, 20)), torch.randn(1, 20, 3 * 128)
    with torch.no_grad():
        torch.testing.assert_close(trained.eval().forward_blocks(ids, states, torch.tensor([[3, 9]])),
                                   back.forward_blocks(ids, states, torch.tensor([[3, 9]])))  # fmt: skip
    # evaluate drafts what the export serves unless told, and says what it judged.
    r = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "ex", "--data", src, "--limit", "6",
             "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["lossless"] and d["rounds"] > 0 and len(d["per_position_acceptance"]) == 3
    longest = json.loads((ds / "dataset.json").read_text())["tokens"]["max"]
    assert d["drafter"] == {"path": str((tmp_path / "ex").resolve()), "kind": "dflash",
                            "draft_tokens": 3, "serves": 3, "longest_training_sample": longest,
                            "target_context": 4096}  # fmt: skip
    r = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "ex", "--data", src,
             "--draft-tokens", "5")  # fmt: skip
    assert r.returncode == 2 and "drafts 3 tokens a round" in r.stderr, r.stderr
    # SGLang's DFLASH drafts over the target's whole head: a drafter over 400 of the 1,024
    # ids would be served as another network (tests/test_dspark.py exports a whole one).
    r = eyas("export", tmp_path / "tr", "--format", "sglang", "--out", tmp_path / "sg")
    assert r.returncode == 2 and "--draft-vocab-size 1024" in r.stderr, r.stderr
    assert not (tmp_path / "sg").exists()
    # Two drafters judged on the same prompts in one run: here the same export in two
    # places, so every prompt's figures agree and the paired difference is exactly zero.
    shutil.copytree(tmp_path / "ex", tmp_path / "ex2")
    r = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "ex", "--drafter", tmp_path / "ex2",
             "--data", src, "--limit", "6", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    both = json.loads(r.stdout)
    a, b = both["drafters"]
    assert a["prompts"] == b["prompts"] == 6 and len(a["per_prompt"]) == 6
    assert a["per_prompt"] == b["per_prompt"] and a["per_prompt"] == d["per_prompt"]
    assert both["paired"] == [{"a": str((tmp_path / "ex").resolve()), "b": str((tmp_path / "ex2").resolve()),
                               "prompts": 6, "tokens_per_forward": [a["tokens_per_forward"]] * 2,
                               "difference": 0.0, "difference_ci95": [0.0, 0.0]}]  # fmt: skip


def test_a_windowed_dflash_drafter_is_exported_for_vllm_and_refused_for_sglang(demo_runs, tmp_path):
    """--attention-window on a DFlash drafter: trained with it, written as vLLM's sliding
    window (use_swa, non-causal), read back with it to the same logits and decoded
    losslessly; SGLang, whose window layers are causal, is refused naming the option."""
    from eyas.demo_target.build import DEMO_TARGET
    from eyas.stages.export import load_export
    from eyas.training.checkpoint import load_trained

    run = demo_runs(60)
    r = eyas("train", "--data", run, "--out", tmp_path / "tr", "--kind", "dflash", "--block-size", "4",
             "--attention-window", "8", "--epochs", "1", "--batch-tokens", "1024", check=True)  # fmt: skip
    assert "DFlash, blocks of 4, 2 layer(s), attention window 8" in r.stderr, r.stderr
    eyas("export", tmp_path / "tr", "--format", "vllm", "--out", tmp_path / "ex", check=True)
    d = json.loads((tmp_path / "ex" / "config.json").read_text())["dflash_config"]
    assert (d["use_swa"], d["swa_window_size"], d["causal"]) == (True, 8, False)
    trained, _ = load_trained(tmp_path / "tr")
    back, _ = load_export(tmp_path / "ex")
    assert back.config.attention_window == 8
    torch.manual_seed(0)
    ids, states = torch.randint(0, 1000, (1, 30)), torch.randn(1, 30, 3 * 128)
    with torch.no_grad():
        torch.testing.assert_close(trained.eval().forward_blocks(ids, states, torch.tensor([[20]])),
                                   back.forward_blocks(ids, states, torch.tensor([[20]])))  # fmt: skip
    r = eyas("export", tmp_path / "tr", "--format", "sglang", "--out", tmp_path / "sg")
    assert r.returncode == 2 and "--attention-window 8" in r.stderr and "causally" in r.stderr
    assert not (tmp_path / "sg").exists()
    r = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "ex", "--data",
             run.parent / "conv.jsonl", "--limit", "4", "--json")  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["lossless"], r.stderr[-2000:]


def test_five_target_layers_extract_train_export_and_decode(
    targets, llama_dataset, conversations, tmp_path
):
    """Any number of target layers: five stored side by side (fp8, one scale per layer),
    verified, a DFlash drafter trained on them, exported naming all five and decoded
    losslessly; an EAGLE-3 drafter trains on them too but is refused for the engines, whose
    EAGLE-3 models read three."""
    from eyas.run.store import Layout

    assert Layout.parse(Layout("fp8", "last", 5).name()) == Layout("fp8", "last", 5)
    assert Layout().name() == "aux=dense,target=last"  # runs of three layers keep their name
    run = tmp_path / "run"
    eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run,
         "--aux-layers", "1,2,3,5,6", "--storage", "fp8", check=True)  # fmt: skip
    meta = json.loads((run / "run.json").read_text())
    assert meta["aux_layers"] == [1, 2, 3, 5, 6] and meta["layout"].endswith("layers=5,argmax=1")
    assert eyas("verify", run).returncode == 0
    eyas(
        "train",
        "--data",
        run,
        "--out",
        tmp_path / "df",
        "--kind",
        "dflash",
        "--epochs",
        "1",
        check=True,
    )
    eyas("export", tmp_path / "df", "--format", "vllm", "--out", tmp_path / "ex", check=True)
    ex = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert ex["dflash_config"]["target_layer_ids"] == [1, 2, 3, 5, 6]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"tell me about {w}"}) + "\n" for w in ("rain", "bread", "maps")
        )
    )
    r = eyas("evaluate", "--model", targets["llama"], "--drafter", tmp_path / "ex", "--data", prompts,
             "--max-new-tokens", "8", "--json")  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["lossless"], r.stderr[-2000:]
    eyas("train", "--data", run, "--out", tmp_path / "e3", "--epochs", "1", check=True)
    r = eyas("export", tmp_path / "e3", "--format", "vllm", "--out", tmp_path / "e3x")
    assert r.returncode == 2 and "reads 5 target layers" in r.stderr, r.stderr


def test_dpace_weights_are_the_drafts_expected_from_each_position_on():
    """D-PACE's weight of block position j: the sum over k >= j of the product of the
    smoothed confidences of positions 1..k, counting counted positions only (an uncounted one
    passes with 1 and adds no term), zero where j itself is not counted."""
    from eyas.drafters.block_kind import DPACE_ALPHA, dpace_weights

    torch.manual_seed(0)
    conf = [torch.rand(2, 5) for _ in range(4)]
    counted = [torch.rand(2, 5) > 0.3 for _ in range(4)]
    got = torch.stack(dpace_weights(conf, counted), -1)
    for b in range(2):
        for n in range(5):
            for j in range(4):
                want = 0.0
                if counted[j][b, n]:
                    reach = 1.0
                    for k in range(4):
                        if counted[k][b, n]:
                            reach *= (1 - DPACE_ALPHA) * float(conf[k][b, n]) + DPACE_ALPHA
                            want += reach if k >= j else 0.0
                assert abs(float(got[b, n, j]) - want) < 1e-5, (b, n, j)


def _block_batch(demo_runs, name="dflash", **options):
    """A drafter of the kind `name` built for the demo run with `options`, its config and a
    batch of 4 samples with the target's labels and anchors."""
    from eyas.drafters import kind
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import TrainConfig, build_drafter
    from eyas.training.train_data import SampleReader, to_device, usable_samples

    run = demo_runs(60)
    meta = read_run_meta(run)
    entries, _ = usable_samples(run, meta["hidden_size"], lambda m: None)
    reader = SampleReader(run, entries, True)
    cfg = TrainConfig.of(data=str(run), out="unused", kind=name, progress=False, **options)
    d, head = build_drafter(cfg, meta)
    b = to_device(reader.batch(sorted(entries)[:4]), torch.device("cpu"))
    reader.close()
    k = kind(name)
    k.prepare_batch(d, b, head, cfg)
    return k, d, cfg, b


def _slot_losses(k, d, b, cfg):
    """Per predicting block position: (the KL loss (B, N), counted (B, N), the drafter's
    argmax right (B, N)), written plainly from the drafter's outputs."""
    import torch.nn.functional as F

    out = k.outputs(d, b)
    res = []
    for i, (src, _, lmask) in enumerate(k._masks(b, d.config.block_size)):
        logits = out["head"](out["states"][:, :, i], i, slice(None))
        at = src[..., None].expand(-1, -1, b["tgt_logits"].shape[-1])
        p = F.softmax(b["tgt_logits"].gather(1, at).float(), -1)
        per = -(p * F.log_softmax(logits.float(), -1)).sum(-1)
        right = d.draft_ids[logits.argmax(-1)] == b["tgt_top"].gather(1, src)
        res.append((per, lmask, right, F.softmax(logits.float(), -1)))
    return res


def test_loss_until_miss_counts_a_block_position_only_up_to_the_first_miss(demo_runs):
    """--loss-until-miss (Spec-AUF): in training, block position j counts only where every
    earlier position of its block drafted the target's token; the first counts every block;
    validation (eval mode) masks nothing."""
    k, d, cfg, b = _block_batch(demo_runs, loss_until_miss=True)
    plain_cfg = _block_batch(demo_runs)[2]
    with torch.no_grad():
        slots = _slot_losses(k, d, b, cfg)
        held = torch.ones_like(b["anchors"], dtype=torch.bool)
        want_counts, want_sums = [], []
        for per, lmask, right, _ in slots:
            m = lmask & held
            want_counts.append(float(m.sum()))
            want_sums.append(float((per * m).sum()))
            held &= right
        d.train()
        _, masked = k.loss(d, b, cfg, None)
        _, plain = k.loss(d, b, plain_cfg, None)
        d.eval()
        _, validated = k.loss(d, b, cfg, None)
    assert masked[:, 1].tolist() == want_counts
    # float32 losses summed in another order (by_rows lists the counted blocks): float32's
    # rounding, not float64's; a block counted wrongly moves a sum by far more
    torch.testing.assert_close(
        masked[:, 0], torch.tensor(want_sums, dtype=torch.float64), rtol=1e-6, atol=0
    )
    assert masked[0, 1] == plain[0, 1] > masked[1, 1] > 0  # blocks left out, not all
    assert masked[2, 1] < plain[2, 1]
    assert torch.equal(validated, plain)


def test_dpace_weighs_each_block_position_by_the_drafts_expected_from_it(demo_runs):
    """--position-weights dpace: the block loss is each position's loss times its D-PACE
    weight (from the drafter's probability of the target's token), where `decay` weighs
    position j by exp(-(j-1)/4); the metrics are the same."""
    from eyas.drafters.block_drafter import block_weights
    from eyas.drafters.block_kind import dpace_weights

    k, d, cfg, b = _block_batch(demo_runs, position_weights="dpace")
    decay_cfg = _block_batch(demo_runs)[2]
    with torch.no_grad():
        slots = _slot_losses(k, d, b, cfg)
        conf = [
            q.gather(
                -1,
                torch.searchsorted(
                    d.draft_ids, b["tgt_top"].gather(1, src).clamp(max=int(d.draft_ids[-1]))
                )[..., None],
            ).squeeze(-1)
            for (_, _, _, q), (src, _, _) in zip(slots, k._masks(b, 4), strict=True)
        ]
        w = dpace_weights(conf, [lm for _, lm, _, _ in slots])
        n = [float(lm.sum()) for _, lm, _, _ in slots]
        want = sum(
            float((per * lm * wi).sum()) / ni
            for (per, lm, _, _), wi, ni in zip(slots, w, n, strict=True)
        )
        decays = block_weights(4, 4.0)
        want_decay = sum(
            float((per * lm).sum()) * float(dw) / ni
            for (per, lm, _, _), dw, ni in zip(slots, decays, n, strict=True)
        )
        got, stats = k.loss(d, b, cfg, None)
        got_decay, stats_decay = k.loss(d, b, decay_cfg, None)
    assert abs(float(got_decay) - want_decay) < 1e-4 * want_decay
    assert abs(float(got) - want) < 1e-4 * want
    assert abs(want - want_decay) > 0.05 * want_decay  # the weights changed the loss
    assert torch.equal(stats, stats_decay)


@pytest.mark.parametrize("rows", [7, 2])
@pytest.mark.parametrize("share", [0.4, 0.0, 1.0])
def test_a_loss_at_listed_rows_is_the_loss_at_every_row_masked(rows, share):
    """by_rows with `live`: the loss computed at the live rows alone, listed as (b, j) pairs,
    gives the values (0 off the mask), every row's argmax and `also`, and the gradients of the
    loss at every row times the mask; in one part and in checkpointed parts, with some, no and
    every row live."""
    import torch.nn.functional as F

    from eyas.drafters.loss import at_rows, by_rows, take_rows

    torch.manual_seed(0)
    x = torch.randn(3, 7, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    target, at = torch.randn(3, 9, 11, dtype=torch.float64), torch.randint(0, 9, (3, 7))
    scale, live = torch.rand(3, 7, dtype=torch.float64), torch.rand(3, 7) < share

    def per_rows(logits, sl):
        p = F.softmax(take_rows(target, at, sl), -1)
        return -(p * F.log_softmax(logits, -1)).sum(-1) * at_rows(scale, sl)

    got = []
    for masked in (False, True):
        x.grad = w.grad = None
        loss, arg, top = by_rows(x, lambda xs, _sl: xs @ w.T, per_rows, rows,
                                 lambda logits, _sl: logits.max(-1).values,
                                 live=live if masked else None)  # fmt: skip
        loss = loss if masked else loss * live
        loss.sum().backward()
        got.append((loss.detach(), arg, top, x.grad.clone(), w.grad.clone()))
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b)
    assert bool((got[1][0] != 0).eq(live).all())  # every live row's loss, and no other


@pytest.mark.parametrize(
    "name, options",
    [("dflash", {"loss_until_miss": True, "position_weights": "dpace"}), ("dflash", {"loss": "opd"}),
     ("dspark", {}), ("dspark", {"markov_head": "gated", "loss": "tv"})],
)  # fmt: skip
def test_a_block_loss_at_its_counted_rows_alone_trains_as_at_every_row(
    demo_runs, monkeypatch, name, options
):
    """The block kinds compute a slot's loss at its counted blocks alone (the rest past the
    first miss under Spec-AUF, or outside the loss mask): the same loss, metrics and gradient
    in every weight as the loss over every block, masked."""
    from eyas.drafters import block_kind, loss

    k, d, cfg, b = _block_batch(demo_runs, name, **options)
    d.train()
    got = []
    for listed in (True, False):
        if not listed:
            monkeypatch.setattr(
                block_kind, "by_rows", lambda *a, live, **kw: loss.by_rows(*a, **kw)
            )
        d.zero_grad()
        total, stats = k.loss(d, b, cfg, None)
        total.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        got.append((total.detach(), stats, grads))
    (total, stats, grads), (total_all, stats_all, grads_all) = got
    torch.testing.assert_close(total, total_all)
    torch.testing.assert_close(stats, stats_all)
    assert grads.keys() == grads_all.keys() and len(grads) > 3
    for n, g in grads_all.items():
        torch.testing.assert_close(grads[n], g, msg=n)
    assert stats[:, 1].max() < b["anchors"].numel()  # rows were left out of the loss


def test_attention_in_parts_of_blocks_is_the_attention_whole():
    """The block queries taken a few blocks at a time, each part over the span of context
    keys it sees, give the outputs and gradients of all queries over every key, in packed
    rows (two samples a row), with and without a window; and so do the later slots' queries
    alone (the last layer's, whose earlier slots are keys and values only)."""
    from eyas.drafters.block_drafter import query_parts

    for window in (None, 6):
        m = _model(window=window).train()
        torch.manual_seed(3)
        ids, states = torch.randint(0, 49, (2, 24)), torch.randn(2, 24, 96, dtype=torch.float64)
        segments = torch.tensor([[0] * 10 + [1] * 14, [0] * 17 + [1] * 7])
        positions = torch.cat([torch.arange(10), torch.arange(14), torch.arange(17), torch.arange(7)]).view(2, 24)  # fmt: skip
        anchors = torch.tensor([[0, 2, 4, 6, 11, 13, 15, 18, 20, -1], [1, 3, 5, 8, 10, 12, 14, 18, 20, 21]])  # fmt: skip
        ids_, pos, kv, sees = m.training_blocks(ids, states, anchors, segments, positions)
        parts = query_parts(sees, 4, size=8)  # two blocks a part
        assert len(parts) == 5 and any(k1 - k0 < 24 for *_, k0, k1 in parts)
        x = m.embed_tokens(ids_).requires_grad_(True)
        layer = m.layers[0]
        k, v = kv[0]
        got = layer(x, pos, k, v, sees, parts)
        (g_got,) = torch.autograd.grad(got.sum(), x)
        want = layer(x, pos, k, v, sees)
        (g_want,) = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(g_got, g_want)
        # the last layer's outputs of the predicting slots alone: the same rows and gradients
        for first in (1, 3):
            got = layer(x, pos, k, v, sees, parts, first)
            (g_got,) = torch.autograd.grad(got.sum(), x)
            whole = layer(x, pos, k, v, sees)
            part = whole.view(2, 10, 4, -1)[:, :, first:].reshape(2, -1, whole.shape[-1])
            (g_want,) = torch.autograd.grad(part.sum(), x)
            torch.testing.assert_close(got, part)
            torch.testing.assert_close(g_got, g_want)

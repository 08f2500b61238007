"""The DSpark block drafter: its Markov head conditions a slot on the token before it (the
true one in training, the slot before's draft when drafting), its confidence head is trained
towards each slot's acceptance, and the kind trains, exports in the speculators format vLLM
loads and decodes losslessly from the command line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import eyas

from eyas.drafters.dspark.model import DSparkConfig, DSparkDrafter


def _model(rank=8, head="vanilla", seed=0) -> DSparkDrafter:
    torch.manual_seed(seed)
    c = DSparkConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, vocab_size=50, draft_vocab_size=20, target_layers=3,
                     block_size=4, mask_token_id=49, markov_rank=rank, markov_head=head)  # fmt: skip
    m = DSparkDrafter(c)
    for p in m.parameters():  # away from the initialisation, so a wrong wiring shows
        p.data.normal_(0, 0.5) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    m.set_draft_vocab(torch.sort(torch.randperm(50)[:20]).values)
    return m.double().eval()


def _train_option(name: str):
    """`eyas train`'s click option of that config field."""
    import typer.main

    from eyas.cli import app

    train = typer.main.get_command(app).commands["train"]
    return next(p for p in train.params if p.name == name)


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_each_slot_is_biased_by_the_token_before_it(head):
    """Slot j's logits are the backbone's plus the Markov bias of x_{a+j}: changing the true
    token at a+j changes slot j's logits and no other slot's (the backbone sees MASKs there);
    without the head the logits are the backbone's alone."""
    m = _model(head=head)
    torch.manual_seed(1)
    ids, states = torch.randint(0, 49, (1, 12)), torch.randn(1, 12, 96, dtype=torch.float64)
    a, anchors = 5, torch.tensor([[5]])
    with torch.no_grad():
        base, conf = m.forward_heads(ids, states, anchors)
        other = ids.clone()
        other[0, a + 2] = (ids[0, a + 2] + 1) % 49
        moved, _ = m.forward_heads(other, states, anchors)
        plain = m.lm_head(m.block_states(*m.training_blocks(ids, states, anchors)))
    changed = [not torch.allclose(base[0, 0, j], moved[0, 0, j]) for j in range(4)]
    assert changed == [False, False, True, False]
    assert conf.shape == (1, 1, 4)
    assert not torch.allclose(base[0, 0], plain.view(4, -1))
    m.markov_head = m.confidence_head = None
    with torch.no_grad():
        torch.testing.assert_close(
            m.forward_heads(ids, states, anchors)[0][0, 0], plain.view(4, -1)
        )


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_the_training_head_gives_each_slots_logits_and_gradients(head):
    """The head a training calls per slot and part of blocks (the vanilla bias computed once
    per distinct token and read per slot) gives slot_logits' values and the same gradients
    in every weight, for blocks whose slots repeat tokens."""
    m = _model(head=head).train()
    torch.manual_seed(3)
    h = torch.randn(2, 5, 4, 32, dtype=torch.float64)
    prev = torch.randint(0, 6, (2, 5, 4))  # few distinct tokens: rows share bias rows
    grads = []

    def per_slot(xs, i, rows):
        return m.slot_logits(xs, prev[:, rows, i])

    for make in (lambda: m.slot_head(prev), lambda: per_slot):
        m.zero_grad()
        head_of = make()
        parts = [head_of(h[:, sl, i], i, sl) for i in range(4) for sl in (slice(0, 2), slice(2, 5))]
        torch.cat(parts, 1).pow(2).sum().backward()
        grads.append((torch.cat(parts, 1).detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))  # fmt: skip
    (fast, fast_grads), (plain, plain_grads) = grads
    torch.testing.assert_close(fast, plain)
    assert fast_grads.keys() == plain_grads.keys() and "markov_head.markov_w1.weight" in fast_grads
    for name, g in plain_grads.items():
        torch.testing.assert_close(fast_grads[name], g, msg=name)


def test_drafting_chains_each_draft_through_the_markov_head():
    """One pass drafts all S slots; slot j's argmax is taken after the bias of slot j-1's
    draft, which a hand-made chain over the same states reproduces."""
    m = _model()
    torch.manual_seed(2)
    states, a, first = torch.randn(1, 9, 96, dtype=torch.float64), 9, 7
    with torch.no_grad():
        kv = m.context_kv(m.context(states), torch.arange(a)[None])
        drafts = m.draft_block(kv, a, first)
        h = m.block_states(*m.inference_block(kv, a, first))[0]
        prev, want = first, []
        for j in range(4):
            bias, _ = m.markov_head(torch.tensor(prev), h[j])
            prev = int(m.draft_ids[(m.lm_head(h[j]) + bias).argmax()])
            want.append(prev)
    assert len(drafts) == m.drafts_per_block() == 4 and drafts == want


def test_dspark_trains_exports_and_decodes_losslessly(demo_runs, tmp_path):
    """eyas train --kind dspark on the demo target: its options are its own (DFlash's and
    the heads'), the confidence loss is trained, the speculators export says every field a
    loader needs (sample_from_anchor written), reads back to the same logits, and evaluate
    decodes it losslessly drafting a whole block; SGLang's format (the DFlash format with the
    heads) reads back to the same network and decodes prompt for prompt as the vLLM one."""
    from eyas.demo_target.build import DEMO_TARGET
    from eyas.stages.export import load_export
    from eyas.training.checkpoint import load_trained

    run = demo_runs(60)
    src = run.parent / "conv.jsonl"
    # for SGLang: the whole vocabulary as the draft vocabulary, what its DSPARK drafts over
    r = eyas("train", "--data", run, "--out", tmp_path / "tr", "--kind", "dspark", "--block-size", "4",
             "--markov-rank", "16", "--epochs", "2", "--batch-tokens", "1024", "--lr", "3e-3",
             "--serve-with", "sglang", check=True)  # fmt: skip
    assert "DSpark, blocks of 4, 2 layer(s), Markov head rank 16 (vanilla)" in r.stderr, r.stderr
    assert "loss up to each block's first miss (Spec-AUF)" in r.stderr, r.stderr  # the default
    cfg = json.loads((tmp_path / "tr" / "train.json").read_text())["config"]
    assert cfg["kind"] == "dspark" and cfg["markov_rank"] == 16 and "ttt_steps" not in cfg
    assert cfg["loss_until_miss"] is True and cfg["serve_with"] == "sglang"
    assert cfg["draft_vocab_size"] is None  # left out: the run's default is 400, not every id
    # Spec-AUF is DSpark's default and --no-loss-until-miss reaches the config: a resume
    # given it is refused naming both values; DFlash keeps it off, EAGLE-3 refuses the flag.
    r = eyas("train", "--resume", "--out", tmp_path / "tr", "--no-loss-until-miss")
    assert r.returncode == 2 and "--loss-until-miss True saved, False given" in r.stderr, r.stderr
    r = eyas("train", "--data", run, "--out", tmp_path / "e3", "--no-loss-until-miss")
    assert r.returncode == 2 and "is an option of --kind dflash and dspark" in r.stderr, r.stderr
    opt = _train_option("loss_until_miss")
    assert opt.secondary_opts == ["--no-loss-until-miss"] and not opt.show_default
    assert opt.help.endswith("default: dflash off, dspark on]"), opt.help
    r = eyas(
        "train", "--data", run, "--out", tmp_path / "no", "--kind", "dspark", "--ttt-steps", "2"
    )
    assert r.returncode == 2 and "--ttt-steps is an option of --kind eagle3" in r.stderr, r.stderr
    r = eyas("export", tmp_path / "tr", "--format", "vllm", "--out", tmp_path / "ex", check=True)
    assert '"method":"dspark"' in r.stderr and '"num_speculative_tokens":4' in r.stderr, r.stderr
    ex = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert ex["architectures"] == ["DSparkSpeculator"] and ex["speculators_model_type"] == "dspark"
    assert ex["sample_from_anchor"] is True and ex["block_size"] == 4
    assert (ex["markov_rank"], ex["markov_head_type"], ex["enable_confidence_head"]) == (
        16,
        "vanilla",
        True,
    )
    assert ex["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    meta = json.loads((run / "run.json").read_text())
    assert ex["aux_hidden_state_layer_ids"] == meta["aux_layers_hf"]
    trained, _ = load_trained(tmp_path / "tr")
    back, layers = load_export(tmp_path / "ex")
    assert layers == meta["aux_layers_hf"]
    torch.manual_seed(0)
    ids, states = torch.randint(0, 1000, (1, 20)), torch.randn(1, 20, 3 * 128)
    with torch.no_grad():
        for x, y in zip(trained.eval().forward_heads(ids, states, torch.tensor([[3, 9]])),
                        back.forward_heads(ids, states, torch.tensor([[3, 9]])), strict=True):  # fmt: skip
            torch.testing.assert_close(x, y)
    r = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "ex", "--data", src,
             "--limit", "6", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["lossless"] and d["rounds"] > 0 and len(d["per_position_acceptance"]) == 4
    assert d["drafter"]["kind"] == "dspark" and d["drafter"]["draft_tokens"] == 4
    r = eyas("export", tmp_path / "tr", "--format", "sglang", "--out", tmp_path / "sg")
    assert r.returncode == 0, r.stderr
    assert "--speculative-algorithm DSPARK" in r.stderr, r.stderr
    assert "--speculative-num-draft-tokens 5" in r.stderr  # SGLang drafts this - 1: the block
    sg = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert sg["architectures"] == ["Qwen3DSparkModel"] and "speculators_model_type" not in sg
    assert sg["dflash_config"]["block_size"] == 4 and sg["vocab_size"] == sg["draft_vocab_size"]
    assert sg["dflash_config"]["target_layer_ids"] == meta["aux_layers"]
    assert (sg["markov_rank"], sg["markov_head_type"], sg["confidence_head_with_markov"]) == (
        16,
        "vanilla",
        True,
    )
    back_sg, layers_sg = load_export(tmp_path / "sg")
    assert layers_sg == meta["aux_layers_hf"]
    with torch.no_grad():
        for x, y in zip(back.forward_heads(ids, states, torch.tensor([[3, 9]])),
                        back_sg.forward_heads(ids, states, torch.tensor([[3, 9]])), strict=True):  # fmt: skip
            torch.testing.assert_close(x, y)
    r = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "ex", "--drafter",
             tmp_path / "sg", "--data", src, "--limit", "6", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = json.loads(r.stdout)["drafters"]
    assert b["drafter"]["kind"] == "dspark" and b["drafter"]["draft_tokens"] == 4, b.keys()
    assert a["per_prompt"] == b["per_prompt"] and a["per_prompt"] == d["per_prompt"]


def test_the_confidence_loss_counts_and_can_be_left_out(demo_runs):
    """--confidence-weight adds the head's cross-entropy against each slot's acceptance to
    the loss of the same batch and weights (0: no head, the block loss alone)."""
    from eyas.drafters import kind
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import TrainConfig, build_drafter
    from eyas.training.train_data import SampleReader, to_device, usable_samples

    demo_run = demo_runs(60)
    meta = read_run_meta(demo_run)
    entries, _ = usable_samples(demo_run, meta["hidden_size"], lambda m: None)
    reader = SampleReader(demo_run, entries, True)
    k, losses = kind("dspark"), {}
    for weight in (0.0, 1.0):
        cfg = TrainConfig.of(data=str(demo_run), out="unused", kind="dspark", markov_rank=8,
                             confidence_weight=weight, progress=False)  # fmt: skip
        d, head = build_drafter(cfg, meta)
        assert (d.confidence_head is not None) == (weight > 0)
        b = to_device(reader.batch(sorted(entries)[:3]), torch.device("cpu"))
        k.prepare_batch(d, b, head, cfg)
        with torch.no_grad():
            losses[weight] = float(k.loss(d, b, cfg, k.counts(b, cfg))[0])
    reader.close()
    assert losses[1.0] > losses[0.0] > 0  # the same backbone (seeded); BCE only adds


def test_sglang_is_refused_a_block_drafter_it_would_run_as_another_network():
    """SGLang's DFLASH and DSPARK models draft over the target's whole head and DSPARK always
    has both heads: a drafter over fewer ids, without a Markov or confidence head, or with a
    window, is refused for SGLang naming what to change; vLLM's format takes the first three.
    A training for SGLang (--serve-with sglang) is refused the same before it starts, and
    drafts every id; one for vLLM (the default) is not refused what vLLM runs."""
    from eyas.drafters import kind
    from eyas.drafters.block_drafter import DFlashConfig
    from eyas.drafters.block_kind import whole_ids
    from eyas.drafters.formats import SGLANG, VLLM
    from eyas.errors import UsageError
    from eyas.training.config import TrainConfig

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=50, target_layers=3, block_size=4,
                 mask_token_id=49)  # fmt: skip
    dspark, dflash = kind("dspark").serving, kind("dflash").serving
    whole = DSparkConfig(**shape, draft_vocab_size=50)
    assert dspark[SGLANG].refuses(whole) is None and dflash[SGLANG].refuses(DFlashConfig(**shape, draft_vocab_size=50)) is None  # fmt: skip
    for served, c in ((dspark, DSparkConfig(**shape, draft_vocab_size=20)), (dflash, DFlashConfig(**shape, draft_vocab_size=20))):  # fmt: skip
        why = served[SGLANG].refuses(c)
        assert "a draft vocabulary of 20 of the target's 50 ids" in why, why
        assert "--draft-vocab-size 50" in why and served[VLLM].refuses(c) is None
    for change, said in (({"markov_rank": 0}, "--markov-rank 0"), ({"confidence_head": False}, "--confidence-weight 0"),
                         ({"attention_window": 8}, "--attention-window 8")):  # fmt: skip
        c = DSparkConfig(**shape, draft_vocab_size=50, **change)
        assert said in dspark[SGLANG].refuses(c)
    trainings = (("dspark", {"markov_rank": 0}, "--markov-rank 0"),
                 ("dspark", {"confidence_weight": 0.0}, "--confidence-weight 0"),
                 ("dflash", {"attention_window": 8}, "--attention-window 8"))  # fmt: skip
    for name, change, said in trainings:
        cfg = TrainConfig.of(data="unused", out="unused", kind=name, **change)
        assert kind(name).unservable(cfg) is None  # vLLM runs it
        why = kind(name).unservable(cfg.replace(serve_with="sglang"))
        assert why and said in why, (name, why)
    cfg = TrainConfig.of(data="unused", out="unused", kind="dflash", serve_with="sglang")
    assert whole_ids(cfg, 50).tolist() == list(range(50))
    with pytest.raises(UsageError, match="whole vocabulary .50 ids., not --draft-vocab-size 20"):
        whole_ids(cfg.replace(draft_vocab_size=20), 50)
    with pytest.raises(UsageError, match="--serve-with must be one of vllm, sglang"):
        TrainConfig.of(data="unused", out="unused", kind="dspark", serve_with="tgi")

"""Compact storage: float8 aux states with per-token, per-layer scales; top-K targets."""

from __future__ import annotations

import json

import torch
from conftest import eyas

from eyas.data.dataset import PreparedDataset
from eyas.run.journal import committed
from eyas.run.runmeta import read_run_meta
from eyas.run.store import Layout, dequantize_fp8, load_sample, quantize_fp8, read_sample
from eyas.stages.extract import ExtractConfig, extract
from eyas.stages.verify import verify
from eyas.targets.weights import lm_head_weight


def test_fp8_scales_keep_an_outlier_to_its_own_token_and_layer():
    torch.manual_seed(0)
    x = torch.randn(16, 3 * 64)
    x[5, 70] = 1e4  # one huge value in layer 1 of token 5
    q, s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (16, 3)
    back = dequantize_fp8(q, s)
    rel = ((back - x).norm(dim=-1) / x.norm(dim=-1)).max()
    assert rel < 0.05  # e4m3 has 3 mantissa bits: ~2-3% relative error per row
    ok = torch.ones(16, 3, dtype=torch.bool)
    ok[5, 1] = False
    g, gb = x.view(16, 3, 64), back.view(16, 3, 64)
    err = ((gb - g).norm(dim=-1) / g.norm(dim=-1))[ok]
    assert err.max() < 0.05  # every other token and layer keeps its precision


def test_compact_run_stores_what_training_needs(tmp_path, targets, llama_dataset):
    dense, compact = tmp_path / "dense", tmp_path / "compact"
    extract(
        ExtractConfig(
            model=str(targets["llama"]), data=str(llama_dataset), out=str(dense), progress=False
        )
    )
    p = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", compact,
             "--storage", "fp8", "--target", "topk:8")  # fmt: skip
    assert p.returncode == 0, p.stderr
    meta = read_run_meta(compact)
    assert Layout.parse(meta["layout"]) == Layout("fp8", "topk:8") and meta["draft_vocab_size"]
    assert verify(compact).clean  # read without flags: the layout is in run.json and each header
    ds = PreparedDataset.open(llama_dataset)
    draft_ids = ds.draft_vocab(meta["draft_vocab_size"])
    W = lm_head_weight(targets["llama"]).float()
    entries = committed(compact)
    for i in (0, 7, 50):
        full = load_sample(dense, i)
        got = read_sample(compact, entries[i], checksums=True)
        a, b = got["aux_hidden_states"], full["aux_hidden_states"]
        assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max() < 0.05
        logits = full["last_hidden_states"] @ W.T  # (T, V)
        assert torch.equal(got["target_argmax"].long(), logits.argmax(-1))
        lp = torch.log_softmax(logits[:, draft_ids], -1)
        v, ids = lp.topk(8, -1)
        assert torch.equal(got["target_topk_ids"], ids)
        torch.testing.assert_close(got["target_topk_logprobs"].float(), v, atol=2e-2, rtol=1e-3)
    size = lambda d: sum(f.stat().st_size for f in d.rglob("*.safetensors"))  # noqa: E731
    assert size(compact) < size(dense) / 2
    # Training reads it without flags; --draft-vocab-size cannot disagree with the stored top-K.
    r = eyas("train", "--data", compact, "--out", tmp_path / "t", "--epochs", "1", "--ttt-steps", "2",
             "--batch-tokens", "1024")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "t" / "metrics.jsonl").read_text().splitlines()[-1])["acc"]
    r = eyas("train", "--data", compact, "--out", tmp_path / "t2", "--draft-vocab-size", "7")
    assert r.returncode == 2 and "cannot differ" in r.stderr


def test_estimate_matches_a_real_run(tmp_path, targets, llama_dataset):
    run = tmp_path / "run"
    s = extract(ExtractConfig(model=str(targets["llama"]), data=str(llama_dataset), out=str(run), storage="fp8",
                              target="topk:8", store_dtype="bfloat16", progress=False))  # fmt: skip
    ds = PreparedDataset.open(llama_dataset)
    from eyas.run.store import projected_bytes

    want = projected_bytes(Layout("fp8", "topk:8"), 64, torch.bfloat16, len(ds), s.tokens / len(ds),
                           ds.meta["draft_vocab_size"])  # fmt: skip
    got = sum(
        f.stat().st_size
        for f in run.rglob("*")
        if f.is_file() and "samples" in f.parts or "journal" in f.parts
    )
    assert abs(got - want) / got < 0.05, (got, want)

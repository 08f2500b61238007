"""prepare with a tokenizer that is Python code only (as Kimi's is): no fast tokenizer, no offsets."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import eyas
from slow_tokenizer import SlowBPETokenizer
from transformers import AutoTokenizer

from eyas.data.chat import _encode, _mask_without_offsets, tokenize_with_mask
from eyas.data.dataset import PreparedDataset
from eyas.demo_target.data import corpus_text, generate_conversations

MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Ünïcode ✓ and   spaces\n\nhere?"},
    {"role": "assistant", "content": "  Yes: ✓✓ — done.\n"},
]


def python_tokenizer_copy(src: Path, dst: Path) -> Path:
    """`src` with its fast tokenizer replaced by SlowBPETokenizer (same ids), loaded as remote code."""
    fast = AutoTokenizer.from_pretrained(src)
    shutil.copytree(
        src, dst, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json")
    )
    vocab = dst.parent / f"{dst.name}-bpe.json"
    shutil.copy(src / "tokenizer.json", vocab)
    SlowBPETokenizer.register_for_auto_class("AutoTokenizer")
    slow = SlowBPETokenizer(
        vocab_file=str(vocab), bos_token=fast.bos_token, eos_token=fast.eos_token,
        pad_token=fast.pad_token,
        additional_special_tokens=[t.content for t in fast.added_tokens_decoder.values()],
    )  # fmt: skip
    slow.chat_template = fast.chat_template
    slow.save_pretrained(dst)
    assert not (dst / "tokenizer.json").exists() and (dst / "slow_tokenizer.py").exists()
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # Llama-3 and ChatML templates
def test_prepare_with_a_python_tokenizer_equals_the_fast_one(tmp_path, targets, arch):
    slow = python_tokenizer_copy(targets[arch], tmp_path / "slow")
    src = tmp_path / "conv.jsonl"
    records = [*generate_conversations(40, seed=11), {"id": "multi", "messages": MULTI}]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))

    p = eyas("prepare", "--model", slow, "--data", src, "--out", tmp_path / "refused")
    assert p.returncode == 2 and "--trust-remote-code" in p.stderr, p.stderr
    assert not (tmp_path / "refused").exists()
    # Every command that loads the tokenizer says it the same way (evaluate did not).
    p = eyas("evaluate", "--model", slow, "--drafter", tmp_path / "no-drafter", "--data", src)
    assert (
        p.returncode == 2 and "--trust-remote-code" in p.stderr and "Traceback" not in p.stderr
    ), p.stderr
    assert "hf.co" not in p.stderr and "trust_remote_code=True" not in p.stderr

    fast_out, slow_out = tmp_path / "fast-ds", tmp_path / "slow-ds"
    eyas("prepare", "--model", targets[arch], "--data", src, "--out", fast_out, check=True)
    p = eyas("prepare", "--model", slow, "--data", src, "--out", slow_out, "--trust-remote-code",
             "--num-workers", "2")  # fmt: skip
    assert p.returncode == 0, p.stderr
    a, b = PreparedDataset.open(fast_out), PreparedDataset.open(slow_out)
    assert len(a) == len(b) == len(records)
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
    assert a.loss_mask.sum() > 0
    tok = AutoTokenizer.from_pretrained(slow, trust_remote_code=True)
    assert not tok.is_fast
    ids, mask = b.sample(len(b) - 1)
    assert tok.decode(ids[mask.astype(bool)].tolist()).startswith("5")


def test_edges_inside_words_match_the_offset_path(tmp_path, targets):
    """Span edges that cut through words: no shortcut, each edge placed by a prefix."""
    fast = AutoTokenizer.from_pretrained(targets["llama"])
    slow = AutoTokenizer.from_pretrained(
        python_tokenizer_copy(targets["llama"], tmp_path / "slow"), trust_remote_code=True
    )
    rng = random.Random(0)
    texts = [t for t in corpus_text(generate_conversations(60, seed=3)) if len(t) > 30]
    cut_inside_a_token = 0
    for text in texts:
        a, b, c, d = sorted(rng.sample(range(1, len(text)), 4))
        spans = [(a, b), (c, d)]
        ids, want = tokenize_with_mask(fast, text, spans)
        got_ids, got = _mask_without_offsets(slow, text, spans)
        assert got_ids == ids and got == want, (text, spans)
        pieces = [text[:a], text[a:b], text[b:c], text[c:d], text[d:]]
        cut_inside_a_token += sum((_encode(slow, p) for p in pieces), []) != ids
    assert cut_inside_a_token > len(texts) // 2  # the prefix path did the work


def test_tiny_copy_of_a_model_with_a_python_tokenizer(tmp_path, targets):
    slow = python_tokenizer_copy(targets["qwen3"], tmp_path / "slow")
    p = eyas("tiny-target", "--like", slow, "--out", tmp_path / "refused")
    assert p.returncode == 2 and "--trust-remote-code" in p.stderr, p.stderr
    out = tmp_path / "tiny"
    eyas("tiny-target", "--like", slow, "--out", out, "--trust-remote-code", check=True)
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": MULTI}) + "\n")
    eyas("prepare", "--model", out, "--data", src, "--out", tmp_path / "ds", "--trust-remote-code",
         check=True)  # fmt: skip
    ids, mask = PreparedDataset.open(tmp_path / "ds").sample(0)
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tok.decode(ids[mask.astype(bool)].tolist()) == "5<|im_end|>  Yes: ✓✓ — done.\n<|im_end|>"


def test_tokenizer_code_that_does_not_import_is_named(tmp_path, targets):
    slow = python_tokenizer_copy(targets["llama"], tmp_path / "slow")
    code = slow / "slow_tokenizer.py"
    text = code.read_text().replace(
        "from transformers import PreTrainedTokenizer",
        "from transformers import PreTrainedTokenizer, no_such_helper  # noqa",
    )
    code.write_text(text)
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": MULTI}) + "\n")
    p = eyas(
        "prepare", "--model", slow, "--data", src, "--out", tmp_path / "ds", "--trust-remote-code"
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert (
        "slow_tokenizer.SlowBPETokenizer" in p.stderr
        and "does not load with transformers" in p.stderr
    )
    assert "no_such_helper" in p.stderr and not (tmp_path / "ds").exists()


def test_pieces_that_do_not_add_up_fall_back_to_the_whole_text(tmp_path, targets, monkeypatch):
    """Cuts a tokenizer does not make (as when an added token swallows nearby spaces):
    the piece ids differ from the whole text's, and the edges are placed in the whole text."""
    import eyas.data.chat as prep

    fast = AutoTokenizer.from_pretrained(targets["qwen3"])
    slow = AutoTokenizer.from_pretrained(
        python_tokenizer_copy(targets["qwen3"], tmp_path / "slow"), trust_remote_code=True
    )
    text, spans = prep.assistant_spans(fast, MULTI)
    bogus = {p for s, e in spans for p in (s + 1, e - 3)}  # inside tokens, never a real cut
    monkeypatch.setattr(prep, "_added_token_edges", lambda tok, t: bogus)
    pieces = sorted({0, len(text)} | bogus)
    parts = [_encode(slow, text[a:b]) for a, b in zip(pieces[:-1], pieces[1:], strict=True)]
    assert sum(parts, []) != _encode(slow, text)
    assert prep._mask_without_offsets(slow, text, spans) == tokenize_with_mask(fast, text, spans)

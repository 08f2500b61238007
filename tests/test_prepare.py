"""prepare: input formats, loss masks on two templates, truncation, bad input, atomicity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import eyas
from transformers import AutoTokenizer

from eyas.data.dataset import PreparedDataset, draft_vocab_from_counts
from eyas.stages.prepare import PrepareConfig, prepare

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Now add 4 to that."},
    {"role": "assistant", "content": "Adding 4 gives 9."},
]


def _prep(tmp_path, model, records, name="in.jsonl", **kw):
    src = tmp_path / name
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "ds"
    s = prepare(
        PrepareConfig(
            model=str(model), data=(str(src),), out=str(out), progress=False, force=True, **kw
        )
    )
    return s, PreparedDataset.open(out)


def _masked_text(tok, ds, i):
    ids, mask = ds.sample(i)
    return tok.decode(ids[mask.astype(bool)].tolist()), tok.decode(ids[~mask.astype(bool)].tolist())


@pytest.mark.parametrize(
    "arch,eot,header",
    [
        ("llama", "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        ("qwen3", "<|im_end|>", "<|im_start|>assistant\n"),
    ],
)
def test_multiturn_mask_two_templates(tmp_path, targets, arch, eot, header):
    tok = AutoTokenizer.from_pretrained(targets[arch])
    _, ds = _prep(tmp_path, targets[arch], [{"id": "a", "messages": CONV}])
    trained, untrained = _masked_text(tok, ds, 0)
    # Exactly the assistant's content and end-of-turn token, for both turns; nothing else.
    assert trained == f"5{eot}Adding 4 gives 9.{eot}"
    assert header in untrained and "What is 2 plus 3?" in untrained and "Be brief." in untrained
    # Two contiguous trained runs, one per assistant turn.
    mask = ds.sample(0)[1].astype(int)
    assert int(np.sum(np.diff(np.concatenate([[0], mask])) == 1)) == 2
    assert tok.decode(ds.sample(0)[0].tolist()) == tok.apply_chat_template(CONV, tokenize=False)


def test_last_turn_only(tmp_path, targets):
    tok = AutoTokenizer.from_pretrained(targets["llama"])
    _, ds = _prep(tmp_path, targets["llama"], [{"messages": CONV}], last_turn_only=True)
    assert _masked_text(tok, ds, 0)[0] == "Adding 4 gives 9.<|eot_id|>"


def test_input_formats_and_ids(tmp_path, targets):
    tok = AutoTokenizer.from_pretrained(targets["llama"])
    share = {
        "id": 7,
        "conversations": [
            {"from": "human", "value": "What is 2 plus 3?"},
            {"from": "gpt", "value": "5"},
        ],
    }
    openai = {"messages": CONV[1:3]}
    text = {"id": "t", "text": "plain pre-rendered text"}
    s, ds = _prep(tmp_path, targets["llama"], [share, openai, text])
    assert s.prepared == 3 and s.failed == 0
    assert [r["id"] for r in ds.records] == ["7", "in.jsonl:2", "t"]
    assert [r["format"] for r in ds.records] == ["sharegpt", "openai", "text"]
    # ShareGPT and OpenAI forms of the same conversation give the same tokens and mask.
    assert np.array_equal(ds.sample(0)[0], ds.sample(1)[0]) and np.array_equal(
        ds.sample(0)[1], ds.sample(1)[1]
    )
    assert ds.sample(2)[1].all()  # pre-rendered text trains on every token
    assert _masked_text(tok, ds, 0)[0] == "5<|eot_id|>"
    # A JSON array file is read too.
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([share, openai]))
    s2 = prepare(
        PrepareConfig(
            model=str(targets["llama"]), data=(str(arr),), out=str(tmp_path / "ds2"), progress=False
        )
    )
    assert s2.prepared == 2
    assert PreparedDataset.open(tmp_path / "ds2").records[1]["line"] == 2


def test_truncate_and_skip(tmp_path, targets):
    long = {
        "id": "long",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "word " * 200},
        ],
    }
    short = {"id": "short", "messages": CONV[1:3]}
    s, ds = _prep(tmp_path, targets["llama"], [long, short], max_length=64)
    assert s.prepared == 2 and s.truncated == 1
    rec = ds.records[0]
    assert rec["truncated"] and rec["tokens"] == 64 and rec["original_tokens"] > 64
    s, ds = _prep(tmp_path, targets["llama"], [long, short], max_length=64, overlong="skip")
    assert s.prepared == 1 and s.skipped_overlong == 1 and s.failed == 0
    assert ds.records[0]["id"] == "short"


BAD_LINES = [
    (b'{"messages": [', "malformed JSON"),
    (b'{"messages": "hello"}', "must be a list"),
    (
        b'{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}',
        "unknown role",
    ),
    (
        b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]}',
        "empty assistant turn",
    ),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    (
        b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "y"}]}',
        "invalid UTF-8",
    ),
    (b"[1, 2, 3]", "expected an object"),
    (b'{"foo": 1}', "no 'messages', 'conversations' or 'text'"),
    (
        b'{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}',
        "content must be a string",
    ),
    (b'{"messages": ["user: hi"]}', "expected an object"),
    (
        b'{"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]}',
        "unknown role",
    ),
    (b'{"text": ""}', "'text' is empty"),
    (b'{"id": ["x"], "text": "hi"}', "id must be a string"),
    (
        b'{"id": "dup", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
        "duplicate id",
    ),
    (
        b'{"id": "zero", "messages": [{"role": "user", "content": "'
        + b"long question " * 40
        + b'"}, {"role": "assistant", "content": "b"}]}',
        "no trainable tokens within --max-length 48",
    ),
]


def test_bad_input_file(tmp_path, targets):
    good = json.dumps({"id": "dup", "messages": CONV}).encode()
    lines = (
        [good]
        + [b for b, _ in BAD_LINES]
        + [json.dumps({"id": f"g{i}", "messages": CONV}).encode() for i in range(5)]
    )
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "ds"
    p = eyas(
        "prepare", "--model", targets["llama"], "--data", src, "--out", out, "--max-length", "48"
    )
    assert p.returncode == 1, p.stderr  # error rate far above 1%
    assert "failed" in p.stderr and "no dataset was written" in p.stderr
    assert not (out / "dataset.json").exists()  # a failed prepare leaves no dataset behind
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == len(BAD_LINES)
    for (_, reason), err in zip(BAD_LINES, sorted(errors, key=lambda e: e["line"]), strict=True):
        assert reason in err["reason"], (reason, err)
        assert err["file"] == str(src) and err["line"] >= 2
    # The record truncation emptied is no failure: it is counted apart.
    assert "1 emptied by truncation" in p.stderr and f"{len(BAD_LINES) - 1} failed" in p.stderr
    # Under a permissive threshold the same input succeeds, in the same directory, no --force.
    p = eyas(
        "prepare",
        "--model",
        targets["llama"],
        "--data",
        src,
        "--out",
        out,
        "--max-length",
        "48",
        "--max-error-rate",
        "1",
    )
    assert p.returncode == 0, p.stderr
    ds = PreparedDataset.open(out)
    assert len(ds) == 6 and ds.meta["counts"]["failed"] == len(BAD_LINES) - 1
    assert ds.meta["counts"]["emptied_by_truncation"] == 1


def test_usage_errors_exit_2(tmp_path, targets, conversations):
    p = eyas(
        "prepare",
        "--model",
        targets["llama"],
        "--data",
        conversations,
        "--out",
        tmp_path / "x",
        "--overlong",
        "chop",
    )
    assert p.returncode == 2 and "--overlong" in p.stderr
    p = eyas(
        "prepare",
        "--model",
        targets["llama"],
        "--data",
        tmp_path / "nope.jsonl",
        "--out",
        tmp_path / "x",
    )
    assert p.returncode == 2 and "nope.jsonl" in p.stderr  # a missing input is a usage error


def test_workers_match_single_process(tmp_path, targets, conversations):
    a = prepare(
        PrepareConfig(
            model=str(targets["llama"]),
            data=(str(conversations),),
            out=str(tmp_path / "a"),
            progress=False,
        )
    )
    b = prepare(
        PrepareConfig(
            model=str(targets["llama"]),
            data=(str(conversations),),
            out=str(tmp_path / "b"),
            progress=False,
            num_workers=2,
        )
    )
    assert a.fingerprint == b.fingerprint and a.prepared == 120


def test_draft_vocab_and_fingerprints(llama_dataset, targets):
    ds = PreparedDataset.open(llama_dataset)
    counts = ds.vocab_counts()
    assert counts.sum() == ds.loss_mask.sum()
    d = draft_vocab_from_counts(np.array([5, 0, 5, 9, 1]), 3)
    assert d.tolist() == [0, 2, 3]  # by count, ties by id, then ascending
    assert ds.draft_vocab().numel() == min(
        32000, len(AutoTokenizer.from_pretrained(targets["llama"]))
    )
    assert len(ds.meta["tokenizer_fingerprint"]) == 16 and ds.meta["tokens"]["total"] == len(
        ds.input_ids
    )


def test_corrupted_dataset_refused(tmp_path, targets):
    _, ds = _prep(tmp_path, targets["llama"], [{"messages": CONV}])
    f = ds.path / ds.meta["files"]["tokens"]["name"]
    f.write_bytes(f.read_bytes()[:-3] + b"xyz")
    with pytest.raises(ValueError, match="checksum"):
        PreparedDataset.open(ds.path)


def test_crash_during_rewrite_leaves_old_or_new(tmp_path, targets, conversations):
    """SIGKILL prepare while it rewrites a dataset: what is left opens as old or new, never a mix."""
    out = tmp_path / "ds"
    prepare(
        PrepareConfig(
            model=str(targets["llama"]), data=(str(conversations),), out=str(out), progress=False
        )
    )
    old = PreparedDataset.open(out).fingerprint
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"messages": CONV, "id": i}) + "\n" for i in range(30)))
    seen = set()
    for delay in (0.5, 2.5, 3.5, 4.0, 4.5, 6.0):
        p = subprocess.Popen([sys.executable, "-m", "eyas.cli", "prepare", "--model", str(targets["llama"]),
                              "--data", str(small), "--out", str(out)], stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(delay)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        fp = PreparedDataset.open(out).fingerprint  # never raises: files and dataset.json agree
        seen.add(fp)
        if fp != old:
            break
    assert seen <= {
        old,
        prepare(
            PrepareConfig(
                model=str(targets["llama"]),
                data=(str(small),),
                out=str(tmp_path / "n"),
                progress=False,
            )
        ).fingerprint,
    }


def test_samples_past_the_targets_context_are_said_where_they_happen(
    tmp_path, targets, conversations
):
    """A dataset whose samples run past the target's context (max_position_embeddings) is
    said so by prepare and by extract (how many, the longest, and the --max-length that cuts
    them), not stored without a word; cut to the context, nothing is said."""
    import shutil

    model = tmp_path / "short-context"
    shutil.copytree(targets["llama"], model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 48}))
    r = eyas("prepare", "--model", model, "--data", conversations, "--out", tmp_path / "ds")
    said = "longer than the target's context (max_position_embeddings 48"
    assert r.returncode == 0 and said in r.stderr and "--max-length 48" in r.stderr, r.stderr
    r = eyas("extract", "--model", model, "--data", tmp_path / "ds", "--out", tmp_path / "run")
    assert r.returncode == 0 and said in r.stderr, r.stderr
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(["many words"] * 40)}) + "\n")
    r = eyas(
        "train", "--data", tmp_path / "run", "--out", tmp_path / "t", "--epochs", "1", check=True
    )
    eyas("export", tmp_path / "t", "--format", "vllm", "--out", tmp_path / "ex", check=True)
    r = eyas("evaluate", "--model", model, "--drafter", tmp_path / "ex", "--data", prompts,
             "--max-new-tokens", "4")  # fmt: skip
    assert r.returncode == 0 and "longer than the target's context (48 tokens" in r.stdout, r.stdout
    r = eyas("prepare", "--model", model, "--data", conversations, "--out", tmp_path / "cut",
             "--max-length", "48")  # fmt: skip
    assert r.returncode == 0 and said not in r.stderr, r.stderr


def test_prepare_says_how_much_of_the_trained_tokens_its_draft_vocabulary_holds(
    tmp_path, targets, conversations
):
    """A token outside the draft vocabulary can never be drafted: prepare says the share of
    the trained (loss-masked) tokens the vocabulary's most frequent ids hold."""
    from eyas.data.dataset import PreparedDataset

    r = eyas("prepare", "--model", targets["llama"], "--data", conversations, "--out",
             tmp_path / "ds", "--draft-vocab-size", "40", check=True)  # fmt: skip
    counts = np.sort(PreparedDataset.open(tmp_path / "ds").vocab_counts())[::-1]
    want = (
        f"{100 * counts[:40].sum() / counts.sum():.1f}% of the {int(counts.sum()):,} trained tokens"
    )
    assert "draft vocabulary: its 40 ids" in r.stderr and want in r.stderr, r.stderr

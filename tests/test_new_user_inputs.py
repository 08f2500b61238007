"""Real data as a new user brings it: truncation that empties records, ShareGPT's many names
for the assistant, empty and misplaced inputs, missing paths, a user's own files in --out,
and prompts-only records for evaluate."""

from __future__ import annotations

import json
import os

import pytest
from conftest import eyas

from eyas.data.dataset import PreparedDataset
from eyas.stages.evaluate import read_prompts

QA = [{"from": "human", "value": "What is 2 plus 3?"}]


def _sharegpt(assistant: str) -> dict:
    return {"id": assistant, "conversations": [*QA, {"from": assistant, "value": "It is 5."}]}


def test_role_aliases_are_read_alike_in_both_forms(tmp_path, targets):
    recs = [_sharegpt(a) for a in ("gpt", "chatgpt", "bing", "bard")]
    recs += [{"id": f"m-{a}", "messages": [{"role": "user", "content": "hi"}, {"role": a, "content": "hello"}]}
             for a in ("assistant", "chatgpt", "bing", "bard")]  # fmt: skip
    recs += [{"id": "robot", "conversations": [*QA, {"from": "robot", "value": "5"}]},
             {"id": "m-robot", "messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "5"}]}]  # fmt: skip
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = eyas("prepare", "--model", targets["llama"], "--data", src, "--out", tmp_path / "ds",
             "--max-error-rate", "1")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert len(PreparedDataset.open(tmp_path / "ds")) == 8
    assert "a turn has an unknown role: 'robot' (2)" in p.stderr, p.stderr


def test_truncation_is_no_failure_and_names_a_length_that_keeps_them(tmp_path, targets):
    long = {"id": "doc", "conversations": [{"from": "human", "value": "word " * 300},
                                           {"from": "gpt", "value": "A summary."}]}  # fmt: skip
    recs = [_sharegpt("gpt") | {"id": f"q{i}"} for i in range(3)] + [long]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = eyas("prepare", "--model", targets["llama"], "--data", src, "--out", tmp_path / "ds",
             "--max-length", 64)  # fmt: skip
    assert p.returncode == 0, p.stderr  # 25% emptied, 0% failed
    assert "1 emptied by truncation, 0 failed" in p.stderr
    keep = int(p.stderr.split("--max-length ")[-1].split()[0])
    assert keep > 300, p.stderr  # the pasted document's length, and room for the answer
    ds = PreparedDataset.open(tmp_path / "ds")
    assert len(ds) == 3 and ds.meta["counts"]["emptied_by_truncation"] == 1


def test_empty_input_fails_at_prepare_and_leaves_nothing(tmp_path, targets):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    p = eyas("prepare", "--model", targets["llama"], "--data", src, "--out", tmp_path / "ds")
    assert p.returncode == 2 and "the input is empty" in p.stderr
    assert not (tmp_path / "ds").exists()


def test_paths_of_the_wrong_kind_are_usage_errors(tmp_path, targets, conversations):
    model = targets["llama"]
    p = eyas("prepare", "--model", model, "--data", tmp_path, "--out", tmp_path / "ds")
    assert p.returncode == 2 and "is a directory" in p.stderr and "Errno" not in p.stderr
    f = tmp_path / "afile"
    f.write_text("x")
    p = eyas("prepare", "--model", model, "--data", conversations, "--out", f)
    assert p.returncode == 2 and "is a file" in p.stderr and "Errno" not in p.stderr
    missing = tmp_path / "missing"
    for args in (("extract", "--model", model, "--data", missing, "--out", tmp_path / "r"),
                 ("extract", "--resume", missing), ("train", "--data", missing, "--out", tmp_path / "t"),
                 ("export", missing, "--format", "vllm", "--out", tmp_path / "e")):  # fmt: skip
        p = eyas(*args)
        assert p.returncode == 2 and "no such" in p.stderr, (args, p.stderr)
    assert not (tmp_path / "t").exists()
    p = eyas("evaluate", "--model", model, "--drafter", missing, "--data", tmp_path)
    assert p.returncode == 2 and "is a directory" in p.stderr and "Errno" not in p.stderr
    p = eyas("estimate", "--samples", -5, "--tokens-per-sample", 100, "--hidden-size", 64)
    assert p.returncode == 2 and "must be positive" in p.stderr


def test_prepare_never_touches_a_users_files(tmp_path, targets, conversations):
    out = tmp_path / "inputs"
    out.mkdir()
    (out / "errors.jsonl").write_text("my own notes\n")
    for force in ((), ("--force",)):
        p = eyas(
            "prepare", "--model", targets["llama"], "--data", conversations, "--out", out, *force
        )
        assert p.returncode == 2 and "errors.jsonl" in p.stderr, p.stderr
    assert (out / "errors.jsonl").read_text() == "my own notes\n"
    assert sorted(x.name for x in out.iterdir()) == ["errors.jsonl"]


def test_a_malformed_line_reads_plainly(tmp_path, targets):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(_sharegpt("gpt")) + '\n{"id": "x", "text": "unterminated\n')
    eyas("prepare", "--model", targets["llama"], "--data", src, "--out", tmp_path / "ds",
         "--max-error-rate", "1", check=True)  # fmt: skip
    err = json.loads((tmp_path / "ds" / "errors.jsonl").read_text())
    assert err["reason"] == "malformed JSON at column 21: unterminated string", err


def test_evaluate_reads_prompts_before_any_model(tmp_path):
    src = tmp_path / "p.jsonl"
    rows = [{"prompt": "Write a haiku.", "category": "writing"},
            {"messages": [{"role": "user", "content": "2+3?"}], "category": "math"},
            {"conversations": [*QA, {"from": "gpt", "value": "5"}]},
            {"messages": [{"role": "assistant", "content": "I speak first"}]}]  # fmt: skip
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_prompts(src, None)
    assert [p.category for p in got] == ["writing", "math", None]
    assert [p.messages[-1]["content"] for p in got] == [
        "Write a haiku.",
        "2+3?",
        "What is 2 plus 3?",
    ]
    src.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="no usable prompts"):
        read_prompts(src, None)


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the refusal is for a machine with no GPU"
)
def test_evaluate_on_a_gpu_that_is_not_there_says_so(tmp_path):
    """--device cuda without a GPU stops before the target loads, in one line."""
    from eyas.demo_target.build import DEMO_TARGET

    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "Write a haiku."}) + "\n")
    r = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "none", "--data", src,
             "--device", "cuda")  # fmt: skip
    assert r.returncode == 2 and "--device cuda: this machine has no GPU" in r.stderr, r.stderr
    r = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "none", "--data", src,
             "--device", "gpu0")  # fmt: skip
    assert r.returncode == 2 and "--device gpu0: not a device" in r.stderr, r.stderr


def test_extract_never_mixes_a_run_into_a_directory_of_inputs(tmp_path, targets, llama_dataset):
    out = tmp_path / "inputs"
    out.mkdir()
    (out / "conversations.jsonl").write_text("{}\n")
    p = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", out)
    assert (
        p.returncode == 2
        and "conversations.jsonl" in p.stderr
        and "extract did not write" in p.stderr
    )
    assert sorted(x.name for x in out.iterdir()) == ["conversations.jsonl"]
    # its own run directory is no foreign file: a resume and a rerun of the same command go on
    run = tmp_path / "run"
    eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run, check=True)
    p = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run)
    assert p.returncode == 0, p.stderr


def test_estimate_agrees_with_what_extract_stores(tmp_path, targets, llama_dataset):
    """estimate --model sizes the dtype extract really stores here (float32 on a CPU)."""
    run = tmp_path / "run"
    x = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run, "--device", "cpu",
             check=True, env={**os.environ, "EYAS_LOG_EVERY": "0"})  # fmt: skip
    # the rate on extract's line is status's: the same window, and it says which
    assert "tok/s (last 5m00s, as status)" in x.stderr, x.stderr
    meta = json.loads((run / "run.json").read_text())
    p = eyas("estimate", "--model", targets["llama"], "--samples", 10, "--tokens-per-sample", 100,
             "--device", "cpu", check=True)  # fmt: skip
    first, per_token = p.stdout.splitlines()[:2]
    assert meta["store_dtype"] == "float32" and "float32 (what extract stores on a CPU" in first
    assert per_token.strip().startswith(f"{meta['bytes_per_token']:,} bytes per token")
    assert "--store-dtype bfloat16 halves this" in p.stdout
    gpu = eyas("estimate", "--model", targets["llama"], "--samples", 10, "--tokens-per-sample", 100,
               "--device", "cuda", check=True).stdout  # fmt: skip
    assert "bfloat16 (what extract stores on a GPU" in gpu and "halves" not in gpu


def test_aux_layers_as_a_count_is_spread_and_estimate_sizes_it(tmp_path, targets, llama_dataset):
    """`--aux-layers 5` asks for five layers spread over the depth (what the block kinds'
    recipes read), written as their ids; `estimate --aux-layers 5` sizes exactly what that
    run stores per token, where three layers would under-count it; one number below 2 is
    refused (2)."""
    from eyas.targets.layers import spread

    run = tmp_path / "run"
    eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run,
         "--device", "cpu", "--aux-layers", "5", check=True)  # fmt: skip
    meta = json.loads((run / "run.json").read_text())
    n = meta["num_hidden_layers"]
    assert meta["aux_layers"] == list(spread(n, 5)) and len(set(meta["aux_layers"])) == 5
    per = {}
    for layers in (3, 5):
        p = eyas("estimate", "--model", targets["llama"], "--samples", 10, "--tokens-per-sample",
                 100, "--device", "cpu", "--aux-layers", layers, check=True)  # fmt: skip
        per[layers] = int(p.stdout.splitlines()[1].split()[0].replace(",", ""))
        assert f"{layers} target layers" in p.stdout.splitlines()[0]
    assert per[5] == meta["bytes_per_token"] > per[3]
    r = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out",
             tmp_path / "one", "--aux-layers", "1")  # fmt: skip
    assert r.returncode == 2 and "one number is a count" in r.stderr, r.stderr

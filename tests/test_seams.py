"""Trust at the seams between stages: data made for another model is refused, evaluation
renders prompts as training did, and nothing a stage leaves out goes unsaid."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import eyas

from eyas.data.dataset import PreparedDataset
from eyas.stages.evaluate import read_prompts, render_prompts
from eyas.stages.prepare import PrepareConfig, prepare
from eyas.targets.target import load_tokenizer

CALL = {"id": "call_0", "type": "function",
        "function": {"name": "lookup_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "lookup_weather", "parameters": {"type": "object"}}}
]


def _records() -> list[dict]:
    """A tool-calling loop, a reasoning turn and a plain chat, each ending in an answer."""
    q = {"role": "user", "content": "What is the weather in Paris?"}
    return [
        {"id": "tool", "tools": TOOLS, "messages": [
            q, {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."}]},
        {"id": "reasoning", "messages": [
            q, {"role": "assistant", "content": "Sunny, I think.", "reasoning_content": "No tool here."}]},
        {"id": "plain", "messages": [q, {"role": "assistant", "content": "Sunny."}]},
    ]  # fmt: skip


def _write(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_data_made_for_another_tokenizer_is_refused_everywhere(tmp_path, targets, conversations):
    """extract, train and evaluate refuse data prepared with another model's tokenizer: exit
    2, naming both fingerprints and both paths."""
    llama, qwen = targets["llama"], targets["qwen3"]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(conversations.read_text().splitlines(keepends=True)[:16]))
    ds, run = tmp_path / "ds", tmp_path / "run"
    eyas("prepare", "--model", qwen, "--data", src, "--out", ds, check=True)
    qwen_fp = PreparedDataset.open(ds).meta["tokenizer_fingerprint"]
    r = eyas("extract", "--model", llama, "--data", ds, "--out", run)
    assert r.returncode == 2, r.stderr
    assert qwen_fp in r.stderr and str(ds) in r.stderr and str(llama) in r.stderr, r.stderr
    assert not (run / "samples").exists()  # refused before anything was extracted

    # The right pairing, trained and exported; then the target swapped under the drafter.
    eyas("prepare", "--model", llama, "--data", src, "--out", ds, "--force", check=True)
    llama_fp = PreparedDataset.open(ds).meta["tokenizer_fingerprint"]
    eyas("extract", "--model", llama, "--data", ds, "--out", run, check=True)
    eyas("train", "--data", run, "--out", tmp_path / "tr", "--epochs", "1", "--ttt-steps", "2",
         "--batch-tokens", "512", "--lr", "1e-3", check=True)  # fmt: skip
    eyas("export", tmp_path / "tr", "--format", "vllm", "--out", tmp_path / "ex", check=True)
    r = eyas(
        "evaluate", "--model", qwen, "--drafter", tmp_path / "ex", "--data", src, "--limit", "2"
    )
    assert r.returncode == 2 and llama_fp in r.stderr and str(qwen) in r.stderr, r.stderr

    # A run whose dataset was replaced by one made with another tokenizer: train refuses it.
    eyas("prepare", "--model", qwen, "--data", src, "--out", ds, "--force", check=True)
    r = eyas("train", "--data", run, "--out", tmp_path / "tr2", "--epochs", "1", "--batch-tokens", "512",
             "--lr", "1e-3")  # fmt: skip
    assert r.returncode == 2 and qwen_fp in r.stderr and str(llama) in r.stderr, r.stderr


def test_evaluate_prompts_are_the_prefix_training_saw(tmp_path, targets):
    """On a template that renders tools and reasoning (the tiny qwen3's, as Qwen3's), each
    evaluation prompt is token for token what prepare rendered before the answer."""
    model = str(targets["qwen3"])
    recs = _records()
    src = _write(tmp_path / "r.jsonl", recs)
    prepare(PrepareConfig(model=model, data=(str(src),), out=str(tmp_path / "ds"), progress=False))
    ds = PreparedDataset.open(tmp_path / "ds")
    tok = load_tokenizer(model)
    prompts = render_prompts(tok, read_prompts(src, None).prompts)
    assert len(prompts) == len(recs) == len(ds)
    for i, rec in enumerate(recs):
        ids, mask = (a.tolist() for a in ds.sample(i))
        last = max(j for j in range(len(mask)) if mask[j] and (j == 0 or not mask[j - 1]))
        assert prompts[i] == ids[:last], rec["id"]
        assert prompts[i][: min(len(prompts[i]), 10)] == ids[:10]
    text = tok.decode(prompts[0])
    assert "lookup_weather" in text and "<tools>" in text  # the declaration is in the prompt


def test_prepare_counts_what_the_template_drops(tmp_path, targets):
    """A bare template (the tiny llama's) renders no tool calls and no reasoning: prepare
    counts those turns, refuses above --max-error-rate, and writes them down when allowed.
    The qwen3 template renders both: nothing is counted."""
    src = _write(tmp_path / "r.jsonl", _records())
    r = eyas("prepare", "--model", targets["llama"], "--data", src, "--out", tmp_path / "bare")
    assert r.returncode == 1, r.stderr
    assert (
        "does not render 1 assistant turn(s)' reasoning and 1 assistant turn(s)' tool calls"
        in r.stderr
    )
    assert (
        "--allow-dropped-fields" in r.stderr and not (tmp_path / "bare" / "dataset.json").exists()
    )
    r = eyas("prepare", "--model", targets["llama"], "--data", src, "--out", tmp_path / "bare",
             "--allow-dropped-fields")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "assistant turns whose tool calls the chat template does not render" in r.stderr
    counts = PreparedDataset.open(tmp_path / "bare").meta["counts"]
    assert counts["dropped_fields"] == {"reasoning": 1, "tool_calls": 1}
    assert counts["records_with_dropped_fields"] == 2
    r = eyas("prepare", "--model", targets["qwen3"], "--data", src, "--out", tmp_path / "q")
    assert r.returncode == 0 and "does not render" not in r.stderr, r.stderr
    assert PreparedDataset.open(tmp_path / "q").meta["counts"]["dropped_fields"] == {}


def test_turns_and_history_a_template_drops_are_counted_and_named(tmp_path, targets):
    """qwen3's template renders no `developer` turn and drops the reasoning of turns before
    the last user turn: both are counted in dataset.json and named with the way to keep them
    (not refused: the served target sees the conversation the same way); --per-turn-samples
    trains every turn with its reasoning, and then only the developer turn is counted."""
    from eyas.stages.prepare import PrepareConfig, prepare

    dev = {"messages": [{"role": "developer", "content": "Always answer in French."},
                        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "bonjour"}]}  # fmt: skip
    two = {"messages": [{"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "a1", "reasoning_content": "first I think of q1"},
                        {"role": "user", "content": "q2"},
                        {"role": "assistant", "content": "a2", "reasoning_content": "then of q2"}]}  # fmt: skip
    plain = [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}
             for i in range(198)]  # fmt: skip
    src = _write(tmp_path / "r.jsonl", [dev, two, *plain])
    r = eyas("prepare", "--model", targets["qwen3"], "--data", src, "--out", tmp_path / "ds")
    assert r.returncode == 0, r.stderr
    assert "1  developer turns the chat template does not render (in 1 records)" in r.stderr
    assert (
        "earlier assistant turns whose reasoning" in r.stderr and "--per-turn-samples" in r.stderr
    )
    counts = PreparedDataset.open(tmp_path / "ds").meta["counts"]
    assert counts["dropped_fields"] == {"developer": 1, "reasoning_in_history": 1}
    assert counts["records_with_dropped_fields"] == 2
    s = prepare(PrepareConfig(model=str(targets["qwen3"]), data=(str(src),), out=str(tmp_path / "pt"),
                              per_turn_samples=True, progress=False))  # fmt: skip
    assert s.dropped == {"developer": 1}


def test_evaluate_says_what_it_left_out(tmp_path, targets):
    """A record with an unknown role and a cut-off last line are named, counted and, above
    --max-error-rate, refused before any model loads."""
    good = [{"prompt": f"question {i}"} for i in range(28)]
    bad = {"messages": [{"role": "narrator", "content": "once"}, {"role": "user", "content": "hi"}]}
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [*good[:5], bad, *good[5:]])
                   + '{"prompt": "cut of')  # fmt: skip
    got = read_prompts(src, None)
    assert len(got.prompts) == 28 and got.records == 30
    assert got.skipped == {"unknown-role": [6], "incomplete-file": [30]}
    summary = got.summary()
    assert "28 of 30 records used as prompts" in summary and "looks incomplete" in summary
    assert "the file's last line is cut off" in summary and "unknown role" in summary
    (tmp_path / "drafter").mkdir()  # never read: the prompts are refused first
    r = eyas(
        "evaluate", "--model", targets["llama"], "--drafter", tmp_path / "drafter", "--data", src
    )
    assert r.returncode == 1 and "--max-error-rate" in r.stderr and "line 6" in r.stderr, r.stderr
    r = eyas("prepare", "--model", targets["llama"], "--data", src, "--out", tmp_path / "ds",
             "--max-error-rate", "0.1")  # fmt: skip
    errors = [json.loads(x) for x in (tmp_path / "ds" / "errors.jsonl").read_text().splitlines()]
    cut = [e for e in errors if e["line"] == 30]
    assert cut and "looks incomplete" in cut[0]["reason"] and "cut off" in cut[0]["reason"], errors


def test_every_command_names_the_directory_it_was_given(tmp_path, targets, llama_dataset):
    """A prepared dataset given where a run belongs (train), a dataset where a training
    directory belongs (export) or a missing drafter are usage errors (exit 2) that say what
    the directory is and which command reads it; doctor describes a dataset, it does not fail
    it; verify and status of a missing path exit 2 as every other command does."""
    r = eyas("train", "--data", llama_dataset, "--out", tmp_path / "t")
    assert r.returncode == 2 and "is a prepared dataset (made by eyas prepare)" in r.stderr, (
        r.stderr
    )
    assert f"eyas extract --model MODEL --data {llama_dataset}" in r.stderr
    assert not (tmp_path / "t").exists()
    r = eyas("export", llama_dataset, "--format", "vllm", "--out", tmp_path / "ex")
    assert r.returncode == 2 and "not a training directory" in r.stderr, r.stderr
    r = eyas("doctor", llama_dataset)
    assert (
        "dataset" in r.stdout and "eyas extract" in r.stdout and "not a usable run" not in r.stdout
    ), r.stdout
    for cmd in (["verify", tmp_path / "nope"], ["status", tmp_path / "nope"]):
        r = eyas(*cmd)
        assert r.returncode == 2 and "no such" in r.stderr, (cmd, r.stderr)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hello"}) + "\n")
    r = eyas(
        "evaluate",
        "--model",
        targets["llama"],
        "--drafter",
        tmp_path / "nope",
        "--data",
        tmp_path / "p.jsonl",
    )
    assert r.returncode == 2 and "no such exported drafter directory" in r.stderr, r.stderr

"""What a new user hits: input files as people have them, loss masks of templates that
inject text, wrong paths, help text, status after a stop, short runs, file modes."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import eyas, mounted_tmpfs

from eyas.data.dataset import PreparedDataset
from eyas.run.journal import journal_path, read_journal, rewrite_journal
from eyas.run.lock import WriterLock
from eyas.stages.extract import ExtractConfig, extract

CONV = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]


def _prepare(model, lines: list[bytes], tmp_path: Path, *extra) -> tuple:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "ds"
    p = eyas(
        "prepare", "--model", model, "--data", src, "--out", out, "--max-error-rate", "1", *extra
    )
    errors = (
        [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
        if out.exists()
        else []
    )
    return p, out, errors


def test_input_files_as_people_have_them(tmp_path, targets):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 plus 3?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "5"}]}]  # fmt: skip
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
             {"role": "assistant", "content": "a cat"}]  # fmt: skip
    lines = [
        b"\xef\xbb\xbf" + json.dumps({"id": "bom", "messages": CONV}).encode(),  # a byte-order mark
        json.dumps({"id": "parts", "messages": parts}).encode(),
        json.dumps({"id": "image", "messages": image}).encode(),
        json.dumps({"id": "bom", "messages": CONV}).encode(),  # repeats line 1's id
        b'{"id": "u", "messages": [{"role": "user", "content": "\xff"}]}',
        json.dumps({"id": "na", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    ]
    p, out, errors = _prepare(targets["llama"], lines, tmp_path)
    assert p.returncode == 0, p.stderr
    ds = PreparedDataset.open(out)
    assert [r["id"] for r in ds.records] == ["bom", "parts"]
    by_id = {e["line"]: e for e in errors}
    assert "content part 0 is of type 'image_url'" in by_id[3]["reason"]
    assert "line" in by_id[4]["reason"] and f"{tmp_path / 'in.jsonl'}:1" in by_id[4]["reason"]
    assert by_id[5]["code"] == "invalid-utf8" and by_id[6]["code"] == "no-assistant"
    # Readable summary lines, grouped by kind: no digits replaced by N.
    for text in (
        "invalid UTF-8",
        "no assistant turn",
        "a turn's content is not text",
        "id repeats",
    ):
        assert text in p.stderr, (text, p.stderr)
    assert "UTF-N" not in p.stderr and "turn N" not in p.stderr
    # The text parts were joined in order, as a serving engine renders them.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(targets["llama"])
    assert "What is\n2 plus 3?" in tok.decode(ds.sample(1)[0].tolist())


KIMI_LIKE = (
    "{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{%- endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_first_turn_mask_skips_an_injected_system_prompt(tmp_path, targets):
    model = tmp_path / "kimi-like"
    shutil.copytree(targets["qwen3"], model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = KIMI_LIKE
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    reply = {"role": "assistant", "content": "Hello! How can I help?"}
    lines = [json.dumps({"id": "a", "messages": [reply]}).encode(),
             json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}, reply]}).encode()]  # fmt: skip
    p, out, errors = _prepare(model, lines, tmp_path)
    assert p.returncode == 0 and not errors, p.stderr
    ds = PreparedDataset.open(out)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    trained = [tok.decode(ds.sample(i)[0][ds.sample(i)[1].astype(bool)].tolist()) for i in (0, 1)]
    assert trained[0] == trained[1] == "Hello! How can I help?<|im_end|>", trained


def test_wrong_model_paths_are_usage_errors(tmp_path, targets, llama_dataset):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_tok = tmp_path / "no-tok"
    no_tok.mkdir()
    shutil.copy(targets["llama"] / "config.json", no_tok)
    conv = tmp_path / "c.jsonl"
    conv.write_text(json.dumps({"messages": CONV}) + "\n")
    cases = [
        (["prepare", "--model", tmp_path / "nope", "--data", conv, "--out", tmp_path / "o"], "no model directory at"),
        (["prepare", "--model", empty, "--data", conv, "--out", tmp_path / "o"], "has no config.json"),
        (["prepare", "--model", no_tok, "--data", conv, "--out", tmp_path / "o"], "has no tokenizer"),
        (["extract", "--model", tmp_path / "nope", "--data", llama_dataset, "--out", tmp_path / "r"], "no model directory at"),
        (["evaluate", "--model", tmp_path / "nope", "--drafter", tmp_path, "--data", conv], "no model directory at"),
    ]  # fmt: skip
    for args, want in cases:
        p = eyas(*args)
        assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, (
            args,
            p.stderr,
        )
        assert "Repo id" not in p.stderr and "Errno" not in p.stderr


def test_help_text_is_clean():
    for cmd in ("extract", "train", "prepare", "verify", "export", "evaluate"):
        out = eyas(cmd, "--help", env={**os.environ, "COLUMNS": "200"}).stdout
        assert "%%" not in out and "<bool>" not in out, (cmd, out)
    assert (
        "index % world == rank"
        in eyas("extract", "--help", env={**os.environ, "COLUMNS": "200"}).stdout
    )


def test_status_shows_rate_only_while_a_writer_runs(tmp_path, targets, llama_dataset):
    run = tmp_path / "run"
    extract(
        ExtractConfig(
            model=str(targets["llama"]), data=str(llama_dataset), out=str(run), progress=False
        )
    )
    entries = read_journal(journal_path(run, 0))
    now = time.time()
    for k, e in enumerate(entries[:41]):  # a burst of commits just before a stop
        e["t"] = now - 2 + k * 0.01
    rewrite_journal(journal_path(run, 0), entries[:41])
    s = json.loads(eyas("status", run, "--json").stdout)
    assert s["recent_samples_per_s"] is None and s["eta_seconds"] is None  # nobody is writing
    assert "no writer running" in eyas("status", run).stdout
    with WriterLock(run, 0, 1):  # a live writer: 41 commits over the last 5 minutes' window
        s = json.loads(eyas("status", run, "--json").stdout)
    assert s["recent_samples_per_s"] is not None and s["recent_samples_per_s"] < 41 / 1.5


def test_short_runs_warm_up_in_proportion(demo_runs, tmp_path):
    run = demo_runs(60)
    r = eyas("train", "--data", run, "--out", tmp_path / "t", "--epochs", "1", "--lr", "1e-3",
             "--batch-tokens", "1024", "--ttt-steps", "2")  # fmt: skip
    assert r.returncode == 0, r.stderr
    steps = int(r.stderr.split(" optimizer steps")[0].split()[-1])
    assert steps < 20 and f"warmup {max(1, steps // 10)}," in r.stderr  # in proportion, not 50
    assert "will learn little" in r.stderr
    r = eyas("train", "--data", run, "--out", tmp_path / "t2", "--epochs", "1", "--warmup-steps", "500",
             "--batch-tokens", "1024", "--ttt-steps", "2")  # fmt: skip
    assert r.returncode == 0 and "never reaches --lr" in r.stderr
    assert oct(os.stat(tmp_path / "t" / "drafter.safetensors").st_mode & 0o777) != "0o600"


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path, "3m") as mnt:
        yield mnt


def test_small_disk_counts_and_advice_agree(small_tmpfs, targets, llama_dataset):
    run = small_tmpfs / "run"
    base = [
        "extract",
        "--model",
        targets["llama"],
        "--data",
        llama_dataset,
        "--out",
        run,
        "--batch-tokens",
        "4096",
    ]
    p = eyas(*base, "--allow-partial")  # the default floor on 3 MiB is 5% of it, not 1 GiB
    assert p.returncode == 75 and "samples are committed" in p.stderr, p.stderr
    done = int(p.stderr.split("/120 samples are committed")[0].split()[-1])
    p = eyas(*base, "--allow-partial", "--min-free", "0")
    # Not one more sample fits: said before the target loads, with what to free first.
    assert p.returncode == 75 and "no room for even one sample" in p.stderr, p.stderr
    assert "was not loaded" in p.stderr and "loading the target" not in p.stderr
    if "adopted" in p.stderr:  # complete files whose journal entry the full disk cut off
        done += int(p.stderr.split("adopted ")[1].split()[0])
    v = json.loads(eyas("verify", run, "--json").stdout)
    assert v["clean"] and v["checked"] + v["unjournaled"] == done > 0, (v, p.stderr)
    d = json.loads(eyas("doctor", run, "--json").stdout)
    assert not any(
        "verify --repair" in (s["command"] or "") for s in d["plan"]
    )  # nothing to quarantine


def test_train_refuses_a_partial_run(tmp_path, targets, llama_dataset):
    """A run whose writer died part-way is not trained on by accident: refused with the
    resume command; --allow-partial trains on what is committed."""
    run = tmp_path / "run"
    extract(ExtractConfig(model=str(targets["llama"]), data=str(llama_dataset), out=str(run), rank=0, world=2,
                          progress=False))  # fmt: skip
    args = ["train", "--data", run, "--epochs", "1", "--ttt-steps", "1"]
    r = eyas(*args, "--out", tmp_path / "t")
    assert r.returncode == 2 and "extraction is not finished" in r.stderr, r.stderr
    assert f"eyas extract --resume {run}" in r.stderr and "--allow-partial" in r.stderr
    assert "60/120" in r.stderr and not (tmp_path / "t").exists()
    assert "chosen for" not in r.stderr  # nothing chosen for a training that does not start
    r = eyas(*args, "--out", tmp_path / "t", "--allow-partial")
    assert r.returncode == 0, r.stderr


def test_prepare_refuses_to_replace_a_dataset_and_a_lost_one_is_rebuilt(
    tmp_path, targets, conversations
):
    ds, run = tmp_path / "ds", tmp_path / "run"
    prep = [
        "prepare",
        "--model",
        targets["llama"],
        "--data",
        conversations,
        "--out",
        ds,
        "--max-length",
        "200",
    ]
    assert eyas(*prep).returncode == 0
    p = eyas(
        "prepare",
        "--model",
        targets["llama"],
        "--data",
        conversations,
        "--out",
        ds,
        "--max-length",
        "100",
    )
    assert (
        p.returncode == 2  # a usage error, as into a run directory
        and "already holds a prepared dataset" in p.stderr
        and "--force" in p.stderr
    )
    extract(
        ExtractConfig(
            model=str(targets["llama"]), data=str(ds), out=str(run), rank=0, world=2, progress=False
        )
    )
    shutil.rmtree(ds)
    # Both say exactly how to rebuild it: the same inputs give the same fingerprint.
    r = eyas("extract", "--resume", run)
    assert r.returncode == 2 and "is gone" in r.stderr and "eyas prepare --model" in r.stderr, (
        r.stderr
    )
    plan = json.loads(eyas("doctor", run, "--json").stdout)["plan"]
    cmd = next(a["command"] for a in plan if a["command"] and "eyas prepare" in a["command"])
    assert "--max-length 200" in cmd and str(conversations) in cmd
    args = cmd.replace(" --force", "").split()[1:]  # run it as printed
    assert eyas(*args).returncode == 0
    r = eyas("extract", "--resume", run)
    assert r.returncode == 0 and "extracted 60 samples" in r.stderr, r.stderr


def test_doctor_says_what_it_did_not_read_and_status_says_what_next(
    tmp_path, targets, llama_dataset
):
    from eyas.run.store import sample_relpath

    run = tmp_path / "run"
    extract(
        ExtractConfig(
            model=str(targets["llama"]), data=str(llama_dataset), out=str(run), progress=False
        )
    )
    f = run / sample_relpath(7)
    b = bytearray(f.read_bytes())
    b[-50] ^= 0x01  # one flipped byte inside a tensor's data
    f.write_bytes(bytes(b))
    d = eyas("doctor", run)
    assert (
        "their data was not read" in d.stdout and "eyas verify" in d.stdout and "MB/s" in d.stdout
    ), d.stdout
    plan = json.loads(eyas("doctor", run, "--json").stdout)["plan"]
    assert any(a["command"] == f"eyas verify {run}" for a in plan)
    assert eyas("verify", run).returncode == 1  # what the plan's command finds
    st = eyas("status", run).stdout
    assert "next       eyas train --data" in st
    journal = journal_path(run, 0)
    rewrite_journal(journal, read_journal(journal)[:100])
    st = eyas("status", run).stdout
    assert f"next       eyas extract --resume {run}" in st and "eyas doctor" in st


def test_estimate_small_runs_in_readable_units():
    p = eyas("estimate", "--samples", "10", "--tokens-per-sample", "100", "--hidden-size", "64",
             "--store-dtype", "bfloat16")  # fmt: skip
    assert p.returncode == 0 and "0.00 TB" not in p.stdout and " kB)" in p.stdout, p.stdout


def test_estimate_states_the_training_memory_of_the_heads_logits():
    """At Kimi-K2.5's vocabulary (163,840, the whole of it drafted) and 8,192-token batches:
    one float32 (tokens, vocabulary) tensor is 5 GiB; in parts a step holds that and one
    part's few tensors, far below the whole head's (bench/head_memory.py measures both)."""
    p = eyas("estimate", "--samples", "10", "--tokens-per-sample", "100", "--hidden-size", "7168",
             "--draft-vocab-size", "163840", "--batch-tokens", "8192")  # fmt: skip
    assert p.returncode == 0, p.stderr
    line = p.stdout.splitlines()[-1]
    assert "--batch-tokens 8,192, draft vocabulary 163,840" in line and "is 5.0 GiB" in line, line
    assert "about 11.0 GiB of logits" in line and "about 50.0 GiB for EAGLE-3" in line, line


def test_long_silent_work_says_it_goes_on(capsys, monkeypatch):
    """A model load or a first step of minutes prints a line every interval, and none after."""
    from eyas.host.ui import still_working

    monkeypatch.delenv("EYAS_LOG_EVERY", raising=False)
    seen = ""
    with still_working("loading the target", every=0.01):
        deadline = time.monotonic() + 120
        while seen.count("... loading the target: ") < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
            seen += capsys.readouterr().err
    assert seen.count("... loading the target: ") >= 2 and "so far" in seen
    capsys.readouterr()
    time.sleep(0.05)
    assert capsys.readouterr().err == ""  # it ends with the work
    with still_working("nothing", every=0.01, enabled=False):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""

"""A base target (a tokenizer without a chat template) through the whole pipeline, from the
command line as a new user runs it: conversations refused once and up front with the two
ways out, plain text and `--chat-template FILE` prepared, extracted, trained (both kinds),
exported and evaluated, and a template that is not the data's refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import eyas

TEMPLATE = (
    "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|begin_of_text|>assistant: {% endif %}"
)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("base")
    eyas("tiny-target", "--out", d / "target", "--base", "--layers", "4", check=True)
    chats = [{"messages": [{"role": "user", "content": f"question {i} about the sea"},
                           {"role": "assistant", "content": f"answer {i}: it is wide and deep."}]}
             for i in range(24)]  # fmt: skip
    texts = [{"text": f"def f{i}(x):\n    return x * {i} + 1\n"} for i in range(24)]
    (d / "chat.jinja").write_text(TEMPLATE)
    return {
        "dir": d,
        "target": d / "target",
        "template": d / "chat.jinja",
        "chats": _jsonl(d / "chats.jsonl", chats),
        "texts": _jsonl(d / "texts.jsonl", texts),
        "chat_prompts": _jsonl(
            d / "cp.jsonl", [{"messages": c["messages"][:1]} for c in chats[:4]]
        ),
        "text_prompts": _jsonl(d / "tp.jsonl", [*texts[:3], {"prompt": "def g(y):"}]),
    }


def test_tiny_base_twin_has_no_chat_template(base):
    from eyas.targets.target import load_tokenizer

    assert not load_tokenizer(str(base["target"])).chat_template


def test_conversations_refused_once_up_front(base):
    out = base["dir"] / "refused"
    p = eyas("prepare", "--model", base["target"], "--data", base["chats"], "--out", out)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "has no chat template" in lines[0] and "24 of 24 records" in lines[0]
    assert '{"text": ...}' in lines[0] and "--chat-template FILE" in lines[0]
    assert not (out / "dataset.json").exists() and not (out / "errors.jsonl").exists()


def test_missing_template_file_is_a_usage_error(base):
    p = eyas("prepare", "--model", base["target"], "--data", base["chats"],
             "--out", base["dir"] / "nofile", "--chat-template", base["dir"] / "absent.jinja")  # fmt: skip
    assert p.returncode == 2 and "--chat-template" in p.stderr and "no such file" in p.stderr


def _pipeline(base, name: str, data: Path, kind: str, *prepare_opts) -> Path:
    d = base["dir"]
    eyas("prepare", "--model", base["target"], "--data", data, "--out", d / f"ds-{name}",
         *prepare_opts, check=True)  # fmt: skip
    eyas("extract", "--model", base["target"], "--data", d / f"ds-{name}", "--out", d / f"run-{name}",
         check=True)  # fmt: skip
    eyas("train", "--data", d / f"run-{name}", "--out", d / f"tr-{name}", "--kind", kind,
         "--epochs", "1", check=True)  # fmt: skip
    eyas("export", d / f"tr-{name}", "--out", d / f"ex-{name}", "--format", "vllm", check=True)
    return d / f"ex-{name}"


def test_chat_template_file_end_to_end(base):
    export = _pipeline(base, "tpl", base["chats"], "eagle3", "--chat-template", base["template"])
    ds = json.loads((base["dir"] / "ds-tpl" / "dataset.json").read_text())
    assert ds["chat_template"] == TEMPLATE
    rendering = json.loads((export / "eyas-manifest.json").read_text())["rendering"]
    assert rendering["chat_template"] == TEMPLATE
    # The engine must render prompts with it too: the export carries it and its line names it.
    assert (export / "chat_template.jinja").read_text() == TEMPLATE
    assert f"--chat-template {export / 'chat_template.jinja'}" in (export / "README.md").read_text()
    p = eyas("evaluate", "--model", base["target"], "--drafter", export, "--data",
             base["chat_prompts"], "--max-new-tokens", "6", "--json")  # fmt: skip
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["prompts"] == 4 and res["lossless"] and res["inputs"]["raw_text"] == 0
    # Another template than the data's is another rendering: refused before the model loads.
    other = base["dir"] / "other.jinja"
    other.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    p = eyas("evaluate", "--model", base["target"], "--drafter", export, "--data",
             base["chat_prompts"], "--chat-template", other)  # fmt: skip
    assert p.returncode == 2 and "another tokenizer or chat template" in p.stderr


@pytest.fixture(scope="module")
def text_export(base) -> Path:
    return _pipeline(base, "text", base["texts"], "dflash")


def test_plain_text_end_to_end_with_text_prompts(base, text_export):
    export = text_export
    p = eyas("evaluate", "--model", base["target"], "--drafter", export, "--data",
             base["text_prompts"], "--max-new-tokens", "6")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "4 of 4 prompts are raw text" in p.stdout and "lossless: yes" in p.stdout
    p = eyas("evaluate", "--model", base["target"], "--drafter", export, "--data",
             base["chat_prompts"])  # fmt: skip
    assert p.returncode == 2 and "has no chat template" in p.stderr and "4 of 4" in p.stderr


def test_text_prompt_tokens_match_prepared_text(base, tmp_path):
    """A text record prepared for training and the same text given as a prompt are the same
    token ids: the drafter is judged on what it was trained on."""
    from eyas.data.dataset import PreparedDataset
    from eyas.stages.evaluate import read_prompts, render_prompts
    from eyas.stages.prepare import PrepareConfig, prepare
    from eyas.targets.target import load_tokenizer

    data = _jsonl(tmp_path / "t.jsonl", [{"text": "  héllo <|eot_id|> wörld\n\n\tx = 1  "},
                                         {"text": "<|begin_of_text|>def f():\n  return 2"}])  # fmt: skip
    prepare(PrepareConfig(model=str(base["target"]), data=(str(data),), out=str(tmp_path / "ds"),
                          progress=False))  # fmt: skip
    ds = PreparedDataset.open(tmp_path / "ds")
    tok = load_tokenizer(str(base["target"]))
    prompts = render_prompts(tok, read_prompts(data, None).prompts)
    assert [list(map(int, ds.sample(i)[0])) for i in range(len(ds))] == prompts


def test_one_exit_code_rule_for_what_was_made_for_something_else(base, text_export, targets):
    """Data, a run or a directory made with another target or config is a usage error
    (exit 2) at every stage, said in one line; so is a path that is no eyas directory."""
    d = base["dir"]
    eyas("prepare", "--model", base["target"], "--data", base["texts"], "--out", d / "ds-short",
         "--max-length", "8", check=True)  # fmt: skip
    cases = {
        "prepare into an existing dataset": ("prepare", "--model", base["target"], "--data", base["texts"],
                                             "--out", d / "ds-text"),
        "extract into a run of another config": ("extract", "--model", base["target"], "--data", d / "ds-short",
                                                 "--out", d / "run-text"),
        "train with another target": ("train", "--data", d / "run-text", "--out", d / "tr-other",
                                      "--model", targets["llama"]),
        "train into a training of another config": ("train", "--data", d / "run-text", "--out", d / "tr-text",
                                                   "--epochs", "2"),
        "evaluate with another target": ("evaluate", "--model", targets["llama"], "--drafter", text_export,
                                         "--data", base["text_prompts"]),
        "status of a missing path": ("status", d / "nothing-here"),
        "export of a dataset": ("export", d / "ds-text", "--format", "vllm", "--out", d / "x"),
    }  # fmt: skip
    for what, args in cases.items():
        p = eyas(*args)
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert p.returncode == 2 and len(lines) == 1, (what, p.returncode, p.stdout, p.stderr)

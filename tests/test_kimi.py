"""The reference target's shape: a tiny Kimi-K2.5 twin (transformers' own wrapper class, a
DeepSeek-V3 language model under the hub's weight names, a tiny vision tower, Kimi's special
tokens and a chat template in Kimi's manner), through every stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import eyas
from transformers import AutoTokenizer

from eyas.data.dataset import PreparedDataset
from eyas.demo_target.data import generate_conversations
from eyas.demo_target.tiny import build_tiny_target

CALL = {"id": "functions.add:0", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
# SGLang's EAGLE-3 model has none of the drafter's three norms: a drafter exported for it too
SGLANG_READY = ("--no-norm-before-fc", "--no-norm-before-residual", "--no-norm-output")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return build_tiny_target(tmp_path_factory.mktemp("kimi") / "twin", "kimi_k25")


def _records() -> list[dict]:
    """Kimi-style conversations: reasoning on some turns, a tool-call loop with a tool turn
    and per-record tools, a turn with tool calls and no text, plain chats."""
    recs = []
    for i, c in enumerate(generate_conversations(30, seed=5)):
        msgs = c["messages"]
        if i % 2 == 0:
            [a for a in msgs if a["role"] == "assistant"][-1]["reasoning_content"] = f"thinking {i}"
        rec = {"id": f"c{i}", "messages": msgs}
        if i % 3 == 0:
            user = next(m for m in msgs if m["role"] == "user")
            rec = {"id": f"t{i}", "tools": TOOLS, "messages": [
                user,
                {"role": "assistant", "content": "", "reasoning_content": "call add", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": CALL["id"], "content": "3"},
                {"role": "assistant", "content": "It is 3.", "reasoning": "the tool said 3"},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "Welcome.", "reasoning_content": "be polite"},
            ]}  # fmt: skip
        recs.append(rec)
    return recs


def _expected_turn(m: dict, keeps_reasoning: bool) -> str:
    """What an assistant turn renders in Kimi's format, written out independently."""
    think = (m.get("reasoning_content") or m.get("reasoning") or "") if keeps_reasoning else ""
    calls = ""
    if m.get("tool_calls"):
        calls = "<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>{c['id']}<|tool_call_argument_begin|>{c['function']['arguments']}<|tool_call_end|>"
            for c in m["tool_calls"]
        ) + "<|tool_calls_section_end|>"  # fmt: skip
    return f"<think>{think}</think>{m['content']}{calls}<|im_end|>"


def _trained(tok, ds: PreparedDataset, i: int) -> list[str]:
    x, m = ds.sample(i)
    segs, cur = [], []
    for t, b in zip(x.tolist(), m.tolist(), strict=True):
        if b:
            cur.append(t)
        elif cur:
            segs.append(cur)
            cur = []
    if cur:
        segs.append(cur)
    return [tok.decode(s) for s in segs]


def test_twin_has_the_hub_shape(kimi):
    from eyas.targets.weights import weight_map

    cfg = json.loads((kimi / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == [
        "KimiK25ForConditionalGeneration"
    ]
    assert cfg["text_config"]["model_type"] == "deepseek_v3" and "vision_config" in cfg
    names = set(weight_map(kimi))
    for want in ("language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
                 "language_model.lm_head.weight", "language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):  # fmt: skip
        assert want in names, want
    assert any(n.startswith("vision_tower.") for n in names)
    assert not any(n.startswith("language_model.model.blocks.") for n in names)


def test_prepare_trains_reasoning_and_tool_calls(kimi, tmp_path):
    src = tmp_path / "kimi.jsonl"
    recs = _records()
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = eyas("prepare", "--model", kimi, "--data", src, "--out", tmp_path / "ds")
    assert r.returncode == 0 and "0 failed" in r.stderr, r.stderr
    tok = AutoTokenizer.from_pretrained(kimi)
    ds = PreparedDataset.open(tmp_path / "ds")
    assert len(ds) == len(recs)
    for i, rec in enumerate(recs):
        msgs = rec["messages"]
        last_user = max(j for j, m in enumerate(msgs) if m["role"] == "user")
        want = [
            _expected_turn(m, j > last_user) for j, m in enumerate(msgs) if m["role"] == "assistant"
        ]
        assert _trained(tok, ds, i) == want, rec["id"]
    # One sample per assistant turn: every turn's reasoning, as the target produced it.
    r = eyas("prepare", "--model", kimi, "--data", src, "--out", tmp_path / "per-turn", "--per-turn-samples",
             "--chat-template-kwargs", '{"thinking": true}')  # fmt: skip
    assert r.returncode == 0, r.stderr
    per = PreparedDataset.open(tmp_path / "per-turn")
    assert per.meta["config"]["chat_template_kwargs"] == {"thinking": True}
    turns = {per.records[i]["id"]: _trained(tok, per, i) for i in range(len(per))}
    t0 = turns["t0/turn-1"]
    assert t0 == [_expected_turn(recs[0]["messages"][1], True)] and "call add" in t0[0]
    assert turns["t0/turn-3"] == ["<think>the tool said 3</think>It is 3.<|im_end|>"]
    # Thinking off: the generation prompt holds an empty think block; turns train without one.
    r = eyas("prepare", "--model", kimi, "--data", src, "--out", tmp_path / "off",
             "--chat-template-kwargs", '{"thinking": false}')  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_a_turn_the_mask_cannot_place_is_an_error(kimi, tmp_path):
    """A template that renders an earlier turn as something the record does not say."""
    bad = shutil.copytree(kimi, tmp_path / "bad")
    tc = json.loads((bad / "tokenizer_config.json").read_text())
    template = (
        (bad / "chat_template.jinja").read_text()
        if (bad / "chat_template.jinja").exists()
        else tc["chat_template"]
    )
    template = template.replace(
        "{{ m['content'] or '' }}", "{{ (m['content'] or '') if loop.last else 'elided' }}"
    )
    (bad / "chat_template.jinja").write_text(template)
    tc.pop("chat_template", None)
    (bad / "tokenizer_config.json").write_text(json.dumps(tc))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "x", "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "b"}, {"role": "assistant", "content": "second"}]}) + "\n")  # fmt: skip
    r = eyas(
        "prepare", "--model", bad, "--data", src, "--out", tmp_path / "ds", "--max-error-rate", "1"
    )
    errors = [json.loads(x) for x in (tmp_path / "ds" / "errors.jsonl").read_text().splitlines()]
    assert errors and errors[0]["id"] == "x" and "assistant turn 1" in errors[0]["reason"], (
        r.stderr,
        errors,
    )


def test_extract_train_export_evaluate_on_the_twin(kimi, tmp_path):
    from transformers import AutoModelForImageTextToText

    from eyas.run.store import load_sample

    src = tmp_path / "kimi.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    ds, run = tmp_path / "ds", tmp_path / "run"
    assert eyas("prepare", "--model", kimi, "--data", src, "--out", ds).returncode == 0
    r = eyas("extract", "--model", kimi, "--data", ds, "--out", run)
    assert r.returncode == 0, r.stderr
    # The stored states equal the wrapper's own language-model forward.
    wrapper = AutoModelForImageTextToText.from_pretrained(kimi, dtype=torch.float32).eval()
    meta = json.loads((run / "run.json").read_text())
    for i in (0, 3):
        s = load_sample(run, i, verify=True)
        ids = s["input_ids"].long()[None]
        with torch.no_grad():
            hs = wrapper.model.language_model(
                input_ids=ids, output_hidden_states=True
            ).hidden_states
        want_aux = torch.cat([hs[k] for k in meta["aux_layers_hf"]], -1)[0]
        assert torch.allclose(s["aux_hidden_states"].float(), want_aux, atol=1e-5)
        assert torch.allclose(s["last_hidden_states"].float(), hs[-1][0], atol=1e-5)
    assert eyas("verify", run).returncode == 0
    tr = tmp_path / "train"
    r = eyas(
        "train",
        "--data",
        run,
        "--out",
        tr,
        "--epochs",
        "1",
        "--ttt-steps",
        "2",
        "--batch-tokens",
        "4096",
        "--head-init",
        "target",
        *SGLANG_READY,
    )
    assert r.returncode == 0, r.stderr
    # The drafter's head started from the wrapper's lm_head rows (language_model.lm_head).
    assert json.loads((tr / "train.json").read_text())["config"]["head_init"] == "target"
    for fmt in ("vllm", "sglang"):
        r = eyas("export", tr, "--format", fmt, "--out", tmp_path / fmt)
        assert r.returncode == 0, r.stderr
    vcfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert vcfg["eagle_aux_hidden_state_layer_ids"] == meta["aux_layers_hf"]
    assert vcfg["target_hidden_size"] == meta["hidden_size"] == 64
    assert vcfg["transformer_layer_config"]["vocab_size"] == meta["vocab_size"]
    r = eyas("evaluate", "--model", kimi, "--drafter", tmp_path / "sglang", "--data", src, "--limit", "4",
             "--max-new-tokens", "16", "--json")  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["lossless"], r.stderr


def test_61_layer_kimi_config_like_and_export_ids(kimi, tmp_path):
    """A real-sized Kimi-K2.5 config (no weights): sizes come from the text part, the aux ids
    are [2, 30, 58] for vLLM and [1, 29, 57] for SGLang, and `tiny-target --like` makes a twin
    of the same shape, saying that it leaves the quantization config out."""
    from eyas.drafters.eagle3.kind import KIND
    from eyas.drafters.eagle3.model import DrafterConfig
    from eyas.drafters.formats import format_named
    from eyas.targets.target import default_aux_layers, target_facts

    real = tmp_path / "Kimi-K2.5"
    real.mkdir()
    for f in kimi.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, real / f.name)
    from eyas.targets.weights import weight_map as names_of

    # The real checkpoint's index (names only; 61 layers' worth of the twin's names).
    real_names = {n.replace("layers.0.", f"layers.{k}."): "model-00001-of-00064.safetensors"
                  for n in names_of(kimi) for k in range(61)}  # fmt: skip
    (real / "model.safetensors.index.json").write_text(json.dumps({"weight_map": real_names}))
    cfg = json.loads((real / "config.json").read_text())
    cfg["text_config"].update(num_hidden_layers=61, hidden_size=7168, vocab_size=163840, tie_word_embeddings=False,
                              routed_scaling_factor=2.827, quantization_config={
                                  "quant_method": "compressed-tensors", "format": "pack-quantized"})  # fmt: skip
    (real / "config.json").write_text(json.dumps(cfg))
    f = target_facts(real)
    assert (f.num_hidden_layers, f.hidden_size, f.vocab_size) == (61, 7168, 163840)
    aux = list(default_aux_layers(61))
    c = DrafterConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64,
                      head_dim=112, vocab_size=163840, draft_vocab_size=32000)  # fmt: skip
    target = {"path": "moonshotai/Kimi-K2.5", "architectures": cfg["architectures"]}

    def export_config(fmt: str) -> dict:
        return KIND.serving[format_named(fmt)].writer.config(c, aux, target, "bfloat16", 3)

    assert export_config("vllm")["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert export_config("sglang")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1,
        29,
        57,
    ]
    # extract on the quantized checkpoint points to the vLLM backend, in one line.
    r = eyas("tiny-target", "--like", real, "--out", tmp_path / "twin")
    assert r.returncode == 0, r.stderr
    assert "leaves out" in r.stdout + r.stderr and "compressed-tensors" in r.stdout + r.stderr
    assert "weight names are all in" in r.stdout, r.stdout  # checked against the real index
    twin = json.loads((tmp_path / "twin" / "config.json").read_text())
    assert twin["model_type"] == "kimi_k25" and twin["architectures"] == cfg["architectures"]
    assert (
        twin["text_config"]["num_hidden_layers"] == 8
        and "quantization_config" not in twin["text_config"]
    )
    assert twin["text_config"]["routed_scaling_factor"] == 2.827
    from eyas.targets.weights import weight_map

    assert "language_model.model.layers.0.input_layernorm.weight" in weight_map(tmp_path / "twin")


def test_quantized_untied_and_unknown_targets_are_one_line(kimi, tmp_path, conversations):
    from eyas.targets.weights import lm_head_weight

    # An untied target whose head cannot be found is an error, never the embeddings.
    headless = shutil.copytree(kimi, tmp_path / "headless")
    from safetensors.torch import load_file, save_file

    st = load_file(str(headless / "model.safetensors"))
    del st["language_model.lm_head.weight"]
    save_file(st, str(headless / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match="tie_word_embeddings is false"):
        lm_head_weight(headless)
    # A quantized checkpoint on a machine transformers cannot run it on: use --backend vllm.
    q = shutil.copytree(kimi, tmp_path / "q")
    cfg = json.loads((q / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
    }
    (q / "config.json").write_text(json.dumps(cfg))
    src = tmp_path / "c.jsonl"
    src.write_text("".join(conversations.read_text().splitlines(keepends=True)[:5]))
    assert eyas("prepare", "--model", kimi, "--data", src, "--out", tmp_path / "ds").returncode == 0
    r = eyas("extract", "--model", q, "--data", tmp_path / "ds", "--out", tmp_path / "run")
    if not torch.cuda.is_available():
        assert (
            r.returncode == 2
            and "--backend vllm" in r.stderr
            and len(r.stderr.strip().splitlines()) <= 3
        ), r.stderr
        assert "Traceback" not in r.stderr
    # An architecture eyas cannot run: one line naming it, exit 2.
    odd = shutil.copytree(kimi, tmp_path / "odd")
    cfg = json.loads((odd / "config.json").read_text())
    cfg = {"model_type": "clip_vision_model", "architectures": ["CLIPVisionModel"], "hidden_size": 64,
           "num_hidden_layers": 8, "vocab_size": 10, "num_attention_heads": 4, "intermediate_size": 64}  # fmt: skip
    (odd / "config.json").write_text(json.dumps(cfg))
    r = eyas("extract", "--model", odd, "--data", tmp_path / "ds", "--out", tmp_path / "run2")
    assert r.returncode == 2 and "CLIPVisionModel" in r.stderr and "Traceback" not in r.stderr, (
        r.stderr
    )
    assert len(r.stderr.strip().splitlines()) <= 4


def test_vllm_states_of_wrong_shape_fail_the_sample(kimi):
    """The vLLM backend checks, per sample, that the engine returned exactly the layers and
    width asked for (some vLLM versions drop the last layer of DeepSeek/Kimi backbones): such
    a sample fails with the cause named. vLLM itself is not needed to check the check."""
    import numpy as np

    from eyas.run.store import Layout
    from eyas.targets.backends import BackendSpec, StateShaper
    from eyas.targets.backends.vllm import VLLMBackend
    from eyas.targets.target import target_facts
    from eyas.targets.weights import final_norm_weight

    b = VLLMBackend.__new__(VLLMBackend)  # the engine is not started: only the check runs
    b.facts = target_facts(kimi)
    n, aux = b.facts.num_hidden_layers, (1, 3, 4)
    wanted = [i + 1 for i in aux] + [n]
    b.layer_ids = sorted(set(wanted))
    b.columns = [b.layer_ids.index(k) for k in wanted]
    b.spec = BackendSpec(model=str(kimi), aux_layers=aux, device="cpu", dtype=torch.float32,
                         store_dtype=torch.float32, layout=Layout())  # fmt: skip
    b.norm_weight = final_norm_weight(kimi).float()
    b.shape = StateShaper(b.spec)
    ids = np.arange(5)
    hs = torch.randn(5, len(b.layer_ids), b.facts.hidden_size)
    assert isinstance(b.states_of(ids, torch.tensor(ids), hs), dict)
    why = b.states_of(ids, torch.tensor(ids), hs[:, :-1])  # the final layer dropped
    assert isinstance(why, str) and "46973" in why and "(5, 3, 64)" in why


@pytest.mark.slow  # the long loop; CI runs it (python -m pytest -m slow)
def test_the_readme_rehearsal_runs_as_written(tmp_path):
    """The Kimi-K2.5 rehearsal of docs/scale.md, every command as printed, on the shipped data."""
    import shlex
    import shutil as sh

    readme = (Path(__file__).parents[1] / "docs" / "scale.md").read_text()
    block = (
        readme.split("Rehearse on a twin first", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    )
    sh.copytree(Path(__file__).parents[1] / "examples", tmp_path / "examples")
    cmds = [c for line in block.splitlines() if line.strip() for c in line.split(" && ")]
    assert len(cmds) == 6 and all(c.startswith("eyas ") for c in cmds)
    for c in cmds:
        args = shlex.split(c)[1:]
        r = eyas(*args, cwd=tmp_path, timeout=600)
        assert r.returncode == 0, (c, r.stderr[-2000:])
    ds = json.loads((tmp_path / "twin-ds" / "dataset.json").read_text())
    assert ds["counts"]["failed"] == 0 and ds["counts"]["samples"] > ds["counts"]["records"] == 20

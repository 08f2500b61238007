"""tiny-target: real architectures load offline; --like keeps tokenizer, template and family."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import eyas
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eyas.targets.target import default_aux_layers


@pytest.mark.parametrize(
    "arch,cls",
    [
        ("llama", "LlamaForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("deepseek_v3", "DeepseekV3ForCausalLM"),
    ],
)
def test_tiny_targets_load_offline(targets, arch, cls):
    m = AutoModelForCausalLM.from_pretrained(targets[arch], local_files_only=True)
    tok = AutoTokenizer.from_pretrained(targets[arch], local_files_only=True)
    assert type(m).__name__ == cls and m.dtype == torch.float32
    assert tok.chat_template
    n = m.config.num_hidden_layers
    assert n >= 8 and len(set(default_aux_layers(n))) == 3
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    assert m(ids).logits.shape == (1, ids.shape[1], len(tok))
    if arch == "deepseek_v3":  # MLA + MoE, the Kimi-K2 family
        assert m.config.kv_lora_rank and m.config.n_routed_experts > 1


def _config_and_tokenizer_only(src, dst, **config_changes):
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("layer_types", None)  # derived from the layer count; a real config lists one per layer
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_like_scales_down_a_real_sized_config(tmp_path, targets):
    # A Qwen2-7B-sized config with our ChatML tokenizer and no weights at all.
    like = _config_and_tokenizer_only(
        targets["qwen3"], tmp_path / "qwen2-7b-like", model_type="qwen2", architectures=["Qwen2ForCausalLM"],
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128,
    )  # fmt: skip
    out = tmp_path / "tiny"
    p = eyas("tiny-target", "--like", like, "--out", out, "--layers", "10", "--hidden-size", "32")
    assert p.returncode == 0, p.stderr
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "qwen2" and cfg.num_hidden_layers == 10 and cfg.hidden_size == 32
    tok, ref = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(like)
    assert tok.chat_template == ref.chat_template and tok.get_vocab() == ref.get_vocab()
    AutoModelForCausalLM.from_pretrained(out)


def test_like_deepseek_keeps_mla_moe(tmp_path, targets):
    like = _config_and_tokenizer_only(
        targets["deepseek_v3"], tmp_path / "ds-like", hidden_size=7168, num_hidden_layers=61,
        routed_scaling_factor=2.827, max_position_embeddings=131072,
    )  # fmt: skip
    out = tmp_path / "tiny"
    assert eyas("tiny-target", "--like", like, "--out", out).returncode == 0
    m = AutoModelForCausalLM.from_pretrained(out)
    assert type(m).__name__ == "DeepseekV3ForCausalLM" and m.config.hidden_size == 64
    # What does not set the size is kept as the real model has it.
    assert m.config.routed_scaling_factor == 2.827 and m.config.max_position_embeddings == 131072


def test_bad_arch_and_missing_like(tmp_path):
    p = eyas("tiny-target", "--arch", "gpt9", "--out", tmp_path / "x")
    assert p.returncode == 2 and "gpt9" in p.stderr
    p = eyas("tiny-target", "--like", tmp_path / "nothing", "--out", tmp_path / "x")
    assert p.returncode == 2 and "config.json" in p.stderr

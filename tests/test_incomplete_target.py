"""A target whose checkpoint does not fill the model is refused: a tensor left at its random
initialisation gives states no checksum can tell from real ones. One line naming the first
missing tensors, exit 2, nothing written; a wrapper saved under transformers' own names loads
whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import eyas
from safetensors.torch import load_file, save_file

from eyas.targets.target import ModelDirError, load_causal_lm
from eyas.targets.weights import weight_map


def _without(src: Path, dest: Path, drop) -> Path:
    shutil.copytree(src, dest)
    f = dest / "model.safetensors"
    tensors = load_file(str(f))
    gone = [k for k in tensors if drop(k)]
    assert gone, "the test removes at least one tensor"
    save_file(
        {k: v for k, v in tensors.items() if k not in gone}, str(f), metadata={"format": "pt"}
    )
    return dest


def test_a_checkpoint_missing_one_tensor_is_refused(tmp_path, targets, llama_dataset):
    model = _without(
        targets["llama"], tmp_path / "model", lambda k: k == "model.layers.0.mlp.up_proj.weight"
    )
    run = tmp_path / "run"
    p = eyas("extract", "--model", model, "--data", llama_dataset, "--out", run)
    assert p.returncode == 2, p.stdout + p.stderr
    err = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "model.layers.0.mlp.up_proj.weight" in err[0], p.stderr
    assert not run.exists(), "a refused target leaves no run behind"
    # A directory the user made beforehand keeps only what was there.
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    p = eyas("extract", "--model", model, "--data", llama_dataset, "--out", run)
    assert p.returncode == 2
    assert sorted(x.name for x in run.iterdir()) == ["notes.txt"]


def test_evaluate_refuses_it_too(tmp_path, targets):
    model = _without(targets["llama"], tmp_path / "model", lambda k: k == "model.norm.weight")
    with pytest.raises(ModelDirError, match="model.norm.weight"):
        load_causal_lm(model, torch.float32)


def test_a_wrapper_with_layers_under_unknown_names_is_refused_before_loading(tmp_path):
    """Every decoder layer renamed away: the headers alone show it, before the model loads."""
    from eyas.demo_target.tiny import build_tiny_target
    from eyas.targets.target import check_layers_present

    src = build_tiny_target(tmp_path / "kimi", "kimi_k25")
    f = src / "model.safetensors"
    tensors = load_file(str(f))
    save_file({k.replace(".layers.", ".decoder.") if k.startswith("language_model.") else k: v
               for k, v in tensors.items()}, str(f), metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ModelDirError, match=r"model\.layers\.0"):
        check_layers_present(src)


def test_a_wrapper_saved_by_transformers_loads_whole(tmp_path, monkeypatch):
    """transformers' Kimi-K2.5 class saves its decoder layers as `language_model.model.blocks.N`
    (its conversion renames the vision tower's blocks, and undoing it on save catches the
    language model's layers too): every tensor loads, and the states equal the hub layout's."""
    import eyas.demo_target.tiny as tiny

    hub = tiny.build_tiny_target(tmp_path / "hub", "kimi_k25")
    monkeypatch.setattr(tiny, "_as_on_the_hub", lambda *a, **k: None)
    saved = tiny.build_tiny_target(tmp_path / "saved", "kimi_k25")
    assert any(".blocks." in k and k.startswith("language_model.") for k in weight_map(saved))
    ids = torch.tensor([[1, 5, 9, 13, 21]])
    with torch.no_grad():
        a = load_causal_lm(hub, torch.float32)(ids).logits
        b = load_causal_lm(saved, torch.float32)(ids).logits
    assert torch.equal(a, b)

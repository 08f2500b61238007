"""Reading target tensors from sharded checkpoints; `eyas status` on a live run's files."""

from __future__ import annotations

import json

import torch
from conftest import eyas
from transformers import AutoModelForCausalLM

from eyas.run.journal import journal_path, read_journal, rewrite_journal
from eyas.stages.extract import ExtractConfig, extract
from eyas.targets.weights import INDEX, embed_weight, lm_head_weight, weight_layout


def test_tensors_from_a_sharded_checkpoint(tmp_path, targets):
    model = AutoModelForCausalLM.from_pretrained(targets["deepseek_v3"])
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / INDEX).is_file() and len(weight_layout(tmp_path)) > 1
    assert torch.equal(lm_head_weight(tmp_path), model.lm_head.weight.detach())
    assert torch.equal(embed_weight(tmp_path), model.model.embed_tokens.weight.detach())


def test_status_counts(tmp_path, targets, llama_dataset):
    run = tmp_path / "run"
    extract(
        ExtractConfig(
            model=str(targets["llama"]), data=str(llama_dataset), out=str(run), progress=False
        )
    )
    entries = read_journal(journal_path(run, 0))
    rewrite_journal(journal_path(run, 0), entries[:70])  # as if the run had stopped at 70
    (run / "errors").mkdir()
    (run / "errors/rank-00000.jsonl").write_text(
        json.dumps({"index": entries[80]["index"], "reason": "NaN"}) + "\n"
    )
    p = eyas("status", run, "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert (s["total"], s["done"], s["failed"], s["remaining"]) == (120, 70, 1, 49)
    assert (
        s["bytes_done"] == sum(e["size"] for e in entries[:70])
        and s["bytes_projected"] > s["bytes_done"]
    )
    assert s["locks"] == [] and not s["live_writer"] and s["fs_warning"]  # under /tmp
    human = eyas("status", run).stdout
    assert "70/120 done" in human and "1 failed" in human and "none (no writer running)" in human

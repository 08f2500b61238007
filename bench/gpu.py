"""A one-shot GPU check of eyas, with nothing to download: every figure from one run.

On one GPU (or on a CPU with `--small`, so that this script cannot rot):
 1. a random target of Llama-3.1-8B shape (H=4096, 32 layers, bf16), built on the device,
    with the demo tokenizer; long generated conversations (~3k tokens each);
 2. a bare batched forward against `eyas extract` on the same batch plan (ratio; >= 0.95);
 3. `eyas extract` SIGKILLed twice and resumed: journal checksums equal an uninterrupted run;
 4. `eyas verify` throughput (checksums);
 5. `eyas train` (bf16 on a GPU): tokens/s and peak memory, per TTT attention; then
    bench/train_speed.py on the same run: each kind's training step (EAGLE-3, DFlash,
    DSpark), tokens/s and peak memory, against the peer's where speculators imports here
    (nothing is installed: the machine may have no network); and bench/head_memory.py at
    Kimi-K2.5's shape (H=7,168, vocabulary 163,840 drafted whole, 4,096 tokens): one step's
    peak memory with the head whole and in parts, per kind;
 6. a one-process `torchrun` training run (NCCL on a GPU);
 7. the GPU preflight refusing while another process holds 40 GB of the GPU; the real
    `nvidia-smi` CSV outputs are saved to --out (tests/fixtures/nvidia-smi/ holds the
    hand-written ones);
 8. the tests marked `gpu` (`pytest -m gpu`: flex attention's gradients), which skip on a CPU.
Prints one JSON summary at the end (and writes it to --out/gpu-bench.json).

    python bench/gpu.py --out /tmp/gpu-bench              # on a GPU: under 8 minutes
    python bench/gpu.py --small --out /tmp/gpu-bench      # rehearsal on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

EYAS = [sys.executable, "-m", "eyas.cli"]


def sh(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def build_target(out: Path, small: bool, device: str) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eyas.demo_target.build import DEMO_TARGET

    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    H, L, heads, kv, inter = (256, 8, 4, 2, 512) if small else (4096, 32, 32, 8, 14336)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=H, intermediate_size=inter, num_hidden_layers=L,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
                      rope_theta=500000.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)  # fmt: skip
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # a random init whose activations stay finite over 32 layers
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return out


def conversations(path: Path, n: int, tokens: int) -> None:
    from eyas.demo_target.data import generate_conversations

    convs = generate_conversations(n * 40, seed=8)
    with open(path, "w") as f:
        for i in range(n):  # ~tokens each: many turns of the generated tasks in one conversation
            msgs = [
                m
                for c in convs[i * 40 : (i + 1) * 40]
                for m in c["messages"]
                if m["role"] != "system"
            ]
            msgs = msgs[: max(2, tokens // 12)]
            while msgs and msgs[-1]["role"] != "assistant":
                msgs.pop()
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")


def bare_forward(model_dir: Path, ds_dir: Path, device: str, batch_tokens: int) -> float:
    from eyas.data.dataset import PreparedDataset
    from eyas.targets.backends.hf import Capture, load_target
    from eyas.targets.target import plan_batches, resolve_dtype

    ds = PreparedDataset.open(ds_dir)
    if device == "cpu":  # the thread count eyas extract chooses for this target, for a fair ratio
        from eyas.host.cpu import configure_threads
        from eyas.targets.target import target_facts

        configure_threads(target_facts(model_dir).hidden_size)
    model, dev = load_target(str(model_dir), device, resolve_dtype("auto", device))
    base = Capture(model, (1, 2, 3)).base
    lengths = ds.lengths().tolist()
    tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for batch in plan_batches(lengths, list(range(len(ds))), batch_tokens):
            T = max(lengths[i] for i in batch)
            ids = torch.zeros((len(batch), T), dtype=torch.long)
            att = torch.zeros((len(batch), T), dtype=torch.long)
            for r, i in enumerate(batch):
                x = ds.sample(i)[0]
                ids[r, : len(x)] = torch.from_numpy(x.astype("int64"))
                att[r, : len(x)] = 1
            base(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False)
            tokens += sum(lengths[i] for i in batch)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del model, base
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return tokens / seconds


def extract_rate(stderr: str) -> float:
    # "extracted N samples (T tokens, B B/token) in S s; ..."
    line = next(x for x in stderr.splitlines() if x.startswith("extracted "))
    tokens = int(line.split("(")[1].split(" tokens")[0])
    seconds = float(line.split(" in ")[1].split("s;")[0])
    return tokens / seconds


def journal_sums(run: Path) -> dict:
    from eyas.run.journal import committed

    return {i: e["header_xxh3"] for i, e in committed(run).items()}


def count(run: Path) -> int:
    d = run / "samples"
    return sum(1 for p in d.rglob("*.safetensors") if ".tmp-" not in p.name) if d.is_dir() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--small", action="store_true", help="Tiny shapes: a rehearsal on a CPU.")
    ap.add_argument("--conversations", type=int, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    n_conv = args.conversations or (24 if args.small else 96)
    tokens = 600 if args.small else 3000
    batch_tokens = 4096 if args.small else 32768
    summary: dict = {"date": time.strftime("%Y-%m-%d"), "device": device, "small": args.small,
                     "torch": torch.__version__, "python": platform.python_version()}  # fmt: skip
    if device == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(0)
    t_all = time.monotonic()

    def step(name):
        print(f"== {name} ({time.monotonic() - t_all:.0f}s)", file=sys.stderr, flush=True)

    step("target and data")
    target = build_target(out / "target", args.small, device)
    conversations(out / "conv.jsonl", n_conv, tokens)
    p = sh([*EYAS, "prepare", "--model", target, "--data", out / "conv.jsonl", "--out", out / "ds", "--max-length",
            str(tokens + 200), "--draft-vocab-size", "512"])  # fmt: skip
    assert p.returncode == 0, p.stderr
    from eyas.data.dataset import PreparedDataset

    ds = PreparedDataset.open(out / "ds")
    summary["samples"], summary["tokens"] = len(ds), int(ds.lengths().sum())
    summary["hidden_size"] = 256 if args.small else 4096

    step("bare forward vs eyas extract")
    ext = [
        *EYAS,
        "extract",
        "--model",
        target,
        "--data",
        out / "ds",
        "--batch-tokens",
        str(batch_tokens),
        "--min-free",
        "0",
    ]
    bare, eyas_rates = [], []
    for r in range(2):  # alternate, take the better of each
        bare.append(bare_forward(target, out / "ds", device, batch_tokens))
        run = out / f"run-{r}"
        p = sh([*ext, "--out", run])
        assert p.returncode == 0, p.stderr[-3000:]
        eyas_rates.append(extract_rate(p.stderr))
        if r == 0:
            shutil.rmtree(run)
    summary["extract"] = {"bare_tokens_per_s": max(bare), "eyas_tokens_per_s": max(eyas_rates),
                          "ratio": max(eyas_rates) / max(bare), "target": 0.95}  # fmt: skip
    reference = out / "run-1"

    step("SIGKILL twice and resume")
    run = out / "run-killed"
    kills = 0
    for _ in range(6):
        cmd = (
            [*ext, "--out", run]
            if not (run / "run.json").exists()
            else [*EYAS, "extract", "--resume", run]
        )
        proc = subprocess.Popen(
            [str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        if kills < 2:
            goal = count(run) + max(1, len(ds) // 6)
            while proc.poll() is None and count(run) < goal:
                time.sleep(0.01)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        proc.wait()
        if kills >= 2 and proc.returncode == 0:
            break
    summary["kill_resume"] = {
        "kills": kills,
        "identical_journal_checksums": journal_sums(run) == journal_sums(reference),
    }

    step("verify")
    p = sh([*EYAS, "verify", reference, "--json"])
    v = json.loads(p.stdout)
    summary["verify"] = {"clean": v["clean"], "mb_per_s": v["mb_per_s"], "bytes": v["bytes_read"]}

    step("train")
    summary["train"] = {}
    dtype = "bfloat16" if device == "cuda" else "float32"
    for attention in ["chunked", "flex"] if device == "cuda" else ["chunked"]:
        tdir = out / f"train-{attention}"
        p = sh([*EYAS, "train", "--data", reference, "--out", tdir, "--epochs", "1", "--ttt-steps", "3", "--dtype", dtype,
                "--batch-tokens", str(tokens + 200), "--attention", attention, "--val-fraction", "0.05",
                "--save-every", "100000"])  # fmt: skip
        line = next((x for x in p.stderr.splitlines() if x.startswith("trained ")), p.stderr[-500:])
        row = {"ok": p.returncode == 0, "summary": line}
        if p.returncode == 0:
            row["tokens_per_s"] = float(line.split(" at ")[1].split(" tokens/s")[0])
        summary["train"][attention] = row
    p = sh([sys.executable, "bench/train_step.py", "--json", "--skip-train", "--lengths", "2048", "8192",
            "--repeats", "2", *(["--hidden", "4096", "--heads", "32"] if device == "cuda" else [])])  # fmt: skip
    summary["train_step"] = (
        json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr[-500:]}
    )

    step("training speed per kind, and the peer's where it imports")
    speed = out / "train-speed.json"
    p = sh([sys.executable, "bench/train_speed.py", "--run", reference, "--kinds", "eagle3,dflash,dspark",
            "--steps", "3" if args.small else "8", "--pairs", "1" if args.small else "2", "--peer", "auto",
            "--device", device, "--batch-tokens", str(tokens + 200 if args.small else 8192),
            "--json", speed], timeout=1200)  # fmt: skip
    summary["train_speed"] = (
        json.loads(speed.read_text())["table"]
        if p.returncode == 0 and speed.is_file()
        else {"error": p.stderr[-1500:]}
    )

    step("one training step's memory at Kimi-K2.5's vocabulary: the head whole and in parts")
    mem = out / "head-memory.json"
    shape = (["--hidden", "256", "--vocab", "32768", "--tokens", "512", "--part-elements", str(2**22)]
             if args.small else ["--hidden", "7168", "--vocab", "163840", "--tokens", "4096"])  # fmt: skip
    p = sh([sys.executable, "bench/head_memory.py", *shape, "--anchor-stride", "1", "--device", device,
            "--json", mem], timeout=1200)  # fmt: skip
    summary["head_memory"] = (
        json.loads(mem.read_text())["rows"]
        if p.returncode == 0 and mem.is_file()
        else {"error": p.stderr[-1500:]}
    )

    step("training input: plain read against eyas's reader")
    p = sh([sys.executable, "bench/reader.py", "--json", "--rounds", "2",
            *(["--samples", "60", "--hidden", "256"] if args.small else ["--samples", "200", "--hidden", "4096"])])  # fmt: skip
    summary["reader"] = (
        json.loads(p.stdout.strip().splitlines()[-1])
        if p.returncode == 0
        else {"error": p.stderr[-500:]}
    )
    if "chunked" in summary["train"] and summary["train"]["chunked"].get("tokens_per_s"):
        summary["reader"]["train_tokens_per_s_beside"] = summary["train"]["chunked"]["tokens_per_s"]

    step("torchrun, one process")
    p = sh([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "eyas.cli",
            "train", "--data", reference, "--out", out / "train-torchrun", "--epochs", "1", "--ttt-steps", "2",
            "--dtype", dtype, "--batch-tokens", str(tokens + 200)])  # fmt: skip
    summary["torchrun"] = {"ok": p.returncode == 0, "backend": "nccl" if device == "cuda" else "gloo",
                           "tail": p.stderr.strip().splitlines()[-1:] if p.stderr else []}  # fmt: skip

    step("GPU preflight against a 40 GB holder")
    if device == "cuda" and shutil.which("nvidia-smi"):
        hold = subprocess.Popen([sys.executable, "-c", "import torch,time; x=torch.empty(40*2**30, dtype=torch.uint8, "
                                 "device='cuda'); print('held', flush=True); time.sleep(600)"],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        hold.stdout.readline()
        for name, q in (("query-gpu.csv", "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu"),
                        ("query-apps.csv", "--query-compute-apps=gpu_uuid,pid,used_memory,process_name")):  # fmt: skip
            (out / name).write_text(sh(["nvidia-smi", q, "--format=csv,noheader,nounits"]).stdout)
        p = sh(
            [
                *EYAS,
                "extract",
                "--model",
                target,
                "--data",
                out / "ds",
                "--out",
                out / "run-refused",
            ]
        )
        hold.kill()
        summary["preflight"] = {"refused": p.returncode == 1 and "hold" in p.stderr, "pid_named": str(hold.pid) in p.stderr,
                                "message": p.stderr.strip().splitlines()[-3:]}  # fmt: skip
    else:
        summary["preflight"] = {"skipped": "no GPU here"}
    # The tests only a GPU can run (`-m gpu`: flex attention's backward, ...), where one is.
    t = sh([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-n", "0",
            str(Path(__file__).resolve().parent.parent / "tests")], timeout=600)  # fmt: skip
    summary["gpu_tests"] = {"exit": t.returncode, "tail": t.stdout.strip().splitlines()[-3:]}
    summary["seconds"] = round(time.monotonic() - t_all, 1)
    (out / "gpu-bench.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()

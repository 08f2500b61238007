"""The sample store of an extraction run: the contract between `extract` and later stages.

Layout of a run directory::

    run.json                         resolved config, fingerprints, layer conventions
    samples/000000-000999/000123.safetensors
    journal/rank-00000.jsonl         append-only: one line per committed sample
    errors/rank-00000.jsonl          samples that failed their checks (never stored)
    locks/rank-00000.lock            PID and host of the live writer
    quarantine/                      files moved aside by `verify --repair`

Guarantee: a sample is either fully committed and checksummed, or absent. A sample file
is published atomically (temp file, fsync, rename, directory fsync) and *then* journaled;
a sample counts as done only when a journal entry exists and the file matches it (size
and the xxh3-128 of its header). Each tensor's xxh3-128 is also kept in the file's header, so a
file is checkable on its own. No pickle: tensors are safetensors, metadata is JSON.
This module is the only code that opens sample files.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load as st_load

from .fsutil import (
    DiskFullError,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    is_temp_file,
    read_json,
)

STORE_VERSION = 1
SAMPLES_PER_DIR = 1000
CHECKSUM = "xxh3_128"
TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states")

_ST_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1, "I64": 8, "F64": 8}


class StoreError(ValueError):
    """A store problem a user can act on; the message names the file."""


def sample_relpath(index: int) -> str:
    lo = index // SAMPLES_PER_DIR * SAMPLES_PER_DIR
    return f"samples/{lo:06d}-{lo + SAMPLES_PER_DIR - 1:06d}/{index:06d}.safetensors"


def journal_path(run: Path, rank: int) -> Path:
    return run / "journal" / f"rank-{rank:05d}.jsonl"


def errors_path(run: Path, rank: int) -> Path:
    return run / "errors" / f"rank-{rank:05d}.jsonl"


def lock_path(run: Path, rank: int) -> Path:
    return run / "locks" / f"rank-{rank:05d}.lock"


def bytes_per_token(hidden_size: int, dtype: torch.dtype) -> int:
    """Stored bytes per token: 3H aux + H final states, int32 id, uint8 mask."""
    return 4 * hidden_size * dtype.itemsize + 4 + 1


# ---------------------------------------------------------------------------- writing


@dataclass
class Sample:
    index: int
    sample_id: str
    source: str
    input_ids: torch.Tensor  # (T,) int32
    loss_mask: torch.Tensor  # (T,) uint8
    aux_hidden_states: torch.Tensor  # (T, 3H)
    last_hidden_states: torch.Tensor  # (T, H)


_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int64: "I64",
}


@dataclass
class Encoded:
    """A sample file as its header bytes (length prefix included) and raw tensor buffers."""

    header: bytes
    parts: list[memoryview]

    @property
    def size(self) -> int:
        return len(self.header) + sum(p.nbytes for p in self.parts)

    def write(self, f) -> None:
        f.write(self.header)
        for p in self.parts:
            f.write(p)


def encode_sample(s: Sample, run_meta: dict) -> Encoded:
    """Serialize one sample as safetensors bytes, with per-tensor checksums in the header.

    The header is written here rather than by `safetensors.save`, whose metadata order
    varies between processes: a resumed run must produce files bit-identical to an
    uninterrupted one. `safetensors` reads the result like any other file.
    """
    tensors = {
        "input_ids": s.input_ids.to(torch.int32),
        "loss_mask": s.loss_mask.to(torch.uint8),
        "aux_hidden_states": s.aux_hidden_states,
        "last_hidden_states": s.last_hidden_states,
    }
    raw = {k: memoryview(v.contiguous().view(torch.uint8).numpy()) for k, v in tensors.items()}
    meta = {
        "format": f"eyas-sample/{STORE_VERSION}",
        "sample_index": str(s.index),
        "sample_id": s.sample_id,
        "source": s.source,
        "tokens": str(s.input_ids.shape[0]),
        "aux_layers": json.dumps(run_meta["aux_layers"]),
        "aux_layers_hf": json.dumps(run_meta["aux_layers_hf"]),
        "last_hidden_state": run_meta["last_hidden_state"],
        "model_fingerprint": run_meta["model_fingerprint"],
        "checksum": CHECKSUM,
        "checksums": json.dumps(
            {k: xxhash.xxh3_128_hexdigest(b) for k, b in raw.items()}, sort_keys=True
        ),
    }
    header: dict = {"__metadata__": meta}
    off = 0
    for k, t in tensors.items():
        header[k] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [off, off + raw[k].nbytes],
        }
        off += raw[k].nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # safetensors aligns the data start to 8 bytes
    return Encoded(struct.pack("<Q", len(h)) + h, list(raw.values()))


def commit_samples(run: Path, samples: list[Sample], run_meta: dict) -> list[dict]:
    """Publish sample files atomically; returns their journal entries (not yet journaled).

    Each file is written and fsynced under a temp name and renamed; the directories are
    fsynced once for the group, and only then may the entries be journaled. The buffers
    go straight to the file (no assembled copy); the journal keeps the header's hash and
    the header holds every tensor's checksum, so one hash pass over the data suffices.
    """
    entries, dirs = [], set()
    for s in samples:
        enc = encode_sample(s, run_meta)
        path = run / sample_relpath(s.index)
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            fsync_dir(path.parent.parent)
        atomic_write(path, enc.write, reserve=enc.size, sync_dir=False)
        dirs.add(path.parent)
        entries.append(journal_entry(s.index, s.sample_id, enc.header, enc.size))
    for d in sorted(dirs):
        fsync_dir(d)
    return entries


def journal_entry(index: int, sample_id: str, header: bytes, size: int) -> dict:
    """A journal line: where the sample is, its size and the xxh3-128 of its header bytes."""
    import time

    meta = parse_header(header, Path(sample_relpath(index)))[0]["__metadata__"]
    return {"index": index, "id": sample_id, "path": sample_relpath(index), "size": size,
            "header_xxh3": xxhash.xxh3_128_hexdigest(header), "tokens": int(meta["tokens"]),
            "t": round(time.time(), 3)}  # fmt: skip


class Journal:
    """Append-only JSONL journal of committed samples, one per rank.

    A torn last line (crash mid-append) is cut off on open. Appends are buffered and
    fsynced by `sync()`; an entry lost at a crash leaves a valid file without an entry,
    which `resume` checks and adopts or redoes.
    """

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._cut_torn_tail()
        self._f = open(path, "ab")
        self._pending = 0

    def _cut_torn_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())

    def append(self, entry: dict) -> None:
        self._f.write((json.dumps(entry, sort_keys=True) + "\n").encode())
        self._pending += 1

    def flush(self) -> None:
        """Hand entries to the kernel (survives a killed process; `sync` survives power loss)."""
        self._f.flush()

    def sync(self) -> None:
        if self._pending:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError as exc:
                if exc.errno in (28, 122):
                    raise DiskFullError(
                        exc.errno, f"no space left appending to {self.path}"
                    ) from exc
                raise
            self._pending = 0

    def close(self) -> None:
        """Sync and close; on a full disk the unsynced entries are dropped, not raised:
        their sample files are complete and `recover` adopts them on resume."""
        try:
            self.sync()
        except DiskFullError:
            pass
        finally:
            try:
                self._f.close()
            except OSError:
                pass


def read_journal(path: Path) -> list[dict]:
    """Entries of one journal; a torn final line is ignored."""
    if not path.exists():
        return []
    out = []
    lines = path.read_bytes().split(b"\n")
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):  # only the last line may be torn
                raise StoreError(f"{path}:{n}: journal line is not valid JSON") from None
    return out


def journal_files(run: Path) -> list[Path]:
    return sorted((run / "journal").glob("rank-*.jsonl"))


def read_all_journals(run: Path) -> dict[int, list[dict]]:
    return {int(p.stem.split("-")[1]): read_journal(p) for p in journal_files(run)}


def rewrite_journal(path: Path, entries: list[dict]) -> None:
    atomic_write_bytes(
        path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries).encode()
    )


def append_error(run: Path, rank: int, entry: dict) -> None:
    p = errors_path(run, rank)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_errors(run: Path) -> list[dict]:
    out = []
    for p in sorted((run / "errors").glob("rank-*.jsonl")):
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


# ---------------------------------------------------------------------------- reading/checking


@dataclass
class Check:
    """Outcome of checking one sample file."""

    path: Path
    ok: bool
    problem: str = ""
    header: dict = field(default_factory=dict)
    nbytes: int = 0


def parse_header(data: bytes | memoryview, path: Path) -> tuple[dict, int]:
    """The safetensors header of `data` and the offset where tensor bytes begin."""
    if len(data) < 8:
        raise StoreError(f"{path}: file is {len(data)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8 or n > 100_000_000:
        raise StoreError(
            f"{path}: header length {n} exceeds the file size {len(data)} (truncated?)"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise StoreError(f"{path}: header is not valid JSON (corrupt)") from None
    return header, 8 + n


def check_sample_bytes(
    data: bytes | memoryview,
    path: Path,
    *,
    checksums: bool,
    hidden_size: int | None = None,
    entry: dict | None = None,
) -> Check:
    """Check header, shapes, dtypes, token count and (optionally) every checksum."""
    try:
        header, base = parse_header(data, path)
        meta = header.get("__metadata__") or {}
        if not str(meta.get("format", "")).startswith("eyas-sample/"):
            raise StoreError(f"{path}: not an eyas sample (no format marker in the header)")
        missing = [t for t in TENSORS if t not in header]
        if missing:
            raise StoreError(f"{path}: missing tensors {missing}")
        T = int(meta["tokens"])
        end = 0
        for name in TENSORS:
            info = header[name]
            shape, dt = info["shape"], info["dtype"]
            a, b = info["data_offsets"]
            if dt not in _ST_DTYPES or b - a != _ST_DTYPES[dt] * _prod(shape):
                raise StoreError(f"{path}: tensor {name} has {b - a} bytes for shape {shape} {dt}")
            end = max(end, b)
            if shape[0] != T:
                raise StoreError(
                    f"{path}: {name} has {shape[0]} rows, expected {T} tokens (token-count mismatch)"
                )
        H = header["last_hidden_states"]["shape"][1]
        if header["aux_hidden_states"]["shape"][1] != 3 * H:
            raise StoreError(
                f"{path}: aux_hidden_states width {header['aux_hidden_states']['shape'][1]} != 3 x {H}"
            )
        if hidden_size is not None and H != hidden_size:
            raise StoreError(f"{path}: hidden size {H}, run expects {hidden_size}")
        if header["input_ids"]["dtype"] != "I32" or header["loss_mask"]["dtype"] != "U8":
            raise StoreError(f"{path}: input_ids/loss_mask dtypes are not int32/uint8")
        if base + end != len(data):
            raise StoreError(
                f"{path}: file is {len(data)} bytes, header says {base + end} (truncated or padded)"
            )
        if entry is not None:
            if entry.get("size") != len(data):
                raise StoreError(
                    f"{path}: size {len(data)} differs from the journal's {entry.get('size')}"
                )
            if xxhash.xxh3_128_hexdigest(bytes(data[:base])) != entry.get("header_xxh3"):
                raise StoreError(
                    f"{path}: header differs from the one journaled (not the committed file)"
                )
            if int(meta["sample_index"]) != entry["index"]:
                raise StoreError(
                    f"{path}: holds sample {meta['sample_index']}, journal says {entry['index']}"
                )
        if checksums:
            sums = json.loads(meta["checksums"])
            for name in TENSORS:
                a, b = header[name]["data_offsets"]
                got = xxhash.xxh3_128_hexdigest(data[base + a : base + b])
                if got != sums.get(name):
                    raise StoreError(f"{path}: checksum mismatch in {name} (data corrupted)")
        return Check(path, True, header=header, nbytes=len(data))
    except StoreError as exc:
        return Check(path, False, str(exc), nbytes=len(data))
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        return Check(path, False, f"{path}: malformed header ({exc})", nbytes=len(data))


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def check_sample_file(
    path: Path, *, checksums: bool = True, hidden_size: int | None = None, entry: dict | None = None
) -> Check:
    try:
        if checksums:
            data = path.read_bytes()
        else:  # header and size only: read the head, the size comes from stat
            with open(path, "rb") as f:
                prefix = f.read(8)  # the header length, then exactly the header
                n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
                head = prefix + f.read(min(n, 100_000_000))
            size = path.stat().st_size
            return _check_head(head, size, path, hidden_size, entry)
    except FileNotFoundError:
        return Check(path, False, f"{path}: file is missing")
    except OSError as exc:
        return Check(path, False, f"{path}: cannot read ({exc})")
    return check_sample_bytes(data, path, checksums=True, hidden_size=hidden_size, entry=entry)


class _Sized:
    """A header prefix that reports the full file size, for quick checks without reading data."""

    def __init__(self, head: bytes, size: int):
        self.head, self.size = head, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, sl):
        return self.head[sl]


def _check_head(head: bytes, size: int, path: Path, hidden_size, entry) -> Check:
    return check_sample_bytes(
        _Sized(head, size), path, checksums=False, hidden_size=hidden_size, entry=entry
    )  # type: ignore[arg-type]


def load_sample(run: Path, index: int, *, verify: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of one committed sample; `verify` checks every checksum first."""
    path = run / sample_relpath(index)
    data = path.read_bytes()
    if verify:
        c = check_sample_bytes(data, path, checksums=True)
        if not c.ok:
            raise StoreError(c.problem)
    return st_load(data)


def open_sample(run: Path, index: int, names: tuple[str, ...] = TENSORS) -> dict[str, torch.Tensor]:
    """Tensors of one committed sample through a memory map (no full read of the file)."""
    from safetensors import safe_open

    with safe_open(run / sample_relpath(index), framework="pt") as f:
        return {n: f.get_tensor(n) for n in names}


def committed_indices(run: Path) -> list[int]:
    """Indices of every committed sample of a run (all ranks), ascending."""
    return sorted({e["index"] for es in read_all_journals(run).values() for e in es})


def iter_sample_files(run: Path) -> Iterator[Path]:
    base = run / "samples"
    if base.is_dir():
        for d in sorted(base.iterdir()):
            if d.is_dir():
                yield from sorted(d.iterdir())


def stray_temp_files(run: Path) -> list[Path]:
    return [p for p in iter_sample_files(run) if is_temp_file(p)] + [
        p
        for sub in ("journal", "errors")
        if (run / sub).is_dir()
        for p in (run / sub).iterdir()
        if is_temp_file(p)
    ]


# ---------------------------------------------------------------------------- run metadata + locks


def read_run_meta(run: Path) -> dict:
    p = Path(run) / "run.json"
    if not p.is_file():
        raise StoreError(f"{run}: not an extraction run (no run.json)")
    meta = read_json(p)
    if meta.get("store_version") != STORE_VERSION:
        raise StoreError(f"{p}: store_version {meta.get('store_version')} is not {STORE_VERSION}")
    return meta


def write_run_meta(run: Path, meta: dict) -> None:
    atomic_write_json(Path(run) / "run.json", meta)

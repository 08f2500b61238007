"""The sample store of an extraction run: the contract between `extract` and later stages.

Layout of a run directory::

    run.json, run.backup.json        the run's intent and facts, each with its own checksum
    samples/000000-000999/000123.safetensors
    journal/rank-00000.jsonl         append-only: one line per committed sample (see `journal`)
    errors/rank-00000.jsonl          samples that failed their checks (never stored)
    locks/rank-00000.lock            the live writer (see `lock`)
    quarantine/                      files and journal lines set aside by repairs

Guarantee: a sample is either fully committed and checksummed, or absent. A sample file
is published atomically (temp file, fsync, rename, directory fsync) and *then* journaled;
a sample counts as done only when a journal entry exists and the file matches it (size,
the xxh3-128 of its header, and the sample index inside the header). Each tensor's xxh3-128
is kept in the header, so a file is checkable on its own. Where a file lives follows from
its sample index alone; no path is ever read from a journal. No pickle: tensors are
safetensors, metadata is JSON. This module is the only code that opens sample files.

What a sample holds depends on the run's storage (`layout`): the aux states in the store
dtype or as float8 (e4m3) with one scale per token and layer; the target as its final
hidden state, or as its top-K log-probabilities over the draft vocabulary plus its argmax.
`read_sample` decodes every layout to float tensors, so readers need no flags.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load as st_load

from eyas.errors import ProblemError, UsageError
from eyas.run.fsutil import atomic_write, fsync_dir, is_temp_file

STORE_VERSION = 1  # a sample file's format (its header's `format`)
# What run.json's `store_version` may say: 2 for a run whose samples hold tensors an eyas
# before it does not know (the target's argmax beside the final state), so that such an eyas
# refuses the run as a whole rather than find every sample "damaged"; 1 for the others.
RUN_VERSIONS = (1, 2)


def run_version(layout: Layout) -> int:
    """The lowest `store_version` whose readers read a run of this layout."""
    return 2 if layout.argmax else 1


SAMPLES_PER_DIR = 1000
CHECKSUM = "xxh3_128"
FP8_MAX = 448.0  # largest finite float8 e4m3fn value

_ST_DTYPES = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "I16": 2,
    "U8": 1,
    "I64": 8,
    "F64": 8,
    "F8_E4M3": 1,
}
_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.uint8: "U8",
    torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
}


_TORCH_DTYPES = {name: dt for dt, name in _DTYPE_NAMES.items()}
_CHUNK = 1 << 20  # bytes read (and hashed) at a time: small enough to stay in the CPU's cache


class StoreError(ProblemError):
    """A store problem a user can act on; the message names the file."""


def samples_dir(run: Path) -> Path:
    """The directory under which a run keeps its sample files."""
    return Path(run) / "samples"


def sample_relpath(index: int) -> str:
    lo = index // SAMPLES_PER_DIR * SAMPLES_PER_DIR
    return f"samples/{lo:06d}-{lo + SAMPLES_PER_DIR - 1:06d}/{index:06d}.safetensors"


# ---------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """What a sample file holds: aux states `aux` ("dense" or "fp8") of `layers` target
    layers side by side, and target `target` ("last": the final hidden state; "topk:K":
    top-K log-probs over the draft vocabulary). `argmax` (with "last"): the target's argmax
    over its whole vocabulary too, so a training never multiplies the head's other rows
    (top-K always holds it)."""

    aux: str = "dense"
    target: str = "last"
    layers: int = 3
    argmax: bool = False

    def __post_init__(self) -> None:
        if self.aux not in ("dense", "fp8"):
            raise UsageError(f"unknown aux storage {self.aux!r}: choose dense or fp8")
        if self.target != "last" and not re.fullmatch(r"topk:[1-9]\d*", self.target):
            raise UsageError(f"unknown target storage {self.target!r}: use last or topk:K")
        if self.layers < 1:
            raise UsageError(
                f"a sample holds the states of at least one target layer, not {self.layers}"
            )
        if self.argmax and self.topk:
            raise UsageError("top-K target storage holds the argmax already: no argmax=1 with it")

    @property
    def topk(self) -> int | None:
        return int(self.target.split(":")[1]) if self.target.startswith("topk:") else None

    def name(self) -> str:
        # Three layers, as every run before the count could vary, is left unsaid.
        return (
            f"aux={self.aux},target={self.target}"
            + (f",layers={self.layers}" if self.layers != 3 else "")
            + (",argmax=1" if self.argmax else "")
        )

    @classmethod
    def parse(cls, s: str | None) -> Layout:
        if not s:
            return cls()
        kv = dict(p.split("=", 1) for p in s.split(",") if "=" in p)
        return cls(
            kv.get("aux", "dense"),
            kv.get("target", "last"),
            int(kv.get("layers", 3)),
            kv.get("argmax") == "1",
        )

    def tensors(self, H: int | None) -> dict[str, tuple[set[str], int | None]]:
        """Name -> (allowed dtypes, row width; None for 1-D) of every tensor in a file."""
        floats = {"F32", "F16", "BF16"}
        out: dict[str, tuple[set[str], int | None]] = {
            "input_ids": ({"I32"}, None),
            "loss_mask": ({"U8"}, None),
        }
        out["aux_hidden_states"] = (
            {"F8_E4M3"} if self.aux == "fp8" else floats,
            self.layers * H if H else -1,
        )
        if self.aux == "fp8":
            out["aux_scales"] = ({"F32"}, self.layers)
        if self.topk:
            out["target_topk_ids"] = ({"I16", "I32"}, self.topk)
            out["target_topk_logprobs"] = (floats, self.topk)
            out["target_argmax"] = ({"I32"}, None)
        else:
            out["last_hidden_states"] = (floats, H if H else -1)
            if self.argmax:
                out["target_argmax"] = ({"I32"}, None)
        return out

    def bytes_per_token(self, H: int, dtype: torch.dtype, draft_vocab: int = 32000) -> int:
        n = 4 + 1  # id, mask
        L = self.layers
        n += L * H + 4 * L if self.aux == "fp8" else L * H * dtype.itemsize
        if self.topk:
            n += self.topk * ((2 if draft_vocab <= 32768 else 4) + 2) + 4
        else:
            n += H * dtype.itemsize + (4 if self.argmax else 0)
        return n


def quantize_fp8(x: torch.Tensor, groups: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, G*H) -> float8 e4m3 (T, G*H) and float32 scales (T, G): one scale per token and
    group (aux layer), so an outlier in one layer or token leaves the others' precision."""
    T, W = x.shape
    g = x.float().view(T, groups, W // groups)  # (T, G, H)
    scale = (g.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)  # (T, G)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(T, W), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    T, W = q.shape
    G = scale.shape[1]
    return (q.float().view(T, G, W // G) * scale[..., None].float()).view(T, W)  # (T, G*H)


def overhead_per_sample(layout: Layout, H: int, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of a sample file's header plus its journal line, measured on a real encoding."""
    shapes = {"input_ids": ((tokens,), torch.int32), "loss_mask": ((tokens,), torch.uint8)}
    for name, (_, width) in layout.tensors(H).items():
        if name in shapes:
            continue
        dt = {
            "aux_scales": torch.float32,
            "target_topk_ids": torch.int16,
            "target_argmax": torch.int32,
        }.get(name)
        if name == "aux_hidden_states" and layout.aux == "fp8":
            dt = torch.float8_e4m3fn
        shapes[name] = (
            (tokens, width) if width else (tokens,),
            dt or (torch.float16 if "logprobs" in name else dtype),
        )
    meta = {
        "aux_layers": [10, 20, 30],
        "aux_layers_hf": [11, 21, 31],
        "last_hidden_state": "post_norm",
        "model_fingerprint": "0" * 16,
        "layout": layout.name(),
    }
    fake = {k: torch.zeros(0, dtype=dt) for k, (_, dt) in shapes.items()}
    enc = encode_sample(Sample(99999, "conversation-000000", "data.jsonl:100000", fake), meta)
    header = enc.header.replace(b"[0]", b"[%d]" % tokens)  # the shapes' digits, roughly
    entry = journal_entry(99999, "conversation-000000", enc.header, 10**9)
    return len(header) + len(json.dumps(entry, sort_keys=True)) + 1


def projected_bytes(
    layout: Layout,
    H: int,
    dtype: torch.dtype,
    samples: int,
    tokens_per_sample: float,
    draft_vocab: int = 32000,
) -> int:
    per_token = layout.bytes_per_token(H, dtype, draft_vocab)
    per_sample = overhead_per_sample(layout, H, dtype, int(tokens_per_sample))
    return int(samples * (tokens_per_sample * per_token + per_sample))


# ---------------------------------------------------------------------------- writing


@dataclass
class Sample:
    index: int
    sample_id: str
    source: str
    tensors: dict[str, torch.Tensor]  # input_ids (T,) int32, loss_mask (T,) uint8, states


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
    tensors = {k: v.contiguous() for k, v in s.tensors.items()}
    raw = {k: memoryview(v.view(torch.uint8).numpy()).cast("B") for k, v in tensors.items()}
    meta = {
        "format": f"eyas-sample/{STORE_VERSION}",
        "sample_index": str(s.index),
        "sample_id": s.sample_id,
        "source": s.source,
        "tokens": str(tensors["input_ids"].shape[0]),
        "aux_layers": json.dumps(run_meta["aux_layers"]),
        "aux_layers_hf": json.dumps(run_meta["aux_layers_hf"]),
        "last_hidden_state": run_meta["last_hidden_state"],
        "model_fingerprint": run_meta["model_fingerprint"],
        "checksum": CHECKSUM,
        "checksums": json.dumps(
            {k: xxhash.xxh3_128_hexdigest(b) for k, b in raw.items()}, sort_keys=True
        ),
    }
    layout = run_meta.get("layout", Layout().name())
    if layout != Layout().name():  # the default layout's files keep the original header
        meta["layout"] = layout
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


_checked_dirs: set[Path] = set()


def ensure_inside(run: Path, path: Path) -> None:
    """Refuse a path of the run that a symlink leads out of the run directory."""
    root = Path(run).resolve()
    real = Path(path).resolve()
    if real != root and root not in real.parents:
        raise StoreError(
            f"{path} leads outside the run directory (to {real}, through a symlink); eyas writes "
            f"only inside {root}: put the whole run directory on the disk you want instead"
        )


# What a run directory holds: an extraction writes these names and nothing else.
RUN_ENTRIES = (
    "run.json",
    "run.backup.json",
    "samples",
    "journal",
    "errors",
    "locks",
    "quarantine",
    "followers",
)


def check_subdirs_inside(run: Path) -> None:
    """Refuse a run whose sub-directories a symlink leads out of it (see `ensure_inside`)."""
    for sub in ("samples", "journal", "errors", "locks", "quarantine"):
        if (run / sub).is_symlink():
            ensure_inside(run, run / sub)


def foreign_run_entries(run: Path) -> list[str]:
    """What in `run` an extraction did not write (a user's files, a dataset's): a new run is
    never mixed into them."""
    if not run.is_dir():
        return []
    return sorted(
        p.name for p in run.iterdir() if p.name not in RUN_ENTRIES and not is_temp_file(p)
    )


def _sample_dir(run: Path, index: int) -> Path:
    d = run / Path(sample_relpath(index)).parent
    if not d.is_dir():
        d.mkdir(parents=True, exist_ok=True)
        fsync_dir(d.parent)
    if d not in _checked_dirs:  # a symlink check per directory and process
        ensure_inside(run, d)
        _checked_dirs.add(d)
    return d


def commit_samples(run: Path, samples: list[Sample], run_meta: dict) -> list[dict]:
    """Publish sample files atomically; returns their journal entries (not yet journaled).

    Each file is written and fsynced under a temp name and renamed; the directories are
    fsynced once for the group, and only then may the entries be journaled.
    """
    entries, dirs = [], set()
    for s in samples:
        enc = encode_sample(s, run_meta)
        d = _sample_dir(run, s.index)
        atomic_write(run / sample_relpath(s.index), enc.write, reserve=enc.size, sync_dir=False)
        dirs.add(d)
        entries.append(journal_entry(s.index, s.sample_id, enc.header, enc.size))
    for d in sorted(dirs):
        fsync_dir(d)
    return entries


def journal_entry(index: int, sample_id: str, header: bytes, size: int) -> dict:
    """A journal line: the sample, its size and the xxh3-128 of its header bytes."""
    meta = parse_header(header, Path(sample_relpath(index)))[0]["__metadata__"]
    return {
        "index": index,
        "id": sample_id,
        "path": sample_relpath(index),
        "size": size,
        "header_xxh3": xxhash.xxh3_128_hexdigest(header),
        "tokens": int(meta["tokens"]),
        "t": round(time.time(), 3),
    }


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
    if not isinstance(header, dict):
        raise StoreError(f"{path}: header is not a JSON object (corrupt)")
    return header, 8 + n


def check_sample_bytes(
    data: bytes | memoryview,
    path: Path,
    *,
    checksums: bool,
    hidden_size: int | None = None,
    entry: dict | None = None,
    layout: Layout | None = None,
) -> Check:
    """Check header, tensors against the layout, token count, the journal entry (size,
    header hash, sample index) and (optionally) every tensor's checksum."""
    try:
        header, base = parse_header(data, path)
        meta = header.get("__metadata__") or {}
        if not str(meta.get("format", "")).startswith("eyas-sample/"):
            raise StoreError(f"{path}: not an eyas sample (no format marker in the header)")
        found = Layout.parse(meta.get("layout"))
        if layout is not None and found != layout:
            raise StoreError(f"{path}: stored as {found.name()}, the run says {layout.name()}")
        T = int(meta["tokens"])
        want = found.tensors(hidden_size)
        names = [k for k in header if k != "__metadata__"]
        if sorted(names) != sorted(want):
            raise StoreError(f"{path}: holds tensors {sorted(names)}, expected {sorted(want)}")
        end = 0
        for name, (dtypes, width) in want.items():
            info = header[name]
            shape, dt = info["shape"], info["dtype"]
            a, b = info["data_offsets"]
            if dt not in dtypes or b - a != _ST_DTYPES[dt] * _prod(shape):
                raise StoreError(f"{path}: tensor {name} has {b - a} bytes for shape {shape} {dt}")
            if shape[0] != T:
                raise StoreError(
                    f"{path}: {name} has {shape[0]} rows, expected {T} tokens (token-count mismatch)"
                )
            if width is None and len(shape) != 1:
                raise StoreError(f"{path}: {name} should be 1-D, has shape {shape}")
            if width is not None and (len(shape) != 2 or (width > 0 and shape[1] != width)):
                raise StoreError(f"{path}: {name} has shape {shape}, expected rows of {width}")
            end = max(end, b)
        if hidden_size is None and found.target == "last":
            H = header["last_hidden_states"]["shape"][1]
            if header["aux_hidden_states"]["shape"][1] != found.layers * H:
                raise StoreError(
                    f"{path}: aux_hidden_states width {header['aux_hidden_states']['shape'][1]} "
                    f"!= {found.layers} x {H}"
                )
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
            view = memoryview(data)  # slices of a view hash in place; slices of bytes copy
            for name in want:
                a, b = header[name]["data_offsets"]
                if xxhash.xxh3_128_hexdigest(view[base + a : base + b]) != sums.get(name):
                    raise StoreError(f"{path}: checksum mismatch in {name} (data corrupted)")
        return Check(path, True, header=header, nbytes=len(data))
    except StoreError as exc:
        return Check(path, False, str(exc), nbytes=len(data))
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
        return Check(path, False, f"{path}: malformed header ({exc})", nbytes=len(data))


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Sized:
    """A header prefix that reports the full file size, for checks without reading data."""

    def __init__(self, head: bytes, size: int):
        self.head, self.size = head, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, sl):
        return self.head[sl]


def read_head(path: Path) -> bytes:
    """The header bytes (length prefix included) of a sample file."""
    with open(path, "rb") as f:
        return _read_head_from(f)


def _read_head_from(f) -> bytes:
    prefix = f.read(8)
    n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
    return prefix + f.read(min(n, 100_000_000))


def check_sample_file(
    path: Path,
    *,
    checksums: bool = True,
    hidden_size: int | None = None,
    entry: dict | None = None,
    layout: Layout | None = None,
) -> Check:
    try:
        if checksums:
            data: bytes | _Sized = path.read_bytes()
        else:  # header and size only: read the head, the size comes from stat
            data = _Sized(read_head(path), path.stat().st_size)
    except FileNotFoundError:
        return Check(path, False, f"{path}: file is missing")
    except OSError as exc:
        return Check(path, False, f"{path}: cannot read ({exc})")
    return check_sample_bytes(
        data,
        path,
        checksums=checksums,
        hidden_size=hidden_size,  # type: ignore[arg-type]
        entry=entry,
        layout=layout,
    )


def decode(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored tensors -> what training reads: aux states as float, whatever the layout."""
    out = dict(raw)
    if "aux_scales" in out:
        out["aux_hidden_states"] = dequantize_fp8(out["aux_hidden_states"], out.pop("aux_scales"))
    if "target_topk_ids" in out:
        out["target_topk_ids"] = out["target_topk_ids"].long()
    return out


def read_sample(run: Path, entry: dict, *, checksums: bool = False) -> dict[str, torch.Tensor]:
    """Decoded tensors of one committed sample, after checking the file against its journal
    entry (size, header hash, index; every tensor checksum with `checksums`). Raises
    StoreError naming the file if anything disagrees: nothing damaged is ever returned."""
    return decode(read_stored(run, entry, checksums=checksums))


def read_stored(run: Path, entry: dict, *, checksums: bool = False) -> dict[str, torch.Tensor]:
    """The stored tensors of one committed sample, in their stored dtypes, checked as
    `read_sample` checks them. The file is read once into one buffer; the checksums hash it
    in place and the tensors are views of it: the bytes are touched once."""
    path = Path(run) / sample_relpath(entry["index"])
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = bytearray(size)
            got = f.readinto(data)
    except OSError as exc:
        raise StoreError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if got != size:
        raise StoreError(f"{path}: read {got} of {size} bytes (the file changed while read)")
    c = check_sample_bytes(data, path, checksums=checksums, entry=entry)
    if not c.ok:
        raise StoreError(c.problem)
    base = len(data) - max(
        info["data_offsets"][1] for k, info in c.header.items() if k != "__metadata__"
    )
    out = {}
    for name, info in c.header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dtype = _TORCH_DTYPES[info["dtype"]]
        if b == a:
            out[name] = torch.empty(info["shape"], dtype=dtype)
        else:  # a view of the buffer (tensors need no alignment on the CPU)
            n = (b - a) // _ST_DTYPES[info["dtype"]]
            out[name] = torch.frombuffer(data, dtype=dtype, count=n, offset=base + a).view(
                info["shape"]
            )
    return out


def stored_layout(run: Path, entry: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each stored tensor's dtype and per-token shape, from one committed sample's header."""
    path = Path(run) / sample_relpath(entry["index"])
    c = check_sample_file(path, checksums=False, entry=entry)
    if not c.ok:
        raise StoreError(c.problem)
    return {
        k: (_TORCH_DTYPES[v["dtype"]], tuple(v["shape"][1:]))
        for k, v in c.header.items()
        if k != "__metadata__"
    }


def read_into(
    run: Path, entry: dict, dest: dict[str, torch.Tensor], *, checksums: bool = False
) -> None:
    """Read one committed sample's tensors straight into `dest` (contiguous CPU tensors of the
    stored dtypes and shapes, e.g. rows of a batch): the header is checked against the journal
    entry first, each tensor's bytes land in place with one read, and with `checksums` they
    are hashed there. Raises StoreError naming the file; `dest` is then undefined."""
    path = Path(run) / sample_relpath(entry["index"])
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = _read_head_from(f)
            c = check_sample_bytes(_Sized(head, size), path, checksums=False, entry=entry)
            if not c.ok:
                raise StoreError(c.problem)
            sums = json.loads(c.header["__metadata__"]["checksums"]) if checksums else {}
            for name, info in c.header.items():
                if name == "__metadata__":
                    continue
                t = dest[name]
                a, b = info["data_offsets"]
                if (
                    t.dtype != _TORCH_DTYPES[info["dtype"]]
                    or t.numel() * t.element_size() != b - a
                    or not t.is_contiguous()
                ):
                    raise StoreError(
                        f"{path}: {name} is {info['dtype']} {info['shape']}, not what the batch holds"
                    )
                buf = (
                    memoryview(t.view(torch.uint8).reshape(-1).numpy())
                    if b > a
                    else memoryview(b"")
                )
                h = xxhash.xxh3_128() if checksums else None
                for c in range(0, b - a, _CHUNK):  # each chunk hashed while it is still in cache
                    piece = buf[c : c + _CHUNK]
                    if os.preadv(f.fileno(), [piece], len(head) + a + c) != len(piece):
                        raise StoreError(
                            f"{path}: short read of {name} (the file changed while read)"
                        )
                    if h is not None:
                        h.update(piece)
                if h is not None and h.hexdigest() != sums.get(name):
                    raise StoreError(f"{path}: checksum mismatch in {name} (data corrupted)")
    except OSError as exc:
        raise StoreError(f"{path}: cannot read ({exc.strerror or exc})") from None


def load_sample(run: Path, index: int, *, verify: bool = False) -> dict[str, torch.Tensor]:
    """Raw stored tensors of one sample by index (no journal check); `verify` checks checksums."""
    path = Path(run) / sample_relpath(index)
    data = path.read_bytes()
    if verify:
        c = check_sample_bytes(data, path, checksums=True)
        if not c.ok:
            raise StoreError(c.problem)
    return st_load(data)


def sample_index_of(path: Path) -> int | None:
    m = re.fullmatch(r"(\d+)\.safetensors", path.name)
    return int(m.group(1)) if m else None


def sample_names(run: Path) -> Iterator[tuple[Path, str]]:
    """(directory, file name) of every file under samples/ (temp files included), in order,
    never following a symlink out of the run. One `scandir` per directory: cheap for 100k."""
    base = Path(run) / "samples"
    if not base.is_dir() or base.is_symlink():
        return
    with os.scandir(base) as it:
        dirs = sorted(d.name for d in it if d.is_dir(follow_symlinks=False))
    for name in dirs:
        d = base / name
        with os.scandir(d) as it:
            files = sorted(f.name for f in it if not f.is_symlink())
        for f in files:
            yield d, f


def iter_sample_files(run: Path) -> Iterator[Path]:
    """Files under samples/ (temp files included), never following a symlink out of the run."""
    for d, name in sample_names(run):
        yield d / name


def bytes_on_disk(run: Path) -> int:
    """Bytes of every file under samples/ now (temp files included; a file deleted while
    it is counted counts 0): what a --max-store budget is measured against from outside."""
    total = 0
    for p in iter_sample_files(run):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def stray_temp_files(run: Path) -> list[Path]:
    return [p for p in iter_sample_files(run) if is_temp_file(p)] + [
        p
        for sub in ("journal", "errors")
        if (run / sub).is_dir()
        for p in (run / sub).iterdir()
        if is_temp_file(p)
    ]

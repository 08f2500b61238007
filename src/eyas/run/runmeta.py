"""`run.json`: what a run is for, written once before the target loads, kept in two copies.

It holds the resolved config shared by every writer of the run (never one rank's view),
the model and dataset fingerprints, the layer conventions and the storage layout. Each
copy (`run.json`, `run.backup.json`) carries the xxh3-128 of its own content, so damage
is told from a deliberate change: a damaged `run.json` is read from the backup, named in
every report, and restored by `verify --repair` or the next writer, never "repaired" by
discarding samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import xxhash

from eyas.run.fsutil import atomic_write_bytes
from eyas.run.store import RUN_VERSIONS, StoreError

PRIMARY = "run.json"
BACKUP = "run.backup.json"


def _digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True).encode())


def _encode(meta: dict) -> bytes:
    meta = {**meta, "meta_checksum": _digest(meta)}
    return (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()


def _load(path: Path) -> tuple[dict | None, str]:
    """(meta, "") or (None, what is wrong with this copy)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    try:
        meta = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"not valid JSON ({exc})"
    if not isinstance(meta, dict):
        return None, f"a JSON {type(meta).__name__}, not an object"
    if "meta_checksum" not in meta:
        return None, "no meta_checksum (written by hand or by another tool?)"
    if meta["meta_checksum"] != _digest(meta):
        return None, "content does not match its meta_checksum (edited or damaged)"
    if meta.get("store_version") not in RUN_VERSIONS:
        return None, (
            f"store_version {meta.get('store_version')}, which this eyas does not read (it reads "
            f"{' and '.join(map(str, RUN_VERSIONS))}): made by a newer eyas?"
        )
    return meta, ""


@dataclass
class MetaRead:
    meta: dict
    damage: str = ""  # what is wrong with run.json when `meta` came from the backup
    backup_damage: str = ""  # what is wrong with the backup when run.json was fine


def load_run_meta(run: str | Path) -> MetaRead:
    run = Path(run)
    meta, why = _load(run / PRIMARY)
    if meta is not None:
        _, bwhy = _load(run / BACKUP)
        return MetaRead(meta, backup_damage=bwhy)
    if why == "missing" and not (run / BACKUP).exists():
        if not run.exists():
            raise StoreError(f"{run}: not an extraction run (no such directory)")
        raise StoreError(
            f"{run}: not an extraction run (no run.json); if an extract into it was stopped before "
            "it wrote anything, run the original `eyas extract --model ... --data ... --out` again"
        )
    backup, bwhy = _load(run / BACKUP)
    if backup is None:
        raise StoreError(
            f"{run / PRIMARY} is {why} and {run / BACKUP} is {bwhy}: the run's description is "
            "lost (its samples are untouched); restore run.json from a copy of the run directory"
        )
    return MetaRead(backup, damage=f"{run / PRIMARY} is {why}; read from {run / BACKUP}")


def is_run(path: str | Path) -> bool:
    """Whether `path` is an extraction run: it holds run.json, or the backup that restores
    it (a run whose primary copy was lost is still a run)."""
    return (Path(path) / PRIMARY).exists() or (Path(path) / BACKUP).exists()


def read_run_meta(run: str | Path) -> dict:
    return load_run_meta(run).meta


def write_run_meta(run: str | Path, meta: dict) -> None:
    """Both copies, each atomically: the backup first, so one good copy exists throughout."""
    run = Path(run)
    data = _encode({k: v for k, v in meta.items() if k != "meta_checksum"})
    atomic_write_bytes(run / BACKUP, data)
    atomic_write_bytes(run / PRIMARY, data)


def restore_run_meta(run: str | Path) -> str | None:
    """Rewrite a damaged copy from the good one; returns what was done, or None."""
    r = load_run_meta(run)
    if r.damage:
        write_run_meta(run, r.meta)
        return f"restored {Path(run) / PRIMARY} from {Path(run) / BACKUP}"
    if r.backup_damage:
        write_run_meta(run, r.meta)
        return f"rewrote {Path(run) / BACKUP} ({r.backup_damage})"
    return None

"""Stage 2, `extract`: run the target over a prepared dataset and store its hidden states.

Guarantee: every sample in a run is either fully committed and checksummed, or absent, and
a restart continues exactly where it stopped (see `store` for the commit protocol).

How:
- The run's intent (`run.json`) is written before the target loads, so a run killed while
  a 1T-parameter model is still loading resumes with `--resume` like any other.
- A backend (`backends/`: transformers or vLLM) runs batches and hands back states; the
  writer thread checks, encodes, writes and fsyncs while the next batch runs.
- Samples are batched by length under a token budget; the batch plan is a pure function
  of the dataset, the share and the budget, so a resumed run recomputes a partly-done
  batch with the same shapes and (hf backend) the stored files are bit-identical.
- `--rank/--world` split the samples (index % world == rank) over processes or nodes; a
  plain `--resume` (world 1) finishes every share that no live writer holds.
- The run stops cleanly (exit 75, resumable) on SIGINT/SIGTERM, when free space falls
  below `min_free`, or on a real ENOSPC; the in-flight commit finishes or leaves nothing.
- `--max-store` keeps the sample bytes under a budget for a trainer that follows the run
  (`train --follow`): consumed samples are retired and deleted (see `stream`), and the
  writer waits while the store is full. `--passes N` runs the dataset N times, each pass in
  its own order, for N epochs of training with a disk smaller than the data.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from eyas import __version__
from eyas.data.dataset import PreparedDataset, check_tokenizer
from eyas.errors import EyasError, Stopped, UsageError
from eyas.host.gpu import gpu_preflight
from eyas.host.ui import RATE_WINDOW, Reporter, console, recent_rate, still_working
from eyas.resume import ResumeRule
from eyas.run.fsutil import (
    DiskFullError,
    filesystem_info,
    free_bytes,
    human_bytes,
    human_duration,
    is_disk_full,
    parse_size,
)
from eyas.run.journal import (
    Journal,
    Ledger,
    append_error,
    journal_path,
    ledger,
    pass_of,
    read_errors,
    scan_journal,
    scan_journals,
    set_aside_damaged_lines,
)
from eyas.run.lock import LockHeld, WriterLock
from eyas.run.recovery import check_journaled_files, recover
from eyas.run.runmeta import is_run, load_run_meta, write_run_meta
from eyas.run.store import (
    Layout,
    Sample,
    StoreError,
    check_subdirs_inside,
    commit_samples,
    foreign_run_entries,
    iter_sample_files,
    run_version,
)
from eyas.run.stream import Retirer
from eyas.stages.config import ExtractConfig
from eyas.stop import StopSignals, start_thread
from eyas.targets.backends import BackendSpec, open_backend, registered
from eyas.targets.layers import hf_indices, spread
from eyas.targets.target import (
    DTYPES,
    ModelDirError,
    check_layers_present,
    check_model_dir,
    check_transformers_can_run,
    default_aux_layers,
    model_fingerprint,
    past_context,
    plan_batches,
    require_target,
    resolve_device,
    resolve_dtype,
    target_facts,
)

# How a resume meets run.json (eyas.resume). Per invocation, never taken from run.json:
# where this process is in a split, what it may do to the machine, and whether the model
# directory's code may run (security: only the current command line can allow that). A
# resume may change the rest of the first set (the new value is kept for later resumes); a
# changed batch_tokens regroups the remaining samples: still correct, but their files are
# then no longer bit-identical to an uninterrupted run's. The dataset and the target may be
# given at new paths (moved to another disk): they are identified by their fingerprints.
RESUME_RULE = ResumeRule(
    per_invocation=frozenset(
        {
            "rank",
            "world",
            "trust_remote_code",
            "progress",
            "queue_depth",
            "ignore_busy_gpus",
            "max_foreign_gpu_mem",
            "staging_dir",
            "out",
        }
    ),
    may_change=frozenset(
        {
            "batch_tokens",
            "device",
            "min_free",
            "allow_partial",
            "tensor_parallel_size",
            "gpu_memory_utilization",
            "max_model_len",
            "max_store",
            "data",
            "model",
        }
    ),
)


class ExtractStopped(Stopped):
    """The run stopped early but cleanly; `extract --resume` continues it."""

    def __init__(self, reason: str, done: int, total: int, run: Path, pending_adoption: int = 0):
        self.reason, self.done, self.total, self.run = reason, done, total, run
        extra = (
            (
                f" ({pending_adoption} of them complete files whose journal entry did not fit: the "
                "resume adopts them after checking every checksum)"
            )
            if pending_adoption
            else ""
        )
        super().__init__(
            f"{reason}. {done}/{total} samples are committed{extra}. "
            f"Resume with: eyas extract --resume {run}"
        )


@dataclass
class ExtractSummary:
    run: str
    total: int
    done_before: int
    committed: int
    failed: int
    tokens: int
    seconds: float
    bytes_written: int
    waited_s: float = 0.0  # time spent waiting for a following trainer (--max-store)

    def render(self) -> str:
        return (
            f"extracted {self.committed} sample{'s' if self.committed != 1 else ''} ({self.tokens} tokens, "
            f"{self.bytes_written / max(self.tokens, 1):.0f} B/token) in {human_duration(self.seconds)}; "
            f"{self.done_before + self.committed}/{self.total} done, {self.failed} failed -> {self.run}"
            + (f"; waited {human_duration(self.waited_s)} for the trainer" if self.waited_s else "")
        )

    def problems(self) -> str | None:
        """What the run found wrong (exit 1), or None."""
        if self.failed:
            return f"{self.failed} samples failed their checks; see {self.run}/errors/"
        return None


def stored_config(cfg: ExtractConfig) -> dict:
    d = RESUME_RULE.stored(asdict(cfg))
    d["aux_layers"] = list(cfg.aux_layers) if cfg.aux_layers else None
    return d


def resolve(cfg: ExtractConfig) -> ExtractConfig:
    """Absolute paths and explicit aux layers, so the stored config means one thing."""
    check_model_dir(cfg.model, weights=True)
    n = target_facts(cfg.model).num_hidden_layers
    aux = cfg.aux_layers or default_aux_layers(n)
    if len(aux) == 1:  # a count: that many layers spread over the depth
        aux = spread(n, aux[0])
    ab = lambda p: str(Path(p).resolve())  # noqa: E731
    return replace(
        cfg, model=ab(cfg.model), data=ab(cfg.data), out=ab(cfg.out), aux_layers=tuple(aux)
    )


def _nothing_committed(run: Path) -> bool:
    """No sample of the run is journaled, failed or on disk, and no writer holds it."""
    from eyas.run.lock import read_lock

    if any(
        (info := read_lock(p)) is not None and info.live for p in (run / "locks").glob("*.lock")
    ):
        return False
    on_disk = next(iter(iter_sample_files(run)), None) is not None
    return not on_disk and not ledger(run).present and not read_errors(run)


def _inputs_in_place(cfg: ExtractConfig, meta: dict, run: Path) -> None:
    """A run's prepared dataset and target, where run.json says or this resume points: one
    that is gone is a usage error saying how to point to where it moved (or rebuild it)."""
    if not (Path(cfg.data) / "dataset.json").exists():
        raise UsageError(
            f"{cfg.data}: the prepared dataset of {run} is gone. If it moved, point to it: "
            f"eyas extract --resume {run} --data NEW_PATH (its fingerprint must be "
            f"{meta['dataset_fingerprint']}). Else: {rebuild_hint(meta)}"
        )
    if not (Path(cfg.model) / "config.json").exists():
        raise UsageError(
            f"{cfg.model}: the target of {run} is gone. If it moved, point to it: eyas extract "
            f"--resume {run} --model NEW_PATH (its fingerprint must be {meta['model_fingerprint']})"
        )


def _check_same_inputs(cfg: ExtractConfig, meta: dict, run: Path, ds: PreparedDataset) -> None:
    if ds.fingerprint != meta["dataset_fingerprint"]:
        raise UsageError(
            f"dataset changed: {cfg.data} has fingerprint {ds.fingerprint}, run {run} was made from "
            f"{meta['dataset_fingerprint']}; refusing to mix samples (start a new run)"
        )
    require_target(cfg.model, meta, f"run {run}", "refusing to mix samples (start a new run)")


def plan_run(cfg: ExtractConfig | None, resume: str | None = None, overrides: dict | None = None):
    """(config, run dir, run.json or {} for a new run, dataset): a new run's config resolved,
    or a resumed run's stored config with this invocation's fields and overrides applied."""
    overrides = dict(overrides or {})
    if resume is not None:
        run = Path(resume).resolve()
        r = load_run_meta(run)
        meta = r.meta
        if r.damage:
            console.print(f"warning: {r.damage}", markup=False, highlight=False)
        stored = {
            k: v
            for k, v in RESUME_RULE.saved(meta["config"]).items()
            if k in ExtractConfig.__dataclass_fields__
        }
        stored["aux_layers"] = tuple(stored["aux_layers"]) if stored.get("aux_layers") else None
        cfg = ExtractConfig(
            **{**RESUME_RULE.resume(stored, overrides, f"{run}/run.json"), "out": str(run)}
        )
    else:
        assert cfg is not None
        cfg = resolve(cfg)
        run = Path(cfg.out)
        meta = {}
        if not is_run(run) and (foreign := foreign_run_entries(run)):
            raise OutDirError(
                f"--out {run} holds files extract did not write ({', '.join(foreign[:3])}"
                f"{' ...' if len(foreign) > 3 else ''}); give an empty or new directory"
            )
        if is_run(run):
            meta = load_run_meta(run).meta
            if diff := RESUME_RULE.differences(meta["config"], stored_config(cfg)):
                if _nothing_committed(run):  # a start that failed early: start it over
                    say(
                        f"{run} holds a run that committed nothing ({'; '.join(diff)}): starting over"
                    )
                    for name in ("run.json", "run.backup.json"):
                        (run / name).unlink(missing_ok=True)
                    meta = {}
                else:
                    raise UsageError(
                        f"{run} already holds a run with a different config ({'; '.join(diff)}); use "
                        f"`eyas extract --resume {run}` to continue it, or choose a new --out"
                    )
    if meta.get("trust_remote_code_required") and not cfg.trust_remote_code:
        raise UsageError(
            f"{run} was started with --trust-remote-code; the model's own code runs only when "
            "the current command allows it: add --trust-remote-code to resume"
        )
    if meta:
        _inputs_in_place(cfg, meta, run)
    ds = PreparedDataset.open(cfg.data)
    if meta:
        _check_same_inputs(cfg, meta, run, ds)
    check_tokenizer(cfg.data, ds.meta, cfg.model, trust_remote_code=cfg.trust_remote_code)
    return cfg, run, meta, ds


class TargetOutOfMemory(EyasError):
    """The target ran out of device memory mid-run (exit 1): the message says how to go on."""


class OutDirError(UsageError):
    """--out is a directory that holds something else: a usage error (exit 2)."""


def rebuild_hint(meta: dict) -> str:
    """How to bring a run's dataset back: the exact `prepare` command, where run.json has it."""
    from eyas.data.dataset import prepare_command

    if not meta.get("dataset_prepare"):
        return f"Restore it at {meta['dataset_path']} (fingerprint {meta['dataset_fingerprint']})"
    return (
        f"Rebuild it with the same inputs (fingerprint {meta['dataset_fingerprint']}), then resume: "
        f"{prepare_command(meta['dataset_prepare'])}"
    )


def new_run_meta(cfg: ExtractConfig, ds: PreparedDataset) -> dict:
    """Everything `run.json` says, derived without loading the model's weights."""
    f = target_facts(cfg.model)
    aux = tuple(cfg.aux_layers or default_aux_layers(f.num_hidden_layers))
    dtype = resolve_dtype(cfg.dtype, cfg.device)
    store_dtype = DTYPES[cfg.store_dtype] if cfg.store_dtype else dtype
    layout = cfg.layout
    return {
        "store_version": run_version(layout),
        "eyas_version": __version__,
        "command": sys.argv,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": stored_config(replace(cfg, aux_layers=aux)),
        "backend": cfg.backend,
        "trust_remote_code_required": cfg.trust_remote_code,
        "model_path": str(Path(cfg.model).resolve()),
        "model_fingerprint": model_fingerprint(cfg.model),
        "model_type": f.model_type,
        "num_hidden_layers": f.num_hidden_layers,
        "hidden_size": f.hidden_size,
        "vocab_size": f.vocab_size,
        "dataset_path": str(Path(cfg.data).resolve()),
        "dataset_fingerprint": ds.fingerprint,
        "dataset_prepare": {**ds.meta.get("config", {}), "out": str(Path(cfg.data).resolve())},
        "samples": len(ds),
        "tokens": int(ds.lengths().sum()),
        "aux_layers": list(aux),
        "aux_layers_convention": "output of 0-based decoder layer i",
        "aux_layers_hf": hf_indices(aux),
        "aux_layers_hf_convention": "index into HF outputs.hidden_states (vLLM eagle_aux_hidden_state_layer_ids)",
        "last_hidden_state": "post_norm",
        "last_hidden_state_note": "output of the final norm: lm_head(last_hidden_states) gives the target logits",
        "compute_dtype": str(dtype).removeprefix("torch."),
        "store_dtype": str(store_dtype).removeprefix("torch."),
        "layout": layout.name(),
        "draft_vocab_size": int(ds.meta["draft_vocab_size"]) if layout.topk else None,
        "bytes_per_token": layout.bytes_per_token(
            f.hidden_size, store_dtype, ds.meta["draft_vocab_size"]
        ),
    }


def say(msg: str) -> None:
    console.print(msg, markup=False, highlight=False)


def extract(
    cfg: ExtractConfig | None = None, *, resume: str | None = None, overrides: dict | None = None
) -> ExtractSummary:
    """Run or resume an extraction. Raises ExtractStopped for a clean early stop."""
    cfg, run, meta, ds = plan_run(cfg, resume, overrides)
    if note := past_context(cfg.model, ds.lengths().tolist(), "samples of the dataset"):
        say(f"note: {note}")
    new_dir = not run.exists()
    if (w := filesystem_info(run).warning()) is not None:
        say(f"warning: {w}; a run of many hours should live on persistent storage")
    check_subdirs_inside(run)
    lengths = ds.lengths().tolist()
    fresh = new_run_meta(cfg, ds) if not meta else None
    bpt = (meta or fresh)["bytes_per_token"]
    mine = [i for i in range(len(ds)) if i % cfg.world == cfg.rank]
    if not meta:  # a new run: checked before anything is written (a resume checks under its lock)
        try:
            need = sum(lengths[i] for i in mine) * bpt + 4096 * len(mine)
            smallest = min((lengths[i] for i in mine), default=0) * bpt + 4096
            _check_disk(run, cfg, _store_need(cfg, need, run, bpt), smallest)
        except DiskFullError:
            if new_dir:
                shutil.rmtree(run, ignore_errors=True)  # a refusal leaves nothing behind
            raise
    device = resolve_device(cfg.device)
    backend = registered(cfg.backend)
    if missing := backend.missing():  # before anything is written: a refusal leaves nothing
        if new_dir:
            shutil.rmtree(run, ignore_errors=True)
        raise UsageError(f"--backend {cfg.backend}: {missing}")
    if backend.transformers:
        check_transformers_can_run(cfg.model, device)
    check_layers_present(cfg.model)
    try:  # before anything is written: a refusal leaves nothing behind
        gpu_preflight(
            device,
            parse_size(cfg.max_foreign_gpu_mem, 1),
            cfg.ignore_busy_gpus,
            say,
            count=cfg.tensor_parallel_size if backend.tensor_parallel else None,
        )
    except Exception:
        if new_dir:
            shutil.rmtree(run, ignore_errors=True)
        raise
    before = set(os.listdir(run)) if run.is_dir() else set()
    run.mkdir(parents=True, exist_ok=True)
    if fresh is not None:
        meta = fresh
        write_run_meta(run, meta)  # the intent: from here on, --resume works
    else:
        _persist_overrides(run, meta, cfg)
    try:
        return _extract_locked(cfg, run, meta, ds, fresh, mine, lengths, bpt, device)
    except ModelDirError:
        if fresh is not None:  # a target refused at load: the new run leaves nothing behind
            for name in set(os.listdir(run)) - before:
                p = run / name
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            if new_dir:
                shutil.rmtree(run, ignore_errors=True)
        raise
    except RuntimeError as exc:
        if "out of memory" not in str(exc).lower():
            raise
        raise TargetOutOfMemory(
            f"{exc}\nThe target ran out of memory; committed samples are kept. Lower --batch-tokens "
            f"and resume: eyas extract --resume {run} --batch-tokens N"
        ) from None


def _extract_locked(cfg, run, meta, ds, fresh, mine, lengths, bpt, device) -> ExtractSummary:
    lock = WriterLock(run, cfg.rank, cfg.world).acquire()
    try:
        if lock.taken_over is not None:
            say(f"took over a stale lock {lock.path}: {lock.taken_over.describe()}")
        scans = scan_journals(run)  # read once: a resume of 100k samples reads each line once
        scan = scans.get(cfg.rank) or scan_journal(journal_path(run, cfg.rank))
        if (q := set_aside_damaged_lines(run, scan)) is not None:
            for n, why in scan.damaged:
                say(
                    f"{scan.path}:{n}: damaged journal line ({why}) set aside (copy in {q}); "
                    "its sample is re-checked by its checksums"
                )
        led = ledger(run, scans)
        # Before the journal opens for appends: dropping entries rewrites it.
        if lost := check_journaled_files(run, led.present, set(mine), cfg.rank, cfg.world == 1):
            say(
                f"{len(lost)} journaled sample(s) have no intact file (missing or of another size; "
                f"e.g. {lost[0]}): their entries are dropped and they are extracted again"
            )
            led = ledger(run)
        journal = Journal(journal_path(run, cfg.rank))
        try:
            layout = Layout.parse(meta.get("layout"))
            if adopted := recover(run, journal, set(mine), led, layout, meta["hidden_size"]):
                say(f"adopted {adopted} complete sample(s) whose journal entry was lost")
            budget = parse_size(cfg.max_store, 1) // cfg.world if cfg.max_store else None
            retirer = Retirer(run, journal, led, set(mine), budget) if budget else None
            if retirer is not None:  # before the disk is judged: a full disk's resume frees it
                if n := retirer.retire():
                    say(
                        f"retired {n} sample(s) the trainer consumed while the extractor was stopped"
                    )
                retirer.budget = _effective_budget(run, cfg, retirer.bytes, bpt)
                batch = cfg.batch_tokens * bpt
                if retirer.budget < 4 * batch:
                    say(
                        f"warning: --max-store {cfg.max_store} holds fewer than 4 batches of --batch-tokens "
                        f"{cfg.batch_tokens} (~{human_bytes(batch)} each{' per rank' if cfg.world > 1 else ''}): "
                        f"the store may reach the budget plus one batch (~{human_bytes(retirer.budget + batch)}), "
                        "and the two sides will wait on each other often; a budget of 4 batches or more lets "
                        "them overlap"
                    )
            if fresh is None:
                todo = [i for p in range(cfg.passes) for i in mine if i not in led.pass_commits(p)]
                need = sum(lengths[i] for i in todo) * bpt + 4096 * len(todo)
                if retirer is not None:
                    need = max(0, min(need, retirer.budget) - retirer.bytes)
                smallest = min((lengths[i] for i in todo), default=0) * bpt + 4096
                _check_disk(run, cfg, need, smallest)
            total = len(mine) * cfg.passes
            if all(i in led.pass_commits(p) for p in range(cfg.passes) for i in mine):
                # nothing left to extract: no need to load the target
                if retirer is not None:
                    _retire_at_end(retirer, run)
                return ExtractSummary(str(run), total, total, 0, 0, 0, 0.0, 0)
            lock.set_phase("loading the model")
            say(f"loading the target ({cfg.backend} backend) from {cfg.model} ...")
            with still_working("loading the target", enabled=cfg.progress):
                backend = open_backend(cfg.backend, _spec(cfg, meta, ds, device, lengths), say)
            lock.set_phase("extracting")
            try:
                loop = _Extraction(cfg, run, meta, ds, backend, mine, led, journal, retirer, lock)
                summary = loop.run()
            finally:
                backend.close()
            if retirer is not None:
                _retire_at_end(retirer, run)
            return summary
        finally:
            journal.close()
    finally:
        lock.release()


def _store_need(cfg: ExtractConfig, need: int, run: Path, bpt: int) -> int:
    """Bytes the run will hold at most: all of it, or its --max-store budget (what the disk
    holds, where that is less)."""
    if not cfg.max_store:
        return need
    return min(need, _effective_budget(run, cfg, 0, bpt, tell=False) * cfg.world)


def _effective_budget(
    run: Path, cfg: ExtractConfig, store: int, bpt: int, tell: bool = True
) -> int:
    """This writer's share of --max-store, or what the disk can hold beside --min-free (less
    the batch a store may run over by) where that is less: a budget larger than the disk
    would fill it and stop the run for good."""
    share = parse_size(cfg.max_store, 1) // cfg.world
    fs = filesystem_info(run)
    free = fs.free_bytes - parse_size(cfg.min_free, fs.total_bytes)
    room = store + free // cfg.world - cfg.batch_tokens * bpt
    if room < share:
        if tell:
            say(
                f"note: {fs.mount_point} holds ~{human_bytes(max(room, 0))} for this writer's samples, less than its "
                f"--max-store share {human_bytes(share)}: the store is kept under what the disk holds"
            )
        return max(room, 1)
    return share


def _retire_at_end(retirer: Retirer, run: Path) -> None:
    """The extraction is done: retire what the followers have passed, and say what stays."""
    retirer.retire()
    left = [i for i in retirer.led.present if i in retirer.mine]
    if left:
        say(
            f"{len(left)} sample(s) ({human_bytes(retirer.bytes)}) stay until the trainer has consumed them; "
            f"`eyas extract --resume {run}` deletes them afterwards (it does not load the target)"
        )


def _spec(cfg: ExtractConfig, meta: dict, ds: PreparedDataset, device: str, lengths) -> BackendSpec:
    layout = Layout.parse(meta.get("layout"))
    return BackendSpec(
        model=cfg.model,
        aux_layers=tuple(meta["aux_layers"]),
        device=device,
        dtype=DTYPES[meta["compute_dtype"]],
        store_dtype=DTYPES[meta["store_dtype"]],
        layout=layout,
        draft_ids=ds.draft_vocab(meta["draft_vocab_size"]) if layout.topk else None,
        trust_remote_code=cfg.trust_remote_code,
        tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_model_len=cfg.max_model_len or (max(lengths) + 1 if lengths else None),
        staging_dir=cfg.staging_dir,
    )


def _persist_overrides(run: Path, meta: dict, cfg: ExtractConfig) -> None:
    """Keep a resume's changes to the overridable fields for later resumes, and where the
    dataset and the target now are (train and doctor read them from run.json)."""
    new = {k: getattr(cfg, k) for k in RESUME_RULE.may_change if k in {f.name for f in fields(cfg)}}
    moved = {
        "dataset_path": str(Path(cfg.data).resolve()),
        "model_path": str(Path(cfg.model).resolve()),
    }
    if any(meta["config"].get(k) != v for k, v in new.items()) or any(
        meta.get(k) != v for k, v in moved.items()
    ):
        meta["config"].update(new)
        meta.update(moved)
        if meta.get("dataset_prepare"):  # a rebuild writes it where it now lives
            meta["dataset_prepare"]["out"] = moved["dataset_path"]
        write_run_meta(run, meta)


def _check_disk(run: Path, cfg: ExtractConfig, need: int, smallest: int) -> None:
    """Before the target loads: refuse a run the disk cannot hold (with --allow-partial, one
    that cannot hold even its smallest sample still to do), naming how much to free."""
    fs = filesystem_info(run)
    floor = parse_size(cfg.min_free, fs.total_bytes)
    say(
        f"disk: this run needs ~{human_bytes(need)} more; {human_bytes(fs.free_bytes)} free on "
        f"{fs.mount_point} ({fs.fs_type}), --min-free floor {human_bytes(floor)}"
    )
    room = fs.free_bytes - floor
    if need > room and not cfg.allow_partial:
        raise DiskFullError(
            28,
            f"not enough space: the run needs ~{human_bytes(need)} but {fs.mount_point} has "
            f"{human_bytes(fs.free_bytes)} free, of which --min-free keeps {human_bytes(floor)} spare. "
            "Free space, use another --out, lower --min-free, or pass --allow-partial to extract what fits",
        )
    if need > 0 and room < smallest:  # not one sample fits: loading the target would be for nothing
        raise DiskFullError(
            28,
            f"no room for even one sample: {fs.mount_point} has {human_bytes(fs.free_bytes)} free and "
            f"--min-free keeps {human_bytes(floor)} spare; free at least {human_bytes(smallest - room)} "
            f"first (~{human_bytes(need - room)} for the whole run), or lower --min-free. The target "
            "was not loaded",
        )


def pass_order(batches: list[list[int]], p: int) -> list[list[int]]:
    """The batches of pass p in the pass's own order (a pure function of p): a trainer that
    follows the run sees every length from the start, and each pass in another order."""
    g = torch.Generator().manual_seed(7919 + p)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def _plan_passes(cfg, run, batches, mine, led: Ledger) -> list[tuple[int, list[int]]]:
    """(pass, batch) still to extract. A sample that failed in a pass that a later one has
    started is not retried in it (its trainer has moved on)."""
    failed: dict[int, set[int]] = {}
    for e in read_errors(run):
        failed.setdefault(pass_of(e), set()).add(e["index"])
    plan = []
    for p in range(cfg.passes):
        done = led.pass_commits(p)
        final = failed.get(p, set()) if led.pass_commits(p + 1) else set()
        plan += [
            (p, b)
            for b in pass_order(batches, p)
            if any(i not in done and i not in final for i in b)
        ]
    return plan


class _Extraction:
    """One extraction loop: the main thread runs the target batch after batch, a writer
    thread commits each batch's states while the next one runs. Its steps: `write_batch`
    (check, encode, write, journal), `_writer` (the thread), `run` (the loop and its stops),
    and `outcome` (the summary, or the stop or failure it ended with)."""

    def __init__(self, cfg, run, meta, ds, backend, mine, led, journal, retirer, lock):
        self.cfg, self.run_dir, self.meta, self.ds, self.backend = cfg, run, meta, ds, backend
        self.mine, self.led, self.journal, self.retirer, self.lock = (
            mine,
            led,
            journal,
            retirer,
            lock,
        )
        self.lengths = ds.lengths().tolist()
        batches = plan_batches(self.lengths, mine, cfg.batch_tokens)
        self.todo = _plan_passes(cfg, run, batches, mine, led)
        self.total = len(mine) * cfg.passes
        passes = range(cfg.passes)
        self.done_before = sum(i in led.pass_commits(p) for p in passes for i in mine)
        self.tokens_left = sum(
            self.lengths[i] for p in passes for i in mine if i not in led.pass_commits(p)
        )
        self.waiting: str | None = None
        self.shown: list[Reporter] = []
        self.stop = threading.Event()
        self.stop_reason: list[str] = []
        self.queue: queue.Queue = queue.Queue(maxsize=cfg.queue_depth)
        self.stats = {"committed": 0, "files": 0, "failed": 0, "bytes": 0, "tokens": 0}
        self.writer_error: list[BaseException] = []
        self.floor = parse_size(cfg.min_free, filesystem_info(run).total_bytes)
        self.commits: list[tuple[float, int]] = []  # (time, tokens) per commit, as `status`
        self.t0 = time.monotonic()

    def show_wait(self, msg: str | None) -> None:
        if msg is not None and self.waiting is None:
            self.lock.set_phase("waiting for followers")
        elif msg is None and self.waiting is not None:
            self.lock.set_phase("extracting")
        self.waiting = msg
        for rep in self.shown:
            rep.note(msg)

    def _failed(self, p: int, i: int, reason: str) -> None:
        rec = self.ds.records[i]
        where = {"index": i, "id": rec["id"], "file": rec["file"], "line": rec["line"]}
        append_error(
            self.run_dir, self.cfg.rank, {**where, "reason": reason, **({"pass": p} if p else {})}
        )
        self.stats["failed"] += 1

    def write_batch(self, p: int, batch: list[int], pending) -> None:
        results = pending.result()
        done = self.led.pass_commits(p)
        retirer = self.retirer
        if retirer is not None and not retirer.make_room(
            [i for i in batch if i not in done], self.stop, self.show_wait
        ):
            pending.release()
            return  # stopped while waiting for room: the batch is extracted again on resume
        samples = []
        for i, res in zip(batch, results, strict=True):
            if i in done:
                continue
            if isinstance(res, str):
                self._failed(p, i, res)
                continue
            rec = self.ds.records[i]
            x, m = self.ds.sample(i)
            tensors = {
                "input_ids": torch.from_numpy(x.astype("int32")),
                "loss_mask": torch.from_numpy(m.copy()),
                **res,
            }
            samples.append(Sample(i, rec["id"], f"{rec['file']}:{rec['line']}", tensors))
        self.journal.reserve(len(samples))  # the lines must fit before their files are written
        entries = commit_samples(self.run_dir, samples, self.meta)
        pending.release()
        self.stats["files"] += len(entries)
        for entry in entries:
            if p:
                entry["pass"] = p
            self.journal.append(entry)
            self.led.add(entry)
            if retirer is not None:
                retirer.committed(entry)
        self.journal.flush()
        for entry in entries:
            self.stats["committed"] += 1
            self.stats["bytes"] += entry["size"]
            self.stats["tokens"] += entry["tokens"]
            self.commits.append((entry.get("t", time.time()), entry["tokens"]))

    def _writer(self) -> None:
        last_sync = time.monotonic()
        while (item := self.queue.get()) is not None:
            if self.writer_error:
                continue  # drain without committing after a failure
            try:
                self.write_batch(*item)
                if time.monotonic() - last_sync > 1.0:
                    self.journal.sync()
                    last_sync = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.writer_error.append(exc)
                self.stop.set()
        if not self.writer_error:
            try:
                self.journal.sync()
            except BaseException as exc:  # noqa: BLE001
                self.writer_error.append(exc)

    def _rate(self) -> float | None:
        return recent_rate(self.commits, time.time())[1]

    def extra(self) -> str:
        if self.waiting is not None:
            return self.waiting
        retirer, cfg = self.retirer, self.cfg
        store = (
            f", store {human_bytes(retirer.bytes)}/{human_bytes(retirer.budget)}"
            if retirer is not None
            else ""
        )
        who = f"rank {cfg.rank}'s " if cfg.world > 1 else ""
        return (
            f"{self._rate() or 0:,.0f} tok/s ({who}last {human_duration(RATE_WINDOW)}, as status), "
            f"{human_bytes(free_bytes(self.run_dir))} free{store}"
        )

    def eta(self) -> float | None:  # in tokens, as `status` computes it
        rate = self._rate()
        return max(self.tokens_left - self.stats["tokens"], 0) / rate if rate else None

    def _handled(self) -> int:
        return self.stats["committed"] + self.stats["failed"]

    def _feed(self, rep: Reporter) -> None:
        """Run the target over every batch still to do, handing each to the writer."""
        seen = 0
        for p, batch in self.todo:
            if self.stop.is_set():
                break
            if free_bytes(self.run_dir) < self.floor:
                self.stop_reason.append(
                    f"free space on {self.run_dir} fell below the --min-free floor of "
                    f"{human_bytes(self.floor)}: free space first (or lower --min-free)"
                )
                break
            self.queue.put((p, batch, self.backend.run([self.ds.sample(i)[0] for i in batch])))
            rep.advance(self._handled() - seen)
            seen = self._handled()
        self.queue.put(None)
        self.writer.join()
        rep.advance(self._handled() - seen)

    def run(self) -> ExtractSummary:
        signals = StopSignals(
            event=self.stop, on_first=lambda name: self.stop_reason.append(f"stopped by {name}")
        )
        self.writer = threading.Thread(target=self._writer, name="eyas-writer", daemon=True)
        start_thread(self.writer)
        with signals:
            try:
                with Reporter(
                    "extract",
                    self.total,
                    enabled=self.cfg.progress,
                    extra=self.extra,
                    eta=self.eta,
                    rate=lambda: recent_rate(self.commits, time.time())[0],
                ) as rep:
                    rep.skip(self.done_before)
                    self.shown.append(rep)
                    self._feed(rep)
            finally:
                if self.writer.is_alive():
                    self.queue.put(None)
                    self.writer.join()
        return self.outcome()

    def outcome(self) -> ExtractSummary:
        stats, run = self.stats, self.run_dir
        if self.writer_error:
            exc = self.writer_error[0]
            if isinstance(exc, DiskFullError) or is_disk_full(exc):
                raise ExtractStopped(
                    f"disk full while writing ({exc})",
                    self.done_before + stats["files"],
                    self.total,
                    run,
                    stats["files"] - stats["committed"],
                )
            raise exc
        if self.stop_reason:
            done = self.done_before + stats["committed"]
            raise ExtractStopped(self.stop_reason[0], done, self.total, run)
        return ExtractSummary(
            str(run),
            self.total,
            self.done_before,
            stats["committed"],
            stats["failed"],
            stats["tokens"],
            time.monotonic() - self.t0,
            stats["bytes"],
            self.retirer.waited if self.retirer else 0.0,
        )


__all__ = ["ExtractConfig", "ExtractStopped", "ExtractSummary", "extract", "LockHeld", "StoreError"]

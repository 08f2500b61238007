"""`eyas doctor`: after a failure, what state is everything in, and what to do now.

One report over the machine and any number of run directories: GPU occupancy with the
owning systemd unit or container and the command that stops it; each run's filesystem,
free space and what the run still needs; each run's state (inputs still in place and
unchanged, progress, errors of the last session, stray temp files, locks, integrity).
It ends with an ordered plan. Nothing is changed: doctor only reads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eyas.host.gpu import GpuReport, query_gpus
from eyas.ops.status import ago, run_status
from eyas.run.fsutil import human_bytes
from eyas.run.journal import read_errors
from eyas.run.runmeta import load_run_meta
from eyas.run.store import StoreError

FOREIGN_GPU_BYTES = 2 << 30  # what counts as "holding" a GPU, as in extract's preflight


@dataclass
class Action:
    text: str
    command: str | None = None
    blocking: bool = True  # False: the plan can go ahead without it (e.g. the resume itself)


@dataclass
class RunReport:
    run: str
    ok: bool = True
    lines: list[tuple[str, str]] = field(default_factory=list)  # (level, text)
    facts: dict = field(default_factory=dict)

    def add(self, level: str, text: str) -> None:
        self.lines.append((level, text))
        if level == "error":
            self.ok = False


@dataclass
class DoctorReport:
    gpus: GpuReport
    runs: list[RunReport]
    actions: list[Action]

    @property
    def needs_action(self) -> bool:
        return any(a.blocking for a in self.actions)

    def to_dict(self) -> dict:
        return {
            "gpus": {
                "source": self.gpus.source,
                "note": self.gpus.note,
                "devices": [
                    {
                        "index": g.index,
                        "name": g.name,
                        "uuid": g.uuid,
                        "used_bytes": g.used_bytes,
                        "total_bytes": g.total_bytes,
                        "utilization": g.utilization,
                        "processes": [
                            {
                                "pid": p.pid,
                                "used_bytes": p.used_bytes,
                                "cmdline": p.cmdline,
                                "unit": p.unit,
                                "user_unit": p.user_unit,
                                "container": p.container,
                                "stop_command": p.stop_command(),
                            }
                            for p in g.processes
                        ],
                    }
                    for g in self.gpus.gpus
                ],
            },
            "runs": [
                {
                    "run": r.run,
                    "ok": r.ok,
                    "findings": [{"level": lv, "text": t} for lv, t in r.lines],
                    **r.facts,
                }
                for r in self.runs
            ],
            "plan": [
                {"step": i + 1, "text": a.text, "command": a.command, "blocking": a.blocking}
                for i, a in enumerate(self.actions)
            ],
            "needs_action": self.needs_action,
        }


def doctor(
    runs: list[str | Path], *, deep: bool = False, proc_root: Path | None = None
) -> DoctorReport:
    gpus = query_gpus(proc_root)
    actions = _gpu_actions(gpus)
    reports = [_check_run(Path(r), deep, actions) for r in runs]
    return DoctorReport(gpus, reports, actions)


def _gpu_actions(gpus) -> list[Action]:
    """One step per owner (a unit, a container, a process) holding GPU memory, however many
    GPUs it holds; a process of another PID namespace is to be stopped where it runs."""
    held: dict[str, list] = {}
    for g in gpus.gpus:
        for p in g.processes:
            if p.used_bytes >= FOREIGN_GPU_BYTES:
                key = (p.unit or p.container or str(p.pid)) if p.here else f"elsewhere {p.pid}"
                held.setdefault(key, []).append(p)
    actions = []
    for procs in held.values():
        p = procs[0]
        where = f"{human_bytes(sum(q.used_bytes for q in procs))} on GPU {_gpu_list(procs)}"
        if p.here:
            text = f"stop {p.owner()} (PID {p.pid}, {p.cmdline or p.name}), which holds {where}"
        else:
            text = (
                f"stop the process the driver reports as PID {p.pid} ({p.name or 'unnamed'}), which "
                f"holds {where}, where it runs: it lives in {p.owner()}, so no command here stops it"
            )
        actions.append(Action(text, p.stop_command()))
    return actions


def _gpu_list(procs) -> str:
    ids = sorted({q.gpu_index for q in procs})
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


def _check_run(run: Path, deep: bool, actions: list[Action]) -> RunReport:
    from eyas.stages.generate import STATE_SUFFIX

    gen = run if (run / "generate.json").is_file() else run.with_name(run.name + STATE_SUFFIX)
    if (gen / "generate.json").is_file():
        return _check_generation(gen, actions)
    rep = RunReport(str(run))
    from eyas.ops.status import describe_other, kind_of, not_eyas

    if (what := not_eyas(run)) is not None:  # an input file, a directory eyas did not write
        rep.add("error", what)
        actions.append(Action(f"{run} is not a run: check the path"))
        return rep

    if kind_of(run) not in (None, "run") and (other := describe_other(run)) is not None:
        for line in other.splitlines():  # not an extraction run, and nothing wrong with it
            rep.add("ok", line)
        if kind_of(run) == "training":
            _plan_training(run, actions)
        return rep
    if (meta := _check_meta(run, rep, actions)) is None:
        return rep
    moved = _check_inputs(run, meta, rep, actions)
    _check_backend(meta, rep, actions)
    st = run_status(run)
    rep.facts = {
        "done": st.done,
        "total": st.total,
        "remaining": st.remaining,
        "failed": st.failed,
        "bytes_needed": st.bytes_needed,
        "free_bytes": st.free_bytes,
    }
    rep.add(
        "ok",
        f"progress: {st.done}/{st.total} samples done, {st.remaining} remaining, {st.failed} failed; last commit {ago(st.last_commit)}",
    )
    if not st.model_loaded and not st.live_writer and any(lk["phase"] for lk in st.locks):
        rep.add(
            "warn",
            "progress: the model never finished loading (the last writer stopped while "
            "starting or loading it); the resume starts again from loading",
        )

    _check_disk(run, st, rep, actions)
    _check_leftovers(run, st, rep)
    _check_stream(run, st, rep, actions)
    kinds = _check_integrity(run, st, deep, rep, actions)
    live = [lk for lk in st.locks if lk["live"]]
    if live:
        actions.append(
            Action(
                f"{len(live)} writer(s) running on {run} ({'; '.join(lk['describe'] for lk in live)}); "
                "let them finish, then resume whatever is left",
                None,
                blocking=False,
            )
        )
    elif moved:  # a resume pointing to where they are also rewrites run.json's paths
        if all(moved.values()):
            flags = " ".join(f"--{flag} {path}" for flag, path in moved.items())
            actions.append(
                Action(
                    f"resume the extraction of {run} from where its inputs are now",
                    f"eyas extract --resume {run} {flags}",
                )
            )
    elif st.remaining > 0 or any(k in kinds for k in ("missing", "corrupt", "journal", "orphan")):
        actions.append(
            Action(
                f"resume the extraction of {run}", f"eyas extract --resume {run}", blocking=False
            )
        )
    return rep


def _check_meta(run: Path, rep: RunReport, actions: list[Action]) -> dict | None:
    """The run's description, or None when neither copy can be read; a damaged copy is planned."""
    try:
        mr = load_run_meta(run)
    except (StoreError, OSError, ValueError) as exc:
        rep.add("error", f"config: {exc}")
        actions.append(
            Action(f"{run} is not a usable run directory; check the path or start a new run")
        )
        return None
    meta = mr.meta
    if mr.damage or mr.backup_damage:
        rep.add("error", f"config: {mr.damage or 'run.backup.json is ' + mr.backup_damage}")
        actions.append(
            Action(
                f"restore the run's description of {run} from its good copy",
                f"eyas verify --repair {run}",
            )
        )
    else:
        rep.add(
            "ok",
            f"config: run.json intact (eyas {meta.get('eyas_version')}, created {meta.get('created')}, "
            f"backend {meta.get('backend', 'hf')})",
        )
    return meta


def _check_backend(meta: dict, rep: RunReport, actions: list[Action]) -> None:
    """What the run's extraction backend needs is installed (a resume would fail without it)."""
    from eyas.targets.backends import registered

    name = meta.get("backend", "hf")
    if missing := registered(name).missing():
        rep.add("error", f"backend: the run extracts with --backend {name}, but {missing}")
        actions.append(
            Action(
                f"install what --backend {name} needs before any resume ({missing}); a run that "
                "committed nothing may instead be started over with another --backend"
            )
        )


def _beside(run: Path, marker: str, fingerprint, want: str) -> Path | None:
    """A directory next to the run (or one level up) holding `marker` whose `fingerprint` is
    `want`: where a dataset or target that moved with the run most likely is."""
    looked = 0
    for base in (run.parent, run.parent.parent):
        try:
            dirs = sorted(d for d in base.iterdir() if d.is_dir() and d != run)
        except OSError:
            continue
        for d in dirs:
            if looked >= 200 or not (d / marker).is_file():
                continue
            looked += 1
            try:
                if fingerprint(d) == want:
                    return d
            except (OSError, ValueError, KeyError):
                continue
    return None


def _moved(run: Path, what: str, flag: str, path: Path, found: Path | None) -> Action:
    if found is not None:
        return Action(
            f"the {what} moved: found at {found} (the same fingerprint; run.json says {path}); "
            "the resume below points the run to it",
            blocking=False,
        )
    return Action(
        f"the {what} is gone from {path}: if it moved, point the run to it with "
        f"`eyas extract --resume {run} --{flag} NEW_PATH`; else put it back",
    )


def _check_inputs(run: Path, meta: dict, rep: RunReport, actions: list[Action]) -> dict:
    """The run's target and prepared dataset: still in place, and unchanged; one that is gone
    is looked for beside the run (a run copied to a new disk with its inputs). Returns the
    resume's flag for each that is gone -> where it was found (None: not found)."""
    gone: dict = {}
    from eyas.data.dataset import PreparedDataset
    from eyas.targets.target import model_fingerprint

    model = Path(meta["model_path"])
    try:
        fp = model_fingerprint(model)
        if fp == meta["model_fingerprint"]:
            rep.add("ok", f"model: {model} present, fingerprint matches")
        else:
            rep.add(
                "error",
                f"model: {model} changed (fingerprint {fp}, run made with {meta['model_fingerprint']})",
            )
            actions.append(
                Action(f"restore the model the run was made with at {model}, or start a new run")
            )
    except (OSError, ValueError, KeyError) as exc:
        rep.add("error", f"model: not usable at {model} ({exc})")
        if not (model / "config.json").is_file():
            found = _beside(run, "config.json", model_fingerprint, meta["model_fingerprint"])
            actions.append(_moved(run, "target", "model", model, found))
            gone["model"] = found
        else:
            actions.append(Action(f"put the target model back at {model} (it was damaged)"))
    data = Path(meta["dataset_path"])
    try:
        ds = PreparedDataset.open(data, check=False)
        if ds.fingerprint == meta["dataset_fingerprint"]:
            rep.add("ok", f"dataset: {data} present, fingerprint matches")
        else:
            rep.add(
                "error",
                f"dataset: {data} changed (fingerprint {ds.fingerprint}, run made from {meta['dataset_fingerprint']})",
            )
            from eyas.data.dataset import prepare_command

            actions.append(
                Action(
                    f"restore the prepared dataset at {data}, or start a new run"
                    + (
                        " (rebuild it from the same inputs:)" if meta.get("dataset_prepare") else ""
                    ),
                    prepare_command(meta["dataset_prepare"]) + " --force"
                    if meta.get("dataset_prepare")
                    else None,
                )
            )
    except (OSError, ValueError, KeyError) as exc:
        from eyas.data.dataset import prepare_command
        from eyas.stages.extract import rebuild_hint

        rep.add("error", f"dataset: not usable at {data} ({exc})")
        fingerprint = lambda d: PreparedDataset.open(d, check=False).fingerprint  # noqa: E731
        found = None
        if not (data / "dataset.json").is_file():
            found = _beside(run, "dataset.json", fingerprint, meta["dataset_fingerprint"])
            gone["data"] = found
        if found is not None:
            actions.append(_moved(run, "prepared dataset", "data", data, found))
        elif meta.get("dataset_prepare"):
            actions.append(
                Action(
                    f"rebuild the prepared dataset at {data} from the same inputs (it was moved, "
                    "deleted or replaced; the same inputs give the same fingerprint)",
                    prepare_command(meta["dataset_prepare"]) + " --force",
                )
            )
        else:
            actions.append(Action(f"{rebuild_hint(meta)} (it was moved, deleted or replaced)"))

    return gone


def _check_disk(run: Path, st, rep: RunReport, actions: list[Action]) -> None:
    """Free space against what the run still needs, and the filesystem's own warning."""
    from eyas.run.fsutil import filesystem_info

    fs = filesystem_info(run)
    margin = fs.free_bytes - st.bytes_needed
    line = (
        f"disk: {fs.mount_point} ({fs.fs_type} on {fs.device}), {human_bytes(fs.free_bytes)} free, "
        f"run still needs ~{human_bytes(st.bytes_needed)}"
    )
    if margin >= 0:
        rep.add("ok", f"{line}: fits with {human_bytes(margin)} to spare")
    else:
        rep.add("error", f"{line}: short by {human_bytes(-margin)}")
        actions.append(
            Action(
                f"free at least {human_bytes(-margin)} on {fs.mount_point} (or move the run to a larger disk)"
            )
        )
    if (w := fs.warning()) is not None:
        rep.add("warn", f"disk: {w}")


def _check_leftovers(run: Path, st, rep: RunReport) -> None:
    """What the last session left: its failed samples, temp files and locks."""
    errors = read_errors(run)
    if errors:
        reasons = Counter(e.get("reason", "?") for e in errors).most_common(3)
        rep.add(
            "warn",
            f"errors: {len(errors)} sample(s) failed their checks: "
            + "; ".join(f"{n}x {r}" for r, n in reasons),
        )
    if st.temp_files:
        rep.add(
            "warn", f"temp files: {st.temp_files} left by an interrupted write (removed on resume)"
        )
    for lk in st.locks:
        rep.add(
            "warn" if not lk["live"] else "ok",
            f"lock: {lk['describe']}" + ("" if lk["live"] else "; it is taken over on resume"),
        )


def _check_integrity(run: Path, st, deep: bool, rep: RunReport, actions: list[Action]) -> dict:
    """verify's findings (headers and sizes, or every checksum with `deep`), and what repairs
    them; the count of each kind of problem."""
    from eyas.stages.config import VerifyConfig
    from eyas.stages.verify import verify

    v = verify(
        VerifyConfig(run=str(run), quick=not deep, progress=deep)
    )  # deep: every byte, minutes
    kinds = {
        k: v.count(k)
        for k in ("missing", "corrupt", "orphan", "duplicate", "temp", "journal", "meta")
        if v.count(k)
    }
    depth = "checksums" if deep else "headers and sizes; --deep for checksums"
    if v.unjournaled:
        rep.add(
            "warn",
            f"integrity: {len(v.unjournaled)} intact file(s) without a journal entry (written just "
            "before the stop); the resume checks every checksum and adopts them",
        )
    if not any(k in kinds for k in ("missing", "corrupt", "duplicate", "orphan", "journal")):
        if deep:
            rep.add("ok", f"integrity: {v.ok}/{v.checked} committed samples intact ({depth})")
        else:
            rep.add(
                "ok",
                f"integrity: {v.ok}/{v.checked} committed samples have intact headers and sizes; "
                f"their data was not read ({_verify_cost(run, st.store_bytes)})",
            )
            if v.checked:
                actions.append(
                    Action(
                        "read every committed sample and check its checksums (the quick check "
                        "above reads headers only)",
                        f"eyas verify {run}",
                        blocking=False,
                    )
                )
    else:
        rep.add(
            "error",
            f"integrity ({depth}): "
            + ", ".join(f"{n} {k}" for k, n in kinds.items() if k not in ("temp", "meta")),
        )
        for p in v.problems[:10]:
            if p.kind not in ("temp", "meta"):
                rep.add("error", f"  {p.kind}: {p.detail}")
        if not any(a.command == f"eyas verify --repair {run}" for a in actions):
            actions.append(
                Action(
                    f"quarantine damaged samples and set aside damaged journal lines of {run} "
                    "so they are re-extracted",
                    f"eyas verify --repair {run}",
                )
            )
    return kinds


def _check_stream(run: Path, st, rep: RunReport, actions: list[Action]) -> None:
    """A streamed run: the store against its budget, each follower, who waits on whom, and
    the command that resumes each side."""
    from eyas.ops.status import bottleneck, leftover_after_stream

    if st.budget or st.retired:
        budget = f" of its {human_bytes(st.budget)} budget" if st.budget else ""
        rep.add(
            "ok",
            f"store: {human_bytes(st.store_bytes)} of samples on disk{budget}; {st.retired} retired "
            "(consumed by training and deleted: done, not missing)",
        )
    for f in st.followers:
        _check_follower(run, f, st.blocked is not None, rep, actions)
    if st.budget and not st.followers and st.remaining > 0:
        rep.add(
            "warn",
            "store: the run has a --max-store budget but no trainer follows it: nothing is deleted, "
            "and the extractor waits once the store is full",
        )
        actions.append(
            Action(
                f"start the trainer that consumes {run}",
                f"eyas train --follow --data {run} --out TRAIN_DIR",
                blocking=False,
            )
        )
    if (b := bottleneck(st)) is not None:
        rep.add("ok", f"bottleneck: {b}")
    if leftover_after_stream(st):
        rep.add(
            "ok",
            f"store: the run and its trainer are finished; {human_bytes(st.store_bytes)} of consumed "
            "samples are still on disk (the extractor deletes them on its next start)",
        )
        actions.append(
            Action(
                "delete the samples the finished trainer consumed",
                f"eyas extract --resume {run}",
                blocking=False,
            )
        )


def _check_follower(run: Path, f: dict, blocked: bool, rep: RunReport, actions) -> None:
    """One trainer that follows the run; `blocked`: the run cannot move until it runs again."""
    if f.get("lost"):
        rep.add(
            "warn",
            f"follower: {f['lost']} sample(s) of pass {f['pass'] + 1} were deleted before {f['out']} "
            "consumed them (it resumed from an older checkpoint than it had published, or came late): "
            "that pass trains without them",
        )
    if f["problem"]:
        rep.add("error", f"follower: {f['describe']}")
        actions.append(
            Action(
                f"resume the trainer that follows {run} (it rewrites its file), or remove "
                "the file if that training was abandoned",
                f["command"] or None,
            )
        )
    elif f["finished"] or f["live"]:
        rep.add("ok", f"follower: {f['describe']} ({'finished' if f['finished'] else 'running'})")
    else:
        rep.add(
            "error" if blocked else "warn",
            f"follower: {f['describe']} (not running: the extractor deletes nothing it has not "
            "consumed, and waits for it when the store is full"
            + ("; it waits now: the run is blocked)" if blocked else ")"),
        )
        actions.append(
            Action(
                "resume the trainer that follows the run (it continues from its newest "
                "checkpoint: every sample once per pass)",
                f["command"],
                blocking=blocked,
            )
        )
        actions.append(
            Action(
                f"or, if the training in {f['out']} was abandoned, stop the run waiting for it",
                f"rm {f['path']}",
                blocking=False,
            )
        )


def _plan_training(out: Path, actions: list[Action]) -> None:
    """A training that stopped before its last step (killed, or stopped) is resumed."""
    from eyas.run.lock import live_locks
    from eyas.training.checkpoint import latest_checkpoint

    if (out / "drafter.safetensors").is_file() or live_locks(out):
        return
    ckpt = latest_checkpoint(out)
    since = (
        f"from its checkpoint at step {int(ckpt.name.split('-')[-1])}" if ckpt else "from the start"
    )
    actions.append(
        Action(
            f"resume the training in {out}: it stopped before its last step and continues {since}",
            f"eyas train --resume --out {out}",
            blocking=False,
        )
    )


def _verify_cost(run: Path, total_bytes: int) -> str:
    """How long a full `eyas verify` would take, from checksumming a couple of samples."""
    import time

    from eyas.run.fsutil import human_duration
    from eyas.run.journal import committed
    from eyas.run.store import check_sample_file, sample_relpath

    done = committed(run)
    picked = [done[i] for i in sorted(done)[:: max(1, len(done) // 2)][:2]]
    t0, nbytes = time.monotonic(), 0
    for e in picked:
        nbytes += check_sample_file(
            run / sample_relpath(e["index"]), checksums=True, entry=e
        ).nbytes
    el = time.monotonic() - t0
    if not nbytes or el <= 0:
        return f"`eyas verify {run}` reads them"
    rate = nbytes / el
    return (
        f"`eyas verify {run}` reads {human_bytes(total_bytes)}, about {human_duration(total_bytes / rate)} "
        f"at the {rate / 1e6:,.0f} MB/s measured on {len(picked)} sample(s)"
    )


def _check_generation(state: Path, actions: list[Action]) -> RunReport:
    """A generation directory (`eyas generate`): progress, failures, writer, what to run."""
    from eyas.run.lock import live_locks
    from eyas.stages.generate import generation_status

    g = generation_status(state)
    rep = RunReport(str(state))
    rep.facts = {k: g[k] for k in ("records", "done", "failed", "remaining")}
    rep.add(
        "ok",
        f"generation: {g['done']}/{g['records']} records done for model {g['model']} at {g['endpoint']}",
    )
    if g["failed"]:
        rep.add(
            "warn",
            f"errors: {g['failed']} record(s) failed in the last session (see {state}/errors.jsonl); "
            "a rerun retries them",
        )
    live = live_locks(state)
    for lk in live:
        rep.add("ok", f"lock: {lk.describe()}")
    cmd = g.get("command") or "the original eyas generate command"
    if live:
        actions.append(
            Action(f"a generator is running on {state}; let it finish", None, blocking=False)
        )
    elif g["remaining"] > 0 or not g["out_written"]:
        actions.append(
            Action(
                f"continue the generation into {g['out']} (only what is missing is sent)",
                cmd,
                blocking=False,
            )
        )
    return rep


def render(rep: DoctorReport, out) -> None:
    """The report for people, on a rich console `out`: GPUs, each run, the plan."""
    from rich.markup import escape

    mark = {"ok": "[green]ok[/]   ", "warn": "[yellow]warn[/] ", "error": "[red]FAIL[/] "}
    plain = dict(markup=False, highlight=False)
    out.print("[bold]GPUs[/]")
    if not rep.gpus.gpus:
        out.print(f"  {rep.gpus.note}", **plain)
    for g in rep.gpus.gpus:
        util = f"{g.utilization}%" if g.utilization is not None else "?"
        out.print(
            f"  GPU {g.index} {g.name}: {human_bytes(g.used_bytes)} / {human_bytes(g.total_bytes)} used, "
            f"{util} busy",
            **plain,
        )
        for p in g.processes:
            out.print(
                f"    PID {p.pid} {human_bytes(p.used_bytes)}: {p.cmdline or p.name} [{p.owner()}]",
                **plain,
            )
            if p.stop_command():
                out.print(f"      stop: {p.stop_command()}", **plain)
    for r in rep.runs:
        out.print(f"[bold]Run {escape(r.run)}[/]", highlight=False)
        for level, text in r.lines:
            out.print(f"  {mark[level]}{escape(text)}", highlight=False)
    out.print("[bold]Plan[/]")
    if not rep.actions:
        out.print("  nothing to do", **plain)
    for n, a in enumerate(rep.actions, 1):
        out.print(f"  {n}. {a.text}" + (f"\n     $ {a.command}" if a.command else ""), **plain)

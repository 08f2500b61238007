"""`eyas status`: where an extraction run stands, read from its directory alone.

Counts come from the journals (what is committed), the error logs (what failed its checks)
and run.json (what the run is for); nothing is inferred from files merely existing.
Throughput and ETA are shown only while a writer is live, measured from the commits of
the last minutes up to now (a stalled writer shows a falling rate, not its last burst).

A streamed run (`--max-store`, `--passes`, `train --follow`) shows both sides: the store
against its budget, each follower's pass and consumption rate, who waits on whom, and each
side's resume command. Retired samples (consumed and deleted) count as done.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eyas.errors import UsageError
from eyas.host.ui import RATE_WINDOW, recent_rate
from eyas.run.fsutil import filesystem_info
from eyas.run.journal import ledger, pass_of, read_errors
from eyas.run.lock import all_locks, live_locks
from eyas.run.runmeta import is_run, load_run_meta
from eyas.run.store import stray_temp_files


@dataclass
class RunStatus:
    run: str
    total: int
    done: int
    failed: int
    remaining: int
    tokens_total: int
    tokens_done: int
    bytes_done: int
    bytes_projected: int
    bytes_needed: int
    free_bytes: int
    fs_type: str
    mount_point: str
    fs_warning: str | None
    last_commit: float | None
    recent_samples_per_s: float | None
    recent_tokens_per_s: float | None
    eta_seconds: float | None
    locks: list[dict] = field(default_factory=list)
    temp_files: int = 0
    ranks: list[int] = field(default_factory=list)
    meta_warning: str = ""
    model_loaded: bool = False  # False: no writer has finished loading the model yet
    ignored_entries: list[str] = field(default_factory=list)  # journal entries outside the dataset
    passes: int = 1
    current_pass: int = 0  # the first pass not complete (0-based)
    store_bytes: int = 0  # sample files that should exist now
    budget: int | None = None  # --max-store
    retired: int = 0
    followers: list[dict] = field(default_factory=list)
    gone: dict[str, str] = field(default_factory=dict)  # "dataset"/"target" -> the path it left

    @property
    def live_writer(self) -> bool:
        return any(lk["live"] for lk in self.locks)

    @property
    def blocked(self) -> str | None:
        """Why the run cannot move, where it cannot: the extractor waits for room that only
        followers which are not running could make."""
        waiting = any(lk["live"] and lk["phase"] == "waiting for followers" for lk in self.locks)
        if waiting and self.followers and not any(f["live"] for f in self.followers):
            return "the extractor waits for room, and no trainer that follows the run is running"
        return None

    def to_dict(self) -> dict:
        return {**asdict(self), "live_writer": self.live_writer, "blocked": self.blocked}


def _locks(run: Path) -> list[dict]:
    """Every lock in the run, live or stale, as status reports it."""
    return [
        {
            "path": str(lk.path),
            "pid": lk.pid,
            "host": lk.host,
            "live": lk.live,
            "phase": lk.phase,
            "describe": lk.describe(),
        }
        for lk in all_locks(run)
    ]


def _followers(run: Path, led) -> list[dict]:
    """The trainings that follow the run, each with the samples its pass lacks."""
    from eyas.run.stream import read_followers

    followers = []
    for f in read_followers(run):
        # Deleted in its pass but not consumed by it: it resumed from an older checkpoint than
        # it had published, or registered after others had passed them. Its pass lacks them.
        lost = 0 if f.finished or f.problem else len(led.pass_retired(f.pass_) - f.consumed)
        followers.append(
            {
                "describe": f.describe(),
                "out": f.out,
                "pass": f.pass_,
                "finished": f.finished,
                "waiting": f.waiting,
                "rate": f.rate(),
                "updated": f.updated,
                "command": f.command,
                "live": bool(f.out) and bool(live_locks(Path(f.out))),
                "problem": f.problem,
                "path": str(f.path),
                "lost": lost,
            }
        )
    return followers


def _rates(entries: dict, live: bool, now: float, window: float):
    """(last commit time, samples/s, tokens/s) over the commits of the last `window`
    seconds; the rates only while a writer is live (a dead run has none)."""
    commits = [
        (e["t"], e["tokens"]) for e in entries.values() if isinstance(e.get("t"), (int, float))
    ]
    last = max((t for t, _ in commits), default=None)
    return (last, *recent_rate(commits, now, window)) if live else (last, None, None)


def run_status(run: str | Path, window: float = RATE_WINDOW, now: float | None = None) -> RunStatus:
    run = Path(run)
    mr = load_run_meta(run)
    meta = mr.meta
    from eyas.run.journal import scan_journals

    scans = scan_journals(run)
    n = meta["samples"]
    ignored = [
        f"journal/rank-{rank:05d}.jsonl names sample {e['index']}, but the dataset has {n}"
        for rank, sc in sorted(scans.items())
        for e in sc.entries
        if e["index"] >= n
    ]
    led = ledger(run, scans)
    conf = meta.get("config", {})
    passes = int(conf.get("passes") or 1)
    entries = {(p, i): e for p in range(passes) for i, e in led.pass_commits(p).items() if i < n}
    failed = {(pass_of(e), e["index"]) for e in read_errors(run) if e["index"] < n} - set(entries)
    total = n * passes
    current = next(
        (p for p in range(passes) if len([k for k in entries if k[0] == p]) < n), passes - 1
    )
    tokens_done = sum(e["tokens"] for e in entries.values())
    bytes_done = sum(e["size"] for e in entries.values())
    tokens_total = meta["tokens"] * passes
    per_token = bytes_done / tokens_done if tokens_done else meta["bytes_per_token"]
    projected = int(per_token * tokens_total)
    fs = filesystem_info(run)
    locks = _locks(run)
    live = [lk for lk in locks if lk["live"]]

    last, rs, rt = _rates(entries, bool(live), time.time() if now is None else now, window)
    eta = max(tokens_total - tokens_done, 0) / rt if rt else None
    phases = [lk["phase"] for lk in locks]
    loaded = bool(entries or failed) or any(
        p in ("extracting", "waiting for followers") for p in phases
    )
    followers = _followers(run, led)
    from eyas.run.fsutil import parse_size

    budget = parse_size(conf["max_store"], 1) if conf.get("max_store") else None
    store = sum(e["size"] for e in led.present.values())
    needed = max(projected - bytes_done, 0)
    if budget:  # the run never holds more than its budget
        needed = min(needed, max(budget - store, 0))
    return RunStatus(
        run=str(run),
        total=total,
        done=len(entries),
        failed=len(failed),
        remaining=total - len(entries) - len(failed),
        tokens_total=tokens_total,
        tokens_done=tokens_done,
        bytes_done=bytes_done,
        bytes_projected=projected,
        bytes_needed=needed,
        free_bytes=fs.free_bytes,
        fs_type=fs.fs_type,
        mount_point=fs.mount_point,
        fs_warning=fs.warning(),
        last_commit=last,
        recent_samples_per_s=rs,
        recent_tokens_per_s=rt,
        eta_seconds=eta,
        locks=locks,
        temp_files=len(stray_temp_files(run)),
        ranks=sorted(scans),
        meta_warning=mr.damage
        or (f"run.backup.json is {mr.backup_damage}" if mr.backup_damage else ""),
        model_loaded=loaded,
        ignored_entries=ignored,
        passes=passes,
        current_pass=current,
        store_bytes=store,
        budget=budget,
        retired=sum(len(r) for r in led.retired),
        followers=followers,
        gone=inputs_gone(meta),
    )


def inputs_gone(meta: dict) -> dict[str, str]:
    """The run's dataset and target that are no longer where run.json says."""
    where = {
        "dataset": (meta["dataset_path"], "dataset.json"),
        "target": (meta["model_path"], "config.json"),
    }
    return {what: path for what, (path, f) in where.items() if not (Path(path) / f).is_file()}


def ago(t: float | None) -> str:
    if t is None:
        return "never"
    from eyas.run.fsutil import human_duration

    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))} ({human_duration(time.time() - t)} ago)"


def format_status(st: RunStatus) -> str:
    """The status for people: one fact per line."""
    from eyas.run.fsutil import human_bytes, human_duration

    # Floored, so that a run one sample short never reads 100.0%.
    pct = math.floor(1000 * st.done / st.total) / 10 if st.total else 100.0
    if st.live_writer:
        span = human_duration(RATE_WINDOW)
        speed = (
            f"{st.recent_samples_per_s:.2f} samples/s, {st.recent_tokens_per_s:,.0f} tokens/s (commits of "
            f"the last {span}, all ranks)"
            if st.recent_tokens_per_s
            else f"no commits in the last {span}"
        )
        eta = human_duration(st.eta_seconds) if st.eta_seconds is not None else "?"
        if st.blocked:
            eta = f"- (blocked: {st.blocked})"
    else:
        speed = eta = "- (no writer running)"
    lines = [
        f"run        {st.run}",
        f"samples    {st.done}/{st.total} done ({pct:.1f}%), {st.remaining} remaining, {st.failed} failed "
        "(from the journals; files not read: `eyas verify` checks them)",
        f"tokens     {st.tokens_done:,}/{st.tokens_total:,}",
        f"disk       {human_bytes(st.bytes_done)} written, ~{human_bytes(st.bytes_projected)} projected in all, "
        f"~{human_bytes(st.bytes_needed)} still needed; {human_bytes(st.free_bytes)} free on {st.mount_point} ({st.fs_type})",
        f"last commit {ago(st.last_commit)}",
        f"throughput {speed}",
        f"ETA        {eta}",
    ]
    lines += _stream_lines(st)
    if not st.model_loaded and not st.live_writer and any(lk["phase"] for lk in st.locks):
        lines.append(
            "model      never loaded: the last writer stopped while starting or loading the target; "
            f"`eyas extract --resume {st.run}` starts again from loading"
        )
    lines += [f"lock       {lk['describe']}" for lk in st.locks] or [
        "lock       none (no writer running)"
    ]
    if st.temp_files:
        lines.append(f"temp files {st.temp_files} stray (removed on resume)")
    if st.meta_warning:
        lines.append(f"warning    {st.meta_warning} (`eyas verify --repair {st.run}` restores it)")
    if st.fs_warning:
        lines.append(f"warning    {st.fs_warning}")
    for w in st.ignored_entries[:5]:
        lines.append(f"warning    ignored: {w}")
    for what, path in st.gone.items():
        lines.append(f"warning    the {what} is gone from {path} (moved or deleted)")
    if not st.live_writer:
        if st.gone:  # even a finished run: train reads them from run.json
            flags = " ".join(f"--{'data' if w == 'dataset' else 'model'} NEW_PATH" for w in st.gone)
            lines.append(
                f"next       eyas extract --resume {st.run} {flags}   (where the {' and '.join(st.gone)} "
                f"now lives; `eyas doctor {st.run}` looks beside the run)"
            )
        elif st.remaining > 0 or (st.budget and st.store_bytes and not st.followers):
            lines.append(
                f"next       eyas extract --resume {st.run}   (after a crash, `eyas doctor {st.run}` first)"
            )
        elif not st.followers:
            lines.append(f"next       eyas train --data {st.run} --out TRAIN_DIR")
    for f in st.followers:
        if not f["finished"] and not f["live"] and f["command"]:
            lines.append(
                f"next       {f['command']}   (the trainer following this run is not running)"
            )
    if st.budget and not st.followers and st.remaining > 0:
        lines.append(
            f"next       eyas train --follow --data {st.run} --out TRAIN_DIR   (with --max-store, "
            "nothing is deleted until a trainer follows the run)"
        )
    if leftover_after_stream(st) and not st.live_writer:
        lines.append(
            f"next       eyas extract --resume {st.run}   (deletes the {human_bytes(st.store_bytes)} of "
            "samples the finished trainer consumed last; nothing else is left to do)"
        )
    return "\n".join(lines)


def leftover_after_stream(st: RunStatus) -> bool:
    """A streamed run whose extraction and followers are all finished still holds the samples
    consumed since the extractor last retired any (up to a budget's worth)."""
    return (
        bool(st.budget or st.retired)
        and st.remaining == 0
        and bool(st.followers)
        and all(f["finished"] for f in st.followers)
        and st.store_bytes > 0
    )


def bottleneck(st: RunStatus) -> str | None:
    """Which side of a streamed run holds the other up, from the writer's phase and the
    followers' own word; None for a run nobody follows."""
    if not st.followers or (st.remaining == 0 and all(f["finished"] for f in st.followers)):
        return None
    extract_waits = any(lk["live"] and lk["phase"] == "waiting for followers" for lk in st.locks)
    train_waits = any(f["waiting"] and f["live"] and not f["finished"] for f in st.followers)
    if extract_waits:
        return "training: the store is at its budget and extraction waits for the trainer to consume samples"
    if train_waits and not st.live_writer:
        return f"extraction: no extractor is running, and the trainer waits for samples (eyas extract --resume {st.run})"
    if train_waits:
        return "extraction: the trainer waits for more committed samples (a window of them, or the pass's end)"
    if st.live_writer and any(f["live"] for f in st.followers):
        return "neither: both sides are working"
    return "- (one side is not running)"


def _stream_lines(st: RunStatus) -> list[str]:
    from eyas.run.fsutil import human_bytes

    out = []
    if st.passes > 1:
        out.append(
            f"passes     pass {st.current_pass + 1} of {st.passes} (each pass runs the dataset once)"
        )
    if st.budget or st.retired:
        budget = f" of its {human_bytes(st.budget)} budget (--max-store)" if st.budget else ""
        out.append(
            f"store      {human_bytes(st.store_bytes)} of samples on disk{budget}; {st.retired} retired "
            "(consumed by training and deleted: done, not missing)"
        )
    rate = (
        f"; extraction {st.recent_samples_per_s:.2f} samples/s" if st.recent_samples_per_s else ""
    )
    for f in st.followers:
        state = "running" if f["live"] else ("finished" if f["finished"] else "not running")
        out.append(f"follower   {f['describe']} ({state}{rate})")
        if f.get("lost"):
            out.append(
                f"warning    {f['lost']} sample(s) of pass {f['pass'] + 1} were deleted before {f['out']} "
                "consumed them: that pass trains without them"
            )
    if (b := bottleneck(st)) is not None:
        out.append(f"bottleneck {b}")
    return out


# What each kind of eyas directory is called, which command makes it, and which reads it next.
_KINDS = {
    "run": (
        "an extraction run",
        "eyas extract",
        "eyas train --data {p} --out TRAIN_DIR (eyas status, verify and doctor check it)",
    ),
    "dataset": (
        "a prepared dataset",
        "eyas prepare",
        "eyas extract --model MODEL --data {p} --out RUN_DIR",
    ),
    "training": (
        "a training directory",
        "eyas train",
        "eyas export {p} --format vllm --out DRAFTER_DIR (eyas status shows its state)",
    ),
    "export": (
        "an exported drafter",
        "eyas export",
        "eyas evaluate --model TARGET --drafter {p} --data PROMPTS.jsonl",
    ),
}


def kind_of(path: Path) -> str | None:
    """Which kind of eyas directory `path` is: run, dataset, training, export; None if none."""
    path = Path(path)
    if is_run(path):
        return "run"
    if (path / "train.json").is_file():
        return "training"
    if (path / "dataset.json").is_file():
        return "dataset"
    if (path / "eyas-manifest.json").is_file():
        return "export"
    return None


def not_eyas(path: Path) -> str | None:
    """One line for a path that exists and is no eyas directory at all (an input file, or a
    directory eyas did not write): what it is and what to run on it. None otherwise."""
    from eyas.stages.generate import STATE_SUFFIX

    path = Path(path)
    if (path / "generate.json").is_file() or (
        path.with_name(path.name + STATE_SUFFIX) / "generate.json"
    ).is_file():
        return None  # generate's output, or its state directory
    if path.is_file():
        return (
            f"{path} is a file, not a directory eyas writes; if it holds records, prepare it with "
            f"`eyas prepare --model TARGET --data {path} --out DATASET_DIR`, or give it to "
            f"`eyas evaluate --data {path}` as prompts"
        )
    if path.is_dir() and kind_of(path) is None:
        return (
            f"{path} is not a directory eyas wrote (no run.json, train.json, dataset.json or "
            "eyas-manifest.json); if an extract into it was stopped before it wrote anything, "
            "run the original `eyas extract --model ... --data ... --out` again"
        )
    return None


def wrong_kind(path: Path, want: str) -> str | None:
    """One line for a directory of another kind than `want` (run, dataset, training,
    export): what it is, what made it and the command that reads it. None otherwise."""
    kind = kind_of(path)
    if kind is None or kind == want:
        return None
    name, made_by, reader = _KINDS[kind]
    return (
        f"{path} is {name} (made by {made_by}), not {_KINDS[want][0]}; the command that reads it: "
        + reader.format(p=path)
    )


def describe_other(path: Path) -> str | None:
    """What a directory that is not an extraction run is, and which command reads it: a
    training directory, a prepared dataset or an exported drafter. None for anything else."""
    from eyas.run.fsutil import read_json
    from eyas.run.lock import live_locks
    from eyas.training.checkpoint import latest_checkpoint

    path = Path(path)
    if (path / "train.json").is_file():
        cfg = read_json(path / "train.json").get("config", {})
        ckpt = latest_checkpoint(path)
        steps = (
            f"newest checkpoint at step {int(ckpt.name.split('-')[-1])}"
            if ckpt
            else "no checkpoint yet"
        )
        val = _last_val(path / "metrics.jsonl")
        running = bool(live_locks(path))
        final = (path / "drafter.safetensors").is_file()
        state = "running" if running else ("finished" if final else "not running")
        if running:
            nxt = f"eyas status {cfg.get('data', 'RUN')} (the run it reads)"
        elif final:
            nxt = f"eyas export {path} --format vllm --out DRAFTER_DIR"
        else:
            nxt = f"eyas train --resume --out {path}"
        return "\n".join(
            [
                f"training   {path} (eyas train): {state}; {steps}; --epochs {cfg.get('epochs')}",
                f"data       {cfg.get('data')}",
                *([f"val        {val}"] if val else []),
                f"next       {nxt}",
            ]
        )
    if (path / "dataset.json").is_file():
        d = read_json(path / "dataset.json")
        c, t = d.get("counts", {}), d.get("tokens", {})
        return "\n".join(
            [
                f"dataset    {path} (eyas prepare): {c.get('samples')} samples from {c.get('records')} records, "
                f"{t.get('total', 0):,} tokens ({t.get('trainable', 0):,} trained on); {c.get('failed', 0)} failed",
                f"model      {d.get('model')}",
                f"next       eyas extract --model {d.get('model')} --data {path} --out RUN_DIR",
            ]
        )
    if (path / "eyas-manifest.json").is_file():
        return _describe_export(path)
    return None


def _describe_export(path: Path) -> str:
    """An export: its kind, format, target, draft length, and the last figures measured."""
    from eyas.run.fsutil import read_json
    from eyas.stages.card import evaluations

    m = read_json(path / "eyas-manifest.json")
    target = m.get("target") or "TARGET"
    lines = [
        f"drafter    {path} (eyas export): {m.get('kind', 'eagle3')} in {m.get('format', '?')}'s "
        f"format, {m.get('drafts_per_round', '?')} drafts a round",
        f"target     {target} (fingerprint {(m.get('data') or {}).get('model_fingerprint', '?')})",
    ]
    if evals := evaluations(path):
        e = evals[-1]
        ci = e.get("tokens_per_forward_ci95") or ["?", "?"]
        lines.append(
            f"measured   {e.get('tokens_per_forward')} tokens per target forward [{ci[0]}, {ci[1]}], "
            f"acceptance length {e.get('acceptance_length')} on {e.get('prompts')} prompts of "
            f"{e.get('prompts_file')} ({e.get('judge')}, {e.get('when')}; {len(evals)} evaluation(s) "
            "in its README.md)"
        )
    else:
        lines.append("measured   not yet")
    lines.append(f"next       eyas evaluate --model {target} --drafter {path} --data PROMPTS.jsonl")
    return "\n".join(lines)


def _last_val(metrics: Path) -> str | None:
    """The newest validation line of a training directory's metrics, in words."""
    import json

    last = None
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("split") == "val":
            last = r
    if last is None:
        return None
    accs = " ".join(f"{a:.2f}" for a in last.get("acc", []))
    return f"step {last.get('step')}: loss0 {last['loss'][0]:.3f}, acc/step [{accs}]"


def status_of(path: Path) -> tuple[dict, str]:
    """`eyas status` of any eyas directory: its JSON form and its text. An extraction run
    (run.json, or only its backup) reads its journals; generate's output its state; a
    dataset, training or export is described. UsageError for a path that is none of them."""
    from eyas.stages.generate import STATE_SUFFIX, format_generation, generation_status

    gen = path if (path / "generate.json").is_file() else path.with_name(path.name + STATE_SUFFIX)
    if not path.exists() and not gen.exists():
        raise UsageError(f"{path}: no such run, training, dataset, drafter or generation")
    if (msg := not_eyas(path)) is not None:
        raise UsageError(msg)
    if (gen / "generate.json").is_file():
        g = generation_status(gen)
        return g, format_generation(g)
    if not is_run(path):
        if (other := describe_other(path)) is not None:
            return {"kind": other.split()[0], "describe": other}, other
    st = run_status(path)
    return st.to_dict(), format_status(st)

"""`eyas demo`: the whole pipeline on the shipped demo target and conversations.

prepare -> extract -> verify -> train -> export (every format the drafter runs in) -> evaluate, in a work
directory, a few minutes on 2 CPU cores. Evaluation uses conversations held out from
training (generated with another seed), so the measured acceptance is not memorised.
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from rich.table import Table

from eyas.demo_target.build import DEMO_CONVERSATIONS, DEMO_TARGET
from eyas.drafters.formats import DEFAULT as DEFAULT_FORMAT
from eyas.errors import ProblemError, UsageError
from eyas.host.ui import console
from eyas.stages.config import DemoConfig

MARKER = ".eyas-demo"
EVAL_SEED = 99


def run_demo(cfg: DemoConfig) -> dict:
    """The pipeline on the demo target as `cfg` says; its summary (figures, paths, times)."""
    workdir = Path(cfg.workdir)
    training = _train_config(cfg, workdir)  # an option of another kind: refused before anything
    _fresh_workdir(workdir)
    clock = _StageClock()
    p, x = _prepare_and_extract(workdir, clock)
    tdir, t = _train(training, clock)
    exports, not_written = _export(cfg.kind, tdir, workdir, clock)
    e = _evaluate(cfg, exports[DEFAULT_FORMAT.name], workdir, clock)
    summary = _summary(cfg.kind, p, x, t, e.to_dict(), tdir, exports, clock)
    summary["not_exported"] = not_written
    summary["next"] = _next_steps(exports[DEFAULT_FORMAT.name])
    _print_table(summary)
    return summary


def _next_steps(export: Path) -> list[str]:
    """Where a user goes from the demo: serving what it made, and training on their own data."""
    from eyas.stages.export import serve_command

    return [
        f"serve it: {serve_command(export, DEFAULT_FORMAT.name)}",
        "train one for your own target and conversations: eyas prepare --model TARGET --data "
        "chats.jsonl --out ds, then extract, train, export, evaluate (README.md, docs/your-data.md)",
    ]


class _StageClock:
    """A rule printed as each stage starts, and the seconds each took."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        console.rule(f"[bold]{name}")
        start = time.monotonic()
        yield
        self.seconds[name] = time.monotonic() - start


def _fresh_workdir(workdir: Path) -> None:
    """An empty work directory marked as the demo's; an earlier demo's is replaced, any other
    directory with files in it refused."""
    if workdir.exists() and any(workdir.iterdir()):
        if not (workdir / MARKER).exists():
            raise UsageError(
                f"{workdir} exists and is not an eyas demo directory; choose another --workdir"
            )
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).write_text("made by eyas demo; deleted and rebuilt by the next eyas demo\n")


def _prepare_and_extract(workdir: Path, clock: _StageClock):
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare
    from eyas.stages.verify import verify

    ds, run = workdir / "dataset", workdir / "run"
    with clock("prepare"):
        p = prepare(
            PrepareConfig(
                model=str(DEMO_TARGET),
                data=(str(DEMO_CONVERSATIONS),),
                out=str(ds),
                draft_vocab_size=512,
            )
        )
    with clock("extract"):
        cfg = ExtractConfig(
            model=str(DEMO_TARGET), data=str(ds), out=str(run), batch_tokens=4096, min_free="64M"
        )
        x = extract(cfg)
    with clock("verify"):
        v = verify(run)
        if not v.clean:
            raise ProblemError(
                f"verify found problems in {run}: {[pr.detail for pr in v.problems[:3]]}"
            )
        console.print(
            f"verify: {v.ok}/{v.checked} samples intact, {v.mb_per_s:.0f} MB/s",
            markup=False,
            highlight=False,
        )
    return p, x


def _train_config(cfg: DemoConfig, workdir: Path):
    """The demo's training: the kind's recipe for the demo target."""
    from eyas.drafters import kind
    from eyas.training.config import TrainConfig

    own = dict(kind(cfg.kind).demo_options)
    if cfg.ttt_steps is not None:
        own["ttt_steps"] = cfg.ttt_steps  # refused on a kind without TTT steps
    return TrainConfig.of(
        data=str(workdir / "run"),
        out=str(workdir / "train"),
        epochs=cfg.epochs,
        lr=3e-3,
        warmup_steps=10,
        batch_tokens=2048,
        val_fraction=0.1,
        save_every=50,
        # The demo target's user turns are a few synthetic templates: scoring them costs its
        # tiny drafter (1.85 tokens a forward against 1.95; docs/recipe.md).
        loss_positions="assistant",
        kind=cfg.kind,
        **own,
    )


def _train(training, clock: _StageClock):
    from eyas.stages.train import train

    with clock("train"):
        t = train(training)
    return Path(training.out), t


def _export(
    kind: str, tdir: Path, workdir: Path, clock: _StageClock
) -> tuple[dict[str, Path], dict[str, str]]:
    """Every format the drafter runs in, and why each other format of its kind was not
    written (it would run another network: said in the summary, not as an error mid-run)."""
    from eyas.drafters import kind as drafter_kind
    from eyas.stages.config import ExportConfig
    from eyas.stages.export import ExportError, export

    exports, not_written = {}, {}
    with clock("export"):
        for fmt in (f.name for f in drafter_kind(kind).serving):
            try:
                exports[fmt] = export(
                    ExportConfig(
                        train_dir=str(tdir), format=fmt, out=str(workdir / f"drafter-{fmt}")
                    )
                ).path
            except ExportError as exc:
                not_written[fmt] = str(exc).split(": ", 1)[-1]
        console.print(
            f"exported {', '.join(map(str, exports.values()))}", markup=False, highlight=False
        )
    return exports, not_written


def _evaluate(cfg: DemoConfig, drafter: Path, workdir: Path, clock: _StageClock):
    from eyas.demo_target.data import generate_conversations, write_jsonl
    from eyas.stages.evaluate import evaluate

    with clock("evaluate"):
        held_out = workdir / "eval_conversations.jsonl"
        write_jsonl(held_out, generate_conversations(cfg.eval_prompts, seed=EVAL_SEED))
        return evaluate(  # drafting what the export serves
            str(DEMO_TARGET),
            str(drafter),
            str(held_out),
            max_new_tokens=48,
            limit=cfg.eval_prompts,
        )


def _summary(kind, p, x, t, ed: dict, tdir: Path, exports: dict, clock: _StageClock) -> dict:
    from eyas.drafters import kind as drafter_kind

    val = t.val
    k = ed["drafter"]["draft_tokens"]  # what the export drafts a round
    return {
        "kind": kind,
        "position_name": drafter_kind(kind).position_name,
        "samples": x.done_before + x.committed,
        "tokens": p.tokens,
        "trainable_tokens": p.trainable_tokens,
        "bytes_per_token": x.bytes_written / max(x.tokens, 1),
        "val_acc_per_step": [round(a, 3) for a in val["acc"]],
        "val_cond_acc_per_step": [round(a, 3) for a in val["cond_acc"]],
        "draft_tokens": k,
        "trained_positions": len(val["acc"]),
        "estimated_acceptance_length": round(
            val["accept_len"][min(k, len(val["accept_len"])) - 1], 3
        ),
        "measured_acceptance_length": ed["acceptance_length"],
        "measured_acceptance_length_ci95": ed["acceptance_length_ci95"],
        "tokens_per_forward": ed["tokens_per_forward"],
        "tokens_per_forward_ci95": ed["tokens_per_forward_ci95"],
        "eval_rounds": ed["rounds"],
        "per_position_acceptance": ed["per_position_acceptance"],
        "train_tokens_per_s": round(t.tokens_per_s, 1),
        "spec_tokens_per_s": ed["spec_tokens_per_s"],
        "greedy_tokens_per_s": ed["greedy_tokens_per_s"],
        "lossless": ed["lossless"],
        "plots": [str(tdir / "loss.png"), str(tdir / "accuracy.png")],
        "drafters": [str(path) for path in exports.values()],
        "seconds": round(time.monotonic() - clock.t0, 1),
        "stage_seconds": {k: round(v, 1) for k, v in clock.seconds.items()},
    }


def _ci(ci: list[float] | None) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""


def _print_table(s: dict) -> None:
    tab = Table(title="eyas demo", show_header=False, title_style="bold")
    tab.add_column(style="bold")
    tab.add_column()
    rows = [
        ("samples", f"{s['samples']}"),
        ("tokens", f"{s['tokens']:,} ({s['trainable_tokens']:,} trainable)"),
        ("bytes per token on disk", f"{s['bytes_per_token']:.0f}"),
        (f"val acc per {s['position_name']}", " ".join(f"{a:.2f}" for a in s["val_acc_per_step"])),
        ("val conditional acc", " ".join(f"{a:.2f}" for a in s["val_cond_acc_per_step"])),
        (
            "drafts a round",
            f"K={s['draft_tokens']}, what the export serves (trained for {s['trained_positions']} "
            f"{s['position_name']}s; the training lines estimate at k={s['trained_positions']})",
        ),
        (
            f"acceptance length, K={s['draft_tokens']}",
            f"measured {s['measured_acceptance_length']:.2f} {_ci(s['measured_acceptance_length_ci95'])} "
            f"(engine-style: 1 + accepted drafts a round); validation estimated "
            f"{s['estimated_acceptance_length']:.2f} at the same K",
        ),
        (
            f"tokens per target forward, K={s['draft_tokens']}",
            f"{s['tokens_per_forward']:.2f} {_ci(s['tokens_per_forward_ci95'])}: the same rounds, "
            f"where the last one of a reply is cut at its end ({s['eval_rounds']} rounds)",
        ),
        (
            "per-position acceptance",
            " ".join(f"{a:.2f}" for a in s["per_position_acceptance"] if a is not None),
        ),
        (
            "decoding tokens/s",
            f"speculative {s['spec_tokens_per_s']:.0f} vs greedy {s['greedy_tokens_per_s']:.0f} (tiny target on CPU)",
        ),
        ("lossless", "yes" if s["lossless"] else "NO"),
        ("training tokens/s", f"{s['train_tokens_per_s']:.0f}"),
        ("plots", "\n".join(s["plots"])),
        ("exported drafters", "\n".join(s["drafters"])),
        *[(f"not for {fmt}", why) for fmt, why in s["not_exported"].items()],
        (
            "time",
            f"{s['seconds']:.0f}s ("
            + ", ".join(f"{k} {v:.0f}s" for k, v in s["stage_seconds"].items())
            + ")",
        ),
    ]
    for k, v in rows:
        tab.add_row(k, v)
    console.print(tab)
    for line in s["next"]:
        console.print(f"next: {line}", markup=False, highlight=False)

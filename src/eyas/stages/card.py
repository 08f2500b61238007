"""An export's model card (`README.md`, as published drafters carry one): what the drafter is,
how it was trained, for which target and on which data, the command that serves it, and what
`evaluate` measured of it.

`export` records the recipe, the target and the data in the export's manifest and writes the
card from it; each complete `evaluate` of the export adds its figures to
`eyas-evaluations.json` beside it and writes the card again. The card is derived: neither
file is in the manifest's checksums, and the weights never change after the export.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from eyas.drafters.formats import DEFAULT, FORMATS
from eyas.run.fsutil import atomic_write_bytes, atomic_write_json, read_json

__all__ = ["CARD", "EVALUATIONS", "evaluations", "record_evaluation", "recipe", "write_card"]

CARD = "README.md"
EVALUATIONS = "eyas-evaluations.json"
MANIFEST = "eyas-manifest.json"
# The shared training options a reader of the card wants; the kind's own are all shown.
_SHARED = (
    "epochs",
    "lr",
    "batch_tokens",
    "loss",
    "loss_positions",
    "optimizer",
    "seed",
    "attention_window",
    "init_from",
)


def recipe(train_info: dict) -> dict:
    """What the card says of a training (its train.json): the shared options above and every
    option of its kind, as they were when it trained."""
    from eyas.drafters import options_class

    config = train_info.get("config", {})
    own = [f.name for f in dataclasses.fields(options_class(config.get("kind")))]
    return {k: config[k] for k in (*_SHARED, *own) if k in config}


def evaluations(path: Path) -> list[dict]:
    """What `evaluate` measured of the export at `path`, oldest first."""
    f = Path(path) / EVALUATIONS
    try:
        return list(read_json(f)) if f.is_file() else []
    except (OSError, ValueError, TypeError):
        return []


def record_evaluation(path: Path, result: dict, prompts: str, judge: str) -> bool:
    """Add a complete evaluation of the eyas export at `path` and write its card again;
    False (nothing written) for a stopped one or a directory eyas did not export."""
    path = Path(path)
    if result.get("partial") or not (path / MANIFEST).is_file():
        return False
    keep = (
        "prompts",
        "draft_tokens",
        "tokens_per_forward",
        "tokens_per_forward_ci95",
        "acceptance_length",
        "acceptance_length_ci95",
        "per_position_acceptance",
        "lossless",
    )
    rec = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "prompts_file": str(Path(prompts).resolve()),
        "judge": judge,
        **{k: result[k] for k in keep if k in result},
        "drafts_per_round": (result.get("drafter") or {}).get("draft_tokens"),
    }
    atomic_write_json(path / EVALUATIONS, [*evaluations(path), rec])
    write_card(path)
    return True


def write_card(path: Path) -> None:
    """Write (or rewrite) the card of the export at `path` from its manifest, its config and
    its evaluations."""
    atomic_write_bytes(Path(path) / CARD, _card(Path(path)).encode())


def _template(manifest: dict) -> str:
    if (manifest.get("rendering") or {}).get("chat_template"):
        return "`chat_template.jinja` here (`prepare --chat-template`; the serving line passes it)"
    return "the target tokenizer's own"


def _vocab(path: Path) -> str:
    cfg = read_json(path / "config.json")
    layer = cfg.get("transformer_layer_config") or cfg
    d, v = cfg.get("draft_vocab_size"), layer.get("vocab_size")
    return f"{d} of the target's {v} tokens" if d and v else "?"


def _card(path: Path) -> str:
    from eyas.stages.export import serve_command

    m = read_json(path / MANIFEST)
    kind, fmt = m.get("kind", "eagle3"), m.get("format", DEFAULT.name)
    others = " | ".join(f for f in FORMATS if f != fmt)
    data, rec = m.get("data") or {}, m.get("recipe") or {}
    lines = [
        f"# A {kind} drafter for {m.get('target')}",
        "",
        f"A speculative-decoding drafter ({kind}) trained by eyas {m.get('eyas_version', '')}, "
        f"written in {fmt}'s format; it drafts {m.get('drafts_per_round')} tokens a round.",
        "",
        "## Serve",
        "",
        "```bash",
        serve_command(path, fmt),
        "```",
        "",
        f"Another engine's format: `eyas export TRAINING_DIR --format {others}` (where the "
        "kind has one).",
        "",
        "## Target and data",
        "",
        f"- target: `{m.get('target')}` (fingerprint `{data.get('model_fingerprint', '?')}`)",
        f"- training data: extraction run `{data.get('run', '?')}` (dataset fingerprint "
        f"`{data.get('dataset_fingerprint', '?')}`; {data.get('samples', '?')} samples, "
        f"{data.get('tokens', '?')} tokens)",
        f"- draft vocabulary: {_vocab(path)}",
        f"- chat template: {_template(m)}",
        "",
        "## Recipe",
        "",
        "| option | value |",
        "|---|---|",
        *[f"| {k.replace('_', '-')} | {v} |" for k, v in rec.items()],
        "",
        "## Measured acceptance",
        "",
    ]
    evals = evaluations(path)
    if not evals:
        lines.append(
            "Not measured yet: `eyas evaluate --model TARGET --drafter "
            f"{path} --data PROMPTS.jsonl` adds its figures here."
        )
    else:
        lines += [
            "| when | prompts | judge | drafts a round | tokens per target forward [95%] | "
            "acceptance length [95%] | per-position acceptance | lossless |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for e in evals:
            ci, aci = (
                e.get("tokens_per_forward_ci95") or ["?", "?"],
                e.get("acceptance_length_ci95") or ["?", "?"],
            )
            pos = " ".join(f"{a}" for a in e.get("per_position_acceptance") or [])
            lines.append(
                f"| {e['when']} | {e.get('prompts')} of `{e['prompts_file']}` | {e['judge']} | "
                f"{e.get('drafts_per_round')} | {e.get('tokens_per_forward')} [{ci[0]}, {ci[1]}] | "
                f"{e.get('acceptance_length')} [{aci[0]}, {aci[1]}] | {pos} | "
                f"{'yes' if e.get('lossless') else 'no'} |"
            )
    return "\n".join(lines) + "\n"

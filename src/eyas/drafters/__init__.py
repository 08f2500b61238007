"""Drafter kinds: what varies between an EAGLE-3 chain drafter and a block drafter, each a
small class behind one protocol, registered by name here and nowhere else.

A kind is a package: its `options` module declares the `train` options only it reads (a
dataclass `Options`, light enough for the command line to import without torch; `train`
refuses them on another kind), and its `kind` module's `KIND` says how to build its drafter
from the target and a run, what its loss is on a training batch, how its trained weights are
written for each serving engine and read back, and how it proposes drafts when `evaluate`
decodes. Its name is written into every file
that holds its weights (`train.json`, `drafter_config.json`, checkpoints' drafter, exports);
a file without one is EAGLE-3's, as everything eyas wrote before kinds existed. Callers ask
`kind(name)` (or `kind_of(config dict)`); they never compare names.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Protocol

from eyas.errors import UsageError

if TYPE_CHECKING:
    import torch

    from eyas.drafters.formats import Format, Served

__all__ = [
    "DEFAULT",
    "KINDS",
    "DrafterKind",
    "Proposer",
    "decoder_fields",
    "kind",
    "kind_for_export",
    "kind_of",
    "option_owners",
    "options_class",
    "with_kind",
]

DEFAULT = "eagle3"
# name -> the kind's package (its `kind` module defines `KIND`, its `options` module
# `Options`), imported on first use.
KINDS = {
    "eagle3": "eyas.drafters.eagle3",
    "dflash": "eyas.drafters.dflash",
    "dspark": "eyas.drafters.dspark",
}


class Proposer(Protocol):
    """A drafter as `evaluate` drives it: the target's states of the prompt, then rounds of
    drafts, each round told which tokens the target kept and their states."""

    target_layers_hf: list[int]
    """HF `hidden_states` indices whose states it reads."""

    def start(self, prompt: list[int], states: torch.Tensor, next_token: int) -> None: ...

    def propose(self, next_token: int, k: int) -> list[int]: ...

    def accept(self, tokens: list[int], states: torch.Tensor) -> None: ...


class DrafterKind(Protocol):
    name: str
    serving: dict[Format, Served]
    """The formats the kind is written in, and how each serves it (`drafters.formats`)."""
    position_name: str
    """What the metrics' positions are called (TTT step, block position)."""
    demo_options: dict
    """The kind's own options `eyas demo` trains its drafter with on the demo target."""

    def unservable(self, cfg) -> str | None:
        """Why no serving format of this kind could run a drafter trained as `cfg` asks
        (said before the training starts, not at its export); None where one can."""

    def drafts_per_round(self, export_config: dict, tokens: int) -> int:
        """Tokens an export (its config.json) drafts a round, asked for `tokens`."""

    def build(self, cfg, meta: dict, model_dir: str, draft_ids: torch.Tensor):
        """(drafter, lm_head) for a training of `cfg` (its own options in `cfg.options`) on a
        run (`meta`) of the target in `model_dir`: the drafter, and the target's lm_head where
        the loss needs it."""

    def config_dict(self, model) -> dict:
        """The drafter's config, as drafter_config.json holds it (without the kind)."""

    def from_config(self, cdict: dict) -> torch.nn.Module:
        """An untrained drafter of the config a `config_dict` gave."""

    def describe(self, cfg) -> str:
        """The kind and its options, for the line that starts a training."""

    def positions(self, cfg) -> int:
        """Predictions per root (or block) that the loss and the metrics count."""

    def prepare_batch(self, model, batch: dict, lm_head, cfg=None) -> None:
        """Add what the loss needs beside the stored tensors (the target's view)."""

    def counts(self, batch: dict, cfg) -> list[float]:
        """Per position, the number of predictions the loss counts in this batch."""

    def loss(self, model, batch: dict, cfg, norm: list[float] | None):
        """(loss, stats): the training loss of a batch, normalised by `norm` (per position
        counts, summed over ranks) or by this batch's; stats (positions, 6) for `summarize`."""

    def export(
        self, fmt: Format, state: dict, cdict: dict, info: dict, target: dict, dtype, k: int
    ):
        """(tensors, config.json) of an export in `fmt` (one of `serving`); raises UsageError
        where the engine would run another network than the one trained."""

    def reads_export(self, cfg: dict) -> bool:
        """Whether an export's config.json is of this kind."""

    def load_export(self, cfg: dict, raw: dict, cfg_file) -> tuple[torch.nn.Module, list[int]]:
        """A drafter from an export's config.json and tensors, and the HF indices of the
        target layers it reads."""

    def proposer(self, model, target_layers_hf: list[int]) -> Proposer:
        """The drafter as `evaluate`'s decoder drives it."""

    def trained_drafts(
        self, model, input_ids: torch.Tensor, states: torch.Tensor, at: int, k: int
    ) -> list[int]:
        """The `k` tokens the training forward predicts for positions at+1 .. at+k, over one
        sequence's ids (1, T) and target states (1, T, L*H), reading the true tokens where
        training does: what the proposer drafts after a prompt of `at` tokens whose next
        token is ids[at], when its drafts are those true tokens."""


def _package(name: str | None) -> str:
    name = name or DEFAULT
    if name not in KINDS:
        raise UsageError(f"unknown drafter kind {name!r}; eyas knows {', '.join(KINDS)}")
    return KINDS[name]


def kind(name: str | None) -> DrafterKind:
    """The registered kind of that name (None: EAGLE-3)."""
    return importlib.import_module(_package(name) + ".kind").KIND


def options_class(name: str | None) -> type:
    """The dataclass of the `train` options that kind alone reads (no torch imported)."""
    return importlib.import_module(_package(name) + ".options").Options


def option_owners() -> dict[str, list[str]]:
    """Each kind's option name -> the kinds that read it, in registry order."""
    owners: dict[str, list[str]] = {}
    for name in KINDS:
        for f in dataclasses.fields(options_class(name)):
            owners.setdefault(f.name, []).append(name)
    return owners


def kind_for_export(cfg: dict) -> DrafterKind | None:
    """The kind an export's config.json is of, or None."""
    for name in KINDS:
        k = kind(name)
        if k.reads_export(cfg):
            return k
    return None


def kind_of(cdict: dict) -> tuple[DrafterKind, dict]:
    """A stored drafter config's kind, and the config without its name."""
    rest = dict(cdict)
    return kind(rest.pop("kind", None)), rest


def with_kind(name: str, cdict: dict) -> dict:
    """A drafter config as it is stored: its kind's name first."""
    return {"kind": name, **cdict}


def decoder_fields(c, model_type: str, layers: int) -> dict:
    """The fields of an export's config.json that describe its decoder layers as
    transformers writes them for `model_type`, from a drafter config of either kind (no
    biases, no tied embeddings, no rope scaling: eyas trains none)."""
    return {
        "model_type": model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }

"""DFlash, the block drafter: a few layers over the target's states that propose a whole
block in one pass (`drafters.block_drafter`, `drafters.block_kind`), written in the DFlash
checkpoint format vLLM (`method: dflash`) and SGLang (`DFLASH`) load."""

from __future__ import annotations

from eyas.drafters.block_drafter import DFlashConfig, DFlashDrafter
from eyas.drafters.block_kind import (
    BlockKind,
    dflash_format,
    dflash_format_fields,
    export_tensors,
    read_block_weights,
    speculators_block_fields,
    whole_vocabulary,
)
from eyas.drafters.formats import SGLANG, VLLM, Format, Served
from eyas.errors import UsageError

ARCH = "DFlashDraftModel"


def _drafts(export_config: dict, tokens: int) -> int:
    # A block of B drafts B - 1 tokens: the export's block, not the tokens asked for.
    d = export_config.get("dflash_config") or export_config  # z-lab's, or speculators'
    return int(d.get("block_size", tokens + 1)) - 1


def _pinned_block(export_config: dict, tokens: int) -> list[str]:
    # SGLang reads the block from the drafter's config and falls back to 16 where it
    # cannot: pinned, so the block verified is the block trained.
    return ["--speculative-num-draft-tokens", str(_drafts(export_config, tokens) + 1)]


def _causal_window(c) -> str | None:
    if not c.attention_window:
        return None
    return (
        f"--attention-window {c.attention_window}: SGLang's DFlash model runs a window causally "
        "inside the block (its sliding layers are decoder layers), so it would run another "
        "network than the one trained. Export --format vllm (its dflash_config.use_swa), or "
        "train without --attention-window"
    )


class DFlash(BlockKind):
    name = "dflash"
    serving = {
        VLLM: Served("dflash"),
        SGLANG: Served(
            "DFLASH",
            flags=_pinned_block,
            refuses=lambda c: _causal_window(c) or whole_vocabulary(c),
            whole_vocabulary=True,
        ),
    }

    def drafts_per_round(self, export_config: dict, tokens: int) -> int:
        return _drafts(export_config, tokens)

    # ---------------------------------------------------------------- export

    def export(
        self, fmt: Format, state: dict, cdict: dict, info: dict, target: dict, dtype, k: int
    ):
        c = DFlashConfig(**cdict)
        if why := self.serving[fmt].refuses(c):
            raise UsageError(why)
        return export_tensors(state, c, dtype), dflash_format(c, info, dtype, ARCH)

    def reads_export(self, cfg: dict) -> bool:
        return (cfg.get("architectures") or [None])[0] == ARCH or cfg.get(
            "speculators_model_type"
        ) == "dflash"

    def load_export(self, cfg: dict, raw: dict, cfg_file) -> tuple[DFlashDrafter, list[int]]:
        if cfg.get("speculators_model_type") == "dflash":  # speculators' own format
            fields, ids = speculators_block_fields(cfg, cfg_file, anchor_drafts=False)
            model = DFlashDrafter(DFlashConfig(**fields))
            read_block_weights(model, raw, cfg_file)
            return model.eval(), ids

        fields, ids = dflash_format_fields(cfg, cfg_file)
        c = DFlashConfig(**fields)
        model = DFlashDrafter(c)
        read_block_weights(model, raw, cfg_file)
        return model.eval(), ids


KIND = DFlash()

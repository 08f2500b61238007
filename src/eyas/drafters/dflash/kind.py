"""DFlash, the block drafter: a few layers over the target's states that propose a whole
block in one pass (`drafters.block_drafter`, `drafters.block_kind`), written in the DFlash
checkpoint format vLLM (`method: dflash`) and SGLang (`DFLASH`) load."""

from __future__ import annotations

from eyas.drafters import decoder_fields
from eyas.drafters.block_drafter import DFlashConfig, DFlashDrafter
from eyas.drafters.block_kind import (
    BlockKind,
    export_tensors,
    read_block_weights,
    speculators_block_fields,
)
from eyas.drafters.blocks import layer_fields
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
        SGLANG: Served("DFLASH", flags=_pinned_block, refuses=_causal_window),
    }

    def drafts_per_round(self, export_config: dict, tokens: int) -> int:
        return _drafts(export_config, tokens)

    # ---------------------------------------------------------------- export

    def export(
        self, fmt: Format, state: dict, cdict: dict, info: dict, target: dict, dtype, k: int
    ):
        from eyas import __version__

        c = DFlashConfig(**cdict)
        if why := self.serving[fmt].refuses(c):
            raise UsageError(why)
        tensors = export_tensors(state, c, dtype)
        config = {
            "architectures": [ARCH],
            **decoder_fields(c, "qwen3", c.num_hidden_layers),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.hidden_size,
            # Both engines read DFlash's target_layer_ids as outputs of 0-based layers.
            "dflash_config": {
                "target_layer_ids": list(info["aux_layers"]),
                "block_size": c.block_size,
                "mask_token_id": c.mask_token_id,
                # vLLM: every layer a sliding window of W, still non-causal inside the block.
                **(
                    {"use_swa": True, "swa_window_size": c.attention_window, "causal": False}
                    if c.attention_window
                    else {}
                ),
            },
            "torch_dtype": str(dtype).removeprefix("torch."),
            "eyas_version": __version__,
        }
        return tensors, config

    def reads_export(self, cfg: dict) -> bool:
        return (cfg.get("architectures") or [None])[0] == ARCH or cfg.get(
            "speculators_model_type"
        ) == "dflash"

    def load_export(self, cfg: dict, raw: dict, cfg_file) -> tuple[DFlashDrafter, list[int]]:
        from eyas.targets.layers import hf_indices

        if cfg.get("speculators_model_type") == "dflash":  # speculators' own format
            fields, ids = speculators_block_fields(cfg, cfg_file, anchor_drafts=False)
            model = DFlashDrafter(DFlashConfig(**fields))
            read_block_weights(model, raw, cfg_file)
            return model.eval(), ids

        d = cfg.get("dflash_config") or {}
        windowed = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
        if d.get("causal") or windowed or (d.get("use_swa") and not d.get("swa_window_size")):
            said = {k: d[k] for k in ("causal", "use_swa", "swa_window_size") if k in d}
            raise UsageError(
                f"{cfg_file}: dflash_config {said}, layer_types {cfg.get('layer_types')}: an "
                "attention eyas's DFlash drafter does not have (a block that sees itself whole, "
                "one window or none on every layer)"
            )
        ids = d["target_layer_ids"]
        c = DFlashConfig(
            **layer_fields(cfg, cfg_file),
            num_hidden_layers=cfg["num_hidden_layers"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_layers=len(ids),
            block_size=d["block_size"],
            mask_token_id=d["mask_token_id"],
            attention_window=d["swa_window_size"] if d.get("use_swa") else None,
        )
        model = DFlashDrafter(c)
        read_block_weights(model, raw, cfg_file)
        return model.eval(), hf_indices(ids)


KIND = DFlash()

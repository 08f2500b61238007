"""DSpark, the block drafter with a Markov head and a confidence head: the block drafter's
kind (`drafters.block_kind`) with every block slot drafting, its heads in the loss, the
speculators format vLLM loads (`method: dspark`) and the DFlash format with the heads that
SGLang loads (`DSPARK`)."""

from __future__ import annotations

import torch.nn.functional as F

from eyas.drafters import decoder_fields
from eyas.drafters.block_kind import (
    BlockKind,
    dflash_format,
    dflash_format_fields,
    export_tensors,
    read_block_weights,
    speculators_block_fields,
    until_miss,
    whole_vocabulary,
)
from eyas.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eyas.drafters.dspark.options import MARKOV_HEADS
from eyas.drafters.formats import SGLANG, VLLM, Format, Served
from eyas.drafters.loss import at_rows
from eyas.errors import UsageError

ARCH = "DSparkSpeculator"  # speculators' format (vLLM)
SGLANG_ARCH = "Qwen3DSparkModel"  # the DFlash format with the heads (SGLang)


def _full_attention(c) -> str | None:
    if not c.attention_window:
        return None
    return (
        f"--attention-window {c.attention_window}: eyas writes DSpark with full attention only: "
        "train without it"
    )


def _sglang_runs(c) -> str | None:
    """Why SGLang's DSPARK model would run another network than `c`: it has full attention
    over the block, always a Markov head and a confidence head, and the target's whole head."""
    if why := _full_attention(c) or whole_vocabulary(c):
        return why
    if getattr(c, "markov_rank", None) == 0:
        return (
            "--markov-rank 0: SGLang's DSPARK model always has a Markov head; export --format vllm"
        )
    if getattr(c, "confidence_head", None) is False:
        return (
            "--confidence-weight 0: SGLang's DSPARK model loads a confidence head and refuses a "
            "checkpoint without one; export --format vllm"
        )
    return None


def _block(export_config: dict, tokens: int) -> int:
    """The export's block (every slot drafts): speculators' field, or dflash_config's."""
    d = export_config.get("dflash_config") or export_config
    return int(d.get("block_size", tokens))


def _pinned_block(export_config: dict, tokens: int) -> list[str]:
    # SGLang drafts num_draft_tokens - 1 tokens a round: pinned to the block trained.
    return ["--speculative-num-draft-tokens", str(_block(export_config, tokens) + 1)]


def _speculators_config(c: DSparkConfig, info: dict, target: dict, dtype) -> dict:
    """speculators' DSpark config.json (vLLM's `method: dspark`), less the heads' fields."""
    from eyas import __version__
    from eyas.targets.layers import hf_indices

    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": [ARCH],
        "speculators_model_type": "dspark",
        "speculators_version": "0.1.0",
        "transformer_layer_config": {
            **decoder_fields(c, "qwen3", c.num_hidden_layers),
            "torch_dtype": dtype_name,
        },
        "draft_vocab_size": c.draft_vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": c.hidden_size,
        "aux_hidden_state_layer_ids": hf_indices(info["aux_layers"]),
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": False,
        # Written whatever a loader's default: served without it, a DSpark export has
        # drafted at about 1% acceptance (the slots shift by one).
        "sample_from_anchor": True,
        "speculators_config": {
            "algorithm": "dspark",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size}],
            "verifier": {
                "name_or_path": target["path"],
                "architectures": target["architectures"],
            },
        },
        "torch_dtype": dtype_name,
        "eyas_version": __version__,
    }


def _sglang_config(c: DSparkConfig, info: dict, target: dict, dtype) -> dict:
    """SGLang's DSPARK config.json, less the heads' fields: the DFlash format (block slot j
    predicts anchor + j + 1, as eyas trains it)."""
    return dflash_format(c, info, dtype, SGLANG_ARCH)


class DSpark(BlockKind):
    name = "dspark"
    serving = {
        VLLM: Served("dspark", refuses=_full_attention, writer=_speculators_config),
        SGLANG: Served(
            "DSPARK",
            flags=_pinned_block,
            refuses=_sglang_runs,
            writer=_sglang_config,
            whole_vocabulary=True,
        ),
    }
    config_class, model_class = DSparkConfig, DSparkDrafter
    first_slot = 0  # the anchor's slot drafts too: slot j predicts the token at anchor + j + 1

    def own_config(self, cfg, target_config, draft_vocab: int) -> dict:
        o = cfg.options
        return {
            **super().own_config(cfg, target_config, draft_vocab),
            "markov_rank": o.markov_rank,
            "markov_head": o.markov_head,
            "confidence_head": o.confidence_weight > 0,
        }

    def describe(self, cfg) -> str:
        o = cfg.options
        heads = (
            f"Markov head rank {o.markov_rank} ({o.markov_head})"
            if o.markov_rank
            else "no Markov head"
        )
        conf = f", confidence head x{o.confidence_weight:g}" if o.confidence_weight else ""
        window = f", attention window {cfg.attention_window}" if cfg.attention_window else ""
        return (
            f"DSpark, blocks of {o.block_size}, {o.drafter_layers} layer(s), {heads}{conf}{window}"
            f"{until_miss(o)}"
        )

    def drafts_per_round(self, export_config: dict, tokens: int) -> int:
        return _block(export_config, tokens)

    def outputs(self, model: DSparkDrafter, batch: dict) -> dict:
        # every slot predicts: the i-th predicting slot is slot i
        args = (batch["input_ids"], batch["aux"], batch["anchors"])
        h, prev = model.training_states(*args, batch.get("segments"), batch.get("positions"))
        return {
            "states": h,
            "head": model.slot_head(prev),
            "confidence": model.confidence(h, prev),
        }

    def slot_loss(self, out: dict, slot: int, s, lmask, chain, i: int, cfg, rows):
        """The block loss of the slot, plus the confidence head's: the binary cross-entropy
        of its logit against the slot's acceptance, 1 - TV = sum(min(p, q)), not
        differentiated."""
        loss = super().slot_loss(out, slot, s, lmask, chain, i, cfg, rows)
        if out["confidence"] is None or not cfg.options.confidence_weight:
            return loss
        accept = s.acceptance().clamp(0, 1)  # (B, r)
        conf = at_rows(out["confidence"][..., i], rows).float()
        bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        return loss + cfg.options.confidence_weight * bce

    # ---------------------------------------------------------------- export

    def export(
        self, fmt: Format, state: dict, cdict: dict, info: dict, target: dict, dtype, k: int
    ):
        c = DSparkConfig(**cdict)
        served = self.serving[fmt]
        if why := served.refuses(c):
            raise UsageError(why)
        heads = {
            "markov_rank": c.markov_rank,
            "markov_head_type": c.markov_head,
            "enable_confidence_head": c.confidence_head,
            "confidence_head_with_markov": c.confidence_head and c.markov_rank > 0,
        }
        return export_tensors(state, c, dtype), {**served.writer(c, info, target, dtype), **heads}

    def reads_export(self, cfg: dict) -> bool:
        arch = (cfg.get("architectures") or [None])[0]
        return arch in (ARCH, SGLANG_ARCH) or cfg.get("speculators_model_type") == "dspark"

    def load_export(self, cfg: dict, raw: dict, cfg_file) -> tuple[DSparkDrafter, list[int]]:
        if cfg.get("markov_head_type", "vanilla") not in MARKOV_HEADS:
            raise UsageError(
                f"{cfg_file}: markov_head_type = {cfg.get('markov_head_type')!r}; eyas's DSpark "
                f"drafter has {' and '.join(MARKOV_HEADS)}, so it cannot evaluate this export"
            )
        if (cfg.get("architectures") or [None])[0] == SGLANG_ARCH:
            fields, ids = dflash_format_fields(cfg, cfg_file)
        else:
            fields, ids = speculators_block_fields(cfg, cfg_file, anchor_drafts=True)
        c = DSparkConfig(
            **fields,
            markov_rank=cfg.get("markov_rank", 256),
            markov_head=cfg.get("markov_head_type", "vanilla"),
            confidence_head=cfg.get("enable_confidence_head", True),
        )
        model = DSparkDrafter(c)
        read_block_weights(model, raw, cfg_file)
        return model.eval(), ids


KIND = DSpark()

"""`eyas estimate`: the disk an extraction run will take, before there is a dataset or a GPU,
and the memory the head's logits take in a training step.

The disk figures are the store's own (`eyas.run.store`: bytes per token of the layout, each
sample's header and journal line), so the estimate is what `extract` will write. The memory
figures count float32 tensors of (batch tokens, draft vocabulary): what a step keeps for the
backward pass of each predicted position, with the head whole, against eyas's head in parts
(`drafters.loss.by_rows`); bench/head_memory.py measures both.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.stages.config import EstimateConfig

__all__ = ["Estimate", "estimate"]


@dataclass(frozen=True)
class Estimate:
    cfg: EstimateConfig
    hidden_size: int
    layout: str
    store_dtype: str
    how: str
    """Where the dtype came from, in words ('' when it was given)."""
    per_token: int
    per_sample: int
    total: int

    def render(self) -> str:
        from eyas.run.fsutil import human_bytes

        c = self.cfg
        # what other tools pickle: bf16 final + the aux states, int64 ids and a mask
        peers = 2 * (c.aux_layers + 1) * self.hidden_size + 16
        halve = "; --store-dtype bfloat16 halves this" if self.store_dtype == "float32" else ""
        return (
            f"{c.samples:,} samples x {c.tokens_per_sample:,.0f} tokens, H={self.hidden_size}, "
            f"{c.aux_layers} target layers, "
            f"{self.layout}, {self.store_dtype}{self.how}:\n"
            f"  {self.per_token:,} bytes per token + {self.per_sample:,} bytes per sample "
            "(header, journal line)\n"
            f"  {human_bytes(self.total)} in all ({_decimal(self.total)}); "
            f"{self.per_token / peers:.0%} of the {peers:,} bytes per token other tools store for "
            f"{c.aux_layers} layers and the final state (in bfloat16, int64 ids{halve})\n"
            + self.logits_memory()
        )

    def logits_memory(self) -> str:
        """The head's logits in a training step of --batch-tokens over the draft vocabulary."""
        from eyas.drafters.loss import HEAD_ELEMENTS
        from eyas.run.fsutil import human_bytes

        c = self.cfg
        one = c.batch_tokens * c.draft_vocab_size * 4  # one (tokens, D) float32 tensor
        part = min(one, HEAD_ELEMENTS * 4)
        # In parts: the target's labels, and one part's logits, log-probabilities, target rows
        # and products (about 6 of them) at a time. Whole: besides the labels, each predicted
        # position keeps two for the backward pass (log-probabilities and target
        # probabilities), about three more are alive at once, and a block kind keeps the
        # logits of all its slots (one more a slot).
        parts = one + 6 * part
        eagle3 = (1 + 2 * 3 + 3) * one  # 3 TTT steps
        block = (1 + 3 * 3 + 3) * one  # 3 predicting slots, a block at every position
        return (
            f"training, --batch-tokens {c.batch_tokens:,}, draft vocabulary {c.draft_vocab_size:,}: "
            f"one (tokens, vocabulary) float32 tensor of the head's logits is {human_bytes(one)}; "
            f"eyas applies the head in parts of at most {human_bytes(HEAD_ELEMENTS * 4)}, so a "
            f"step holds about {human_bytes(parts)} of logits, any kind (the whole head at once: "
            f"about {human_bytes(eagle3)} for EAGLE-3, {human_bytes(block)} for DFlash with a "
            "block at every position)"
        )


def estimate(cfg: EstimateConfig) -> Estimate:
    """The run's size; ValueError (a ModelDirError for --model) for what cannot be sized."""
    from eyas.run.store import overhead_per_sample, projected_bytes
    from eyas.targets.backends import new_layout
    from eyas.targets.target import DTYPES, resolve_device, resolve_dtype, target_facts

    H = cfg.hidden_size or target_facts(cfg.model).hidden_size
    layout = new_layout(cfg.backend, cfg.storage, cfg.target, cfg.aux_layers)  # as extract's
    store_dtype, how = cfg.store_dtype, ""
    if store_dtype == "auto":  # as extract decides: its compute dtype on that device
        where = resolve_device(cfg.device)
        store_dtype = str(resolve_dtype("auto", where)).removeprefix("torch.")
        how = f" (what extract stores on {'a GPU' if where == 'cuda' else 'a CPU'} unless --store-dtype)"
    dt = DTYPES[store_dtype]
    return Estimate(
        cfg=cfg,
        hidden_size=H,
        layout=layout.name(),
        store_dtype=store_dtype,
        how=how,
        per_token=layout.bytes_per_token(H, dt, cfg.draft_vocab_size),
        per_sample=overhead_per_sample(layout, H, dt, int(cfg.tokens_per_sample)),
        total=projected_bytes(
            layout, H, dt, cfg.samples, cfg.tokens_per_sample, cfg.draft_vocab_size
        ),
    )


def _decimal(n: float) -> str:
    """Bytes in decimal units (what disks are sold in), beside human_bytes' binary ones."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.2f} kB"

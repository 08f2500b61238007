"""`eyas estimate`: the disk an extraction run will take, before there is a dataset or a GPU.

The figures are the store's own (`eyas.run.store`: bytes per token of the layout, each
sample's header and journal line), so the estimate is what `extract` will write.
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
            f"{c.aux_layers} layers and the final state (in bfloat16, int64 ids{halve})"
        )


def estimate(cfg: EstimateConfig) -> Estimate:
    """The run's size; ValueError (a ModelDirError for --model) for what cannot be sized."""
    from eyas.run.store import Layout, overhead_per_sample, projected_bytes
    from eyas.targets.target import DTYPES, resolve_device, resolve_dtype, target_facts

    H = cfg.hidden_size or target_facts(cfg.model).hidden_size
    layout = Layout(cfg.storage, cfg.target, cfg.aux_layers)
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

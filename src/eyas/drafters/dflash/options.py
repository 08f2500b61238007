"""DFlash's own `train` options: the block drafter's (`drafters.block_options`), nothing
more. `TrainConfig.options` holds one of these when `--kind dflash`; another kind refuses
them."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.drafters.block_options import BlockOptions


@dataclass(frozen=True, kw_only=True)
class Options(BlockOptions):
    pass

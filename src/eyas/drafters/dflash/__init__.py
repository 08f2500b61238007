"""DFlash, the block drafter: `model` (its config, block attention over the target's context
and the drafter) and `kind` (what the registry asks of it: build, loss, exports, proposer).

Reached through the registry (`eyas.drafters`) alone.
"""

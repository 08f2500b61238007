"""EAGLE-3, the chain drafter: `model` (its config, its decoder layer and the drafter, with
training-time test), `attention` (TTT attention in three implementations) and `kind` (what
the registry asks of it: build, loss, exports, proposer).

Reached through the registry (`eyas.drafters`) alone.
"""

"""The pipeline's stages, one module per verb: generate, prepare, extract, verify,
train, export, evaluate; their configs in `config` (training's own in `eyas.training`).
Each has one shape: a config (its inputs and outputs included) goes in, a summary comes out
that renders itself for people (`render()`) and, where a command prints JSON, for machines."""

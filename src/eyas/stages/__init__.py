"""The pipeline's stages, one module per verb: generate, prepare, extract, verify,
train, export, evaluate; their configs in `config` (training's own in `eyas.training`)."""

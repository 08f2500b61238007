"""Targets and the engines that run them.

- `target`: what every backend knows of a target from its directory alone (sizes, layer
  conventions, wrapped layouts such as Kimi-K2.5's, the weights that must be present, its
  tokenizer) and the plain HF load that refuses an incomplete checkpoint;
- `layers`: which target layers are read, in the conventions of every engine;
- `weights`: single tensors read from a checkpoint's shards (embeddings, head, final norm);
- `backends`: the engines that produce hidden states (`hf`, `vllm`).

The built-in demo target and the tiny targets built from configs are `eyas.demo_target`.

May import: `eyas.run` and `eyas.host`. Never the data, drafter, training or stage modules
above.
"""

"""Targets and the engines that run them.

- `target`: what every backend knows of a target from its directory alone (sizes, layer
  conventions, wrapped layouts such as Kimi-K2.5's, the weights that must be present, its
  tokenizer) and the plain HF load that refuses an incomplete checkpoint;
- `weights`: single tensors read from a checkpoint's shards (embeddings, head, final norm);
- `tiny`: tiny targets built from configs, and twins of real checkpoints;
- `demo_target`, `demo_data`: the built-in demo target and the synthetic conversations it
  was trained on;
- `backends`: the engines that produce hidden states (`hf`, `vllm`).

May import: `eyas.run` and `eyas.host`. Never the data, training or stage modules above.
"""

"""Evaluation's decoders: what a judge measures and how eyas decodes.

- `result`: `EvalResult`, the counts every judge fills (rounds, acceptances per position,
  per prompt and per context length, times, the lossless check) and their intervals;
- `hf`: eyas's own greedy and speculative decoding with a transformers target: hooks on the
  target layers a drafter reads, the chain of proposals verified in one forward a round,
  and the loop over prompts (progress, a signal drops the prompt it came in, early stop);
- `vllm`: vLLM as the judge, greedy without and with the drafter, its own counters.

The `evaluate` stage (`eyas.stages.evaluate`) reads the prompts and the export and calls them.

May import: everything below `eyas.stages`. Never the stages.
"""

"""Conversations in, and the prepared dataset they become.

- `records`: input records in every form eyas reads, read by one reader;
- `chat`: the target's chat template rendered, and the assistant-only loss mask derived
  from it;
- `dataset`: a prepared dataset's format (token ids, loss mask, the draft vocabulary's
  counts), written and read here alone, and the tokenizer fingerprint it is checked by.

The stages that make them are `eyas.stages.generate` and `eyas.stages.prepare`.

May import: `eyas.run`, `eyas.host` and `eyas.targets` (a target's tokenizer and chat
template). Never drafters, training or the stages above.
"""

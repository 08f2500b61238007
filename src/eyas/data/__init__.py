"""Conversations in: input records in every form eyas reads (`records`), the target's own
answers from a serving engine (`generate`), and prepared datasets of token ids with an
assistant-only loss mask (`prepare`).

May import: `eyas.run`, `eyas.host` and `eyas.targets` (a target's tokenizer and chat
template). Never training or the stages above.
"""

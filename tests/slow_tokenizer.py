"""A tokenizer that exists only as Python code, loaded with `trust_remote_code`.

Kimi's tokenizer is like this: a `PreTrainedTokenizer` subclass shipped next to the weights,
with no `tokenizer.json`, so no character offsets. This one wraps the byte-level BPE of a tiny
target (its vocabulary file is that target's `tokenizer.json`, renamed) and gives the same ids
as the target's fast tokenizer; tests copy this file into a model directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizer


class SlowBPETokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "slow_bpe.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        self.vocab_file = vocab_file
        self._bpe = Tokenizer.from_file(vocab_file)
        self._vocab = self._bpe.get_vocab(with_added_tokens=True)
        self._tokens = {i: t for t, i in self._vocab.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # special tokens were split off already; what is left is ordinary text
        return self._bpe.encode(text, add_special_tokens=False).tokens

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self._tokens[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._bpe.decoder.decode(tokens)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None):
        out = Path(save_directory) / ((filename_prefix or "") + "slow_bpe.json")
        if Path(self.vocab_file).resolve() != out.resolve():
            shutil.copy(self.vocab_file, out)
        return (str(out),)

"""The reference encoder backend over a ``tokenizers.Tokenizer``, and flat ids.

Every backend gives flat ``(tokens uint32, lengths int64)``; ``HFBackend`` is what the others
are compared against.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np


def flatten_ids(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Flatten per-text id lists to ``(uint32 tokens, int64 lengths)``, no per-text array."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(
        itertools.chain.from_iterable(ids), dtype=np.uint32, count=int(lengths.sum())
    )
    return tokens, lengths


class HFBackend:
    """The reference backend over a ``tokenizers.Tokenizer`` (a ``backend_tokenizer``)."""

    name = "hf"

    def __init__(self, tokenizer: Any):
        import tokenizers

        self.tokenizer = tokenizer
        self.version = tokenizers.__version__

    def encode_lists(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Per-text ids from ``encode_batch``: exactly ``tokenizer(text)["input_ids"]``."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def encode_flat(
        self, texts: list[str], add_special_tokens: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Flat ids through ``encode_batch_fast`` (the same ids, no character offsets)."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encodings = encode(texts, add_special_tokens=add_special_tokens)
        return flatten_ids([e.ids for e in encodings])


#: ``(texts, add_special_tokens) -> (tokens uint32, lengths int64)``, flat.
EncodeFlat = Callable[[list[str], bool], tuple[np.ndarray, np.ndarray]]

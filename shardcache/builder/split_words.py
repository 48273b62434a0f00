"""Ids for tokenizers whose pre-tokenizer first splits at whitespace: HF's own parts, each
distinct word encoded once.

When the pre-tokenizer starts by splitting at whitespace and dropping it (``WhitespaceSplit``,
``Whitespace``, ``BertPreTokenizer``) and every later step works on each piece alone
(``Metaspace`` that prepends to every piece or to none, ``Punctuation``, ``Digits``,
``Split``), the ids of a text are the ids of the words of its normalized text, in order. T5's
Unigram tokenizer has this shape (a precompiled charsmap, then ``WhitespaceSplit`` and
``Metaspace``). :class:`SplitWords` normalizes each text whole with HF's normalizer, splits it
at whitespace as HF does (Rust's ``char::is_whitespace``), and encodes each distinct word once
with HF's pre-tokenizer and model (:class:`~shardcache.builder.chunk_cache.ChunkCache`).
Normalization and the model are HF's own; the split is this module's, and it is checked at load
on every whitespace character. A text holding an added token goes to HF whole. Ids come
without the post-processor's special tokens; the caller adds them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardcache.builder.chunk_cache import AddedTokens, ChunkCache
from shardcache.version import __version__ as BACKEND_VERSION

#: Name of this backend in a build's ``encoder`` selection and report (its version is
#: :data:`BACKEND_VERSION`, the package's).
BACKEND_NAME = "shardcache-words"
__all__ = ["BACKEND_NAME", "BACKEND_VERSION", "RELEASES_GIL", "SplitWords"]

#: The split and the lookups run in Python, holding the GIL: a build runs its partitions in
#: processes to use every core.
RELEASES_GIL = False

#: Pre-tokenizers that split at whitespace and drop it: one of them must come first.
SPLITS_AT_WHITESPACE = frozenset({"WhitespaceSplit", "Whitespace", "BertPreTokenizer"})

#: Pre-tokenizers that work on each piece alone, allowed after the first.
PER_PIECE = SPLITS_AT_WHITESPACE | {"Punctuation", "Digits", "Split", "Metaspace"}

#: Whitespace to HF (Unicode White_Space: Rust's ``char::is_whitespace``); ``str.split`` also
#: splits at the separators U+001C..U+001F, which HF keeps in a word.
WHITESPACE = re.compile("[\t-\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")
PYTHON_ONLY_SPACE = "\x1c\x1d\x1e\x1f"


def words(normalized: str) -> list[str]:
    """``normalized`` split at whitespace as HF's pre-tokenizers split it.

    Args:
        normalized: a text after HF's normalizer.

    Returns:
        Its non-empty pieces between whitespace.
    """
    if not any(c in normalized for c in PYTHON_ONLY_SPACE):
        return normalized.split()
    return [w for w in WHITESPACE.split(normalized) if w]


class SplitWords:
    """Exact ids (without special tokens) for a tokenizer that first splits at whitespace.

    Args:
        data: the tokenizer.json content, parsed.
        reference: the HF backend of the same JSON (``tokenizer``, truncation and padding off,
            and ``encode_flat``): its normalizer, pre-tokenizer and model do the work.

    Raises:
        ValueError: the pre-tokenizer does not split at whitespace first, a later step may
            depend on other pieces, the model is randomized, or the split differs from HF's on
            the load-time probe (the message says which).
    """

    def __init__(self, data: Mapping[str, Any], reference: Any):
        steps = _pre_tokenizer_steps(data.get("pre_tokenizer"))
        if not steps or steps[0].get("type") not in SPLITS_AT_WHITESPACE:
            first = steps[0].get("type") if steps else None
            raise ValueError(f"pre-tokenizer {first!r} does not split at whitespace first")
        for step in steps[1:]:
            kind = step.get("type")
            if kind not in PER_PIECE:
                raise ValueError(f"pre-tokenizer step {kind!r} may depend on other pieces")
            if kind == "Metaspace" and step.get("prepend_scheme") == "first":
                raise ValueError("Metaspace prepends to the first piece of a text only")
        model = data.get("model") or {}
        if model.get("dropout"):
            raise ValueError(f"the model drops merges at random (dropout {model['dropout']})")
        self.reference = reference
        tokenizer = reference.tokenizer
        self.pre_tokenize = tokenizer.pre_tokenizer.pre_tokenize_str
        self.tokenize = tokenizer.model.tokenize
        normalizer = tokenizer.normalizer
        self.normalize = normalizer.normalize_str if normalizer is not None else str
        self.added = AddedTokens(data.get("added_tokens") or [], self.normalize)
        self.cache = ChunkCache(self.encode_word)
        # T5's shape (WhitespaceSplit, then Metaspace that prepends to every piece): a word
        # without the marker is one piece, the marker and the word
        self.marker = _marker_only(steps)
        self._check_split()

    def _check_split(self) -> None:
        """HF's pre-tokenization of a text equals that of its :func:`words`, one by one, on a
        text holding every character either Python or HF counts as whitespace."""
        spaces = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
        others = ["▁", ".", "-", "'", "1", "é", "中", "\u0301", "\u200b", "\u180e"]
        probe = " ".join(f"a{c}b{c}{c}1{c}" for c in [*spaces, *others]) + " \u3000end "
        normalized = self.normalize(probe)
        want = [piece for piece, _ in self.pre_tokenize(normalized)]
        got = [piece for word in words(normalized) for piece, _ in self.pre_tokenize(word)]
        if got != want:
            raise ValueError("the pre-tokenizer splits the probe text otherwise than at words")
        for word in words(normalized) if self.marker else ():
            if self.marker not in word and [p for p, _ in self.pre_tokenize(word)] != [
                self.marker + word
            ]:
                raise ValueError(f"the Metaspace step does not make {word!r} one piece")

    def encode_word(self, word: str) -> list[int]:
        """HF's ids of one word of a normalized text (its pre-tokenizer, then its model).

        Args:
            word: a normalized word, without whitespace.

        Returns:
            Its ids.
        """
        if self.marker and self.marker not in word:
            return [t.id for t in self.tokenize(self.marker + word)]
        return [t.id for piece, _ in self.pre_tokenize(word) for t in self.tokenize(piece)]

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Ids of ``texts`` without special tokens, as HF's ``encode_batch`` gives them.

        Args:
            texts: the texts.

        Returns:
            ``(uint32 tokens, int64 lengths)``, flat, in text order.
        """
        chunk_lists: list[list[str] | None] = []
        for text in texts:
            chunks = None
            if not self.added.in_raw(text):
                normalized = self.normalize(text)
                if not self.added.in_normalized(normalized):
                    chunks = words(normalized)
            chunk_lists.append(chunks)
        return self.cache.encode_or_whole(
            texts, chunk_lists, lambda whole: self.reference.encode_flat(whole, False)
        )


def _pre_tokenizer_steps(pre_tokenizer: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The pre-tokenizer's steps in order (a ``Sequence`` flattened)."""
    if pre_tokenizer is None:
        return []
    if pre_tokenizer.get("type") == "Sequence":
        return [
            s for p in pre_tokenizer.get("pretokenizers") or [] for s in _pre_tokenizer_steps(p)
        ]
    return [pre_tokenizer]


def _marker_only(steps: list[Mapping[str, Any]]) -> str:
    """The Metaspace marker when the steps are ``WhitespaceSplit`` then a ``Metaspace`` that
    prepends it to every piece (T5), else ``""``."""
    if [step.get("type") for step in steps] != ["WhitespaceSplit", "Metaspace"]:
        return ""
    metaspace = steps[1]
    scheme = metaspace.get("prepend_scheme")
    if scheme is None:  # before tokenizers 0.15: add_prefix_space
        scheme = "always" if metaspace.get("add_prefix_space", True) else "never"
    return str(metaspace.get("replacement", "\u2581")) if scheme == "always" else ""

"""BERT-style WordPiece ids equal to HF's: ASCII chunks in Python, the rest through HF.

For ``BertNormalizer`` (or none), ``BertPreTokenizer`` and ``WordPiece``, all HF does to ASCII
text is per character: ``AsciiWordPiece`` learns those tables from the HF tokenizer at load and
checks them on every ASCII character. Texts split into chunks at ASCII whitespace, which nothing
HF does crosses; an ASCII chunk is encoded in Python, any other chunk by HF alone (Unicode
tables differ between libraries), a text holding an added token by HF whole. Ids come without
the post-processor's special tokens; the caller adds them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from shardcache.builder import chunk_cache
from shardcache.builder.chunk_cache import AddedTokens, ChunkedEncoder, ascii_table

__all__ = ["AsciiWordPiece"]

ASCII = "".join(map(chr, range(128)))


class AsciiWordPiece(ChunkedEncoder):
    """Exact WordPiece ids (without special tokens) for a BERT-style tokenizer.

    ``reference`` is the HF backend of the same JSON: it encodes what this class does not, and
    the tables come from it. Raises ``ValueError`` (naming the part) when the tokenizer is not
    BERT-style WordPiece or its ASCII behaviour is not per character.
    """

    #: The backend's name in a build's ``encoder`` selection and report.
    name = "shardcache-wordpiece"

    def __init__(self, data: Mapping[str, Any], reference: Any):
        model = data.get("model") or {}
        normalizer = data.get("normalizer")
        pre_tokenizer = data.get("pre_tokenizer")
        if model.get("type") != "WordPiece":
            raise ValueError(f"model {model.get('type')!r}, not WordPiece")
        if normalizer is not None and normalizer.get("type") != "BertNormalizer":
            raise ValueError(f"normalizer {normalizer.get('type')!r}, not BertNormalizer")
        if (pre_tokenizer or {}).get("type") != "BertPreTokenizer":
            raise ValueError(f"pre-tokenizer {(pre_tokenizer or {}).get('type')!r}, not Bert")
        self.vocab: dict[str, int] = dict(model["vocab"])
        unk = model.get("unk_token", "[UNK]")
        if unk not in self.vocab:
            raise ValueError(f"the unknown token {unk!r} is not in the vocabulary")
        self.unk = self.vocab[unk]
        self.prefix = str(model.get("continuing_subword_prefix") or "")
        self.max_chars = int(model.get("max_input_chars_per_word", 100))
        # no match is longer than the longest entry: the search starts there, not at the end
        self.longest = max(map(len, self.vocab), default=0)
        super().__init__(reference)
        self.tokenizer = tokenizer = reference.tokenizer
        self.table, space, punct = _ascii_tables(tokenizer)
        kept = {code: out for code, out in self.table.items() if out}
        self.byte_table = bytes.maketrans(bytes(kept), "".join(kept.values()).encode())
        self.byte_deletes = bytes(code for code, out in self.table.items() if not out)
        # within a chunk (no whitespace): each punctuation character alone, runs of the rest
        self.piece_re = re.compile(
            f"[{re.escape(punct)}]|[^{re.escape(punct)}]+" if punct else ".+", re.DOTALL
        )
        self._check_tables(space)
        normalizer = tokenizer.normalizer
        self.added = AddedTokens(
            data.get("added_tokens") or [], normalizer.normalize_str if normalizer else None
        )
        # word -> ids, shared by every thread (a lost entry is only computed again)
        self.words = _WordCache(self)

    def _check_tables(self, space: str) -> None:
        """Check that this class's split and normalization equal HF's on every ASCII character."""
        if " " not in space:
            raise ValueError("HF does not split at a space")
        for c in space:
            if not c.isspace():
                raise ValueError(f"HF splits at {c!r}, which str.split keeps")
        kept = ASCII.translate(self.table)
        for c in kept:
            if c.isspace() and c not in space:
                raise ValueError(f"str.split splits at {c!r}, which HF keeps in words")
        # HF normalizes the chunks it encodes again: a second pass must change nothing
        if kept.translate(self.table) != kept:
            raise ValueError("the normalizer changes its own output on ASCII text")
        text = " ".join(f"a{c}b{c}{c}Z" for c in ASCII)
        normalized = text.translate(self.table)
        normalizer = self.tokenizer.normalizer
        if normalizer is not None and normalizer.normalize_str(text) != normalized:
            raise ValueError("the normalizer is not per character on ASCII text")
        words = [w for w, _ in self.tokenizer.pre_tokenizer.pre_tokenize_str(normalized)]
        if words != self._pieces(normalized):
            raise ValueError("the pre-tokenizer splits ASCII text otherwise than per character")

    def _normalize(self, text: str) -> str:
        """``text`` with its ASCII characters mapped by ``table`` (the others unchanged)."""
        if text.isascii():
            return text.translate(self.table)
        # str.translate looks every character up; on UTF-8 bytes (where an ASCII byte is
        # always its own character) one table does it at memory speed
        raw = text.encode("utf-8", "surrogatepass")
        return raw.translate(self.byte_table, self.byte_deletes).decode("utf-8", "surrogatepass")

    def _pieces(self, normalized: str) -> list[str]:
        return [p for chunk in normalized.split() for p in self.piece_re.findall(chunk)]

    def word_ids(self, word: str) -> tuple[int, ...]:
        """WordPiece ids of one normalized word (no whitespace or punctuation).

        The longest vocabulary match from the left, then again with the continuing prefix; the
        unknown token for the whole word if any part fails.
        """
        if len(word) > self.max_chars:
            return (self.unk,)
        out: list[int] = []
        start, n = 0, len(word)
        while start < n:
            prefix = self.prefix if start else ""
            end = min(n, start + self.longest)  # no entry is longer
            while end > start:
                found = self.vocab.get(prefix + word[start:end])
                if found is not None:
                    out.append(found)
                    break
                end -= 1
            else:
                return (self.unk,)
            start = end
        return tuple(out)

    def chunks(self, text: str) -> list[str] | None:
        """The chunks of ``text`` normalized, or None to encode it with HF whole."""
        # an added token is matched in the raw text (a normalized one in HF's normalized text,
        # known here for ASCII only) before anything else: HF encodes those texts
        if self.added.in_raw(text) or (self.added.normalized and not text.isascii()):
            return None
        n = self._normalize(text)
        if self.added.in_normalized(n):
            return None
        # split at ASCII whitespace only: other whitespace is left to HF in its chunk
        return n.split() if n.isascii() else n.split(" ")

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """As ``ChunkedEncoder.encode_flat``; the word memo starts again when full."""
        out = super().encode_flat(texts)
        if len(self.words) > chunk_cache.CACHE_CHUNKS:
            self.words = _WordCache(self)
        return out

    def encode_chunk(self, chunk: str) -> Iterable[int]:
        """One chunk's ids: ASCII in Python, the rest by HF."""
        if chunk.isascii():
            words = self.words
            return itertools.chain.from_iterable(
                map(words.__getitem__, self.piece_re.findall(chunk))
            )
        # HF, on the chunk alone: normalization and words never cross an ASCII space
        return self.tokenizer.encode(chunk, add_special_tokens=False).ids


class _WordCache(dict):
    """Word -> its ``AsciiWordPiece.word_ids``, computed on first use."""

    def __init__(self, encoder: AsciiWordPiece):
        super().__init__()
        self.encoder = encoder

    def __missing__(self, word: str) -> tuple[int, ...]:
        ids = self.encoder.word_ids(word)
        if len(word) <= chunk_cache.CACHED_CHUNK_CHARS:
            self[word] = ids
        return ids


def _ascii_tables(tokenizer: Any) -> tuple[dict[int, str], str, str]:
    """HF's ASCII behaviour: the normalizer's table, whitespace it drops, punctuation it isolates.

    Raises ``ValueError`` when a character normalizes to several or non-ASCII characters, or
    splits in any other way.
    """
    normalizer = tokenizer.normalizer
    table = ascii_table(normalizer.normalize_str if normalizer is not None else str)
    if table is None:
        raise ValueError("the normalizer changes the letters around an ASCII character")
    for code, out in table.items():
        if len(out) > 1 or not out.isascii():
            raise ValueError(f"the normalizer maps {chr(code)!r} to {out!r}")
    space, punct = [], []
    for c in sorted(set(ASCII.translate(table))):
        parts = [w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str(f"a{c}b")]
        if parts == [f"a{c}b"]:
            continue
        if parts == ["a", "b"]:
            space.append(c)
        elif parts == ["a", c, "b"]:
            punct.append(c)
        else:
            raise ValueError(f"the pre-tokenizer splits 'a{c}b' into {parts}")
    return table, "".join(space), "".join(punct)

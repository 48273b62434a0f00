"""BERT-style WordPiece ids: ASCII text in Python, the rest through HF, equal to HF's.

For a tokenizer whose normalizer is ``BertNormalizer`` (or none), pre-tokenizer
``BertPreTokenizer`` and model ``WordPiece``, everything HF does to ASCII text is per
character: the normalizer maps each character to at most one character, the pre-tokenizer
splits on whitespace (dropped) and punctuation (kept alone), and WordPiece matches the longest
vocabulary entry from the left within each word. :class:`AsciiWordPiece` learns the
per-character tables from the HF tokenizer itself at load (so a normalizer option changes them
as it changes HF's ids) and checks them on every ASCII character before it is used.

A text is split into chunks at ASCII whitespace; nothing HF does crosses one (normalization is
per character there, and a word never spans a space). A chunk of ASCII text is encoded in
Python, a chunk with any other character by HF on its own (Unicode tables differ between
libraries), and a text containing an added token by HF whole (added tokens are matched before
normalization). Words repeat, so each chunk is encoded once and its ids looked up after (per
thread, bounded by :data:`CACHE_CHUNKS`); a batch is split, looked up and gathered with C-level
``map`` and numpy, without a Python loop per token. A new ASCII chunk costs less in Python than
one more text in an HF batch. Ids come without the post-processor's special tokens; the caller
adds them.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardcache.version import __version__ as BACKEND_VERSION

#: Name of this backend in a build's ``encoder`` selection and report (its version is
#: :data:`BACKEND_VERSION`, the package's).
BACKEND_NAME = "shardcache-wordpiece"
__all__ = ["BACKEND_NAME", "BACKEND_VERSION", "RELEASES_GIL", "AsciiWordPiece"]

#: The ASCII chunks are encoded in Python, holding the GIL: a build runs its partitions in
#: processes to use every core.
RELEASES_GIL = False

#: Distinct chunks one thread remembers before it starts again (memory stays bounded: about
#: 100-150 bytes per chunk).
CACHE_CHUNKS = 1 << 19

#: Ids one thread's chunk cache holds before it starts again (long chunks are encoded once
#: but their ids are written there too).
CACHE_IDS = 1 << 24

#: Chunks longer than this are encoded each time (one huge run of characters is not kept).
CACHED_CHUNK_CHARS = 128

ASCII = "".join(map(chr, range(128)))


class AsciiWordPiece:
    """Exact WordPiece ids (without special tokens) for a BERT-style tokenizer.

    Args:
        data: the tokenizer.json content, parsed.
        reference: the HF backend of the same JSON (``tokenizer``, truncation and padding off,
            and ``encode_flat``): it encodes the texts and chunks this class does not, and the
            per-character tables come from it.

    Raises:
        ValueError: the tokenizer is not BERT-style WordPiece, or its ASCII behaviour is not
            per character (the message says which part).
    """

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
        self.reference = reference
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
        added = [t for t in data.get("added_tokens") or [] if t.get("content")]
        self.raw_added = tuple(t["content"] for t in added if not t.get("normalized", False))
        normalize = tokenizer.normalizer.normalize_str if tokenizer.normalizer else str
        self.normalized_added = tuple(
            normalize(t["content"]) for t in added if t.get("normalized", False)
        )
        self._local = threading.local()

    def _check_tables(self, space: str) -> None:
        """The splitting this class does (``str.split`` on whitespace, then punctuation)
        equals HF's pre-tokenization for every ASCII character, and normalizing twice changes
        nothing (HF normalizes the chunks it encodes again)."""
        if " " not in space:
            raise ValueError("HF does not split at a space")
        for c in space:
            if not c.isspace():
                raise ValueError(f"HF splits at {c!r}, which str.split keeps")
        kept = ASCII.translate(self.table)
        for c in kept:
            if c.isspace() and c not in space:
                raise ValueError(f"str.split splits at {c!r}, which HF keeps in words")
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
        """The ASCII characters of ``text`` mapped by :attr:`table` (the others unchanged)."""
        if text.isascii():
            return text.translate(self.table)
        # str.translate looks every character up; on UTF-8 bytes (where an ASCII byte is
        # always its own character) one table does it at memory speed
        raw = text.encode("utf-8", "surrogatepass")
        return raw.translate(self.byte_table, self.byte_deletes).decode("utf-8", "surrogatepass")

    def _pieces(self, normalized: str) -> list[str]:
        return [p for chunk in normalized.split() for p in self.piece_re.findall(chunk)]

    def word_ids(self, word: str) -> tuple[int, ...]:
        """WordPiece of one word: the longest vocabulary match from the left, again after it
        with the continuing prefix; the unknown token for the whole word if any part fails.

        Args:
            word: a word (no whitespace or punctuation), normalized.

        Returns:
            Its ids.
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

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Ids of ``texts`` without special tokens, as HF's ``encode_batch`` gives them.

        Args:
            texts: the texts.

        Returns:
            ``(uint32 tokens, int64 lengths)``, flat, in text order.
        """
        normalized: list[str | None] = []
        for text in texts:
            n = None
            # an added token is matched in the raw text (a normalized one in HF's normalized
            # text, known here for ASCII only) before anything else: HF encodes those texts
            if not any(a in text for a in self.raw_added) and (
                not self.normalized_added or text.isascii()
            ):
                n = self._normalize(text)
                if any(a in n for a in self.normalized_added):
                    n = None
            normalized.append(n)
        other = [i for i, n in enumerate(normalized) if n is None]
        if not other:
            return self._encode_normalized(normalized)  # type: ignore[arg-type]
        mine = [i for i, n in enumerate(normalized) if n is not None]
        a = self._encode_normalized([normalized[i] for i in mine])  # type: ignore[misc]
        b = self.reference.encode_flat([texts[i] for i in other], False)
        return _interleave(
            len(texts),
            (np.asarray(mine, dtype=np.int64), a),
            (np.asarray(other, dtype=np.int64), b),
        )

    def _encode_normalized(self, normalized: list[str]) -> tuple[np.ndarray, np.ndarray]:
        cache = self._cache()
        # split at ASCII whitespace only: other whitespace is left to HF inside its chunk
        chunks = [n.split() if n.isascii() else n.split(" ") for n in normalized]
        counts = np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks))
        entries = np.fromiter(
            map(cache.__getitem__, itertools.chain.from_iterable(chunks)),
            dtype=np.int64,
            count=int(counts.sum()),
        )
        cache.flush()
        starts, lens = cache.starts[entries], cache.lens[entries]
        total = int(lens.sum())
        ends = np.cumsum(lens)
        # every id of every chunk, in order: chunk k's ids are ids[starts[k] : starts[k] + lens[k]]
        tokens = cache.ids[np.repeat(starts - (ends - lens), lens) + np.arange(total)]
        chunk_ends = np.concatenate(([0], ends))
        doc_ends = np.cumsum(counts)
        lengths = chunk_ends[doc_ends] - chunk_ends[doc_ends - counts]
        # start again when full; words outlive chunks (there are fewer)
        if cache.count > CACHE_CHUNKS or len(cache.ids) > CACHE_IDS:
            self._local.cache = None
            if len(cache.words) > CACHE_CHUNKS:
                self._local.words = None
        return tokens.astype(np.uint32, copy=False), lengths

    def _cache(self) -> _ChunkCache:
        cache = getattr(self._local, "cache", None)
        if cache is None:
            words = getattr(self._local, "words", None)
            if words is None:
                words = self._local.words = _WordCache(self)
            cache = self._local.cache = _ChunkCache(self, words)
        return cache


class _ChunkCache(dict):
    """Chunk -> entry number; entry ``k``'s ids are ``ids[starts[k] : starts[k] + lens[k]]``
    once :meth:`flush` has run. One thread's: entries are only appended, so numbers stay
    valid until the cache is dropped. Chunks over :data:`CACHED_CHUNK_CHARS` get an entry but
    no key."""

    def __init__(self, encoder: AsciiWordPiece, words: _WordCache):
        super().__init__()
        self.encoder = encoder
        self.words = words
        self.starts = np.zeros(0, dtype=np.int64)
        self.lens = np.zeros(0, dtype=np.int64)
        self.ids = np.zeros(0, dtype=np.uint32)
        self.count = 0
        # entries added since the last flush (a Python list appends faster than numpy writes)
        self.new_lens: list[int] = []
        self.new_ids: list[int] = []

    def __missing__(self, chunk: str) -> int:
        before = len(self.new_ids)
        if chunk.isascii():
            pieces = self.encoder.piece_re.findall(chunk)
            self.new_ids.extend(itertools.chain.from_iterable(map(self.words.__getitem__, pieces)))
        else:  # HF, on the chunk alone: normalization and words never cross an ASCII space
            encoding = self.encoder.tokenizer.encode(chunk, add_special_tokens=False)
            self.new_ids.extend(encoding.ids)
        self.new_lens.append(len(self.new_ids) - before)
        entry = self.count
        self.count += 1
        if len(chunk) <= CACHED_CHUNK_CHARS:
            self[chunk] = entry
        return entry

    def flush(self) -> None:
        """Move the entries added since the last call into the arrays."""
        if not self.new_lens:
            return
        lens = np.asarray(self.new_lens, dtype=np.int64)
        first = len(self.ids)
        self.starts = np.concatenate((self.starts, first + np.cumsum(lens) - lens))
        self.lens = np.concatenate((self.lens, lens))
        self.ids = np.concatenate((self.ids, np.asarray(self.new_ids, dtype=np.uint32)))
        self.new_lens, self.new_ids = [], []


class _WordCache(dict):
    """Word -> its WordPiece ids (:meth:`AsciiWordPiece.word_ids`), computed on first use."""

    def __init__(self, encoder: AsciiWordPiece):
        super().__init__()
        self.encoder = encoder

    def __missing__(self, word: str) -> tuple[int, ...]:
        ids = self.encoder.word_ids(word)
        if len(word) <= CACHED_CHUNK_CHARS:
            self[word] = ids
        return ids


def _ascii_tables(tokenizer: Any) -> tuple[dict[int, str], str, str]:
    """Per ASCII character, from HF: the normalizer's output (a translate table), the
    characters the pre-tokenizer drops as whitespace and those it isolates as punctuation.

    Raises:
        ValueError: a character normalizes to more than one character or outside ASCII, or
            splits in a way other than these three.
    """
    table: dict[int, str] = {}
    space, punct = [], []
    normalizer = tokenizer.normalizer
    for code in range(128):
        c = chr(code)
        out = normalizer.normalize_str(c) if normalizer is not None else c
        if len(out) > 1 or not out.isascii():
            raise ValueError(f"the normalizer maps {c!r} to {out!r}")
        if out != c:
            table[code] = out
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


def _interleave(
    n: int, *groups: tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """Merge flat encodings of disjoint sets of positions into one in position order.

    Args:
        n: the number of positions.
        *groups: ``(positions, (tokens, lengths))``, each encoding in its positions' order.

    Returns:
        ``(tokens, lengths)`` over positions ``0..n-1``.
    """
    lengths = np.zeros(n, dtype=np.int64)
    for positions, (_, group_lengths) in groups:
        lengths[positions] = group_lengths
    out_starts = np.cumsum(lengths) - lengths
    tokens = np.empty(int(lengths.sum()), dtype=np.uint32)
    for positions, (group_tokens, group_lengths) in groups:
        src_starts = np.cumsum(group_lengths) - group_lengths
        shift = np.repeat(out_starts[positions] - src_starts, group_lengths)
        tokens[shift + np.arange(len(group_tokens))] = group_tokens
    return tokens, lengths

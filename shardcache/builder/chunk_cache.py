"""Ids of texts split into independent chunks, each distinct chunk encoded once.

This package's own backends (``wordpiece``, ``split_words``) split a text where nothing the
tokenizer does crosses, so a text's ids are its chunks' ids in order. ``ChunkCache`` gathers a
batch's ids with C-level ``map`` and numpy indexing, with no Python loop per token; its memory
is bounded by ``CACHE_CHUNKS`` and ``CACHE_IDS``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "CACHED_CHUNK_CHARS",
    "CACHE_CHUNKS",
    "CACHE_IDS",
    "AddedTokens",
    "ChunkCache",
    "ChunkedEncoder",
    "ascii_table",
    "interleave",
]

#: Distinct chunks the cache remembers before it starts again (about 100-150 bytes each).
CACHE_CHUNKS = 1 << 19

#: Ids the cache holds before it starts again (long chunks are encoded once but
#: their ids are written there too).
CACHE_IDS = 1 << 24

#: Chunks longer than this are encoded each time (one huge run of characters is not kept).
CACHED_CHUNK_CHARS = 128


class ChunkCache:
    """Chunk lists to flat ids, each distinct chunk encoded once by ``encode_chunk``.

    ``encode_chunk`` must give exactly the ids the tokenizer gives that chunk inside any text.
    One cache serves every thread (each partition runs in a new thread: per-thread caches would
    start cold); a lock makes a batch's lookups one step, and that work holds the GIL anyway.
    """

    def __init__(self, encode_chunk: Callable[[str], Iterable[int]]):
        self.encode_chunk = encode_chunk
        self._lock = threading.Lock()
        self._table: _Table | None = None

    def encode(self, chunk_lists: Sequence[list[str]]) -> tuple[np.ndarray, np.ndarray]:
        """Flat ``(uint32 tokens, int64 lengths)`` of texts given as their chunks in order."""
        with self._lock:
            return self._encode(chunk_lists)

    def _encode(self, chunk_lists: Sequence[list[str]]) -> tuple[np.ndarray, np.ndarray]:
        table = self._table
        if table is None:
            table = self._table = _Table(self.encode_chunk)
        counts = np.fromiter(map(len, chunk_lists), dtype=np.int64, count=len(chunk_lists))
        entries = np.fromiter(
            map(table.__getitem__, itertools.chain.from_iterable(chunk_lists)),
            dtype=np.int64,
            count=int(counts.sum()),
        )
        table.flush()
        starts, lens = table.starts[entries], table.lens[entries]
        total = int(lens.sum())
        ends = np.cumsum(lens)
        # every id of every chunk, in order: chunk k's ids are ids[starts[k] : starts[k] + lens[k]]
        tokens = table.ids[np.repeat(starts - (ends - lens), lens) + np.arange(total)]
        chunk_ends = np.concatenate(([0], ends))
        text_ends = np.cumsum(counts)
        lengths = chunk_ends[text_ends] - chunk_ends[text_ends - counts]
        if table.count > CACHE_CHUNKS or len(table.ids) > CACHE_IDS:
            self._table = None  # start again when full
        return tokens.astype(np.uint32, copy=False), lengths

    def encode_or_whole(
        self,
        texts: list[str],
        chunk_lists: Sequence[list[str] | None],
        whole: Callable[[list[str]], tuple[np.ndarray, np.ndarray]],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Ids of texts by their chunks, or by ``whole`` (HF) where ``chunk_lists`` has None."""
        other = [i for i, chunks in enumerate(chunk_lists) if chunks is None]
        if not other:
            return self.encode(chunk_lists)  # type: ignore[arg-type]
        mine = [i for i, chunks in enumerate(chunk_lists) if chunks is not None]
        return interleave(
            len(texts),
            (np.asarray(mine, dtype=np.int64), self.encode([chunk_lists[i] for i in mine])),  # type: ignore[misc]
            (np.asarray(other, dtype=np.int64), whole([texts[i] for i in other])),
        )


class _Table(dict):
    """Chunk -> entry number; entry ``k``'s ids are ``ids[starts[k] : starts[k] + lens[k]]``.

    The arrays are valid once ``flush`` has run. Used under the cache's lock; entries are only
    appended, so numbers stay valid until the table is dropped. Chunks over
    ``CACHED_CHUNK_CHARS`` get an entry but no key.
    """

    def __init__(self, encode_chunk: Callable[[str], Iterable[int]]):
        super().__init__()
        self.encode_chunk = encode_chunk
        self.starts = np.zeros(0, dtype=np.int64)
        self.lens = np.zeros(0, dtype=np.int64)
        self.ids = np.zeros(0, dtype=np.uint32)
        self.count = 0
        # entries added since the last flush (a Python list appends faster than numpy writes)
        self.new_lens: list[int] = []
        self.new_ids: list[int] = []

    def __missing__(self, chunk: str) -> int:
        before = len(self.new_ids)
        self.new_ids.extend(self.encode_chunk(chunk))
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


class ChunkedEncoder:
    """Base of this package's backends: a text's ids are its ``chunks``' ids in order.

    Each distinct chunk is encoded once by ``encode_chunk``; a text without chunks goes to the HF
    ``reference`` whole.
    """

    #: The split and the lookups run in Python, holding the GIL: a build runs its partitions
    #: in processes to use every core.
    releases_gil = False

    def __init__(self, reference: Any):
        self.reference = reference
        self.cache = ChunkCache(self.encode_chunk)

    def chunks(self, text: str) -> list[str] | None:
        """Split a text where nothing the tokenizer does crosses (None: HF encodes it whole)."""
        raise NotImplementedError

    def encode_chunk(self, chunk: str) -> Iterable[int]:
        """One chunk's ids, exactly as the tokenizer gives them to it inside any text."""
        raise NotImplementedError

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Flat ids of ``texts`` without special tokens, as HF's ``encode_batch`` gives."""
        return self.cache.encode_or_whole(
            texts,
            [self.chunks(t) for t in texts],
            lambda whole: self.reference.encode_flat(whole, False),
        )


class AddedTokens:
    """The tokenizer's added tokens: a text holding one goes to HF whole.

    HF matches them before anything else, across any chunk boundary. ``normalized`` tokens are
    matched after HF's ``normalize`` (None: the tokenizer has no normalizer).
    """

    def __init__(self, added: Iterable[Mapping[str, Any]], normalize: Callable[[str], str] | None):
        added = [t for t in added if t.get("content")]
        self.raw = tuple(t["content"] for t in added if not t.get("normalized", False))
        self.normalized = tuple(
            (normalize or str)(t["content"]) for t in added if t.get("normalized", False)
        )
        # one scan per distinct two-character start, not per token (T5 has 100 <extra_id_N>)
        self._raw_groups = _by_start(self.raw)
        self._normalized_groups = _by_start(self.normalized)

    def in_raw(self, text: str) -> bool:
        """Whether ``text``, as given, holds a token matched before normalization."""
        return _holds(text, self._raw_groups)

    def in_normalized(self, normalized: str) -> bool:
        """Whether ``normalized`` (HF's normalizer output) holds a normalized token."""
        return _holds(normalized, self._normalized_groups)


def _by_start(tokens: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``tokens`` grouped by their first two characters: ``(start, tokens)`` pairs."""
    groups: dict[str, list[str]] = {}
    for token in tokens:
        groups.setdefault(token[:2], []).append(token)
    return tuple((start, tuple(group)) for start, group in groups.items())


def _holds(text: str, groups: tuple[tuple[str, tuple[str, ...]], ...]) -> bool:
    return any(start in text and any(t in text for t in group) for start, group in groups)


def interleave(
    n: int, *groups: tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """Merge ``(positions, (tokens, lengths))`` groups of disjoint positions over ``0..n-1``."""
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


def ascii_table(normalize: Callable[[str], str]) -> dict[int, str] | None:
    """What ``normalize`` does to each ASCII character, as a ``str.translate`` table.

    Each character is read between two letters (``"a" + c + "b"``), out of reach of steps that act
    at a text's ends (``Strip``). The table is exact only for a per-character normalizer, which the
    caller checks on whole texts. None when the surrounding letters do not come out unchanged.
    """
    if normalize("ab") != "ab":
        return None
    table: dict[int, str] = {}
    for code in range(128):
        c = chr(code)
        out = normalize(f"a{c}b")
        if not (out.startswith("a") and out.endswith("b")):
            return None
        if out[1:-1] != c:
            table[code] = out[1:-1]
    return table

"""Encoding huge documents in pieces, exactly, with bounded memory.

A document above ``HUGE_CHARS`` is cut into pieces of about ``PIECE_CHARS``, each encoded
without special tokens, and the post-processor's wrapping is put around the joined ids. Cuts
are before a single space between non-space characters, or where the tokenizer's own
pre-tokenizer splits and encoding across the cut gives the same ids. ``chunking_is_exact``
checks each tokenizer once; a tokenizer that fails it, or a stretch with no safe cut, is
encoded whole: exact first, memory second.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

#: Documents above this many characters are encoded in pieces (when exact).
HUGE_CHARS = 1 << 20
#: Target piece size in characters.
PIECE_CHARS = 1 << 18
#: UTF-8 bytes of pieces encoded in one ``encode_batch`` call (see ``encode_in_pieces``).
BATCH_BYTES = 1 << 20

_PROBE_WORDS = (
    "The quick brown fox jumps over the lazy dog; data, shard & cache! 42 x3.5 don't "
    "naïve café 東京 データ 🙂 def f(x): return x ** 2  tabs\tand\nnew lines"
).split(" ")


#: Characters around a target position that the pre-tokenizer looks at for a boundary.
WINDOW_CHARS = 4096
#: Characters on each side of a pre-tokenizer cut encoded to check it.
CHECK_CHARS = 1024

#: ``fallback(text, start, target)``: a cut in ``(start, target]`` where no space serves.
CutFinder = Callable[[str, int, int], "int | None"]


def _space_cut(text: str, start: int, target: int) -> int | None:
    pos = target
    while True:
        pos = text.rfind(" ", start + 1, pos)
        if pos <= start:
            return None
        if not text[pos - 1].isspace() and pos + 1 < len(text) and not text[pos + 1].isspace():
            return pos


_SPACELESS_PROBE = (
    "東京データ。日本語の文章です、中文字符！function(a,b){return a*2+b;}var x=f(1,2);"
    "aGVsbG8gd29ybGQ+/=QUJDRA==ñandú🙂🙂—«»1234.56e7"
)


def split_points(
    text: str, piece_chars: int = PIECE_CHARS, fallback: CutFinder | None = None
) -> list[int] | None:
    """Where to cut a text into pieces of about ``piece_chars``; None if a stretch has no cut.

    A cut is at a space between non-space characters, else where ``fallback(text, start,
    target)`` finds one (None: spaces only).
    """
    cuts = []
    start = 0
    while len(text) - start > piece_chars:
        target = start + piece_chars
        pos = _space_cut(text, start, target)
        if pos is None and fallback is not None:
            pos = fallback(text, start, target)
        if pos is None or pos <= start:
            return None
        cuts.append(pos)
        start = pos
    return cuts


def pretokenizer_cut(backend: Any, text: str, start: int, target: int) -> int | None:
    """A pre-tokenizer split in ``(start, target]`` nearest ``target``, or None.

    Taken only when the text around it encodes to the same ids together and apart; gives up
    after 8 rejected candidates.
    """
    pre = backend.pre_tokenizer
    if pre is None:
        return None
    lo = max(start + 1, target - WINDOW_CHARS)
    window_start = max(0, lo - CHECK_CHARS)
    window = text[window_start : min(len(text), target + CHECK_CHARS)]
    margin = min(CHECK_CHARS, max(1, (target - start) // 4))
    bounds = sorted({window_start + s for _, (s, _) in pre.pre_tokenize_str(window)}, reverse=True)
    tried = 0
    for pos in bounds:
        if pos > target or pos < lo or pos - window_start < margin:
            continue
        if pos + margin > window_start + len(window) and pos + margin <= len(text):
            continue  # too close to the window end to trust the split
        if _cut_is_invisible(backend, text, pos):
            return pos
        tried += 1
        if tried >= 8:
            return None
    return None


def _cut_is_invisible(backend: Any, text: str, pos: int) -> bool:
    left, right = text[max(0, pos - CHECK_CHARS) : pos], text[pos : pos + CHECK_CHARS]
    whole = backend.encode(left + right, add_special_tokens=False).ids
    apart = backend.encode_batch([left, right], add_special_tokens=False)
    return whole == apart[0].ids + apart[1].ids


def special_wrapping(backend: Any, add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
    """``(prefix, suffix)`` ids the post-processor puts around a text; None if not a wrap."""
    plain = backend.encode("x", add_special_tokens=False).ids
    full = backend.encode("x", add_special_tokens=add_special_tokens).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return None


def encode_in_pieces(
    backend: Any, text: str, wrapping: tuple[list[int], list[int]], piece_chars: int = PIECE_CHARS
) -> np.ndarray | None:
    """The int64 ids of ``text`` encoded piecewise and wrapped; None if it cannot be cut."""
    cuts = split_points(
        text, piece_chars, lambda t, start, target: pretokenizer_cut(backend, t, start, target)
    )
    if cuts is None:
        return None
    bounds = [0, *cuts, len(text)]
    prefix, suffix = wrapping
    parts = [np.asarray(prefix, dtype=np.int64)]
    # Pieces per encode_batch call: parallel, yet at most BATCH_BYTES of UTF-8 at once, since
    # an Encoding's memory follows tokens, and tokens follow bytes, not characters (CJK).
    pending: list[str] = []
    pending_bytes = 0
    for a, b in itertools.pairwise(bounds):
        piece = text[a:b]
        size = len(piece.encode("utf-8", "surrogatepass"))
        if pending and pending_bytes + size > BATCH_BYTES:
            parts += _encode_pieces(backend, pending)
            pending, pending_bytes = [], 0
        pending.append(piece)
        pending_bytes += size
    parts += _encode_pieces(backend, pending)
    parts.append(np.asarray(suffix, dtype=np.int64))
    return np.concatenate(parts)


def _encode_pieces(backend: Any, pieces: list[str]) -> list[np.ndarray]:
    if not pieces:
        return []
    encodings = backend.encode_batch(pieces, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


def chunking_is_exact(backend: Any, add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
    """The wrapping when piecewise encoding gives the whole-text ids on probe texts, else None.

    None: never cut with this tokenizer (huge documents are encoded whole).
    """
    wrapping = special_wrapping(backend, add_special_tokens)
    if wrapping is None:
        return None
    words = list(_PROBE_WORDS) * 6
    texts = [(" ".join(words[i % len(words)] for i in range(n * 9)), n) for n in (17, 29, 53)]
    texts += [(_SPACELESS_PROBE * 4, n) for n in (23, 61)]  # pre-tokenizer cuts
    for text, n in texts:  # piece sizes above the longest probe word
        whole = backend.encode(text, add_special_tokens=add_special_tokens).ids
        pieces = encode_in_pieces(backend, text, wrapping, piece_chars=n)
        if pieces is not None and pieces.tolist() != whole:
            return None  # a cut changed the ids: never cut with this tokenizer
    return wrapping

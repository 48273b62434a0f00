"""The code points a compiled library backend is trusted on, and the documents holding others.

A compiled library (fastokens, gigatoken) carries its own Unicode tables. Where they and HF's
differ (a character newer than one of them, e.g. U+A7D2, a letter to one and unassigned to the
other), the library's ids differ from HF's; a sample of the corpus cannot find such rare
characters. ``proven_table`` marks the code points the equality covers: those Python's
``unicodedata`` assigns (the tables the slow test compares every library on, code point by code
point) on which HF's regex classes agree with Python's categories, checked at load.
``Trusted.outside`` finds, in vectorised code, the documents holding any other code point; they
go to the HF reference, so a library backend's ids are HF's by construction.
"""

from __future__ import annotations

import functools
import json
import unicodedata

import numpy as np

from shardcache.store.files import read_memo, sha256_text, write_memo

__all__ = ["CODE_POINTS", "Trusted", "assigned_table", "major_classes", "proven_table"]

#: Code points of Unicode (U+0000 .. U+10FFFF).
CODE_POINTS = 0x110000

#: General categories never trusted: unassigned (a later Unicode may assign them and a
#: library's tables may already have), surrogates and private use.
UNTRUSTED_CATEGORIES = frozenset({"Cn", "Cs", "Co"})

#: HF regex classes (Oniguruma's tables) checked at load against Python's categories: those a
#: pre-tokenizer's split regex uses.
REGEX_CLASSES = ("L", "N", "M", "P", "S", "Z")


@functools.cache
def major_classes() -> np.ndarray:
    """Per code point, the first letter of Python's category (``b""`` for untrusted ones)."""
    category = unicodedata.category

    def major(c: int) -> bytes:
        name = category(chr(c))
        return b"" if name in UNTRUSTED_CATEGORIES else name[0].encode()

    return np.fromiter(map(major, range(CODE_POINTS)), dtype="S1", count=CODE_POINTS)


def assigned_table() -> np.ndarray:
    """A bool per code point: Python's ``unicodedata`` assigns it a trusted category."""
    return major_classes() != b""


@functools.cache
def proven_table() -> np.ndarray:
    """``assigned_table`` less the code points where HF's regex classes disagree with Python.

    HF's split regexes (classes such as letter, number) use Oniguruma's Unicode tables: a character
    newer than those is in Python's category but in no HF class, and is left out here. Computing
    it takes about half a second (a category per code point), in every build process: the table
    is remembered on disk (a memo, as runs of trusted code points) per Unicode version of
    Python and version of tokenizers, the two things it depends on.
    """
    import tokenizers

    digest = sha256_text(
        json.dumps(["proven_table", 1, unicodedata.unidata_version, tokenizers.__version__])
    )
    runs = read_memo("code_points", digest)
    if isinstance(runs, list) and all(isinstance(r, list) and len(r) == 2 for r in runs):
        table = np.zeros(CODE_POINTS, dtype=bool)
        for start, end in runs:
            table[start:end] = True
        return table
    table = computed_table()
    edges = np.flatnonzero(np.diff(np.concatenate(([False], table, [False])).astype(np.int8)))
    write_memo("code_points", digest, edges.reshape(-1, 2).tolist())
    return table


def computed_table() -> np.ndarray:
    """``proven_table`` computed here (what the memo remembers)."""
    from tokenizers import Regex, pre_tokenizers

    majors = major_classes()
    table = majors != b""
    for major in REGEX_CLASSES:
        members = np.flatnonzero(majors == major.encode())
        text = "".join(map(chr, members.tolist()))
        # what HF's class does not match is left in pieces
        split = pre_tokenizers.Split(Regex(f"\\p{{{major}}}"), behavior="removed")
        for _, (start, end) in split.pre_tokenize_str(text):
            table[members[start:end]] = False
    return table


class Trusted:
    """Finds the documents holding a code point outside a backend's ``table`` (True: trusted)."""

    def __init__(self, table: np.ndarray):
        self.table = table
        self._ascii_trusted = bool(table[:128].all())  # (always, for the proven table)

    def outside(self, texts: list[str]) -> np.ndarray:
        """Positions of the texts holding an untrusted code point (ASCII is always trusted).

        Only the texts with a non-ASCII character are looked at (``str.isascii`` reads a flag),
        through their UTF-8 bytes: only a multi-byte character's code point is decoded and
        looked up, so a mostly-ASCII document costs its bytes once, not a 4-byte view of every
        character (``outside_all``, the reference, decides the same).
        """
        if not self._ascii_trusted:
            return self.outside_all(texts)
        others = [i for i, text in enumerate(texts) if not text.isascii()]
        if not others:
            return np.zeros(0, dtype=np.int64)
        chosen = [texts[i] for i in others]
        data = np.frombuffer("".join(chosen).encode("utf-8", "surrogatepass"), dtype=np.uint8)
        lead = np.flatnonzero(data >= 0xC0)  # the first byte of every multi-byte character
        first = data[lead].astype(np.int64)
        tail = np.concatenate([data, np.zeros(3, dtype=np.uint8)]).astype(np.int64) & 0x3F
        b1, b2, b3 = tail[lead + 1], tail[lead + 2], tail[lead + 3]
        points = np.where(
            first >= 0xF0,
            ((first & 0x07) << 18) | (b1 << 12) | (b2 << 6) | b3,
            np.where(first >= 0xE0, ((first & 0x0F) << 12) | (b1 << 6) | b2,
                     ((first & 0x1F) << 6) | b1),
        )  # fmt: skip
        bad = ~self.table[points]
        if not bad.any():
            return np.zeros(0, dtype=np.int64)
        sizes = [len(text.encode("utf-8", "surrogatepass")) for text in chosen]
        ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
        holding = np.unique(np.searchsorted(ends, lead[bad], side="right"))
        return np.asarray(others, dtype=np.int64)[holding]

    def outside_all(self, texts: list[str]) -> np.ndarray:
        """``outside``, every text's code points looked up (the reference)."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        points = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), dtype="<u4")
        bad = ~self.table[points]
        if not bad.any():
            return np.zeros(0, dtype=np.int64)
        ends = np.cumsum(lengths)
        per_text = np.cumsum(bad)[ends - 1] if len(bad) else np.zeros(len(texts), np.int64)
        before = np.concatenate(([0], per_text[:-1]))
        return np.flatnonzero(per_text - before > 0)

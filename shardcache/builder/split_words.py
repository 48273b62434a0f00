"""Ids for tokenizers whose pre-tokenizer splits text into independent pieces, each encoded once.

Two layouts qualify: (1) a first step that splits at whitespace and drops it, then only steps
that work on each piece alone (T5's Unigram); (2) a ``Metaspace`` alone that splits at its
marker (Gemma-like BPE). ``SplitWords`` normalizes each text whole with HF, splits it itself,
checked at load against HF on every whitespace character, runs of spaces and the marker, and
encodes each distinct piece with HF's pre-tokenizer and model. A text holding an added token
goes to HF whole. Ids come without the post-processor's special tokens; the caller adds them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from shardcache.builder.chunk_cache import AddedTokens, ChunkedEncoder, ascii_table

__all__ = ["SplitWords"]

#: Pre-tokenizers that split at whitespace and drop it: one of them must come first.
SPLITS_AT_WHITESPACE = frozenset({"WhitespaceSplit", "Whitespace", "BertPreTokenizer"})

#: Pre-tokenizers that work on each piece alone, allowed after the first.
PER_PIECE = SPLITS_AT_WHITESPACE | {"Punctuation", "Digits", "Split", "Metaspace"}

#: Normalizers that act on ASCII text one character at a time (Unicode normalization forms do
#: nothing to it; Precompiled maps each grapheme, and an ASCII grapheme is one character or
#: CR LF, checked at load).
PER_CHARACTER = frozenset(
    {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "BertNormalizer", "Precompiled"}
)

#: ``Replace`` regexes that only turn a run of whitespace into whitespace (T5's converter
#: writes the first): they change no word.
WHITESPACE_RUNS = frozenset({" {2,}", " +", "\\s+", "\\s{2,}"})

#: Whitespace to HF (Unicode White_Space: Rust's ``char::is_whitespace``); ``str.split`` also
#: splits at the separators U+001C..U+001F, which HF keeps in a word.
HF_SPACES = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
    "\u200a\u2028\u2029\u202f\u205f\u3000"
)
WHITESPACE = re.compile(f"[{HF_SPACES}]+")
PYTHON_ONLY_SPACE = "\x1c\x1d\x1e\x1f"


def words(normalized: str) -> list[str]:
    """``normalized`` split at whitespace as HF's pre-tokenizers split it (Unicode White_Space)."""
    if not any(c in normalized for c in PYTHON_ONLY_SPACE):
        return normalized.split()
    return [w for w in WHITESPACE.split(normalized) if w]


class SplitWords(ChunkedEncoder):
    """Exact ids (without special tokens) for the two layouts the module describes.

    ``reference`` is the HF backend of the same JSON; its normalizer, pre-tokenizer and model do
    the work. Raises ``ValueError`` (saying which) for another pre-tokenizer, a step that may
    depend on other pieces, a randomized model (dropout) or a split that differs from HF's.
    """

    #: The backend's name in a build's ``encoder`` selection and report.
    name = "shardcache-words"

    def __init__(self, data: Mapping[str, Any], reference: Any):
        steps = _pre_tokenizer_steps(data.get("pre_tokenizer"))
        # a Metaspace alone that splits at its marker: pieces start at each marker
        self.metaspace = _metaspace_alone(steps)
        if self.metaspace is None and (
            not steps or steps[0].get("type") not in SPLITS_AT_WHITESPACE
        ):
            first = steps[0].get("type") if steps else None
            raise ValueError(
                f"pre-tokenizer {first!r} neither splits at whitespace first nor is a Metaspace "
                "alone that splits at its marker"
            )
        for step in steps[1:]:
            kind = step.get("type")
            if kind not in PER_PIECE:
                raise ValueError(f"pre-tokenizer step {kind!r} may depend on other pieces")
            if kind == "Metaspace" and step.get("prepend_scheme") == "first":
                raise ValueError("Metaspace prepends to the first piece of a text only")
        model = data.get("model") or {}
        if model.get("dropout"):
            raise ValueError(f"the model drops merges at random (dropout {model['dropout']})")
        tokenizer = reference.tokenizer
        self.pre_tokenize = tokenizer.pre_tokenizer.pre_tokenize_str
        self.tokenize = tokenizer.model.tokenize
        normalizer = tokenizer.normalizer
        self.normalize = normalizer.normalize_str if normalizer is not None else str
        self.added = AddedTokens(data.get("added_tokens") or [], self.normalize)
        # ASCII text: the normalizer as a translate table when its words are HF's (a
        # normalized added token may hold a space, which only HF's own output shows)
        # (pieces of a Metaspace alone depend on every space: only an exact table will do)
        exact = self.metaspace is not None
        self.table = (
            None
            if self.added.normalized
            else _ascii_table(data.get("normalizer"), self.normalize, exact)
        )
        super().__init__(reference)
        # T5's shape (WhitespaceSplit, then Metaspace that prepends to every piece): a word
        # without the marker is one piece, the marker and the word
        self.marker = _marker_only(steps)
        self._check_split()

    def _check_split(self) -> None:
        """Check at load that this split equals HF's pre-tokenization, else raise ``ValueError``.

        Probed on every character Python or HF counts as whitespace, runs of spaces and the marker.
        The ASCII table must give HF's output (Metaspace alone) or its words on every pair of ASCII
        characters, and in T5's shape each word without the marker must be one piece.
        """
        spaces = [*HF_SPACES, *PYTHON_ONLY_SPACE]
        others = ["▁", ".", "-", "'", "1", "é", "中", "\u0301", "\u200b", "\u180e"]
        probe = " ".join(f"a{c}b{c}{c}1{c}" for c in [*spaces, *others]) + " \u3000end "
        for text in (probe, "", " ", "  a  b ", "▁", "▁▁x▁ y", "x▁", "\n x"):
            normalized = self.normalize(text)
            want = [piece for piece, _ in self.pre_tokenize(normalized)]
            if self.metaspace is not None:
                got = self._pieces(normalized)
            else:
                got = [p for word in words(normalized) for p, _ in self.pre_tokenize(word)]
            if got != want:
                raise ValueError(f"the pre-tokenizer splits {text[:40]!r} otherwise than here")
        if self.table is not None:
            ascii_probe = " ".join(f"a{chr(x)}{chr(y)}b" for x in range(128) for y in range(128))
            hf, mine = self.normalize(ascii_probe), ascii_probe.translate(self.table)
            if (hf != mine) if self.metaspace is not None else (words(hf) != words(mine)):
                raise ValueError("the normalizer is not per character on ASCII text")
        normalized = self.normalize(probe)
        for word in words(normalized) if self.marker else ():
            if self.marker not in word and [p for p, _ in self.pre_tokenize(word)] != [
                self.marker + word
            ]:
                raise ValueError(f"the Metaspace step does not make {word!r} one piece")

    def encode_chunk(self, word: str) -> list[int]:
        """HF's ids of one normalized word: its pre-tokenizer, then its model."""
        if self.metaspace is not None:  # a piece already
            return [t.id for t in self.tokenize(word)]
        if self.marker and self.marker not in word:
            return [t.id for t in self.tokenize(self.marker + word)]
        return [t.id for piece, _ in self.pre_tokenize(word) for t in self.tokenize(piece)]

    def chunks(self, text: str) -> list[str] | None:
        """The words of ``text`` normalized, or None when it holds an added token."""
        if self.added.in_raw(text):
            return None
        if self.table is not None and text.isascii():
            normalized = text.translate(self.table)
        else:
            normalized = self.normalize(text)
        if self.added.in_normalized(normalized):
            return None
        return self._pieces(normalized) if self.metaspace is not None else words(normalized)

    def _pieces(self, normalized: str) -> list[str]:
        """Metaspace-alone pieces: spaces become the marker (put first unless ``never``)."""
        marker, prepend, pattern = self.metaspace  # type: ignore[misc]
        text = normalized.replace(" ", marker)
        if prepend and text and not text.startswith(marker):
            text = marker + text
        return pattern.findall(text)


def _pre_tokenizer_steps(pre_tokenizer: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The pre-tokenizer's steps in order (a ``Sequence`` flattened)."""
    if pre_tokenizer is None:
        return []
    if pre_tokenizer.get("type") == "Sequence":
        return [
            s for p in pre_tokenizer.get("pretokenizers") or [] for s in _pre_tokenizer_steps(p)
        ]
    return [pre_tokenizer]


def _metaspace_alone(steps: list[Mapping[str, Any]]) -> tuple[str, bool, re.Pattern] | None:
    """``(marker, prepends, piece pattern)`` if the only step is a Metaspace that splits at it.

    ``first`` prepends as ``always`` here: a text holding no added token is one piece at offset 0.
    """
    if len(steps) != 1 or steps[0].get("type") != "Metaspace" or not steps[0].get("split", True):
        return None
    marker = str(steps[0].get("replacement", "\u2581"))
    pattern = re.compile(f"{re.escape(marker)}[^{re.escape(marker)}]*|[^{re.escape(marker)}]+")
    return marker, _prepend_scheme(steps[0]) != "never", pattern


def _prepend_scheme(metaspace: Mapping[str, Any]) -> str:
    scheme = metaspace.get("prepend_scheme")
    if scheme is None:  # before tokenizers 0.15: add_prefix_space
        scheme = "always" if metaspace.get("add_prefix_space", True) else "never"
    return str(scheme)


def _marker_only(steps: list[Mapping[str, Any]]) -> str:
    """The marker for T5's shape (``WhitespaceSplit``, an ``always`` Metaspace), else ``""``."""
    if [step.get("type") for step in steps] != ["WhitespaceSplit", "Metaspace"]:
        return ""
    metaspace = steps[1]
    return (
        str(metaspace.get("replacement", "\u2581"))
        if _prepend_scheme(metaspace) == "always"
        else ""
    )


def _ascii_table(
    normalizer: Mapping[str, Any] | None, normalize: Callable[[str], str], exact: bool
) -> dict[int, str] | None:
    """HF's normalizer on ASCII text as a ``str.translate`` table, when that gives HF's words.

    Every step must act per character on ASCII (``PER_CHARACTER``) or, unless ``exact`` (the table
    must give HF's output itself), only turn whitespace into whitespace (``Strip``, a ``Replace``
    of ``WHITESPACE_RUNS``). None otherwise, or when whitespace does not stay whitespace.
    """
    steps = _normalizer_steps(normalizer)
    for step in steps:
        kind = step.get("type")
        if kind in PER_CHARACTER or (kind == "Strip" and not exact):
            continue
        pattern = step.get("pattern") or {}
        content = str(step.get("content", ""))
        if (
            not exact
            and kind == "Replace"
            and pattern.get("Regex") in WHITESPACE_RUNS
            and content.isspace()
        ):
            continue
        return None
    table = ascii_table(normalize)
    if table is None:
        return None
    for code, out in table.items():
        c = chr(code)
        if c.isspace() and c not in PYTHON_ONLY_SPACE and words(out) != []:
            return None  # whitespace must stay whitespace (or go), or a word is made of it
    crlf, mine = normalize("a\r\nb"), "a\r\nb".translate(table)
    if (crlf != mine) if exact else (words(crlf) != words(mine)):
        return None
    return table


def _normalizer_steps(normalizer: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The normalizer's steps in order (a ``Sequence`` flattened)."""
    if normalizer is None:
        return []
    if normalizer.get("type") == "Sequence":
        return [s for n in normalizer.get("normalizers") or [] for s in _normalizer_steps(n)]
    return [normalizer]

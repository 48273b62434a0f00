"""The fast libraries a ``FastBackend`` may load, and how each loads a tokenizer.json.

fastokens is tried first for any tokenizer, then the ``FALLBACK_LIBRARIES`` of the tokenizer's
model type. A library outside this package is imported by name (it may be missing); this
package's own backends are registered directly.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.builder.hf_backend import EncodeFlat, HFBackend
from shardcache.builder.special_tokens import SpecialTokens
from shardcache.builder.split_words import SplitWords
from shardcache.builder.tokenizer_memo import library_versions
from shardcache.builder.wordpiece import AsciiWordPiece
from shardcache.errors import MissingDependencyError
from shardcache.version import __version__

#: The first accelerated library tried (any tokenizer), and the pip extra of all of them.
FAST_MODULE = "fastokens"
FAST_PIP = "pip install 'shardcache[fast]'"

#: The names of this package's own backends start so.
OWN_PREFIX = "shardcache."


@dataclass(frozen=True)
class Loaded:
    """A fast backend a loader made: its encode function, name, version and ``releases_gil``.

    ``every_code_point``: its ids are HF's whatever the characters (this package's own backends
    hand what they do not encode themselves to HF); else documents are routed by ``Trusted``.
    """

    encode: EncodeFlat
    name: str
    version: str
    releases_gil: bool = True
    every_code_point: bool = False

    @classmethod
    def library(cls, encode: EncodeFlat, name: str) -> Loaded:
        """A library's backend, with the library's installed version."""
        return cls(encode, name, library_versions((name,))[name])


def _load_fastokens(module: Any, serialized: str, parsed: Callable[[], Any]) -> Loaded:
    try:
        tokenizer = module.Tokenizer.from_json_str(serialized)
    except Exception:  # retried without the decoder, else reported by the caller
        # Only ids are read from this backend, and a decoder never changes them: a decoder
        # fastokens does not implement (e.g. Metaspace) must not refuse it.
        data = parsed()
        if data.get("decoder") is None:
            raise
        tokenizer = module.Tokenizer.from_json_str(json.dumps({**data, "decoder": None}))
    tokenizer.no_truncation()
    tokenizer.no_padding()

    def encode(texts: list[str], add_special_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
        ids, offsets = tokenizer.encode_batch_flat(texts, add_special_tokens=add_special_tokens)
        tokens = np.frombuffer(ids, dtype="<u4")
        return tokens, np.diff(np.frombuffer(offsets, dtype="<u8")).astype(np.int64)

    return Loaded.library(encode, "fastokens")


def _load_gigatoken(module: Any, serialized: str, parsed: Callable[[], Any]) -> Loaded:
    data = {**parsed(), "truncation": None, "padding": None}  # as HF encodes for the build
    tokenizer = module.Tokenizer.from_json(json.dumps(data))
    specials = SpecialTokens.of(data.get("post_processor"))

    def encode(texts: list[str], add_special_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
        layout = tokenizer.encode_batch(texts).layout
        offsets = np.asarray(layout.offsets.data)
        tokens = np.asarray(layout.content.data)[offsets[0] : offsets[-1]].astype(np.uint32)
        lengths = np.diff(offsets).astype(np.int64)
        return specials.add(tokens, lengths) if add_special_tokens else (tokens, lengths)

    return Loaded.library(encode, "gigatoken")


def _load_wordpiece(module: Any, serialized: str, parsed: Callable[[], Any]) -> Loaded:
    return _load_own(AsciiWordPiece, serialized, parsed)


def _load_split_words(module: Any, serialized: str, parsed: Callable[[], Any]) -> Loaded:
    return _load_own(SplitWords, serialized, parsed)


def _load_own(
    backend: Callable[[Any, HFBackend], Any], serialized: str, parsed: Callable[[], Any]
) -> Loaded:
    """Load one of this package's backends over an HF reference of ``serialized``.

    ``backend(data, reference)`` gives ``encode_flat`` (without special tokens), ``name`` and
    ``releases_gil``; the post-processor's special tokens are added here.
    """
    import tokenizers

    data = parsed()
    reference = tokenizers.Tokenizer.from_str(serialized)
    reference.no_truncation()
    reference.no_padding()
    encoder = backend(data, HFBackend(reference))
    specials = SpecialTokens.of(data.get("post_processor"))

    def encode(texts: list[str], add_special_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
        tokens, lengths = encoder.encode_flat(texts)
        return specials.add(tokens, lengths) if add_special_tokens else (tokens, lengths)

    return Loaded(encode, encoder.name, __version__, encoder.releases_gil, every_code_point=True)


#: ``load(module, serialized, parsed)``: ``module`` is the imported library (None: one of this
#: package's own), ``parsed`` gives the parsed JSON.
Loader = Callable[[Any, str, Callable[[], Any]], Loaded]


@dataclass(frozen=True)
class Library:
    """One fast library: its name (in messages), its loader, the module it needs (None: own)."""

    name: str
    load: Loader
    module: str | None = None

    def import_module(self) -> Any:
        """The library's module (None for this package's own); ``ImportError`` when missing."""
        return importlib.import_module(self.module) if self.module is not None else None


FASTOKENS = Library("fastokens", _load_fastokens, "fastokens")
GIGATOKEN = Library("gigatoken", _load_gigatoken, "gigatoken")
WORDPIECE = Library("shardcache.builder.wordpiece", _load_wordpiece)
SPLIT_WORDS = Library("shardcache.builder.split_words", _load_split_words)

#: Libraries tried, by the tokenizer's model type, when fastokens refuses the tokenizer, in
#: order; each is used only after the gate finds its ids equal to HF's. gigatoken loads BPE with
#: a Metaspace pre-tokenizer (Mistral). BERT-style WordPiece gets this package's ``wordpiece``;
#: a tokenizer that first splits at whitespace (T5's Unigram) gets ``split_words``. kitoken is
#: not used: on WordPiece it lowercases a word-final Σ to ς (HF: σ) and drops code points its
#: Unicode tables lack (HF: [UNK]), rare enough to pass a gate sample.
FALLBACK_LIBRARIES: dict[str, tuple[Library, ...]] = {
    "BPE": (GIGATOKEN, SPLIT_WORDS),
    "WordPiece": (WORDPIECE, SPLIT_WORDS),
    "Unigram": (SPLIT_WORDS,),
}


def import_fast_module() -> Any:
    """Import fastokens, or raise ``MissingDependencyError`` naming the pip command."""
    try:
        return importlib.import_module(FAST_MODULE)
    except ImportError as err:
        raise MissingDependencyError(
            f"the fast encoder needs the optional package {FAST_MODULE!r}, which is not "
            f"installed ({err}); install it with {FAST_PIP}, or build with --encoder hf"
        ) from err

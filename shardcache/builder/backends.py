"""Encoder backends (``name``, ``version``, ``encode_flat``) and the gate that picks one.

``HFBackend`` (``tokenizers``, in ``hf_backend``) is the reference. ``FastBackend`` (fastokens,
else a fallback library or this package's own: ``fast_loaders``) is used only when
``select_backend`` finds it encodes the key's probe and a corpus sample to exactly HF's ids; a
random sample of what it then encodes is re-checked against HF during the build
(``sampled_verify``). Both give flat ``(tokens uint32, lengths int64)``. The cache key never
depends on the backend. A compiled library is trusted only on the code points of
``code_points.proven_table``: a document holding any other goes to HF, so the library's
Unicode tables never decide an id.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shardcache.builder.ahead import Ahead
from shardcache.builder.chunk_cache import interleave
from shardcache.builder.code_points import Trusted, proven_table
from shardcache.builder.fast_loaders import (
    FALLBACK_LIBRARIES,
    FAST_PIP,
    FASTOKENS,
    OWN_PREFIX,
    Library,
    import_fast_module,
)
from shardcache.builder.hf_backend import HFBackend, flatten_ids
from shardcache.builder.sampled_verify import first_difference
from shardcache.builder.tokenizer_memo import parse_tokenizer_json
from shardcache.errors import EncoderError, MissingDependencyError

#: Most corpus documents (and ``GATE_SAMPLE_CHARS`` characters) the gate compares; small,
#: since every partition is verified during the build anyway.
GATE_SAMPLE_DOCS = 512
GATE_SAMPLE_CHARS = 256 * 1024


#: What ``--encoder fast`` is told when no library loads the tokenizer; ``auto`` falls back
#: to HF by itself, so its gate reason leaves it out.
LOAD_ADVICE = (
    "; byte-level BPE and Llama-2-style BPE load with fastokens, Metaspace BPE with gigatoken, "
    "BERT-style WordPiece and tokenizers that split at whitespace first (T5) with shardcache's "
    "own; build with --encoder hf (or auto, which falls back by itself)"
)


class FastBackend:
    """An accelerated library over the same ``tokenizer.json``, truncation and padding off.

    fastokens is tried first, then the ``FALLBACK_LIBRARIES`` of the tokenizer's model type; the
    first that loads is used. Raises ``MissingDependencyError`` when only installing a library
    could help, else ``EncoderError`` when every installed one refuses the tokenizer.
    """

    def __init__(self, serialized: str):
        refusals: list[str] = []
        missing: list[str] = []
        # parsed once, and only when fastokens cannot take the text as it is
        parsed = functools.cache(lambda: parse_tokenizer_json(serialized))
        for library in itertools.chain((FASTOKENS,), _fallbacks(parsed, refusals)):
            try:
                module = library.import_module()
            except ImportError:
                missing.append(library.name)
                continue
            try:
                loaded = library.load(module, serialized, parsed)
            except Exception as err:  # each library raises its own types for what it lacks
                refusals.append(f"{library.name}: {err or type(err).__name__}")
                continue
            self._encode = loaded.encode
            self.name, self.version = loaded.name, loaded.version
            self.releases_gil = loaded.releases_gil
            self._trusted = None if loaded.every_code_point else Trusted(proven_table())
            self._serialized = serialized
            self._reference: HFBackend | None = None
            self._reference_lock = threading.Lock()
            return
        # this package's own backends are always there: when only they refused, installing a
        # library is what helps
        if missing and all(r.startswith(OWN_PREFIX) for r in refusals):
            raise MissingDependencyError(
                f"the fast encoder needs the optional package {' or '.join(map(repr, missing))}, "
                f"which is not installed; install it with {FAST_PIP}, or build with --encoder hf"
                + (f" (shardcache's own: {'; '.join(refusals)})" if refusals else "")
            )
        raise EncoderError(
            f"the fast libraries cannot load this tokenizer ({'; '.join(refusals)}"
            f"{'; not installed: ' + ', '.join(missing) if missing else ''}){LOAD_ADVICE}"
        )

    def encode_flat(
        self, texts: list[str], add_special_tokens: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encode as HF's ``encode_batch`` would; ``EncoderError`` if specials cannot be added.

        Texts holding a code point the library is not trusted on are encoded by HF.
        """
        outside = self._trusted.outside(texts) if self._trusted is not None else ()
        if not len(outside):
            return self._encode(texts, add_special_tokens)
        inside = np.setdiff1d(np.arange(len(texts), dtype=np.int64), outside)
        groups = [(outside, self.reference().encode_flat([texts[i] for i in outside],
                                                         add_special_tokens))]  # fmt: skip
        if len(inside):
            groups.append((inside, self._encode([texts[i] for i in inside], add_special_tokens)))
        return interleave(len(texts), *groups)

    def reference(self) -> HFBackend:
        """The HF backend of the same JSON (truncation and padding off), made on first use."""
        with self._reference_lock:
            if self._reference is None:
                import tokenizers

                tokenizer = tokenizers.Tokenizer.from_str(self._serialized)
                tokenizer.no_truncation()
                tokenizer.no_padding()
                self._reference = HFBackend(tokenizer)
            return self._reference


def _fallbacks(parsed: Callable[[], Any], refusals: list[str]) -> Iterator[Library]:
    """The ``FALLBACK_LIBRARIES`` of the tokenizer's model; a JSON error is a refusal."""
    try:
        model = parsed().get("model") or {}
    except ValueError as err:
        refusals.append(f"tokenizer.json: {err}")
        return
    yield from FALLBACK_LIBRARIES.get(model.get("type", ""), ())


def load_fast_ahead(serialized: str) -> Ahead[FastBackend]:
    """Load a ``FastBackend`` in a background thread; ``result`` raises what loading raised.

    fastokens is imported here and the thread is waited for until it runs, so it does not queue
    on the GIL the caller holds next.
    """
    with contextlib.suppress(MissingDependencyError):  # the thread reports it
        import_fast_module()
    entered = threading.Event()
    ahead = Ahead(_load_entering, serialized, entered)
    entered.wait(timeout=1.0)
    return ahead


def _load_entering(serialized: str, entered: threading.Event) -> FastBackend:
    entered.set()
    return FastBackend(serialized)


@dataclass
class EncoderSelection:
    """Which backend a build uses and why (the manifest's soft ``encoder`` field)."""

    requested: str
    backend: str
    version: str
    reason: str
    gate_documents: int = 0

    def to_json(self) -> dict[str, Any]:
        """The selection as JSON, fields by name."""
        return asdict(self)


def select_backend(
    requested: str,
    serialized: str,
    reference: HFBackend,
    add_special_tokens: bool,
    probes: list[str],
    *,
    chat: bool = False,
    sample: list[str] | tuple[str, ...] = (),
    loading: Ahead[FastBackend] | None = None,
) -> tuple[FastBackend | None, EncoderSelection]:
    """Decide the build's backend: fast only if it encodes ``probes`` and ``sample`` as HF does.

    Gives the fast backend (None: HF) and the selection with its reason. Any refusal (load or
    encode failure, a differing id, chat data) means HF, except that ``requested == "fast"``
    raises ``EncoderError`` (``MissingDependencyError`` when the library is not installed).
    ``loading`` is a load started earlier; HF encodes the sample while it finishes.
    """
    texts = [*probes, *sample]
    corpus_documents = len(sample)
    hf = EncoderSelection(requested, reference.name, reference.version, "", corpus_documents)
    if requested == "hf":
        hf.reason = "--encoder hf"
        return None, hf

    def refuse(reason: str, missing: bool = False) -> tuple[None, EncoderSelection]:
        if requested == "fast":
            error = MissingDependencyError if missing else EncoderError
            raise error(f"--encoder fast cannot be used: {reason}")
        hf.reason = reason
        return None, hf

    if chat:
        return refuse(
            "chat builds need character offsets (char -> token) for the loss masks, which "
            "the fast libraries do not provide; the Hugging Face tokenizer encodes chat data"
        )
    loading = loading or load_fast_ahead(serialized)
    expected = None
    if not loading.done():  # HF encodes the sample while the fast backend finishes loading
        expected = flatten_ids(reference.encode_lists(texts, add_special_tokens))
    try:
        fast = loading.result()
    except MissingDependencyError as err:
        return refuse(str(err), missing=True)
    except EncoderError as err:
        if requested == "fast":
            return refuse(str(err))
        return refuse(f"{str(err).removesuffix(LOAD_ADVICE)}; the Hugging Face tokenizer "
                      "encodes this build")  # fmt: skip
    try:
        candidate = fast.encode_flat(texts, add_special_tokens)
    except Exception as err:  # an encode failure is a refusal, never a crash of the build
        return refuse(f"{fast.name} failed on the gate sample ({type(err).__name__}: {err})")
    if expected is None:
        expected = flatten_ids(reference.encode_lists(texts, add_special_tokens))
    diff = first_difference(texts, expected, candidate)
    if diff is not None:
        return refuse(
            f"{fast.name} {fast.version} and HF disagree on the gate sample ({len(texts)} "
            f"texts: the key's probe set and {corpus_documents} corpus documents): {diff}"
        )
    return fast, EncoderSelection(
        requested,
        fast.name,
        fast.version,
        f"ids equal to HF on the gate sample ({len(texts)} texts: the key's probe set and "
        f"{corpus_documents} corpus documents)",
        corpus_documents,
    )

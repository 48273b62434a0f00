"""Encoder backends (``name``, ``version``, ``encode_flat``) and the gate that picks one.

``HFBackend`` (``tokenizers``) is the reference. ``FastBackend`` (fastokens, else a fallback
library or this package's own) is used only when ``select_backend`` finds it encodes the key's
probe and a corpus sample to exactly HF's ids; a random sample of what it then encodes is
re-checked against HF during the build (``sampled``, ``SampleVerifier``). Both give flat
``(tokens uint32, lengths int64)``. The cache key never depends on the backend. A compiled
library is trusted only on the code points of ``code_points.proven_table``: a document holding
any other goes to HF, so the library's Unicode tables never decide an id.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from shardcache.builder.chunk_cache import interleave
from shardcache.builder.code_points import Trusted, proven_table
from shardcache.builder.split_words import SplitWords
from shardcache.builder.tokenizer_memo import library_versions, parse_tokenizer_json
from shardcache.builder.wordpiece import AsciiWordPiece
from shardcache.errors import EncoderError, MissingDependencyError
from shardcache.version import __version__

#: The first accelerated library tried (any tokenizer), and the pip extra of all of them.
FAST_MODULE = "fastokens"
FAST_PIP = "pip install 'shardcache[fast]'"

#: Libraries tried, by the tokenizer's model type, when fastokens refuses the tokenizer, in
#: order; each is used only after the gate finds its ids equal to HF's. gigatoken loads BPE with
#: a Metaspace pre-tokenizer (Mistral). BERT-style WordPiece gets this package's ``wordpiece``;
#: a tokenizer that first splits at whitespace (T5's Unigram) gets ``split_words``. kitoken is
#: not used: on WordPiece it lowercases a word-final Σ to ς (HF: σ) and drops code points its
#: Unicode tables lack (HF: [UNK]), rare enough to pass a gate sample.
FALLBACK_MODULES: dict[str, tuple[str, ...]] = {
    "BPE": ("gigatoken", "shardcache.builder.split_words"),
    "WordPiece": ("shardcache.builder.wordpiece", "shardcache.builder.split_words"),
    "Unigram": ("shardcache.builder.split_words",),
}

#: The import names of this package's own backends start so.
OWN_PREFIX = "shardcache."

#: Most corpus documents (and ``GATE_SAMPLE_CHARS`` characters) the gate compares; small,
#: since every partition is verified during the build anyway.
GATE_SAMPLE_DOCS = 512
GATE_SAMPLE_CHARS = 256 * 1024


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


#: What ``--encoder fast`` is told when no library loads the tokenizer; ``auto`` falls back
#: to HF by itself, so its gate reason leaves it out.
LOAD_ADVICE = (
    "; byte-level BPE and Llama-2-style BPE load with fastokens, Metaspace BPE with gigatoken, "
    "BERT-style WordPiece and tokenizers that split at whitespace first (T5) with shardcache's "
    "own; build with --encoder hf (or auto, which falls back by itself)"
)


class FastBackend:
    """An accelerated library over the same ``tokenizer.json``, truncation and padding off.

    fastokens is tried first, then the ``FALLBACK_MODULES`` of the tokenizer's model type; the
    first that loads is used. Raises ``MissingDependencyError`` when only installing a library
    could help, else ``EncoderError`` when every installed one refuses the tokenizer.
    """

    def __init__(self, serialized: str):
        refusals: list[str] = []
        missing: list[str] = []
        # parsed once, and only when fastokens cannot take the text as it is
        parsed = functools.cache(lambda: parse_tokenizer_json(serialized))
        for name in itertools.chain((FAST_MODULE,), _fallbacks(parsed, refusals)):
            try:
                module = importlib.import_module(name)
            except ImportError:
                missing.append(name)
                continue
            try:
                loaded = _LOADERS[name](module, serialized, parsed)
            except Exception as err:  # each library raises its own types for what it lacks
                refusals.append(f"{name}: {err or type(err).__name__}")
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


def _fallbacks(parsed: Callable[[], Any], refusals: list[str]) -> Iterator[str]:
    """The ``FALLBACK_MODULES`` of the tokenizer's model; a JSON error is a refusal."""
    try:
        model = parsed().get("model") or {}
    except ValueError as err:
        refusals.append(f"tokenizer.json: {err}")
        return
    yield from FALLBACK_MODULES.get(model.get("type", ""), ())


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


_LOADERS: dict[str, Callable[[Any, str, Callable[[], Any]], Loaded]] = {
    "fastokens": _load_fastokens,
    "gigatoken": _load_gigatoken,
    "shardcache.builder.wordpiece": _load_wordpiece,
    "shardcache.builder.split_words": _load_split_words,
}


@dataclass(frozen=True)
class SpecialTokens:
    """The ids a post-processor puts around one sequence, for libraries that encode without them.

    ``error`` is set for a post-processor this does not model: only builds with
    ``add_special_tokens=False`` can then use the library.
    """

    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    error: str | None = None

    @classmethod
    def of(cls, processor: Mapping[str, Any] | None) -> SpecialTokens:
        """The special tokens of a tokenizer.json ``post_processor`` (None: none)."""
        if processor is None:
            return cls()
        kind = processor.get("type")
        if kind == "ByteLevel":  # offsets only
            return cls()
        if kind in ("BertProcessing", "RobertaProcessing"):
            return cls((int(processor["cls"][1]),), (int(processor["sep"][1]),))
        if kind == "Sequence":
            parts = [cls.of(p) for p in processor.get("processors") or []]
            errors = [p.error for p in parts if p.error]
            if errors:
                return cls(error=errors[0])
            added = [p for p in parts if p.before or p.after]
            return added[0] if len(added) == 1 else cls() if not added else cls(error="several")
        if kind == "TemplateProcessing":
            before: list[int] = []
            after: list[int] = []
            side = before
            for piece in processor.get("single") or []:
                if "Sequence" in piece:
                    if side is after:
                        return cls(error="a template with the sequence twice")
                    side = after
                    continue
                name = piece.get("SpecialToken", {}).get("id")
                ids = (processor.get("special_tokens") or {}).get(name, {}).get("ids")
                if ids is None:
                    return cls(error=f"template token {name!r} without ids")
                side.extend(int(i) for i in ids)
            return cls(tuple(before), tuple(after))
        return cls(error=f"post-processor {kind!r}")

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Put ``before``/``after`` around each sequence; ``EncoderError`` when ``error`` is set."""
        if self.error is not None:
            raise EncoderError(f"cannot add this tokenizer's special tokens: {self.error}")
        if not self.before and not self.after:
            return tokens, lengths
        nb, na = len(self.before), len(self.after)
        out_lengths = lengths + nb + na
        starts = np.cumsum(out_lengths) - out_lengths
        out = np.empty(int(out_lengths.sum()), dtype=np.uint32)
        body = np.ones(len(out), dtype=bool)
        for k, token in enumerate(self.before):
            out[starts + k] = token
            body[starts + k] = False
        for k, token in enumerate(self.after):
            at = starts + out_lengths - na + k
            out[at] = token
            body[at] = False
        out[body] = tokens
        return out, out_lengths


T = TypeVar("T")


class Ahead(Generic[T]):
    """``fn(*args)`` in a background non-daemon thread; ``result`` re-raises what it raised."""

    def __init__(self, fn: Callable[..., T], *args: Any):
        self._value: T | None = None
        self._error: BaseException | None = None
        # not a daemon: a daemon killed inside fastokens at interpreter exit aborts the process
        self._thread = threading.Thread(
            target=self._run, args=(fn, args), name="shardcache-ahead", daemon=False
        )
        self._thread.start()

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as err:  # re-raised in the caller
            self._error = err

    def done(self) -> bool:
        """Whether ``fn`` has returned or raised (``result`` then does not wait)."""
        return not self._thread.is_alive()

    def result(self) -> T:
        """Wait for ``fn``; return its value or re-raise the very exception it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


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


#: Keys of a tokenizer.json that never change the ids an encode returns: the decoder (ids ->
#: text only) and the saved truncation / padding (every backend switches both off).
IDS_IRRELEVANT_KEYS = ("decoder", "truncation", "padding")


def ids_content(backend_json: Mapping[str, Any]) -> dict[str, Any]:
    """A tokenizer's JSON without what cannot change ids: equal contents encode texts alike.

    Drops ``IDS_IRRELEVANT_KEYS`` and ByteLevel ``trim_offsets``. transformers rewrites parts of
    tokenizer.json as it loads it; this lets a backend loaded from the file stand in for one
    loaded from transformers' JSON.
    """

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: strip(v)
                for k, v in value.items()
                if not (k == "trim_offsets" and value.get("type") == "ByteLevel")
            }
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    content = {k: v for k, v in backend_json.items() if k not in IDS_IRRELEVANT_KEYS}
    for key in ("pre_tokenizer", "post_processor"):
        if key in content:
            content[key] = strip(content[key])
    return content


@dataclass
class EarlyLoad:
    """A fast backend loaded from a folder's tokenizer.json before the tokenizer was resolved."""

    text: str | None
    backend: FastBackend | None = None
    error: EncoderError | MissingDependencyError | None = None

    def take(self) -> FastBackend:
        """The backend, freeing the text; re-raises the load's refusal (the same object)."""
        self.text = None
        if self.error is not None:
            raise self.error
        return self.backend  # type: ignore[return-value]


def _load_early(path: str, text: str | None, entered: threading.Event) -> EarlyLoad:
    entered.set()
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    early = EarlyLoad(text)
    try:
        early.backend = FastBackend(text)
    except (EncoderError, MissingDependencyError) as err:
        early.error = err
    return early


def load_fast_early(folder: str, text: str | None = None) -> Ahead[EarlyLoad] | None:
    """Start loading the fast backend from ``folder/tokenizer.json`` (None: the folder has none).

    ``text`` is the file's content when the caller has read it. ``adopt_early`` or
    ``adopt_agreed`` decides whether the backend is used.
    """
    path = os.path.join(folder, "tokenizer.json")
    if text is None and not os.path.isfile(path):
        return None
    with contextlib.suppress(MissingDependencyError):  # the thread reports it
        import_fast_module()
    entered = threading.Event()
    ahead = Ahead(_load_early, path, text, entered)
    entered.wait(timeout=1.0)  # running before the caller takes the GIL for long
    return ahead


def _adopt(early: Ahead[EarlyLoad], backend_json: Mapping[str, Any], serialized: str) -> Any:
    try:
        loaded = early.result()
    except (OSError, ValueError):  # file unreadable: load transformers' JSON
        return FastBackend(serialized)
    text, loaded.text = loaded.text, None  # the file (large for a big vocabulary) goes now
    try:
        same = ids_content(parse_tokenizer_json(text or "")) == ids_content(backend_json)
    except (ValueError, RecursionError):  # not JSON: load transformers' JSON
        same = False
    if not same:
        loaded.backend = None
        return FastBackend(serialized)
    return loaded.take()


def adopt_early(
    early: Ahead[EarlyLoad], backend_json: Mapping[str, Any], serialized: str
) -> Ahead[FastBackend]:
    """The build's fast backend from an early load, decided in the background.

    The early backend is kept only when its file has the same ``ids_content`` as
    ``backend_json`` (transformers' JSON); otherwise a new one loads from ``serialized``.
    """
    return Ahead(_adopt, early, backend_json, serialized)


def adopt_agreed(early: Ahead[EarlyLoad]) -> Ahead[FastBackend]:
    """The early backend as it is, waited for in the background (a refusal re-raised by ``result``).

    Only for a caller that has checked that the loaded text agrees, in every part that decides
    ids, with the build's tokenizer (``tokenizer_memo.read_resolved`` does, for the memo).
    """
    return Ahead(_take, early)


def _take(early: Ahead[EarlyLoad]) -> FastBackend:
    return early.result().take()


def import_fast_module() -> Any:
    """Import fastokens, or raise ``MissingDependencyError`` naming the pip command."""
    try:
        return importlib.import_module(FAST_MODULE)
    except ImportError as err:
        raise MissingDependencyError(
            f"the fast encoder needs the optional package {FAST_MODULE!r}, which is not "
            f"installed ({err}); install it with {FAST_PIP}, or build with --encoder hf"
        ) from err


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


def first_difference(
    texts: list[str],
    reference: tuple[np.ndarray, np.ndarray],
    candidate: tuple[np.ndarray, np.ndarray],
) -> str | None:
    """Where HF's ``reference`` and the ``candidate`` encoding first differ (None: equal)."""
    ref_tokens, ref_lengths = reference
    tokens, lengths = candidate
    if np.array_equal(ref_lengths, lengths) and np.array_equal(ref_tokens, tokens):
        return None
    ref_ends, ends = np.cumsum(ref_lengths), np.cumsum(lengths)
    for i, text in enumerate(texts):
        a = ref_tokens[ref_ends[i] - ref_lengths[i] : ref_ends[i]]
        b = tokens[ends[i] - lengths[i] : ends[i]] if i < len(lengths) else np.zeros(0, np.uint32)
        if np.array_equal(a, b):
            continue
        n = min(len(a), len(b))
        at = int(np.argmax(a[:n] != b[:n])) if n and (a[:n] != b[:n]).any() else n
        return (
            f"text {i} ({text[:60]!r}{'...' if len(text) > 60 else ''}): at id {at}, HF gives "
            f"{a[at : at + 4].tolist()} (of {len(a)}) and the fast backend "
            f"{b[at : at + 4].tolist()} (of {len(b)})"
        )
    return f"{len(texts)} texts: the backends return {len(ref_lengths)} and {len(lengths)} ids"


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


@dataclass
class VerifyCounts:
    """In-build verification of one partition (fast backend only): counts and mismatches."""

    documents: int = 0
    tokens: int = 0
    mismatches: int = 0
    detail: list[str] = field(default_factory=list)


#: However low the verification rate, the sample covers at least this many bytes' worth of
#: input (a small corpus is verified whole): the rate is raised to this share of the input.
VERIFY_FLOOR_BYTES = 64 * 1024


def verify_rate(fraction: float, input_bytes: int) -> float:
    """The share re-checked with HF: ``fraction`` (0: none) raised to ``VERIFY_FLOOR_BYTES``."""
    if fraction <= 0:
        return 0.0
    return min(1.0, max(fraction, VERIFY_FLOOR_BYTES / max(1, input_bytes)))


def source_salt(name: str) -> int:
    """The 64-bit salt ``sampled`` uses for the records of the input at path ``name``."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def build_draw_keys(
    records: np.ndarray, files: np.ndarray | None, names: tuple[str, ...]
) -> np.ndarray:
    """Each text's key for the build's verification sample (``sampled`` with salt 0).

    The key is the record index plus its file's salt, salted apart from ``verify --tokens``'
    sample. ``files`` indexes ``names`` per text (None: all in ``names[0]``).
    """
    salts = np.array([source_salt("build:" + n) for n in names or ("",)], dtype=np.uint64)
    per_text = salts[files] if files is not None else salts[0]
    with np.errstate(over="ignore"):
        return records.astype(np.uint64) + per_text


def sampled(records: np.ndarray, rate: float, salt: int) -> np.ndarray:
    """Which records are in the verification sample: a bool per record.

    A record is in when splitmix64 of ``salt`` and its index, read as a number in [0, 1), is
    below ``rate``: independent per record, and the same whatever the batching, the number of
    processes or a resume.
    """
    if rate >= 1:
        return np.ones(len(records), dtype=bool)
    with np.errstate(over="ignore"):
        z = records.astype(np.uint64) + np.uint64(salt) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) < rate * 2.0**53


#: Characters of sampled documents one background HF call verifies: the samples of many
#: batches go in one call, since every call also pays a thread start, GIL hand-overs and the
#: wake-up of HF's thread pool, which in a busy build outweigh encoding a few documents.
VERIFY_GROUP_CHARS = 64 * 1024

#: Groups whose verification may still run in the background while the encoder goes on.
VERIFY_AHEAD = 2


@dataclass
class SampledBatch:
    """One batch's verification sample: positions in the batch, texts and fast ids, copied."""

    positions: np.ndarray
    texts: list[str]
    tokens: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(
        cls, texts: list[str], tokens: np.ndarray, lengths: np.ndarray, positions: np.ndarray
    ) -> SampledBatch:
        """The sample at ``positions`` of a batch, as copies."""
        ends = np.cumsum(lengths)
        starts = ends - lengths
        picked = [tokens[starts[i] : ends[i]] for i in positions]
        flat = np.concatenate(picked) if picked else np.zeros(0, dtype=tokens.dtype)
        return cls(positions, [texts[i] for i in positions], flat, lengths[positions].copy())


def verify_group(
    group: list[SampledBatch], reference: HFBackend, add_special_tokens: bool
) -> list[VerifyCounts]:
    """Re-encode ``group``'s samples with HF in one call and compare with the fast ids.

    Gives each batch's counts. An HF failure is a mismatch of the batch it fails on (a failing
    group is re-run batch by batch to find it).
    """
    try:
        ref_tokens, ref_lengths = reference.encode_flat(
            [text for batch in group for text in batch.texts], add_special_tokens
        )
    except Exception as err:  # any HF failure is the batch's
        if len(group) > 1:  # find the batch it fails on
            return [c for batch in group for c in verify_group([batch], reference,
                                                               add_special_tokens)]  # fmt: skip
        detail = f"HF failed on the verification sample ({type(err).__name__}: {err})"[:300]
        return [VerifyCounts(mismatches=1, detail=[detail])]
    out = []
    docs = np.cumsum([0, *(len(batch.texts) for batch in group)])
    ends = np.cumsum(ref_lengths)
    for batch, first, last in zip(group, docs[:-1], docs[1:]):
        start = int(ends[first - 1]) if first else 0
        end = int(ends[last - 1]) if last else 0
        out.append(_compare_sample(batch, ref_tokens[start:end], ref_lengths[first:last]))
    return out


def _compare_sample(
    batch: SampledBatch, ref_tokens: np.ndarray, ref_lengths: np.ndarray
) -> VerifyCounts:
    counts = VerifyCounts(documents=len(batch.texts), tokens=int(ref_lengths.sum()))
    if np.array_equal(ref_lengths, batch.lengths) and np.array_equal(ref_tokens, batch.tokens):
        return counts
    ref_ends, ends = np.cumsum(ref_lengths), np.cumsum(batch.lengths)
    for j, i in enumerate(batch.positions):
        expected = ref_tokens[ref_ends[j] - ref_lengths[j] : ref_ends[j]]
        got = batch.tokens[ends[j] - batch.lengths[j] : ends[j]]
        if len(got) == len(expected) and np.array_equal(got, expected):
            continue
        counts.mismatches += 1
        a, b = expected, got
        text = batch.texts[j]
        diff = first_difference([text], (a, np.asarray([len(a)])), (b, np.asarray([len(b)])))
        counts.detail.append(f"document {int(i)} of the batch: {diff}")
    return counts


class SampleVerifier:
    """The in-build verification of an encoder's batches, in background threads.

    Samples are queued; every ``VERIFY_GROUP_CHARS`` of them go to ``verify_group`` in one
    thread, at most ``VERIFY_AHEAD`` groups behind the encoder. ``settle`` verifies the rest.
    """

    def __init__(self) -> None:
        self._queued: list[SampledBatch] = []
        self._chars = 0
        self._jobs: list[Ahead[list[VerifyCounts]]] = []
        self._how: tuple[Any, ...] = ()

    def add(
        self,
        sample: SampledBatch,
        reference: HFBackend,
        add_special_tokens: bool,
        times: Any = None,
    ) -> None:
        """Queue one batch's sample; ``times`` (a ``StageTimes``) gets ``verify_busy``."""
        self._queued.append(sample)
        self._chars += sum(map(len, sample.texts))
        self._how = (reference, add_special_tokens, times)
        if self._chars >= VERIFY_GROUP_CHARS:
            self._start()

    def _start(self) -> None:
        if len(self._jobs) >= VERIFY_AHEAD:  # backpressure
            self._jobs[-VERIFY_AHEAD].result()
        group, self._queued, self._chars = self._queued, [], 0
        self._jobs.append(Ahead(_verify_timed, group, *self._how))

    def settle(self) -> list[VerifyCounts]:
        """Verify what is queued, wait for every group and give each batch's counts."""
        if self._queued:
            self._start()
        jobs, self._jobs = self._jobs, []
        return [counts for job in jobs for counts in job.result()]


def _verify_timed(
    group: list[SampledBatch], reference: HFBackend, add_special_tokens: bool, times: Any
) -> list[VerifyCounts]:
    with times.busy("verify_busy") if times is not None else contextlib.nullcontext():
        return verify_group(group, reference, add_special_tokens)

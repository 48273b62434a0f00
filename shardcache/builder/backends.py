"""Encoder backends: the Hugging Face tokenizer (the reference) and an accelerated one, behind
one small protocol, and the gate that decides which one a build uses.

What this module owns:

* :class:`Backend` — ``encode_flat(texts) -> (tokens, lengths)``: every text's ids
  concatenated (uint32) and the number of ids per text (int64). The build converts ids in
  bulk, never through per-token Python ints where the backend allows it.
* :class:`HFBackend` — ``tokenizers.Tokenizer.encode_batch``: the reference, always there.
* :class:`FastBackend` — `fastokens <https://pypi.org/project/fastokens/>`_
  (``pip install 'shardcache[fast]'``), which loads the same ``tokenizer.json`` and returns a
  batch as one flat buffer (``encode_batch_flat``). It refuses what it does not implement
  (at load: e.g. BertNormalizer, NFKC, the Metaspace pre-tokenizer) and tracks no character
  offsets, so chat builds (loss masks from char -> token lookups) always use HF.
* The gate (:func:`select_backend`): a fast backend is used only when it loads the tokenizer
  AND encodes the behaviour probe of the cache key plus a sample of the corpus to exactly the
  ids of HF. Any difference -> HF for the whole build, and the reason is recorded
  (:class:`EncoderSelection`: manifest ``encoder``, build report, ``info``). During the build
  :func:`verify_sample` re-encodes a deterministic sample of every encode batch with HF
  (partition.py re-encodes a partition with HF on a mismatch).

Start-up: with a warm memo of the tokenizer folder (:mod:`shardcache.builder.tokenizer_memo`) the
fast load starts from the memo's backend JSON (the JSON transformers produced) while the
reference backend parses the same JSON. Without one, a build starts the fast load from the
folder's tokenizer.json first thing (:func:`load_fast_early`), before transformers is
imported, and adopts it once transformers' backend JSON is known if the two have the same
:func:`ids_content` (else it loads that JSON).

Exactness is by proof, not by trust: ids equal the reference on everything the gate and the
in-build sample saw, and ``shardcache verify --tokens`` audits any cache afterwards. The cache
key does not depend on the backend (it is computed with HF).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from shardcache.errors import EncoderError, MissingDependencyError

#: The accelerated backend's import name and its pip extra.
FAST_MODULE = "fastokens"
FAST_PIP = "pip install 'shardcache[fast]'"

#: Corpus documents the gate encodes with both backends before the build starts: at most
#: this many documents and :data:`GATE_SAMPLE_CHARS` characters. Every partition is verified
#: during the build anyway, so the gate's sample stays small (its HF side is slow).
GATE_SAMPLE_DOCS = 512
GATE_SAMPLE_CHARS = 256 * 1024


class Backend(Protocol):
    """Text -> ids. ``encode_flat`` returns (uint32 tokens of all texts, int64 lengths)."""

    name: str
    version: str

    def encode_flat(
        self, texts: list[str], add_special_tokens: bool
    ) -> tuple[np.ndarray, np.ndarray]: ...


def flatten_ids(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-text id lists -> (uint32 tokens, int64 lengths), without a per-text array."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(
        itertools.chain.from_iterable(ids), dtype=np.uint32, count=int(lengths.sum())
    )
    return tokens, lengths


class HFBackend:
    """The Hugging Face ``tokenizers`` backend: the reference."""

    name = "hf"

    def __init__(self, tokenizer: Any):
        import tokenizers

        self.tokenizer = tokenizer
        self.version = tokenizers.__version__

    def encode_lists(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """``encode_batch``: exactly ``tokenizer(text)["input_ids"]`` (the reference)."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def encode_flat(
        self, texts: list[str], add_special_tokens: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The build's ids: ``encode_batch_fast`` (tokenizers >= 0.20), the same pipeline
        without character offsets (less work than ``encode_batch``) and the same ids (the
        build tests compare with ``tokenizer(text)``)."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encodings = encode(texts, add_special_tokens=add_special_tokens)
        return flatten_ids([e.ids for e in encodings])


class FastBackend:
    """fastokens over the same ``tokenizer.json`` (truncation and padding off, as HF's)."""

    name = FAST_MODULE

    def __init__(self, serialized: str):
        module = import_fast_module()
        try:
            self.tokenizer = module.Tokenizer.from_json_str(serialized)
        except Exception as err:  # fastokens raises ValueError for what it does not implement
            raise EncoderError(
                f"{FAST_MODULE} cannot load this tokenizer ({type(err).__name__}: {err}); "
                "it supports byte-level BPE and BPE tokenizers without Metaspace; build with "
                "--encoder hf (or auto, which falls back by itself)"
            ) from err
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.version = fast_version()

    def encode_flat(
        self, texts: list[str], add_special_tokens: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        ids, offsets = self.tokenizer.encode_batch_flat(
            texts, add_special_tokens=add_special_tokens
        )
        tokens = np.frombuffer(ids, dtype="<u4")
        lengths = np.diff(np.frombuffer(offsets, dtype="<u8")).astype(np.int64)
        return tokens, lengths


T = TypeVar("T")


class Ahead(Generic[T]):
    """``fn(*args)`` run in a background thread; :meth:`result` waits and returns it (or
    re-raises its exception in the caller). For start-up work that releases the GIL or fills
    time the caller spends waiting anyway."""

    def __init__(self, fn: Callable[..., T], *args: Any):
        self._value: T | None = None
        self._error: BaseException | None = None
        # not a daemon: interpreter shutdown waits for it. A daemon thread still inside
        # fastokens when a failing build exits aborted the process once ("FATAL: exception
        # not rethrown", seen when it reacquired the GIL during finalization)
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
        """True once ``fn`` has returned or raised (:meth:`result` then does not wait)."""
        return not self._thread.is_alive()

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def load_fast_backend(serialized: str) -> FastBackend:
    """:class:`FastBackend`, with any failure turned into the :class:`EncoderError` of a
    refusal (never a crash of the build)."""
    try:
        return FastBackend(serialized)
    except (EncoderError, MissingDependencyError):
        raise
    except Exception as err:
        raise EncoderError(f"{FAST_MODULE} failed to load the tokenizer: {err!r}") from err


def load_fast_ahead(serialized: str) -> Ahead[FastBackend]:
    """Load a :class:`FastBackend` in the background: fastokens releases the GIL while it
    parses, so the load overlaps planning and the HF side of the gate (or, in a worker, the
    HF load). Returns once the thread is about to call fastokens (the package is imported
    here first): callers next run ``Tokenizer.from_str``, which holds the GIL, and a thread
    still importing fastokens would wait for all of it."""
    with contextlib.suppress(MissingDependencyError):  # the thread reports it
        import_fast_module()
    entered = threading.Event()
    ahead = Ahead(_load_entering, serialized, entered)
    entered.wait(timeout=1.0)
    return ahead


def _load_entering(serialized: str, entered: threading.Event) -> FastBackend:
    entered.set()
    return load_fast_backend(serialized)


#: Keys of a tokenizer.json that never change the ids an encode returns: the decoder (ids ->
#: text only) and the saved truncation / padding (every backend switches both off).
IDS_IRRELEVANT_KEYS = ("decoder", "truncation", "padding")


def ids_content(backend_json: Mapping[str, Any]) -> dict[str, Any]:
    """``backend_json`` without what cannot change ids: :data:`IDS_IRRELEVANT_KEYS` and the
    ``trim_offsets`` flag of ByteLevel components (in tokenizers it only trims character
    offsets, which the fast backend does not produce). Two tokenizer.json whose
    ``ids_content`` are equal encode every text to the same ids in the same backend.

    Why it exists: transformers 5 rewrites parts of a saved tokenizer.json as it loads it
    (for Qwen2: the decoder and the pre-tokenizer's ``trim_offsets``), so the backend JSON
    the build uses is not byte-for-byte the file; this comparison lets the fast backend
    loaded from the file before transformers is imported (:func:`load_fast_early`) stand in
    for one loaded from transformers' JSON."""

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
    """The fast backend loaded from a folder's tokenizer.json before transformers ran:
    ``content`` (:func:`ids_content` of the file) says what it was loaded from; ``backend``
    or ``error`` (the refusal: unsupported tokenizer, package missing)."""

    content: dict[str, Any] | None
    backend: FastBackend | None = None
    error: EncoderError | MissingDependencyError | None = None


def _load_early(path: str) -> EarlyLoad:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    early = EarlyLoad(None)
    try:
        early.backend = load_fast_backend(text)
    except (EncoderError, MissingDependencyError) as err:
        early.error = err
    early.content = ids_content(json.loads(text))
    return early


def load_fast_early(folder: str) -> Ahead[EarlyLoad] | None:
    """Start loading the fast backend from ``folder/tokenizer.json`` now, in a thread, or
    None when the folder has no tokenizer.json. A build calls this first thing: the load
    (the GIL released) then overlaps the transformers import and the HF load.
    :func:`adopt_early` decides whether it can be used."""
    path = os.path.join(folder, "tokenizer.json")
    return Ahead(_load_early, path) if os.path.isfile(path) else None


def _adopt(early: Ahead[EarlyLoad], backend_json: Mapping[str, Any], serialized: str) -> Any:
    try:
        loaded = early.result()
    except (OSError, ValueError):  # file unreadable or not JSON: load transformers' JSON
        return load_fast_backend(serialized)
    same = loaded.content == ids_content(backend_json)
    loaded.content = None  # the parsed file (large for a big vocabulary) goes now
    if not same:
        loaded.backend = None
        return load_fast_backend(serialized)
    if loaded.error is not None:
        raise loaded.error
    return loaded.backend


def adopt_early(
    early: Ahead[EarlyLoad], backend_json: Mapping[str, Any], serialized: str
) -> Ahead[FastBackend]:
    """The fast backend for the HF tokenizer whose backend is ``backend_json`` (parsed
    ``serialized``): the early one when the file it loaded has the same :func:`ids_content`,
    else one loaded from ``serialized`` (in the background either way). Exactness is
    unchanged: the gate and the in-build sample still compare its ids with HF."""
    return Ahead(_adopt, early, backend_json, serialized)


def import_fast_module() -> Any:
    """The fastokens module, or :class:`MissingDependencyError` naming the pip command."""
    try:
        return importlib.import_module(FAST_MODULE)
    except ImportError as err:
        raise MissingDependencyError(
            f"the fast encoder needs the optional package {FAST_MODULE!r}, which is not "
            f"installed ({err}); install it with {FAST_PIP}, or build with --encoder hf"
        ) from err


def fast_version() -> str:
    try:
        return metadata.version(FAST_MODULE)
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class EncoderSelection:
    """Which backend a build uses and why (the manifest's soft ``encoder`` field)."""

    requested: str  # auto | hf | fast
    backend: str  # "hf" or the fast backend's name
    version: str
    reason: str
    gate_documents: int = 0  # corpus documents the gate compared

    def to_json(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "backend": self.backend,
            "version": self.version,
            "reason": self.reason,
            "gate_documents": self.gate_documents,
        }


def first_difference(
    texts: list[str],
    reference: tuple[np.ndarray, np.ndarray],
    candidate: tuple[np.ndarray, np.ndarray],
) -> str | None:
    """None when both (tokens, lengths) are equal, else a description of the first differing
    text (its position, an excerpt, the first differing position and ids)."""
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
    """The gate: the fast backend when ``requested`` allows it, it loads ``serialized`` and it
    encodes ``probes`` (the key's behaviour probe) and ``sample`` (corpus documents) to
    exactly HF's ids; else None and the reason. ``requested == "fast"`` raises
    :class:`EncoderError` instead of falling back. ``loading``: the load, started earlier."""
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
            f"chat builds need character offsets (char -> token) for the loss masks, which "
            f"{FAST_MODULE} does not provide; the Hugging Face tokenizer encodes chat data"
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
        return refuse(str(err))
    try:
        candidate = fast.encode_flat(texts, add_special_tokens)
    except Exception as err:  # an encode failure is a refusal, never a crash of the build
        return refuse(f"{FAST_MODULE} failed on the gate sample ({type(err).__name__}: {err})")
    if expected is None:
        expected = flatten_ids(reference.encode_lists(texts, add_special_tokens))
    diff = first_difference(texts, expected, candidate)
    if diff is not None:
        return refuse(
            f"{FAST_MODULE} {fast.version} and HF disagree on the gate sample ({len(texts)} "
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
    """In-build verification of one partition (fast backend only)."""

    documents: int = 0  # documents re-encoded with HF and compared
    mismatches: int = 0
    detail: list[str] = field(default_factory=list)


def sample_positions(
    texts: list[str], lengths: np.ndarray, fraction: float, batch_number: int
) -> np.ndarray:
    """Positions of a batch to re-encode with HF: every ``round(1/fraction)``-th document
    (the phase moves with ``batch_number``, so a partition's sample is deterministic and
    spread), plus the longest (most ids) and the most non-ASCII document of the batch."""
    n = len(texts)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    chosen = [int(np.argmax(lengths))]
    if fraction > 0:
        step = max(1, round(1 / fraction))
        chosen.extend(range(batch_number % step, n, step))
    # UTF-8 bytes beyond one per character: 0 for ASCII (isascii is a C-speed check)
    extra = [0 if t.isascii() else len(t.encode("utf-8", "surrogatepass")) - len(t) for t in texts]
    if max(extra) > 0:
        chosen.append(int(np.argmax(extra)))
    return np.unique(np.asarray(chosen, dtype=np.int64))


def verify_sample(
    texts: list[str],
    tokens: np.ndarray,
    lengths: np.ndarray,
    positions: np.ndarray,
    reference: HFBackend,
    add_special_tokens: bool,
    counts: VerifyCounts,
) -> None:
    """Re-encode ``texts[positions]`` with HF and compare with the fast ids; updates
    ``counts`` (each differing document adds one mismatch and its description). HF encodes
    as an HF build does (:meth:`HFBackend.encode_flat`), so a fast build is compared with the
    ids an HF build stores."""
    if len(positions) == 0:
        return
    ends = np.cumsum(lengths)
    picked = [texts[i] for i in positions]
    ref_tokens, ref_lengths = reference.encode_flat(picked, add_special_tokens)
    ref_ends = np.cumsum(ref_lengths)
    counts.documents += len(positions)
    for j, i in enumerate(positions):
        expected = ref_tokens[ref_ends[j] - ref_lengths[j] : ref_ends[j]]
        got = tokens[ends[i] - lengths[i] : ends[i]]
        if len(got) == len(expected) and np.array_equal(got, expected):
            continue
        counts.mismatches += 1
        a, b = expected, got
        diff = first_difference([texts[i]], (a, np.asarray([len(a)])), (b, np.asarray([len(b)])))
        counts.detail.append(f"document {int(i)} of the batch: {diff}")

"""Tokenizer adapter: text -> ids, with explicit special tokens, EOS and truncation.

Ids are exactly ``tokenizer(text)["input_ids"]``; tokenizers load from local folders only
and a caller's tokenizer is never mutated. The backend's own truncation/padding settings are
recorded in the cache key and switched off: truncation is shardcache's, explicit and counted.
EOS is appended by default and never doubled (SEP when there is no EOS). Workers build
encoders from a plain-JSON ``ResolvedTokenizer`` without importing transformers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import queue
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.builder.ahead import Ahead
from shardcache.builder.backends import EncoderSelection, FastBackend, load_fast_ahead
from shardcache.builder.chunking import HUGE_CHARS, chunking_is_exact, encode_in_pieces
from shardcache.builder.early_load import EarlyLoad, adopt_early
from shardcache.builder.hf_backend import HFBackend
from shardcache.builder.sampled_verify import (
    SampledBatch,
    SampleVerifier,
    VerifyCounts,
    build_draw_keys,
    sampled,
)
from shardcache.builder.stage_times import StageTimes
from shardcache.builder.tokenizer_memo import (
    ResolvedTokenizer,
    folder_digest,
    parse_tokenizer_json,
    write_resolved,
)
from shardcache.config import DEFAULT_VERIFY_FRACTION, TokenizeOptions
from shardcache.errors import ConfigError, EncoderError, TokenizerError
from shardcache.store.files import memo_disabled


@dataclass
class Encoded:
    """Sequences of one batch as flat arrays.

    Per sequence: its document's position in the batch and its piece number (0 unless split);
    ``mask`` flags trainable tokens (chat; None: all). ``columns``: per-token columns
    (``store/columns.py`` names) flat like ``tokens``, written beside the mask; a column the
    spec marks ``in_mask`` travels as ``mask`` instead.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    doc_index: np.ndarray
    piece: np.ndarray
    mask: np.ndarray | None = None
    failed: list[tuple[int, str, str]] = field(default_factory=list)
    columns: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FlatIds:
    """Raw uint32 ids of one encode batch, concatenated; ``ids[i]`` is text ``i``'s (a view)."""

    tokens: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        end = int(self.lengths[: i + 1].sum())
        return self.tokens[end - int(self.lengths[i]) : end]


class EncodingMismatch(EncoderError):
    """The fast backend's ids differed from HF's on the in-build sample."""


@dataclass
class TruncationStats:
    """Counts that go into the manifest and the build report.

    ``empty_documents`` tokenized to nothing (not stored); ``lost_tokens`` were removed by
    truncate/drop; ``dropped_no_trainable`` and ``trainable_tokens`` count chat data only.
    """

    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    truncated_documents: int = 0
    dropped_documents: int = 0
    split_documents: int = 0
    empty_documents: int = 0
    lost_tokens: int = 0
    dropped_no_trainable: int = 0
    trainable_tokens: int = 0

    def add(self, other: TruncationStats) -> None:
        """Add another partition's counts."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_json(self) -> dict[str, int]:
        """The counts by name."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def token_dtype(max_token_id: int) -> np.dtype:
    """The cache's token type: uint16 when ``max_token_id`` fits, else uint32."""
    return np.dtype(np.uint16) if max_token_id < 65536 else np.dtype(np.uint32)


def max_token_id(backend_json: Mapping[str, Any], backend: Any) -> int:
    """The largest id ``backend`` can emit (vocabulary and added tokens)."""
    model = backend_json.get("model") or {}
    vocab = model.get("vocab")
    added = [int(t["id"]) for t in backend_json.get("added_tokens") or []]
    if model.get("type") in ("BPE", "WordPiece", "WordLevel") and isinstance(vocab, dict):
        return max([*vocab.values(), *added], default=0)
    if model.get("type") == "Unigram" and isinstance(vocab, list):
        return max([len(vocab) - 1, *added], default=0) if vocab or added else 0
    ids = backend.get_vocab(with_added_tokens=True).values()
    return max(ids) if ids else 0


def load_hf_tokenizer(path: str) -> Any:
    """Load a fast transformers tokenizer from a local folder.

    Raises ``TokenizerError`` for a missing folder, no tokenizer files, a load failure, or a
    slow-only tokenizer.
    """
    if not os.path.isdir(path):
        raise TokenizerError(
            f"tokenizer {path!r}: no such folder; pass --tokenizer with a local folder holding "
            "tokenizer.json (shardcache never downloads tokenizers)"
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    known = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
             "tokenizer.model", "spiece.model")  # fmt: skip
    if not any(os.path.isfile(os.path.join(path, name)) for name in known):
        raise TokenizerError(
            f"tokenizer {path!r}: the folder holds no tokenizer files (none of "
            f"{', '.join(known)}); pass --tokenizer with the folder that holds tokenizer.json "
            "(e.g. one saved with tokenizer.save_pretrained(folder))"
        )
    try:
        cls = named_tokenizer_class(path)
        if cls is None:
            from transformers import AutoTokenizer

            cls = AutoTokenizer
        tok = cls.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers raises many types for unusable folders
        raise TokenizerError(
            f"tokenizer {path!r}: transformers cannot load it ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:300]}); "
            "the folder needs tokenizer.json or the files of a fast tokenizer"
        ) from err
    ensure_fast(tok, path)
    return tok


def named_tokenizer_class(path: str) -> Any | None:
    """The class tokenizer_config.json names: what AutoTokenizer would pick, without torch.

    Falls back to the name without ``Fast``; None when transformers exports neither.
    """
    config = os.path.join(path, "tokenizer_config.json")
    try:
        with open(config, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str) or not name.isidentifier():
        return None
    import transformers

    for candidate in (name, name.removesuffix("Fast")):
        try:
            return getattr(transformers, candidate)
        except (AttributeError, ImportError, RuntimeError):
            continue
    return None


def ensure_fast(tok: Any, path: str) -> None:
    """Raise ``TokenizerError`` unless ``tok`` has a Rust (fast) backend."""
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise TokenizerError(
            f"tokenizer {path!r} ({type(tok).__name__}) is a slow (Python) tokenizer; shardcache "
            "needs a fast one: save it with tokenizer.json (e.g. convert it once with "
            "AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(folder))"
        )


class TextEncoder:
    """Encodes batches of text into ``Encoded`` sequences under ``TokenizeOptions``.

    ``resolved`` holds all it takes from transformers; ``hf`` is the transformers tokenizer
    (None when built by ``from_resolved``). A given ``hf_tokenizer`` is never mutated; without
    one, the tokenizer is loaded from ``options.tokenizer`` and what it resolved memoised.
    """

    def __init__(
        self,
        options: TokenizeOptions,
        hf_tokenizer: Any | None = None,
        preload_fast: bool = False,
        early: Ahead[EarlyLoad] | None = None,
    ):
        from tokenizers import Tokenizer

        owned = hf_tokenizer is None
        digest = folder_digest(options.tokenizer) if owned and not memo_disabled() else None
        hf = hf_tokenizer if hf_tokenizer is not None else load_hf_tokenizer(options.tokenizer)
        ensure_fast(hf, options.tokenizer)
        source = hf.backend_tokenizer
        truncation, padding = _plain(source.truncation), _plain(source.padding)
        serialized = source.to_str()
        fast_loading = load_fast_ahead(serialized) if preload_fast and early is None else None
        backend_json = parse_tokenizer_json(serialized)
        if preload_fast and early is not None:
            fast_loading = adopt_early(early, backend_json, serialized)
        # A tokenizer loaded here is this encoder's alone, so its backend is used as is (its
        # truncation and padding switched off below); a caller's is cloned, never mutated.
        backend = source if owned else Tokenizer.from_str(serialized)
        resolved = ResolvedTokenizer.from_hf(
            hf, serialized, truncation, padding, max_token_id(backend_json, backend)
        )
        self._adopt(options, resolved, backend, fast_loading)
        self.hf = hf
        self.backend_json = backend_json
        # the folder's files unchanged while transformers read them: the record is theirs
        if digest is not None and folder_digest(options.tokenizer) == digest:
            write_resolved(digest, resolved)

    @classmethod
    def from_resolved(
        cls, options: TokenizeOptions, resolved: ResolvedTokenizer, preload_fast: bool = False
    ) -> TextEncoder:
        """The encoder of ``resolved``, built without transformers (``hf`` is None)."""
        from tokenizers import Tokenizer

        self = cls.__new__(cls)
        fast_loading = load_fast_ahead(resolved.backend) if preload_fast else None
        self._adopt(options, resolved, Tokenizer.from_str(resolved.backend), fast_loading)
        self.hf = None
        return self

    def _adopt(
        self,
        options: TokenizeOptions,
        resolved: ResolvedTokenizer,
        backend: Any,
        fast_loading: Ahead[FastBackend] | None,
    ) -> None:
        """Set every attribute from ``resolved`` and the reference ``backend`` built from it."""
        self.options = options
        self.resolved = resolved
        self.hf_class = resolved.class_name
        # the backend's own settings as saved (recorded in the cache key, then disabled)
        self.backend_truncation = resolved.truncation
        self.backend_padding = resolved.padding
        # the fast backend loading in the background (the gate decides whether it is used)
        self.fast_loading = fast_loading
        self.backend = backend
        # the backend as JSON (the fast backend loads it)
        self.serialized = resolved.backend
        self.backend.no_truncation()
        self.backend.no_padding()
        self._init_backends()
        self.add_special_tokens = (
            True if options.add_special_tokens is None else options.add_special_tokens
        )
        self.max_token_id = resolved.max_token_id
        self.dtype = token_dtype(self.max_token_id)
        self.eos_id = self._end_token_id()
        pad = resolved.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0

    @functools.cached_property
    def backend_json(self) -> dict[str, Any]:
        """The backend as loaded, parsed (only when needed: it is large for a big vocabulary)."""
        return parse_tokenizer_json(self.serialized)

    def spec(self) -> dict[str, Any]:
        """The plain JSON ``from_spec`` rebuilds this encoder from in a worker."""
        return {
            "options": dataclasses.asdict(self.options),
            "resolved": self.resolved.to_json(),
            "add_special_tokens": self.add_special_tokens,
            "selection": self.selection.to_json(),
            "fast": self.fast is not None,
            "verify_fraction": self.verify_fraction,
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> TextEncoder:
        """The encoder ``spec`` described, with the parent's fast backend (``hf`` is None)."""
        # the parent's gate passed: load the same fast backend (in a thread, overlapping the
        # reference's load), or fail loudly
        self = cls.from_resolved(
            TokenizeOptions(**spec["options"]),
            ResolvedTokenizer.from_json(spec["resolved"]),
            preload_fast=spec["fast"],
        )
        loading, self.fast_loading = self.fast_loading, None
        self.selection = EncoderSelection(**spec["selection"])
        self.verify_fraction = float(spec["verify_fraction"])
        if loading is not None:
            self.fast = loading.result()
        self.add_special_tokens = bool(spec["add_special_tokens"])
        return self

    def _init_backends(self) -> None:
        # the reference (HF) backend; ``fast`` is set by ``use_fast`` after the gate
        self.reference = HFBackend(self.backend)
        self.fast: FastBackend | None = None
        self.selection = EncoderSelection("hf", self.reference.name, self.reference.version,
                                          "the gate did not run (HF by default)")  # fmt: skip
        # the share of documents verified (``backends.verify_rate``)
        self.verify_fraction = DEFAULT_VERIFY_FRACTION
        self.verify = VerifyCounts()
        self._verifying = SampleVerifier()  # the batches' samples, verified in the background
        # the partition's stage times (set per partition): the verification's seconds
        self.stage_times: StageTimes | None = None

    def use_fast(
        self, fast: FastBackend | None, selection: EncoderSelection, verify_fraction: float
    ) -> None:
        """Encode with ``fast`` from now on (None: HF), as the gate's ``selection`` decided."""
        self.fast = fast
        self.selection = selection
        self.verify_fraction = verify_fraction

    def reference_only(self) -> TextEncoder:
        """A copy that encodes with the HF reference alone; this one is unchanged."""
        clone = self.for_partition()
        clone.use_fast(None, self.selection, self.verify_fraction)
        return clone

    def for_partition(self) -> TextEncoder:
        """A copy for one partition: shared backends, its own verification counts and times.

        Partitions may run at once in threads, so each needs its own counters.
        """
        clone = copy.copy(self)
        clone.verify, clone._verifying, clone.stage_times = VerifyCounts(), SampleVerifier(), None
        return clone

    def take_verify(self) -> VerifyCounts:
        """The verification counts since the last call, then reset (waits for running ones)."""
        self._settle_verify()
        counts, self.verify = self.verify, VerifyCounts()
        return counts

    def encode_reference(self, texts: list[str]) -> list[list[int]]:
        """Ids per text from the HF backend (the cache key's behaviour probe, audits)."""
        return self.reference.encode_lists(texts, self.add_special_tokens)

    def _end_token_id(self) -> int | None:
        for value in (self.resolved.eos_token_id, self.resolved.sep_token_id):
            if value is not None:
                return int(value)
        if self.options.append_eos:
            raise ConfigError(
                f"append_eos: tokenizer {self.options.tokenizer!r} defines neither an EOS nor a "
                "SEP token, so there is nothing to append; build with --no-append-eos or add an "
                "eos_token to its tokenizer_config.json"
            )
        return None

    def describe(self) -> dict[str, Any]:
        """Facts about the tokenizer recorded in the manifest."""
        return {
            "path": self.options.tokenizer,
            "class": self.hf_class,
            "vocab_size": int(self.backend.get_vocab_size(with_added_tokens=True)),
            "max_token_id": int(self.max_token_id),
            "dtype": self.dtype.name,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "add_special_tokens": self.add_special_tokens,
            "backend_truncation": self.backend_truncation,
            "backend_padding": self.backend_padding,
        }

    def template_component(self) -> dict[str, Any]:
        """The template part of the cache key: for plain text, the special-token policy."""
        return {
            "kind": "text",
            "add_special_tokens": self.add_special_tokens,
            "append_eos": self.options.append_eos,
        }

    def encode_texts(self, texts: list[str], keys: np.ndarray | None = None) -> FlatIds:
        """Raw ids of a batch.

        With the fast backend, the verification sample drawn from ``keys`` (None: none) is
        re-encoded with HF in the background; ``check_verified`` reports a difference. Huge
        documents are always encoded by HF (in exact pieces where possible).
        """
        huge = [i for i, t in enumerate(texts) if len(t) > HUGE_CHARS]
        if not huge:
            return self._encode_flat(texts, keys)
        out: list[Any] = [None] * len(texts)
        for i in huge:
            ids = self._encode_huge(texts[i])
            if ids is None:
                ids = self.reference.encode_flat([texts[i]], self.add_special_tokens)[0]
            out[i] = ids
        small = [i for i in range(len(texts)) if out[i] is None]
        rest = self._encode_flat([texts[i] for i in small], None if keys is None else keys[small])
        for i, ids in zip(small, np.split(rest.tokens, np.cumsum(rest.lengths)[:-1])):
            out[i] = ids
        lengths = np.fromiter(map(len, out), dtype=np.int64, count=len(out))
        return FlatIds(np.concatenate(out).astype(np.uint32, copy=False), lengths)

    def _encode_flat(self, texts: list[str], keys: np.ndarray | None) -> FlatIds:
        if self.fast is None:
            return FlatIds(*self.reference.encode_flat(texts, self.add_special_tokens))
        tokens, lengths = self.fast.encode_flat(texts, self.add_special_tokens)
        if keys is None or self.verify_fraction <= 0:
            return FlatIds(tokens, lengths)
        positions = np.flatnonzero(sampled(keys, self.verify_fraction, 0))
        if len(positions) == 0:
            return FlatIds(tokens, lengths)
        sample = SampledBatch.of(texts, tokens, lengths, positions)
        self._verifying.add(sample, self.reference, self.add_special_tokens, self.stage_times)
        return FlatIds(tokens, lengths)

    def check_verified(self) -> None:
        """Wait for verifications since ``take_verify``; ``EncodingMismatch`` on a difference."""
        self._settle_verify()
        if self.verify.mismatches:
            raise EncodingMismatch(
                f"the fast encoder ({self.selection.backend} {self.selection.version}) and HF "
                f"disagree: {self.verify.detail[0]}"
            )

    def _settle_verify(self) -> None:
        """Add the background verifications' counts in batch order, up to the first mismatch.

        So the counts never depend on thread timing.
        """
        for counts in self._verifying.settle():
            if self.verify.mismatches:
                continue
            self.verify.documents += counts.documents
            self.verify.tokens += counts.tokens
            self.verify.mismatches += counts.mismatches
            self.verify.detail += counts.detail

    def _encode_huge(self, text: str) -> np.ndarray | None:
        if not hasattr(self, "_wrapping"):
            self._wrapping = chunking_is_exact(self.backend, self.add_special_tokens)
        if self._wrapping is None:
            return None  # not provably exact for this tokenizer: encoded whole
        return encode_in_pieces(self.backend, text, self._wrapping)

    def finish(self, ids: FlatIds, stats: TruncationStats) -> Encoded:
        """The sequences to store: EOS and truncation over a batch's ids, counted in ``stats``."""
        lengths = ids.lengths
        tokens = ids.tokens.astype(self.dtype, copy=False)
        stats.documents += len(lengths)
        if self.options.append_eos and self.eos_id is not None:
            tokens, lengths = append_end_token(tokens, lengths, self.eos_id)
        encoded = apply_truncation(tokens, lengths, self.options, self.eos_id, stats)
        stats.sequences += len(encoded.lengths)
        stats.tokens += int(encoded.lengths.sum())
        return encoded


def _plain(value: Any) -> Any:
    """A backend's truncation/padding settings (a dict or None), made JSON-safe."""
    if value is None:
        return None
    return {str(k): (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
            for k, v in dict(value).items()}  # fmt: skip


def append_end_token(
    tokens: np.ndarray, lengths: np.ndarray, end_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Append ``end_id`` to every sequence not ending with it (same arrays when none needs it)."""
    ends = np.cumsum(lengths)
    nonempty = lengths > 0
    last = np.full(len(lengths), -1, dtype=np.int64)
    last[nonempty] = tokens[ends[nonempty] - 1]
    need = last != end_id
    if not need.any():
        return tokens, lengths
    tokens = np.insert(tokens, ends[need], np.asarray(end_id, dtype=tokens.dtype))
    return tokens, lengths + need


def apply_truncation(
    tokens: np.ndarray,
    lengths: np.ndarray,
    options: TokenizeOptions,
    end_id: int | None,
    stats: TruncationStats,
) -> Encoded:
    """Apply ``options.truncation`` at ``options.max_length``; empty documents are left out.

    A truncated sequence that ended with ``end_id`` keeps it as its last token.
    """
    n_docs = len(lengths)
    doc_index = np.arange(n_docs, dtype=np.int64)
    piece = np.zeros(n_docs, dtype=np.int32)
    empty = lengths == 0
    if empty.any():
        stats.empty_documents += int(empty.sum())
        doc_index, lengths = doc_index[~empty], lengths[~empty]
        piece = piece[~empty]
    limit = options.max_length
    if limit is None:
        return Encoded(tokens, lengths, doc_index, piece)
    over = lengths > limit
    if not over.any():
        return Encoded(tokens, lengths, doc_index, piece)
    starts = np.cumsum(lengths) - lengths
    if options.truncation == "split":
        stats.split_documents += int(over.sum())
        n_pieces = -(-lengths // limit)
        piece_lengths = np.full(int(n_pieces.sum()), limit, dtype=np.int64)
        last_piece = np.cumsum(n_pieces) - 1
        piece_lengths[last_piece] = lengths - (n_pieces - 1) * limit
        first_piece = last_piece - n_pieces + 1
        piece_no = np.arange(len(piece_lengths)) - np.repeat(first_piece, n_pieces)
        return Encoded(
            tokens, piece_lengths, np.repeat(doc_index, n_pieces), piece_no.astype(np.int32)
        )
    position = np.arange(len(tokens), dtype=np.int64) - np.repeat(starts, lengths)
    if options.truncation == "drop":
        stats.dropped_documents += int(over.sum())
        stats.lost_tokens += int(lengths[over].sum())
        keep = np.repeat(~over, lengths)
        return Encoded(tokens[keep], lengths[~over], doc_index[~over], piece[~over])
    # truncate: keep the first `limit` tokens; a sequence that ended with the end marker
    # keeps it as its last token (as the backend's own truncation would place it).
    stats.truncated_documents += int(over.sum())
    stats.lost_tokens += int((lengths[over] - limit).sum())
    keep = position < limit
    new_lengths = np.minimum(lengths, limit)
    new_tokens = tokens[keep]
    if end_id is not None:
        ends_with_end = tokens[starts + lengths - 1] == end_id
        fix = over & ends_with_end
        if fix.any():
            new_ends = np.cumsum(new_lengths)
            new_tokens[new_ends[fix] - 1] = end_id
    return Encoded(new_tokens, new_lengths, doc_index, piece)


_DONE = object()


@dataclass(frozen=True)
class EncodeFailure:
    """Stands for the ids of a record the encoder failed on alone (see ``encode_isolating``)."""

    detail: str


def encode_isolating(encoder: Any, texts: list[Any], keys: np.ndarray | None = None) -> Any:
    """Encode ``texts``, isolating a failure to its record.

    Returns the batch's ``FlatIds``, or, when the batch failed, a list of each text's ids or
    ``EncodeFailure``. ``EncodingMismatch`` propagates: it is the partition's, not a record's.
    """
    try:
        return encoder.encode_texts(texts, keys)
    except EncodingMismatch:
        raise
    except Exception as err:  # re-tried one by one below
        if len(texts) == 1:
            return [EncodeFailure(f"{type(err).__name__}: {err}"[:300])]
    out: list[Any] = []
    for i, text in enumerate(texts):
        one = None if keys is None else keys[i : i + 1]
        out += list(encode_isolating(encoder, [text], one))
    return out


def drop_failures(batch: Any, ids: Any) -> tuple[Any, Any, list[tuple[int, str]]]:
    """The batch and its ids without ``EncodeFailure``s, and ``(doc, detail)`` per failure.

    ``doc`` is the failure's position in the original batch.
    """
    if isinstance(ids, FlatIds):
        return batch, ids, []
    failed = [(i, x.detail) for i, x in enumerate(ids) if isinstance(x, EncodeFailure)]
    keep = [i for i, x in enumerate(ids) if not isinstance(x, EncodeFailure)]
    kept_ids = [ids[i] for i in keep]
    if failed:
        batch = batch.take(keep)
    if kept_ids and all(isinstance(x, np.ndarray) for x in kept_ids):
        lengths = np.fromiter(map(len, kept_ids), dtype=np.int64, count=len(kept_ids))
        return (
            batch,
            FlatIds(np.concatenate(kept_ids).astype(np.uint32, copy=False), lengths),
            failed,
        )
    return batch, kept_ids, failed


@dataclass
class _Failure:
    error: BaseException


def _read_ahead(
    batches: Iterable[Any], stop: threading.Event, times: StageTimes | None = None
) -> Iterator[Any]:
    """``batches`` read one ahead in a thread (until ``stop``); upstream errors re-raise here."""
    items: queue.Queue[Any] = queue.Queue(maxsize=1)

    def read() -> None:
        try:
            with times.cpu("reader") if times is not None else contextlib.nullcontext():
                for batch in batches:
                    if not _put(items, batch, stop):
                        return
            _put(items, _DONE, stop)
        except BaseException as err:  # re-raised in the consumer
            _put(items, _Failure(err), stop)

    # not a daemon (see encode_ahead): interpreter shutdown waits for it to see ``stop``
    threading.Thread(target=read, name="shardcache-read", daemon=False).start()
    while not stop.is_set():
        try:
            item = items.get(timeout=0.1)
        except queue.Empty:
            continue
        if item is _DONE:
            return
        if isinstance(item, _Failure):
            raise item.error
        yield item


def _put(items: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """``items.put(item)`` unless ``stop`` is set first; False when stopped."""
    while not stop.is_set():
        try:
            items.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def encode_ahead(
    encoder: TextEncoder,
    batches: Iterable[Any],
    depth: int = 2,
    times: StageTimes | None = None,
) -> Iterator[tuple[Any, Any]]:
    """Yield ``(batch, ids)`` in input order, encoding and reading ahead in two threads.

    Reading, encoding and writing overlap; at most ``depth`` encoded batches wait. Errors of the
    upstream iterator or the encoder re-raise here.
    """
    out: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        return _put(out, item, stop)

    def produce() -> None:
        try:
            for batch in _read_ahead(batches, stop, times):
                if stop.is_set():
                    return
                with times.busy("encode_busy") if times is not None else contextlib.nullcontext():
                    keys = build_draw_keys(
                        batch.records, batch.files, batch.names or (batch.source,)
                    )
                    ids = encode_isolating(encoder, batch.texts, keys)
                if not put((batch, ids)):
                    return
            put(_DONE)
        except BaseException as err:  # re-raised in the consumer
            put(_Failure(err))

    # not a daemon: a daemon killed inside the Rust encoder at interpreter exit aborts the
    # process; shutdown waits for the encode in flight, which then sees ``stop``
    thread = threading.Thread(target=produce, name="shardcache-encode", daemon=False)
    thread.start()
    try:
        while True:
            item = out.get()
            if item is _DONE:
                break
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                out.get_nowait()
        # On an error or early close, do not wait for the encode in flight: it sees ``stop``
        # and ends by itself (it writes no file).
        if sys.exc_info()[0] is None:
            thread.join()

"""The planning units of a selection: sequences, or preference pairs, with their lengths.

``Units`` is what one cache and a mixture share: the reader they hold (closed and reopened),
every unit's length and bucket, and the checks pair reading needs. Also the identities a
reader state and a plan depend on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from shardcache.errors import ConfigError
from shardcache.read.plan.epoch_plan import PlanOptions, plan_sequences
from shardcache.read.selection.mixed_cache import MixedCache
from shardcache.store.cache import Cache

#: Open shards kept per reader process during a pass (a shuffled pass returns to a shard many
#: times). Each map holds a file descriptor, so fewer under a low open-file limit.
OPEN_SHARDS = 256


def cache_digest(manifest: dict[str, Any]) -> str:
    """The identity of a cache's data in a reader state: its key digest, else its shards' sha256."""
    digest = manifest.get("key", {}).get("digest")
    if digest:
        return str(digest)
    shards = json.dumps(manifest["shards"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(shards.encode()).hexdigest()


def data_identity(caches: list[Cache], *terms: Any) -> str:
    """What a plan depends on besides options, seed and epoch: length indexes, shards, ``terms``."""
    parts = [
        [c.manifest["index"]["lengths"]["sha256"], [[s["bucket"], s["rows"]] for s in c.shards]]
        for c in caches
    ]
    return hashlib.sha256(json.dumps([*parts, *terms] if terms else parts[0]).encode()).hexdigest()


class Units:
    """What both selections share: the unit lengths and buckets of their (mixed) cache.

    A subclass opens its reader (``_open_cache``) and lists its caches (``_caches``).
    """

    path: str
    pairs: bool
    pad_id: int
    _mode: str
    _cache: Any

    def _described(self, cache: Cache | MixedCache) -> None:
        """What the sample readers need of the open cache: masks, columns, id dtype, largest id.

        Taken now: a remote cache is closed before DataLoader workers fork, and must not be
        opened again in this process to ask.
        """
        self.has_mask = bool(cache.has_mask)
        self.columns: tuple[str, ...] = tuple(getattr(cache, "columns", ()))
        self.dtype = np.dtype(cache.dtype)
        self.max_token_id = min(
            int(c.manifest["tokenizer"]["max_token_id"]) for c in self._caches(cache)
        )

    def _setup(self, cache: Cache | MixedCache, options: PlanOptions, pairs: bool) -> None:
        self.pairs, self._mode = pairs, options.mode
        if pairs:
            check_pair_options(cache, options)
        self.pad_id = cache.pad_id
        self.cache_bytes = sum(int(i["bytes"]) for c in self._caches(cache) for i in c.shards)
        lengths = np.asarray(cache.lengths)
        self._lengths: np.ndarray | None = (
            pair_lengths(lengths, self._combine) if pairs else lengths
        )
        self._buckets: np.ndarray | None = None  # every unit's: only the global plan's
        # a remote cache is not kept: its filesystem client is not fork-safe, and forked
        # DataLoader workers would inherit it (each opens its own when it reads)
        self._cache = None if cache.remote else cache
        if cache.remote:
            cache.close()

    def _check_fits(
        self, cache: Cache | MixedCache, lengths: Callable[[], np.ndarray], options: PlanOptions
    ) -> None:
        """``check_fits`` of the units an epoch reads; the reader is closed if it refuses."""
        try:
            check_fits(lengths, options, longest_bound(self._caches(cache)))
        except ConfigError:
            self.close()
            raise

    @staticmethod
    def _caches(cache: Any) -> list[Cache]:
        raise NotImplementedError

    def _open_cache(self) -> Cache | MixedCache:
        raise NotImplementedError

    @property
    def _combine(self) -> Any:
        """A pair unit's length from its sides': the longer (pad: two rows), the sum (pack)."""
        return np.add if self._mode == "pack" else np.maximum

    def open(self) -> Any:
        """The cache reader (opened again after ``close``)."""
        if self._cache is None:
            self._cache = self._open_cache()
        return self._cache

    def is_open(self) -> bool:
        """Whether this process holds the reader."""
        return self._cache is not None

    def close(self) -> None:
        """Release the reader, its open shards and the arrays derived from it."""
        if self._cache is not None:
            self._cache.close()
        self._cache = self._lengths = self._buckets = None

    def __getstate__(self) -> dict[str, Any]:
        # memory maps do not travel to worker processes: a spawned one opens its own
        state = self.__dict__.copy()
        for name in self._dropped:
            state[name] = None
        return state

    _dropped: tuple[str, ...] = ("_cache", "_lengths", "_buckets")

    def sample_lengths(self) -> np.ndarray:
        """The length of every sample id."""
        return np.asarray(self.open().lengths)

    def unit_lengths(self) -> np.ndarray:
        """The length of every planning unit."""
        if self._lengths is None:
            lengths = self.sample_lengths()
            self._lengths = pair_lengths(lengths, self._combine) if self.pairs else lengths
        return self._lengths

    def counted_lengths(self) -> np.ndarray:
        """The tokens every unit counts toward a mixture's targets."""
        if not self.pairs:
            return self.unit_lengths()
        return pair_lengths(self.sample_lengths(), np.add)

    def unit_buckets(self) -> np.ndarray:
        """Every unit's bucket (a pair's two sides agree)."""
        if self._buckets is None:
            buckets = self.open().buckets()
            self._buckets = buckets[0::2] if self.pairs else buckets
        return self._buckets


def check_fits(
    lengths: Callable[[], np.ndarray], options: PlanOptions, bound: int | None = None
) -> None:
    """Refuse, when the dataset is made, a sequence that no batch (or row) of ``options`` holds.

    Plans the longest of ``lengths()`` (the units an epoch reads) alone, so the policy's own
    check and message (pad: ``max_tokens``; best_fit: ``seq_len``) speak at construction, not
    when the first epoch is planned (``len(ds)``, a trainer's set-up, the first batch).
    ``bound``: a length no sequence exceeds (``longest_bound``): when it fits, the lengths are
    not read, so a rank of a large cache does not scan its whole length index to be made.
    """
    if bound is not None:
        try:
            _plan_one(bound, options)
            return
        except ConfigError:
            pass  # the bound does not fit: the longest sequence read decides
    read = lengths()
    if len(read):
        _plan_one(int(np.max(read)), options)


def _plan_one(length: int, options: PlanOptions) -> None:
    """Plan one sequence of ``length`` tokens (ConfigError where no batch or row holds it)."""
    plan_sequences(np.array([length], dtype=np.int64), np.zeros(1, dtype=np.int64), options, None)


def longest_bound(caches: list[Cache]) -> int | None:
    """A length no sequence of ``caches`` exceeds, from their manifests; None if unknown.

    The upper end of the highest bucket any shard holds (None when that bucket is open: a
    cache built without ``max_length``). A manifest is checked against its shards when they
    are read; planning checks every length again, so a wrong bound only delays the error.
    """
    bounds = []
    for cache in caches:
        try:
            ranges = cache.manifest["buckets"]["ranges"]
            top = max((int(s["bucket"]) for s in cache.manifest["shards"]), default=None)
            high = None if top is None else ranges[top][1]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        if top is not None and high is None:
            return None
        if high is not None:
            bounds.append(int(high))
    return max(bounds, default=None)


def pair_lengths(lengths: np.ndarray, combine: Any) -> np.ndarray:
    """Per pair, ``combine`` of its chosen and rejected lengths (np.maximum, np.add)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.asarray(combine(lengths[0::2], lengths[1::2]))


def pair_samples(units: np.ndarray) -> np.ndarray:
    """The sample ids of pair units: 2u (chosen) then 2u + 1 (rejected), per unit."""
    return (2 * np.asarray(units, dtype=np.int64)[:, None] + np.arange(2)).ravel()


def pair_units(cache: Cache, rows: np.ndarray) -> np.ndarray:
    """The pairs of a split's sample ids ``rows`` (ascending): both sides share one record."""
    units = rows[rows % 2 == 0] // 2
    if len(rows) != 2 * len(units) or not np.array_equal(rows, pair_samples(units)):
        cache.close()
        raise ConfigError(
            f"split: {cache.path!r} holds pairs whose chosen and rejected sides have different "
            "document keys, so a split would part them; rebuild the cache with this version "
            "(both sides of a pair carry the pair's record)"
        )
    return units


def check_pair_options(cache: Cache | MixedCache, options: PlanOptions) -> None:
    """Refuse what pair reading cannot honour: a budget below a pair, a pair split in a row."""
    lengths = np.asarray(cache.lengths)
    if options.mode == "pack":
        if options.packing != "best_fit":
            cache.close()
            raise ConfigError(
                f"packing: got {options.packing!r} with a preference cache; a pair's two "
                "sequences go whole into one row, which packing='best_fit' does and 'concat' "
                "(cutting every seq_len tokens) does not. Pass packing='best_fit'"
            )
        sums = np.asarray(lengths[0::2], dtype=np.int64) + lengths[1::2]
        longest_pair = int(sums.max()) if len(sums) else 0
        if longest_pair > int(options.seq_len or 0):
            cache.close()
            raise ConfigError(
                f"seq_len: {options.seq_len} cannot hold a preference pair: a packed row holds "
                f"both sequences of a pair, and the longest pair has {longest_pair} tokens "
                f"(chosen + rejected); raise seq_len to at least {longest_pair}, or rebuild the "
                "cache with a lower --max-length"
            )
        return
    longest = int(options.padded(int(lengths.max()))) if len(lengths) else 0
    if 2 * longest > options.max_tokens:
        cache.close()
        raise ConfigError(
            f"max_tokens: {options.max_tokens} cannot hold a preference pair: a batch holds "
            f"both rows of a pair, and the longest side has {int(lengths.max())} tokens "
            f"({longest} padded); raise max_tokens to at least {2 * longest}"
        )

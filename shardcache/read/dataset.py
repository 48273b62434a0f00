"""ShardDataset: an epoch plan + the shard reader -> token-budget batches, with resumable state.

A batch (``Batch``) is a dict of model inputs plus ``batch["meta"]``, as docs/guide/batches.md
lists them; ``labels`` are -100 on padding, outside chat caches' trainable turns and on every
packed segment's first token. State is a global cursor (epoch, global batches consumed),
checked against the cache digest and plan options: it resumes at any world size and workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardcache.config import check_choice, check_int, check_known
from shardcache.errors import ConfigError, StateError
from shardcache.read.collate import kernels
from shardcache.read.collate.attention import ATTENTION_MODES, block_causal_mask, varlen_keys
from shardcache.read.collate.layout import IGNORE_INDEX, pack_batch, packed_layout, pad_batch
from shardcache.read.device_prefetch.tree import packed_offsets, packed_view
from shardcache.read.fetch.shard_readahead import (
    ReadAhead,
    ReadAheadOptions,
    ReadStats,
    cache_readahead,
    readahead_options,
)
from shardcache.read.plan.epoch_plan import (
    DEFAULT_SHUFFLE_BLOCK,
    EpochPlan,
    EpochSplit,
    PlanOptions,
    plan_epoch,
    split_epoch,
)
from shardcache.read.plan.plan_store import plan_digest, read_counts, shared_plan, write_counts
from shardcache.read.plan.streams import (
    ShardIndex,
    StreamLayout,
    StreamPlan,
    count_batches,
    mixture_shard_index,
    own_streams,
)
from shardcache.read.selection.mixed_cache import MixedCache
from shardcache.read.selection.mixture import (
    Mixture,
    MixtureIndex,
    MixtureTable,
    Source,
    as_sources,
    mixture_changes,
    source_splits,
)
from shardcache.read.selection.schedule import (
    Schedule,
    ScheduleLayout,
    ScheduleTable,
    as_schedule,
    resolve_schedule,
    schedule_changes,
)
from shardcache.read.selection.splits import Split, check_split_name, split_ids
from shardcache.read.trainers import refuse_accelerate_wrapper
from shardcache.store.cache import Cache, Gathered, MappedTable, shards_within_file_limit
from shardcache.store.key import verify_manifest_key

STATE_VERSION = 1
#: ``transform(ids, mask, rng) -> (ids, mask)``: a per-sequence read-time step (numpy int ids,
#: the chat loss mask or None, a generator seeded by (seed, epoch, sample id, repetition,
#: segment start; and the wrap of a batch that ``tail="wrap"`` reads again)). Optional
#: attributes: ``max_growth`` (int, tokens it may add; default 0) and ``keeps_mask`` (bool,
#: whether it carries a chat loss mask; default True).
Transform = Callable[
    [np.ndarray, "np.ndarray | None", np.random.Generator], "tuple[np.ndarray, np.ndarray | None]"
]
#: Mixed into a transform's seed so that it is no other generator of the same numbers.
_TRANSFORM_KEY = 0x54524E53
#: A batch's wrap rides in the high bits of its segments' repetitions (a mixture's are small).
_WRAP_SHIFT = 32
#: Open shards kept per reader process during a pass (a shuffled pass returns to a shard many
#: times). Each map holds a file descriptor, so fewer under a low open-file limit.
OPEN_SHARDS = 256
logger = logging.getLogger("shardcache")


def _transform_growth(transform: Any) -> int:
    """The tokens ``transform`` may add to a sequence (its ``max_growth``, default 0), checked."""
    if transform is None:
        return 0
    if not callable(transform):
        raise ConfigError(
            f"transform: got {transform!r}, expected a function (ids, mask, rng) -> (ids, mask)"
        )
    growth = getattr(transform, "max_growth", 0)
    if isinstance(growth, bool) or not isinstance(growth, (int, np.integer)) or growth < 0:
        raise ConfigError(
            f"transform: max_growth={growth!r}, expected an int >= 0 (the tokens it may add to "
            "a sequence; 0 for a transform that keeps or shortens the length)"
        )
    return int(growth)


def _check_transform_tokens(transform: Any, cache: Cache | MixedCache) -> None:
    """Let a transform refuse ids the cache's tokenizer lacks (its ``check_tokens``, if any)."""
    check = getattr(transform, "check_tokens", None)
    if not callable(check):
        return
    caches = cache.caches if isinstance(cache, MixedCache) else [cache]
    largest = min(int(c.manifest["tokenizer"]["max_token_id"]) for c in caches)
    try:
        check(largest, np.dtype(cache.dtype))
    except Exception:
        cache.close()
        raise


def cache_digest(manifest: dict[str, Any]) -> str:
    """The identity of a cache's data in a reader state: its key digest, else its shards' sha256."""
    digest = manifest.get("key", {}).get("digest")
    if digest:
        return str(digest)
    shards = json.dumps(manifest["shards"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(shards.encode()).hexdigest()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"{name} environment variable: got {value!r}, expected an integer (set by torchrun); "
            "fix or unset it, or pass rank= and world_size="
        ) from None


def _process_group() -> tuple[int, int] | None:
    """Rank and world size of the torch.distributed process group, if one is initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if (rank is None) != (world_size is None):
        given, missing = ("rank", "world_size") if world_size is None else ("world_size", "rank")
        raise ConfigError(
            f"rank/world_size: got {given}={rank if world_size is None else world_size} without "
            f"{missing}; pass both (or neither: then torch.distributed or RANK/WORLD_SIZE)"
        )
    if rank is not None and world_size is not None:
        check_int("rank", rank, 0)
        check_int("world_size", world_size, 1)
    else:
        rank, world_size = _process_group() or (_env_int("RANK", 0), _env_int("WORLD_SIZE", 1))
    assert rank is not None and world_size is not None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            f"rank/world_size: got rank={rank}, world_size={world_size}; need "
            "0 <= rank < world_size"
        )
    return rank, world_size


class ShardDataset(IterableDataset):
    """Token-budget batches from a cache (or a mixture), sharded over ranks and workers.

    Iterate it through ``DataLoader(ds, batch_size=None)``: each item is already a batch. A
    context manager: ``close`` releases the cache and its open shards. accelerate's wrappers,
    which would split it over ranks again, are refused (docs/guide/batches.md, Trainers).

    Args:
        path: a cache folder or URL, or a list of [`Source`][shardcache.Source] (a mixture of
            caches sharing a tokenizer).
        max_tokens: the token budget of a batch (padding included).
        shuffle: shuffle the epoch (default True).
        seed: the plan's seed (>= 0).
        options: all batch options as one [`PlanOptions`][shardcache.PlanOptions] (then
            without ``max_tokens``, ``shuffle`` or keywords).
        rank: this process's rank; with ``world_size``, else torch.distributed when
            initialised (also later: followed), else ``RANK`` / ``WORLD_SIZE``.
        world_size: the number of ranks.
        expect: a ``CacheKey``, lock file path or mapping of tokenizer options the cache must
            have been built under (for a mixture: each source without its own).
        attention: ``"mask"`` (a 4-D block-causal mask), ``"varlen"`` (flash-attention keys)
            or ``"none"``: required with ``mode="pack"``, refused otherwise.
        ids_dtype: ``"int32"`` or ``"int64"``: ``input_ids``, ``position_ids``, ``attention_mask``.
        tokens_per_epoch: a mixture's epoch size (default: the largest every share fits in;
            ignored with ``eval=True``).
        remix: let ``load_state_dict`` take the state of another mixture (with a warning).
        readahead: how far a remote cache downloads ahead: an int of shards (0: on demand only),
            a [`ReadAheadOptions`][shardcache.ReadAheadOptions] or None (the defaults).
        split: read only one side of ``splits``: ``"train"``, ``"validation"`` or ``"test"``
            (documents, every piece of a split document together; docs/guide/evaluation.md).
            A mixture splits every source as that cache alone, and its weights apply to the
            sources' sides.
        splits: the held-out fractions ([`Split`][shardcache.Split]); required with ``split``
            (a mixture: for every source without its own ``Source(splits=...)``).
        eval: an evaluation pass: no shuffle, every planned sequence exactly once over all
            ranks, no drop or repeat; a rank with no batch left yields a filler batch (labels
            all -100, ``meta["filler"]`` True) so every rank yields the same count. A mixture
            reads every document of every source (of its side) once: no weights or repetitions.
        transform: ``transform(ids, mask, rng) -> (ids, mask)`` applied to every sequence (or
            packed piece) after it is read and before the batch is collated; ``rng`` is seeded
            by (seed, epoch, sample id, repetition, piece start), so a resumed stream is the
            same. It may lengthen a sequence by up to its ``max_growth`` attribute (default 0),
            which the plan reserves (``PlanOptions.growth``); a transform whose ``keeps_mask``
            attribute is False is refused on a chat cache, and one with a ``check_tokens``
            method is asked to refuse ids the cache's tokenizer lacks (FIM and SpanMask
            check their sentinels) when the dataset is built (docs/guide/transforms.md).
        schedule: a mixture's weights over the run ([`Schedule`][shardcache.Schedule], or a
            list of its points): epoch ``w`` is the schedule's window ``w`` (``ds.epochs`` of
            them), each source reads its documents without reuse before all were used, and
            ``max_repetitions`` bound a source over the whole run (docs/guide/mixtures.md).
        **plan_options: the other ``PlanOptions`` fields (``mode``, ``seq_len``, ``packing``,
            ``pad_to_multiple_of``, ``window_size``, ``tail``).

    Raises:
        ConfigError: an option is missing, unknown or out of range (``split`` without
            ``splits``, a mixture source without a split, ``eval`` with ``shuffle=True``, a
            ``growth`` with ``packing="concat"`` and no transform, or a transform that cannot
            keep a chat cache's loss masks).
        CacheNotFoundError: no committed cache at ``path``.
        CacheKeyMismatch: the cache was built under another key than ``expect``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | list[Source],
        max_tokens: int | None = None,
        shuffle: bool | None = None,
        seed: int = 0,
        *,
        options: PlanOptions | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        expect: Any = None,
        attention: str | None = None,
        ids_dtype: str = "int32",
        tokens_per_epoch: int | None = None,
        remix: bool = False,
        readahead: ReadAheadOptions | int | None = None,
        split: str | None = None,
        splits: Split | None = None,
        eval: bool = False,
        transform: Transform | None = None,
        schedule: Schedule | list[Any] | None = None,
        **plan_options: Any,
    ) -> None:
        super().__init__()
        self.eval = _check_eval(eval, shuffle, options)
        if self.eval and shuffle is None and options is None:
            shuffle = False
        growth = _transform_growth(transform)
        self.transform = transform
        self.readahead: ReadAheadOptions = readahead_options(readahead)
        self._readahead: ReadAhead | None = None  # of the pass being read
        self._stats = ReadStats()
        #: Attach each batch's stage times to ``meta["stage_s"]`` (``StallMonitor`` sets it).
        self.time_stages = False
        self._gather_s = 0.0  # time in ``_gather`` since the batch began (stage timing)
        self._plan_s = 0.0  # time planning the pass, charged to its first batch
        if options is not None:
            if max_tokens is not None or shuffle is not None or plan_options:
                raise ConfigError(
                    "ShardDataset: pass the batch options either as options=PlanOptions(...) "
                    "or as max_tokens=/shuffle=/keywords, not both"
                )
            if not isinstance(options, PlanOptions):
                raise ConfigError(f"options: got {options!r}, expected a PlanOptions")
        else:
            if max_tokens is None:
                raise ConfigError("max_tokens: required (the token budget of a batch)")
            shuffle = True if shuffle is None else shuffle
            fields = PlanOptions.__dataclass_fields__
            check_known("ShardDataset", plan_options, fields, noun="batch option")
            options = PlanOptions(max_tokens=max_tokens, shuffle=shuffle, **plan_options)
        if growth > options.growth:  # the plan reserves what the transform may add
            options = dataclasses.replace(options, growth=growth)
        concat = options.mode == "pack" and options.packing == "concat"
        if options.growth and concat and transform is None:
            raise ConfigError(
                f"growth: {options.growth} with packing='concat' but no transform; concat "
                "then plans documents longer than they are, for a transform to fill. Pass "
                "the transform, or growth=0"
            )
        self.options: PlanOptions = options
        self.attention: str | None = _check_attention(attention, options.mode)
        check_choice("ids_dtype", ids_dtype, IDS_DTYPES)
        self.ids_dtype = np.dtype(ids_dtype)
        check_int("seed", seed, 0)
        self.seed = seed
        self.epoch = 0
        self._rank, self._world_size = _resolve_rank(rank, world_size)
        self._rank_given = rank is not None  # else a process group started later is followed
        # streams=None: the world size now; a loaded state's streams win (load_state_dict)
        self._auto_streams = options.streams is None
        if options.streams is None:
            options = dataclasses.replace(options, streams=self._world_size)
            self.options = options
        self._mixture: Mixture | None = None  # a mixture of caches (mixture.py), else None
        self._sources: tuple[Source, ...] | None = None
        self.remix = remix
        schedule = as_schedule(schedule)
        if schedule is not None and isinstance(path, (str, os.PathLike)):
            raise ConfigError(
                "schedule: applies to a mixture (a list of Source); one cache has no weights. "
                "Drop schedule or pass [Source(path), ...]"
            )
        if schedule is not None and tokens_per_epoch is not None:
            raise ConfigError(
                f"tokens_per_epoch={tokens_per_epoch!r} with a schedule: a schedule's epochs are "
                "its windows; give Schedule(window_tokens=...) instead"
            )
        if isinstance(path, (str, os.PathLike)):
            if tokens_per_epoch is not None:
                raise ConfigError(
                    "tokens_per_epoch: applies to a mixture (a list of Source); one cache's "
                    "epoch is all of it. Drop tokens_per_epoch or pass [Source(path)]"
                )
            self.path = os.fspath(path)
            cache: Cache | MixedCache = self._open_cache(expect)
            assert isinstance(cache, Cache)
            self.cache_digest = cache_digest(cache.manifest)
            self._data_identity = _data_identity([cache])
            #: the sample ids of the chosen side of ``splits`` (ascending), None without a split
            self._split_rows = _split_rows(cache, split, splits)
            self.split_name, self.splits = split, splits
            self._source_splits: tuple[Split, ...] | None = None  # a mixture's, per source
            if splits is not None:
                self._data_identity = _data_identity([cache], splits.to_json(), split)
        else:
            self._sources = sources = as_sources(path)
            self.path = f"mixture({', '.join(s.label for s in sources)})"
            self._source_splits = source_splits(sources, split, splits)
            self._split_rows, self.split_name, self.splits = None, split, splits
            cache = self._open_cache(expect)
            assert isinstance(cache, MixedCache)
            kinds = [c.is_preference for c in cache.caches]
            if any(kinds) and not all(kinds):
                cache.close()
                pairs = [s.label for s, k in zip(sources, kinds) if k]
                others = [s.label for s, k in zip(sources, kinds) if not k]
                raise ConfigError(
                    f"{self.path}: sources {pairs} are preference caches and {others} are not; "
                    "a batch of pairs holds no plain sequence, so a mixture mixes preference "
                    "caches with each other only. Read the others in a ShardDataset of their "
                    "own, see docs/guide/preference.md"
                )
            rows = None  # each source's side: the sample ids one cache's split reads
            if self._source_splits is not None:
                assert split is not None
                rows = tuple(
                    split_ids(c, own, split) for c, own in zip(cache.caches, self._source_splits)
                )
            table = cache.table(tokens_per_epoch, rows, split, once=self.eval)
            digests = tuple(cache_digest(c.manifest) for c in cache.caches)
            index = cache.index
            if all(kinds):
                # a mixture of preference caches plans pairs: unit u of source s is its pair
                # u - offsets[s], sample ids 2u and 2u + 1 of the mixture's (even) sample space
                index = MixtureIndex(cache.index.offsets // 2)
                if rows is not None:
                    rows = tuple(_pair_units(c, r) for c, r in zip(cache.caches, rows))
            layout = None
            if schedule is not None and not self.eval:
                layout = resolve_schedule(schedule, sources, [r.tokens for r in table.sources])
            self._mixture = Mixture(
                sources, table, index, digests, tokens_per_epoch, rows, self.eval, layout
            )
            mixture_json = json.dumps(self._mixture.state(), sort_keys=True)
            shape_json = json.dumps(self._mixture.shape(), sort_keys=True)  # (no schedule)
            self.cache_digest = hashlib.sha256(shape_json.encode()).hexdigest()
            terms: tuple[Any, ...] = (mixture_json, table.tokens_per_epoch)
            if rows is not None or self.eval:  # other documents than the weighted whole caches
                terms = (*terms, self._split_state(), self.eval)
            self._data_identity = _data_identity(cache.caches, *terms)
        _check_transform_tokens(transform, cache)
        if cache.has_mask and transform is not None and not getattr(transform, "keeps_mask", True):
            cache.close()
            raise ConfigError(
                f"transform: {transform!r} says it cannot keep loss masks (keeps_mask=False) but "
                f"{self.path} is a chat cache whose labels follow them; use a transform that "
                "moves the mask with its tokens, or a plain-text cache"
            )
        #: a preference cache: the planners see pair units (unit u = sample ids 2u, 2u + 1)
        self._pairs = (
            all(c.is_preference for c in cache.caches)
            if isinstance(cache, MixedCache)
            else cache.is_preference
        )
        if self._pairs:
            _check_pair_options(cache, self.options)
            if isinstance(cache, Cache) and self._split_rows is not None:
                self._split_rows = _pair_units(cache, self._split_rows)
        self.pad_id = cache.pad_id
        lengths = np.asarray(cache.lengths)
        self._lengths: np.ndarray | None = (
            _pair_lengths(lengths, self._pair_combine) if self._pairs else lengths
        )
        self._buckets: np.ndarray | None = None  # every sample id's: only the global plan's
        self._shard_index: ShardIndex | None = None  # a cache's (a mixture's is per epoch)
        #: stream batch counts by epoch (small; travel to workers with the dataset)
        self._counts: dict[int, dict[int, np.ndarray]] = {}
        self._counting: threading.Thread | None = None  # the next epoch's, in the background
        self._passes = 0  # passes started by this process (for fetched_over_share)
        #: a scheduled mixture's tokens per source this process read, by epoch (window)
        self._delivered: dict[int, np.ndarray] = {}
        self.cache_bytes = sum(
            int(info["bytes"])
            for c in (cache.caches if isinstance(cache, MixedCache) else [cache])
            for info in c.shards
        )
        # the dataset owns its cache (close()); spawned workers open their own (__getstate__).
        # A remote one is not kept here: its filesystem client is not fork-safe, and forked
        # DataLoader workers would inherit it
        self._cache: Cache | MixedCache | None = cache
        if cache.remote:
            cache.close()
            self._cache = None
        self._plan: tuple[int, EpochPlan] | None = None
        self._start = 0  # global cursor where the current pass started (set/load/restart)
        self._consumed = 0  # live global cursor (this process's iteration)
        self._worker: dict[str, int] | None = None  # worker-level position while iterating
        self._worker_resume: dict[str, int] | None = None
        self._loaded = False  # the cursor came from load_state_dict: honour it as it is
        # the position persistent DataLoader workers start their next pass from, written by
        # set_epoch / load_state_dict in the main process; _generation is the one this copy's
        # position came from
        self._published = _SharedPosition()
        self._generation = 0
        #: Read batches with the compiled kernels (kernels.py) when numba is installed; False
        #: takes the numpy path (the reference: same batches, slower).
        self.kernels = True
        self._batch_kernels: kernels.BatchKernels | None = None  # of the current plan

    @property
    def mixture(self) -> MixtureTable | None:
        """A mixture's per-source numbers ([`MixtureTable`][shardcache.MixtureTable]), or None.

        With a schedule its documents and tokens hold, its weights are not used (``schedule``).
        """
        return None if self._mixture is None else self._mixture.table

    @property
    def schedule(self) -> ScheduleTable | None:
        """A scheduled mixture's phases ([`ScheduleTable`][shardcache.ScheduleTable]), or None."""
        layout = self._layout
        return None if layout is None else layout.table()

    @property
    def _layout(self) -> ScheduleLayout | None:
        return None if self._mixture is None else self._mixture.schedule

    @property
    def epochs(self) -> int | None:
        """A scheduled mixture's epochs (its windows: the run), or None (epochs never end)."""
        layout = self._layout
        return None if layout is None else layout.windows

    @property
    def rank(self) -> int:
        """This process's rank: as passed, else of the process group (also one started later)."""
        self._follow_process_group()
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks: as passed, else of the process group (also one started later)."""
        self._follow_process_group()
        return self._world_size

    def _follow_process_group(self) -> None:
        """Take rank and world size from a process group started after construction.

        Lightning's launcher starts it in ``fit()``, after the script built the dataset, and sets
        WORLD_SIZE but no RANK. In the main process only: workers get the main process's values.
        """
        if self._rank_given or get_worker_info() is not None:
            return
        group = _process_group()
        if group is not None and group != (self._rank, self._world_size):
            logger.info(
                "shardcache: ShardDataset(%r): rank %d of %d from the process group (it was %d of "
                "%d when built)", self.path, *group, self._rank, self._world_size,
            )  # fmt: skip
            self._rank, self._world_size = group
            if self._auto_streams and self._plan is None and not self._counts:
                # streams=None is the world size the run starts reading with: nothing was
                # planned or loaded yet, so the process group's is that size
                self.options = dataclasses.replace(self.options, streams=self._world_size)

    def _open_cache(self, expect: Any = None) -> Cache | MixedCache:
        """This process's reader of the cache (or of a mixture's caches)."""
        if self._sources is not None:
            open_shards = shards_within_file_limit(OPEN_SHARDS, len(self._sources))
            return MixedCache(self._sources, expect, open_shards=open_shards)
        cache = Cache(self.path, open_shards=shards_within_file_limit(OPEN_SHARDS))
        if expect is not None:  # CacheKeyMismatch names the fields
            verify_manifest_key(cache.manifest, expect, self.path)
        return cache

    def __getstate__(self) -> dict[str, Any]:
        self._follow_process_group()  # (spawned workers start with the main process's rank)
        state = self.__dict__.copy()
        # memory maps do not travel to worker processes: a spawned one opens its own
        names = ("_cache", "_plan", "_batch_kernels", "_lengths", "_buckets", "_readahead")
        for name in (*names, "_shard_index", "_counting"):
            state[name] = None
        return state

    def close(self) -> None:
        """Release the cache, open shards, plan and downloads (reopened when needed); idempotent."""
        if self._readahead is not None:
            self._readahead.close()
            self._readahead = None
        if self._cache is not None:
            self._cache.close()
        self._cache = self._plan = self._batch_kernels = None
        self._lengths = self._buckets = self._shard_index = None

    def __enter__(self) -> ShardDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> Cache | MixedCache:
        """The cache this dataset owns, opened on first use (again after ``close``)."""
        if self._cache is None:
            self._cache = self._open_cache()
        return self._cache

    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        """The length and bucket of every sample id (the bucket array only for the global plan)."""
        if self._buckets is None:
            buckets = self._open().buckets()
            self._buckets = buckets[0::2] if self._pairs else buckets  # (a pair's two agree)
        return self._all_lengths(), self._buckets

    def _all_lengths(self) -> np.ndarray:
        """The length of every planning unit: a sample id's, or a pair's longer side."""
        if self._lengths is None:
            lengths = self._sample_lengths()
            self._lengths = _pair_lengths(lengths, self._pair_combine) if self._pairs else lengths
        return self._lengths

    def _counted_lengths(self) -> np.ndarray:
        """The tokens every unit counts toward a mixture's targets: a pair's both sides'."""
        if not self._pairs:
            return self._all_lengths()
        return _pair_lengths(self._sample_lengths(), np.add)

    @property
    def _pair_combine(self) -> Any:
        """A pair unit's length from its sides': the longer (pad: two rows), the sum (pack)."""
        return np.add if self.options.mode == "pack" else np.maximum

    def _sample_lengths(self) -> np.ndarray:
        """The length of every sample id (a memory map of the cache's index)."""
        return np.asarray(self._open().lengths)

    @property
    def _planning(self) -> PlanOptions:
        """The planners' options: for pairs in pad mode half the budget (a unit is two rows).

        In pack mode a pair is one unit of its two sequences, each of which a transform may
        lengthen: twice the growth.
        """
        if not self._pairs:
            return self.options
        if self.options.mode == "pack":
            growth = 2 * self.options.growth
            return dataclasses.replace(self.options, growth=growth) if growth else self.options
        return dataclasses.replace(self.options, max_tokens=self.options.max_tokens // 2)

    # ---- epochs and sizes ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (reshuffles); persistent DataLoader workers follow it.

        A new epoch starts at cursor 0; the current one keeps its cursor (as a resumed job needs).

        Args:
            epoch: the epoch (>= 0).

        Raises:
            ConfigError: ``epoch`` is negative.
        """
        refuse_accelerate_wrapper(f"ShardDataset({self.path!r})", self.rank, self.world_size)
        epoch = int(epoch)
        if epoch < 0:
            raise ConfigError(f"set_epoch: got {epoch}, expected an epoch >= 0")
        if self._layout is not None:
            self._layout.window_targets(epoch)  # (ConfigError past the run's end)
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = self._consumed = 0
            self._loaded = False
        self._publish()

    def _publish(self) -> None:
        """Publish this position for persistent workers' next pass (a worker only reads it)."""
        if get_worker_info() is None:
            self._generation = self._published.write(self.epoch, self._consumed, self._loaded)
        else:
            self._generation = self._published.read()[0]

    def _adopt_published(self) -> None:
        """In a persistent worker: take the position published since this copy's last pass."""
        generation, epoch, consumed, loaded = self._published.read()
        if generation == self._generation:
            return
        if epoch != self.epoch:
            self._plan = None
        self.epoch = epoch
        self._start = self._consumed = consumed
        self._loaded = bool(loaded)
        self._generation = generation

    def plan(self, epoch: int | None = None) -> EpochPlan | StreamPlan:
        """The global batch plan of an epoch for all ranks.

        With canonical streams (``PlanOptions.streams`` > 0) a ``StreamPlan`` that plans a block
        of a stream when a batch of it is first asked for; with ``streams=0`` the whole
        ``EpochPlan``, computed once per machine and epoch.

        Args:
            epoch: the epoch (None: the current one).

        Returns:
            The plan.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        if self._plan is None or self._plan[0] != epoch:
            if self._global_plan():
                digest = self._plan_digest(epoch)
                count = len(self._all_lengths() if self._split_rows is None else self._split_rows)
                plan: EpochPlan | StreamPlan = shared_plan(
                    digest, count, lambda: self._plan_epoch(epoch)
                )
            else:
                plan = self._stream_plan(epoch)
            self._plan = (epoch, plan)
        return self._plan[1]

    def _global_plan(self) -> bool:
        """Whether an epoch is one global plan: ``streams=0``, or one stream of one block.

        One stream of one block is the global plan by construction (``streams.plan_block``);
        planning it whole keeps its plan an ``EpochPlan`` shared per machine, as before streams.
        """
        streams = self.options.streams
        if streams != 1:
            return streams == 0
        if self._mixture is None:
            rows = len(self._all_lengths() if self._split_rows is None else self._split_rows)
        else:  # (the documents an epoch chooses, as the mixture's table expects them)
            rows = self._mixture.expected_documents()
        return rows <= self.options.shuffle_block

    def _plan_digest(self, epoch: int) -> str:
        options = json.dumps(self.options.to_json(), sort_keys=True)
        return plan_digest(self._data_identity, options, self.seed, epoch)

    def _stream_layout(self, epoch: int) -> StreamLayout:
        """An epoch's shards dealt to the canonical streams."""
        options = self.options
        assert options.streams  # (plan() takes the global plan for 0)
        if self._mixture is not None:
            index = self._mixture_index(epoch)
        else:
            if self._shard_index is None:
                cache = self._open()
                assert isinstance(cache, Cache)
                rows = self._split_rows
                self._shard_index = _shard_index(cache, self._all_lengths(), rows, self._pairs)
            index = self._shard_index
        return StreamLayout(
            index, options.streams, options.shuffle_block, self.seed, epoch, options.shuffle
        )

    def _mixture_index(self, epoch: int) -> ShardIndex:
        """A mixture epoch's chosen documents (repeats included) by the shard that holds them."""
        assert self._mixture is not None
        cache = self._open()
        assert isinstance(cache, MixedCache)
        lengths, buckets = self._index()
        counted = self._counted_lengths()
        chosen = self._mixture.documents(lengths, self.seed, epoch, counted=counted)
        offsets = self._mixture.index.offsets  # (a preference mixture's: in pairs)
        halve = 2 if self._pairs else 1  # (a preference cache's shards are cut between pairs)
        shard_starts = np.concatenate(
            [c.shard_starts[:-1] // halve + offsets[s] for s, c in enumerate(cache.caches)]
            + [offsets[-1:]]
        ).astype(np.int64)
        return mixture_shard_index(chosen, shard_starts, lengths, buckets)

    def _stream_counts(self, layout: StreamLayout, epoch: int) -> dict[int, np.ndarray]:
        """Every block's batch count: this process's, this machine's, or computed here."""
        counts = self._counts.get(epoch)
        if counts is not None:
            return counts
        thread = self._counting
        if thread is not None and thread.is_alive():
            thread.join()  # the next epoch's, counted in the background: nearly done
            counts = self._counts.get(epoch)
            if counts is not None:
                return counts
        counts = self._machine_counts(layout, epoch)
        self._counts = {e: c for e, c in self._counts.items() if e > epoch - 2}
        self._counts[epoch] = counts
        return counts

    def _machine_counts(self, layout: StreamLayout, epoch: int) -> dict[int, np.ndarray]:
        """The counts another process of this machine stored, else counted here and stored."""
        digest = self._plan_digest(epoch)
        counts = read_counts(digest)
        if counts is None or set(counts) != set(range(layout.streams)):
            counts = count_batches(layout, self._planning)
            write_counts(digest, counts)
        return counts

    def _stream_plan(self, epoch: int) -> StreamPlan:
        layout = self._stream_layout(epoch)
        counts = self._stream_counts(layout, epoch)
        streams = int(self.options.streams or 1)
        touched = streams // math.gcd(streams, self.world_size)  # streams this rank reads
        keep = 2 * min(touched, 64) + 2
        plan = StreamPlan(layout, self._planning, counts, keep=keep, even=not self.eval)
        # (a cache of one block's rows counts in milliseconds: no thread for it)
        if get_worker_info() is None and int(layout.row_cum[-1]) > self.options.shuffle_block:
            self._count_ahead(epoch + 1)
        return plan

    def _count_ahead(self, epoch: int) -> None:
        """Count the next epoch's batches in a background thread, so its start does not wait."""
        if epoch in self._counts or (self._counting is not None and self._counting.is_alive()):
            return

        def run() -> None:
            try:
                self._counts[epoch] = self._machine_counts(self._stream_layout(epoch), epoch)
            except Exception:  # the epoch is counted again when it comes, and raises there
                logger.debug("shardcache: counting epoch %d ahead failed", epoch, exc_info=True)

        self._counting = threading.Thread(target=run, name="shardcache-plan-ahead", daemon=True)
        self._counting.start()

    def prepare(self, epoch: int | None = None) -> None:
        """Plan an epoch with the other ranks: each counts its own streams' batches, then all share.

        A collective under ``torch.distributed``: call it on every rank at the same point (for
        example after ``set_epoch``). Without it each machine counts every stream's batches
        itself (bounded memory, time in proportion to the epoch).

        Args:
            epoch: the epoch (None: the current one).
        """
        epoch = self.epoch if epoch is None else int(epoch)
        if self._global_plan() or epoch in self._counts:
            return
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            self.plan(epoch)
            return
        layout = self._stream_layout(epoch)
        streams = int(self.options.streams or 1)
        mine = own_streams(streams, self.rank, self.world_size)
        own = count_batches(layout, self._planning, mine)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {s: c.tolist() for s, c in own.items()})
        counts = {
            int(s): np.asarray(c, dtype=np.int64) for part in gathered for s, c in part.items()
        }
        if set(counts) != set(range(streams)):
            raise ConfigError(
                f"ShardDataset.prepare: the ranks counted streams {sorted(counts)[:8]}... of "
                f"{streams}; every rank must construct the dataset with the same options and "
                f"world_size={self.world_size} (torch.distributed has {dist.get_world_size()})"
            )
        self._counts[epoch] = counts
        write_counts(self._plan_digest(epoch), counts)

    def _plan_epoch(self, epoch: int) -> EpochPlan:
        args = (*self._index(), self._planning, self.seed, epoch)
        if self._mixture is not None:
            return self._mixture.plan(*args, counted=self._counted_lengths())
        rows = self._split_rows
        if rows is None:
            return plan_epoch(*args)
        lengths, buckets = self._index()
        plan = plan_epoch(lengths[rows], buckets[rows], self._planning, self.seed, epoch)
        return dataclasses.replace(plan, sample_ids=rows[plan.sample_ids])

    def split(self, epoch: int | None = None, start: int = 0) -> EpochSplit:
        """How the global batches of an epoch go to ranks.

        Args:
            epoch: the epoch (None: the current one).
            start: the global cursor the batches are dealt from.

        Returns:
            The split.
        """
        return split_epoch(len(self.plan(epoch)), self.world_size, start, self._tail)

    @property
    def _tail(self) -> str:
        """How ranks even out: an evaluation pass wraps, its extra batches become fillers."""
        return "wrap" if self.eval else self.options.tail

    def batches_per_rank(self, epoch: int | None = None) -> int:
        """How many batches every rank yields in a whole epoch (for LR schedulers).

        Args:
            epoch: the epoch (None: the current one).

        Returns:
            The count, the same on every rank.
        """
        return self.split(epoch).batches_per_rank

    def _pass_start(self, cursor: int) -> int:
        """Where a pass begins: ``cursor``, or 0 if the epoch is spent there (unless loaded)."""
        if cursor and not self._loaded and self.split(start=cursor).batches_per_rank == 0:
            return 0
        return cursor

    def __len__(self) -> int:
        """Batches this rank yields in the current (or next) pass over the current epoch."""
        refuse_accelerate_wrapper(f"ShardDataset({self.path!r})", self.rank, self.world_size)
        n = self.split(start=self._pass_start(self._start)).batches_per_rank
        if n == 0 and self._start == 0:
            self._warn_empty()
        return n

    def _warn_empty(self) -> None:
        """Warn (once per dataset) when more ranks than batches leave every rank with none."""
        total = len(self.plan())
        if total < self.world_size and not getattr(self, "_warned_empty", False):
            self._warned_empty = True
            warnings.warn(
                f"ShardDataset({self.path!r}): world_size={self.world_size} but epoch "
                f"{self.epoch} has {total} global batches, so every rank gets 0 batches; use "
                "a smaller max_tokens, fewer ranks, or tail='wrap'",
                stacklevel=3,
            )

    def tail_report(self, epoch: int | None = None) -> dict[str, Any]:
        """What a whole epoch drops (``tail="drop"``) or repeats (``"wrap"``) to even out ranks.

        Args:
            epoch: the epoch (None: the current one).

        Returns:
            A JSON-able dict: tail mode, world size, global and per-rank batches, and the batches,
            segments and tokens dropped and repeated; with canonical streams also
            ``stream_dropped_*`` / ``stream_repeated_*``: what evening the streams' counts out
            left out of the epoch's batches or put in twice.
        """
        plan = self.plan(epoch)
        split = self.split(epoch)
        lengths = self._all_lengths()
        per = 1
        if self._pairs:  # a unit is two sequences of both sides' tokens
            lengths, per = _pair_lengths(self._sample_lengths(), np.add), 2

        def count(batches: np.ndarray) -> tuple[int, int]:
            segs = per * sum(len(plan.batch(int(b))) for b in batches)
            tokens = sum(plan.token_count(lengths, int(b)) for b in batches)
            return segs, tokens

        dropped, repeated = count(split.dropped), count(split.repeated)
        extra: dict[str, int] = {}
        if isinstance(plan, StreamPlan):
            for name, pairs in (("dropped", plan.dropped()), ("repeated", plan.repeated())):
                located = [plan.stream_batch(s, k) for s, k in pairs]
                extra[f"stream_{name}_batches"] = len(pairs)
                extra[f"stream_{name}_segments"] = per * sum(len(p.batch(i)) for p, i in located)
                extra[f"stream_{name}_tokens"] = sum(p.token_count(lengths, i) for p, i in located)
        return {
            **extra,
            "tail": self._tail,
            "world_size": self.world_size,
            "global_batches": len(plan),
            "batches_per_rank": split.batches_per_rank,
            "dropped_batches": len(split.dropped),
            "dropped_segments": dropped[0],
            "dropped_tokens": dropped[1],
            "repeated_batches": len(split.repeated),
            "repeated_segments": repeated[0],
            "repeated_tokens": repeated[1],
        }

    # ---- state -----------------------------------------------------------------------------

    def state_dict(self, *, steps: int | None = None) -> dict[str, Any]:
        """The resumable position, JSON-able.

        Args:
            steps: None for this object's live position (inside a DataLoader worker: the
                worker's own); ``k`` for the position after this rank took ``k`` batches since
                ``set_epoch`` / ``load_state_dict`` (behind a plain DataLoader).

        Returns:
            ``version``, ``cache_digest``, ``seed``, ``plan``, ``epoch``, ``consumed`` and
            ``world_size`` (plus ``mixture``, and ``worker`` inside a worker).

        Raises:
            ConfigError: ``steps`` is not an integer in ``[0, batches of this pass]``.
        """
        if steps is None:
            consumed = self._consumed
        else:
            start = self._pass_start(self._start)
            available = self.split(start=start).batches_per_rank
            if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= available:
                raise ConfigError(
                    f"steps: got {steps!r}, expected an integer in [0, {available}] (the "
                    f"batches this rank yields from global batch {start} of epoch {self.epoch})"
                )
            consumed = start + self.world_size * steps
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "cache_digest": self.cache_digest,
            "seed": self.seed,
            "plan": self.options.to_json(),
            "epoch": self.epoch,
            "consumed": consumed,
            "world_size": self.world_size,
        }
        if self._mixture is not None:
            state["mixture"] = self._mixture.state()
        split_state = self._split_state()
        if split_state is not None:
            state["split"] = split_state
        if steps is None and self._worker is not None:
            state["worker"] = dict(self._worker)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state, at any world size and ``num_workers``.

        Args:
            state: what ``state_dict`` returned, or a whole ``StatefulDataLoader`` state (its
                worker states together give the global cursor).

        Raises:
            StateError: the state is of another cache, plan or mixture (see ``remix``), or damaged.
        """
        if isinstance(state, dict) and "version" not in state:
            converted = dataset_state_of_loader(state)
            if converted is not None:
                state = converted
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise StateError(
                f"reader state: expected a dict with version {STATE_VERSION}, got "
                f"{type(state).__name__} with version "
                f"{state.get('version') if isinstance(state, dict) else None!r}; pass what "
                "ShardDataset.state_dict() returned"
            )
        remixed = self._check_mixture_state(state)
        if not remixed and state.get("cache_digest") != self.cache_digest:
            raise StateError(
                f"reader state: it was taken on a cache with digest {state.get('cache_digest')!r}"
                f" but {self.path!r} has digest {self.cache_digest!r}; the data differ, so the "
                "position means nothing here. Resume on the cache the state came from, or start "
                "this cache from epoch 0 without loading the state"
            )
        ours_split = self._split_state()
        if state.get("split") != ours_split:
            raise StateError(
                f"reader state: it was taken on split {state.get('split')!r} but this dataset "
                f"reads split {ours_split!r}; another split plans other documents. Construct "
                "the ShardDataset with the split= and splits= of the state"
            )
        # a state of a version without streams was read with the global plan (streams=0)
        theirs_plan = {"streams": 0, "shuffle_block": DEFAULT_SHUFFLE_BLOCK, "growth": 0}
        theirs_plan.update(dict(state.get("plan") or {}))
        if self._auto_streams and theirs_plan["streams"] != self.options.streams:
            streams = theirs_plan["streams"]
            if isinstance(streams, int) and not isinstance(streams, bool) and streams >= 0:
                # streams=None means "as the run started": the state says how it started
                self.options = dataclasses.replace(self.options, streams=streams)
                self._plan, self._counts = None, {}
        self._auto_streams = False  # the state's streams hold from here
        ours = {"seed": self.seed, **self.options.to_json()}
        theirs = {"seed": state.get("seed"), **theirs_plan}
        changed = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if changed:
            diff = ", ".join(f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in changed)
            raise StateError(
                f"reader state: the plan options differ ({diff}); another plan orders the "
                "batches differently, so resuming would repeat or skip data. Construct the "
                "ShardDataset with the options of the state (state['plan'], state['seed'])"
            )
        epoch, consumed = state.get("epoch"), state.get("consumed")
        for name, value in (("epoch", epoch), ("consumed", consumed)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
                raise StateError(
                    f"reader state: {name}={value!r}, expected an integer in [0, 2**63) (int64); "
                    "pass the state that ShardDataset.state_dict() returned"
                )
        assert isinstance(epoch, int) and isinstance(consumed, int)
        total = len(self.plan(epoch))
        if remixed:  # another mixture's plan: continue at the same place, within this plan
            consumed = min(consumed, total)
        their_world = state.get("world_size")
        slack = max(self.world_size, their_world if isinstance(their_world, int) else 1)
        if consumed > total + slack:  # tail="wrap" may run up to world_size - 1 past the end
            raise StateError(
                f"reader state: consumed={consumed} but epoch {epoch} of {self.path!r} has "
                f"{total} global batches; the state is damaged or belongs to another run: "
                "pass the state that ShardDataset.state_dict() returned"
            )
        self.epoch = epoch
        self._start = self._consumed = consumed
        self._loaded = True
        worker = state.get("worker")  # (states of older versions lack its world_size)
        self._worker_resume = (
            {"world_size": state.get("world_size"), **worker} if isinstance(worker, dict) else None
        )
        self._publish()

    def _split_state(self) -> dict[str, Any] | None:
        """The split a reader state records: side and fractions (per source), or None."""
        if self._source_splits is not None:
            assert self._sources is not None
            return {
                "name": self.split_name,
                "sources": {
                    s.label: own.to_json() for s, own in zip(self._sources, self._source_splits)
                },
            }
        if self.splits is None or self._sources is not None:
            return None
        return {"name": self.split_name, **self.splits.to_json()}

    def _check_mixture_state(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` is of another mixture: warned with ``remix=True``, else StateError."""
        if self._mixture is None:
            return False
        changes = mixture_changes(state.get("mixture"), self._mixture.state())
        if not changes:
            return self._check_schedule_state(state)
        listed = "; ".join(changes)
        if not self.remix:
            raise StateError(
                f"reader state: the mixture changed ({listed}); its plan uses other documents, "
                "so the position means another place in the data. Construct the ShardDataset "
                "with the sources, weights and caches of the state, or pass remix=True to "
                "continue from the same epoch and batch with the new mixture"
            )
        warnings.warn(
            f"ShardDataset({self.path!r}): remix=True: continuing epoch {state.get('epoch')} at "
            f"global batch {state.get('consumed')} with the new mixture ({listed}); documents "
            "before and after that point may repeat or be skipped this epoch",
            stacklevel=3,
        )
        return True

    def _check_schedule_state(self, state: dict[str, Any]) -> bool:
        """Accept a schedule changed only after the state's window (warned); else as a remix."""
        assert self._mixture is not None
        recorded = state.get("mixture")
        theirs = recorded.get("schedule") if isinstance(recorded, dict) else None
        layout = self._layout
        ours = None if layout is None else layout.schedule.to_json()
        if theirs == ours:
            return False
        changes = schedule_changes(theirs, ours)
        listed = "; ".join(changes)
        epoch = state.get("epoch")
        if layout is not None and theirs is not None and isinstance(epoch, int) and epoch >= 0:
            try:
                old = resolve_schedule(
                    Schedule.from_json(theirs), self._mixture.sources, list(layout.tokens)
                )
            except ConfigError:
                old = None
            if old is not None and old.same_until(layout, epoch):
                warnings.warn(
                    f"ShardDataset({self.path!r}): the schedule changed after the state's "
                    f"epoch {epoch} ({listed}); the windows read so far are the same, so the "
                    "stream up to here is unchanged and the new schedule applies from the first "
                    "window it changes",
                    UserWarning,
                    stacklevel=4,
                )
                return False
        if not self.remix:
            raise StateError(
                f"reader state: the schedule changed at or before the state's epoch {epoch} "
                f"({listed}); the windows already read would hold other documents, so the "
                "position means another place in the data. Change only points after the "
                "current window, construct the ShardDataset with the state's schedule "
                "(state['mixture']['schedule']), or pass remix=True to continue from the same "
                "epoch and batch with the new schedule"
            )
        warnings.warn(
            f"ShardDataset({self.path!r}): remix=True: continuing epoch {epoch} at global batch "
            f"{state.get('consumed')} with the new schedule ({listed}); documents before and "
            "after that point may repeat or be skipped",
            stacklevel=4,
        )
        return True

    # ---- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        refuse_accelerate_wrapper(f"ShardDataset({self.path!r})", self.rank, self.world_size)
        self._open()
        info = get_worker_info()
        worker_id, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        resume, self._worker_resume = self._worker_resume, None
        if info is not None and resume is None:
            self._adopt_published()
        planned = time.perf_counter()
        plan = self.plan()
        self._plan_s = time.perf_counter() - planned
        if resume is not None:
            self._check_worker_resume(resume, worker_id, num_workers)
            start, skip = int(resume["start"]), int(resume["yielded"])
        else:
            start, skip = self._pass_start(self._consumed), 0
        split = split_epoch(len(plan), self.world_size, start, self._tail)
        mine = split.for_rank(self.rank)
        if start == 0 and worker_id == 0 and split.batches_per_rank == 0:
            self._warn_empty()
        positions = np.arange(worker_id, len(mine), num_workers)
        if info is None:
            self._start = start
        if self.rank == 0 and worker_id == 0 and start == 0:
            self._log_tail(split)
        done = int(positions[skip - 1]) + 1 if skip else 0
        self._consumed = start + self.world_size * done
        self._worker = None
        if info is not None:
            self._worker = {
                "id": worker_id,
                "num_workers": num_workers,
                "world_size": self.world_size,
                "start": start,
                "yielded": skip,
            }
        return self._generate(plan, mine, positions[skip:], start)

    def _check_worker_resume(
        self, resume: dict[str, Any], worker_id: int, num_workers: int
    ) -> None:
        """Refuse a worker state of another worker, ``num_workers`` or world size (StateError)."""
        theirs = (resume.get("id"), resume.get("num_workers"), resume.get("world_size"))
        ours = (worker_id, num_workers, self.world_size)
        if theirs == ours:
            return
        raise StateError(
            f"reader state: a DataLoader worker state of worker {theirs[0]} of {theirs[1]} at "
            f"world_size {theirs[2]} is being restored into worker {ours[0]} of {ours[1]} at "
            f"world_size {ours[2]}; one worker's position does not give the global cursor "
            "once the ranks or workers change, so resuming from it would skip or repeat "
            "batches. Resume from the whole StatefulDataLoader checkpoint instead: "
            "ds.load_state_dict(loader_state) on the dataset before building the loader (any "
            "world size and num_workers), and do not call loader.load_state_dict"
        )

    def _generate(
        self, plan: EpochPlan | StreamPlan, mine: np.ndarray, positions: np.ndarray, start: int
    ) -> Iterator[Batch]:
        if self._readahead is not None:  # a pass left unfinished: its downloads stop
            self._readahead.close()
        self._passes += 1
        cache = self._open()
        where = f"ShardDataset({self.path!r})"
        sampled = _PairSamples(plan) if self._pairs else plan  # (read-ahead needs sample ids)
        readahead = cache_readahead(
            cache, sampled, mine[positions], self.readahead, self._stats, where
        )
        self._readahead = readahead
        try:
            for n, position in enumerate(positions.tolist()):
                began = time.perf_counter()
                if readahead is not None:
                    readahead.ready(n)
                fetched = time.perf_counter()
                self._gather_s = 0.0
                virtual = start + self.rank + self.world_size * position  # (past the end: wrapped)
                wrap = virtual // len(plan) if self.transform is not None else 0
                batch = self.collate_batch(plan, int(mine[position]), wrap)
                if self._layout is not None:
                    self._count_delivered(plan, int(mine[position]))
                if self.time_stages:
                    built = time.perf_counter() - fetched
                    batch["meta"]["stage_s"] = {
                        "plan_s": self._plan_s,
                        "fetch_s": fetched - began,
                        "gather_s": self._gather_s,
                        "collate_s": built - self._gather_s,
                    }
                    self._plan_s = 0.0
                if self.eval:  # past the plan's end: a wrapped batch that must not count
                    _mark_filler(batch, start + self.rank + self.world_size * position >= len(plan))
                # a batch counts as consumed once it is handed out (the torchdata convention)
                self._consumed = start + self.world_size * (position + 1)
                if self._worker is not None:
                    self._worker["yielded"] += 1
                handed = time.perf_counter()
                yield batch
                self._stats.consumed(time.perf_counter() - handed)
        finally:
            if readahead is not None:
                readahead.close()
                if self._readahead is readahead:
                    self._readahead = None
        if self._cache is not None:
            # the pass is over: its shards close here, not at the next pass or close(); the
            # next pass reopens what it reads (a remote cache's local copies stay on disk)
            _close_shards(self._cache)
        # the pass is done: the next one (in-process, or of a persistent worker) replays from 0
        self._loaded = False
        if self._worker is None:
            self._start = 0
        else:
            self._consumed = start + self.world_size * len(mine)

    def _count_delivered(self, plan: EpochPlan | StreamPlan, index: int) -> None:
        """Add a global batch's tokens per source to this epoch's (a scheduled mixture's stats)."""
        assert self._mixture is not None
        ids, _, pieces = plan.segments(index)
        ids = np.asarray(ids, dtype=np.int64)
        real = ids >= 0
        if pieces is not None:
            tokens = pieces[real]
        elif self._pairs:  # a pair unit counts both of its sides
            sides = self._sample_lengths()
            tokens = sides[2 * ids[real]].astype(np.int64) + sides[2 * ids[real] + 1]
        else:
            tokens = self._all_lengths()[ids[real]]
        source, _ = self._mixture.index.locate(ids[real])
        counts = np.bincount(
            source,
            weights=np.asarray(tokens, dtype=np.float64),
            minlength=len(self._mixture.sources),
        )
        seen = self._delivered.setdefault(self.epoch, np.zeros(len(counts), dtype=np.int64))
        seen += counts.astype(np.int64)

    def _schedule_stats(self) -> dict[str, Any]:
        """What this process delivered per source against the schedule's shares."""
        layout = self._layout
        assert layout is not None
        delivered = np.zeros(len(layout.labels), dtype=np.int64)
        expected = np.zeros(len(layout.labels), dtype=np.float64)
        for epoch, counts in self._delivered.items():
            delivered += counts
            expected += layout.shares[epoch] * float(counts.sum())
        total = max(int(delivered.sum()), 1)
        return {
            "epochs": sorted(self._delivered),
            "delivered_tokens": dict(zip(layout.labels, delivered.tolist())),
            "delivered_shares": dict(zip(layout.labels, (delivered / total).tolist())),
            "scheduled_shares": dict(zip(layout.labels, (expected / total).tolist())),
        }

    def stats(self) -> dict[str, Any]:
        """What reading from object storage cost this process, all passes (zeros for a local cache).

        Returns:
            ``batches``, ``first_wait_s`` (first batches), ``wait_s`` / ``longest_wait_s`` (others),
            ``elapsed_s``, ``wait_share``, ``consumer_s`` (the consumer's own time between
            batches), ``bytes_ahead`` / ``shards_ahead``, ``bytes_on_demand`` /
            ``shards_on_demand``, ``retried``, ``warned`` (each DataLoader worker its own);
            ``share_bytes`` (the cache's bytes over the world size) and ``fetched_over_share``
            (bytes fetched per epoch read, over that share: about 1 when reading locally);
            with a schedule, ``schedule``: the epochs (windows) read, ``delivered_tokens`` and
            ``delivered_shares`` per source, and ``scheduled_shares`` (the schedule's shares of
            each window, weighted by the tokens read in it).
        """
        stats = self._stats.as_dict()
        share = self.cache_bytes / self.world_size
        fetched = stats["bytes_ahead"] + stats["bytes_on_demand"]
        passes = max(self._passes, 1)
        stats["share_bytes"] = share
        stats["fetched_over_share"] = fetched / passes / share if share else 0.0
        if self._layout is not None:
            stats["schedule"] = self._schedule_stats()
        return stats

    def _log_tail(self, split: EpochSplit) -> None:
        if len(split.dropped) or len(split.repeated):
            logger.info(
                "shardcache: epoch %d: %d global batches over %d ranks -> %d per rank; "
                "tail=%s drops %d and repeats %d batches (see ShardDataset.tail_report())",
                self.epoch,
                split.num_batches,
                split.world_size,
                split.batches_per_rank,
                split.tail,
                len(split.dropped),
                len(split.repeated),
            )

    # ---- collation -------------------------------------------------------------------------

    def collate_batch(self, plan: EpochPlan | StreamPlan, index: int, wrap: int = 0) -> Batch:
        """Read global batch ``index`` of ``plan`` and build its tensors.

        Args:
            plan: an epoch plan of this dataset.
            index: the global batch.
            wrap: how many times ``tail="wrap"`` went round the epoch's global batches before
                this read of the batch (0: its first read). A transform seeds a read again
                anew; without a transform it changes nothing.

        Returns:
            The batch.

        Raises:
            CorruptShardError: a shard is damaged or disagrees with the length index.
        """
        if isinstance(plan, StreamPlan):
            if self.transform is not None:  # (a shorter stream's batch the rounds read again)
                wrap = wrap * plan.wraps_per_round + plan.wrap_of(index)
            plan, index = plan.locate(index)
        batch = self._collate_batch(plan, index, wrap)
        meta = batch["meta"]
        if self._mixture is not None and "source_ids" not in meta:  # (else the kernels did)
            # the numpy path: mixture ids -> (source, sample id in the source)
            cache = self._open()
            assert isinstance(cache, MixedCache)
            source, local = cache.index.locate(meta["sample_ids"].numpy())
            meta["sample_ids"] = torch.from_numpy(local)
            meta["source_ids"] = torch.from_numpy(source)
            if self._pairs:  # a pair's number in its source
                meta["pair_ids"] = torch.from_numpy(np.where(local >= 0, local // 2, -1))
        return batch

    def _collate_batch(self, plan: EpochPlan, index: int, wrap: int = 0) -> Batch:
        if self._pairs and self.options.mode == "pack":
            return self._collate_pair_packed(plan, index, wrap)
        if self._pairs:  # units -> rows 2u (chosen), 2u + 1 (rejected), adjacent
            units = np.asarray(plan.batch(index), dtype=np.int64)
            batch = self.collate(_pair_samples(units), self._repeats(plan, index, wrap, 2))
            batch["meta"]["pair_ids"] = torch.from_numpy(np.repeat(units, 2))
            batch["meta"]["side"] = torch.from_numpy(np.tile(np.array([0, 1]), len(units)))
            return batch
        compiled = self._compiled(plan)
        if self.options.mode == "pad":
            made = None
            if compiled is not None:  # one pass, straight from the mapped shards
                multiple = self.options.pad_to_multiple_of
                made = compiled.pad(index, multiple, self.pad_id, self.ids_dtype)
            if made is None:
                return self.collate(plan.batch(index), self._repeats(plan, index, wrap))
            return _to_batch(*made)
        return self._collate_packed(plan, index, compiled, wrap)

    def _repeats(self, plan: EpochPlan, index: int, wrap: int, per: int = 1) -> np.ndarray | None:
        """What seeds a transform per segment: its repetition, the batch's ``wrap`` above it.

        ``per``: segments a planned unit reads (2 for a pair). None without a transform.
        """
        if self.transform is None:
            return None
        repeats = plan.repeats_of(index)
        if per != 1:
            repeats = np.repeat(repeats, per)
        return repeats + (np.int64(wrap) << _WRAP_SHIFT) if wrap else repeats

    def _gather(
        self,
        sample_ids: np.ndarray,
        starts: np.ndarray | None = None,
        lengths: Any = None,
        layout: tuple[np.ndarray, int] | None = None,
        repeats: np.ndarray | None = None,
    ) -> Gathered:
        """``Cache.gather`` of segments (and chat loss masks), flat or placed by ``layout``.

        With a transform, flat (``layout`` is ignored: a transformed segment may be longer) and
        transformed; ``repeats`` gives each segment's repetition for its generator's seed.
        """
        began = time.perf_counter()
        cache = self._open()
        if self.transform is not None:
            layout = None
        got = cache.gather(
            sample_ids, starts, lengths, cache.has_mask, self.ids_dtype, layout, self.pad_id
        )
        if self.transform is not None:
            count = len(got.offsets) - 1
            first = np.zeros(count, np.int64) if starts is None else np.asarray(starts)
            uses = np.zeros(count, np.int64) if repeats is None else np.asarray(repeats)
            got = self._apply_transform(got, np.asarray(sample_ids), first, uses)
        self._gather_s += time.perf_counter() - began
        return got

    def _apply_transform(
        self, got: Gathered, sample_ids: np.ndarray, starts: np.ndarray, repeats: np.ndarray
    ) -> Gathered:
        """``transform`` run on each gathered segment with its own seeded generator, checked."""
        transform = self.transform
        assert transform is not None
        tokens, mask = got.tokens, got.mask
        growth = self.options.growth
        offsets = got.offsets.tolist()
        uses, wraps = repeats & ((1 << _WRAP_SHIFT) - 1), repeats >> _WRAP_SHIFT
        keys = np.stack([sample_ids, uses, starts, wraps]).T.tolist()
        out_ids: list[np.ndarray] = []
        out_masks: list[np.ndarray] = []
        for k, (sample, use, start, wrap) in enumerate(keys):
            lo, hi = offsets[k], offsets[k + 1]
            n = hi - lo
            key = [self.seed, self.epoch, sample, use, start, _TRANSFORM_KEY]
            if wrap:  # read again by tail="wrap": its own generator (a first read's is as before)
                key.append(wrap)
            rng = np.random.default_rng(key)
            seg_mask = None if mask is None else mask[lo:hi].copy()
            out = transform(tokens[lo:hi].copy(), seg_mask, rng)
            if not isinstance(out, tuple) or len(out) != 2:
                raise ConfigError(
                    f"transform: returned {type(out).__name__}, expected a tuple (ids, mask)"
                )
            ids, new_mask = np.asarray(out[0]), out[1]
            if ids.ndim != 1 or not min(n, 1) <= len(ids) <= n + growth:
                raise ConfigError(
                    f"transform: returned ids of shape {ids.shape} for sample {sample} (piece "
                    f"at token {start}) of {n} tokens, but it declared max_growth={growth}: the "
                    f"plan reserved room for 1 to {n + growth} tokens. Return at most "
                    "max_growth more tokens than given (truncate inside the transform), or "
                    "declare a larger max_growth attribute on the transform"
                )
            out_ids.append(ids)
            if mask is None:
                continue
            if new_mask is None:
                if len(ids) != n:
                    raise ConfigError(
                        f"transform: returned {len(ids)} ids but no loss mask for sample {sample} "
                        f"of {n} tokens of a chat cache; the mask cannot follow tokens it was "
                        "not given: return the mask moved with the tokens (inserted tokens "
                        "False), or keep the length"
                    )
                new_mask = mask[lo:hi]
            new_mask = np.asarray(new_mask, dtype=bool)
            if new_mask.shape != ids.shape:
                raise ConfigError(
                    f"transform: returned a loss mask of shape {new_mask.shape} with ids of "
                    f"shape {ids.shape} for sample {sample}; return one mask entry per token"
                )
            out_masks.append(new_mask)
        new_offsets = np.zeros(len(out_ids) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids in out_ids], out=new_offsets[1:])
        new_tokens = (
            np.concatenate(out_ids).astype(tokens.dtype, copy=False)
            if out_ids
            else tokens[:0].copy()
        )
        new_mask_all = None
        if mask is not None:
            new_mask_all = np.concatenate(out_masks) if out_masks else mask[:0].copy()
        return Gathered(new_tokens, new_offsets, new_mask_all)

    @property
    def reads_compiled(self) -> bool:
        """Whether the compiled kernels build batches here (numba, a local uncompressed cache).

        Never for preference pairs: the numpy path collates them.
        """
        # (a remote cache keeps no Cache here)
        cache = self._cache
        if self._pairs or self.transform is not None or cache is None:
            return False
        return self._table(cache) is not None

    def _table(self, cache: Cache | MixedCache) -> MappedTable | None:
        if not self.kernels or not kernels.available(cache.dtype):
            return None
        return cache.mapped_table()

    def _compiled(self, plan: EpochPlan) -> kernels.BatchKernels | None:
        """The compiled reader of ``plan``, or None when the numpy path reads its batches."""
        cache, cached = self._open(), self._batch_kernels
        if self.transform is not None:  # read, transform, then collate: the numpy path
            return None
        if self.kernels and cached is not None and cached.plan is plan and cached.cache is cache:
            return cached
        table = self._table(cache)
        if table is None:
            return None
        sources = None if self._mixture is None else self._mixture.index.offsets
        self._batch_kernels = kernels.BatchKernels(
            cache, table, plan, self.options.max_tokens, sources
        )
        return self._batch_kernels

    def collate(self, sample_ids: np.ndarray, repeats: np.ndarray | None = None) -> Batch:
        """Read sequences and pad them into one batch, one per row (pad mode).

        Args:
            sample_ids: the sequences' global row numbers, one per row.
            repeats: each sequence's repetition in the epoch (seeds the transform; None: 0).

        Returns:
            The batch, rows padded to the longest (rounded up to ``pad_to_multiple_of``),
            transformed first when the dataset has a transform.
        """
        sample_ids = np.asarray(sample_ids)
        if self.transform is not None:  # flat, transformed, then padded to the longest result
            got = self._gather(sample_ids, repeats=repeats)
            width = int(self.options.padded(int(got.lengths.max())))
            laid_out = False
        else:
            width = int(self.options.padded(int(self._sample_lengths()[sample_ids].max())))
            rows = np.arange(0, len(sample_ids) * width, width, dtype=np.int64)
            got = self._gather(sample_ids, layout=(rows, len(sample_ids) * width))  # padded rows
            laid_out = True
        batch = pad_batch(
            got.tokens, got.lengths, sample_ids, self.pad_id, width, got.mask, self.ids_dtype,
            laid_out=laid_out,
        )  # fmt: skip
        meta = {k: batch.pop(k) for k in ("sample_ids", "num_tokens")}
        return _to_batch(batch, meta)

    def _collate_packed(
        self, plan: EpochPlan, index: int, compiled: kernels.BatchKernels | None, wrap: int = 0
    ) -> Batch:
        seq_len = int(self.options.seq_len or 0)
        made = None
        if compiled is not None:  # one pass, straight from the mapped shards
            made = compiled.pack(index, seq_len, self.pad_id, self.ids_dtype)
        if made is not None:
            batch, meta = made
        else:
            ids, starts, taken, row_bounds = plan.packed_segments(index)
            repeats = self._repeats(plan, index, wrap)
            batch = self._pack_numpy(ids, starts, taken, row_bounds, seq_len, repeats)
            meta = {k: batch.pop(k) for k in META_KEYS if k in batch}
        self._add_attention(batch)
        return _to_batch(batch, meta)

    def _collate_pair_packed(self, plan: EpochPlan, index: int, wrap: int = 0) -> Batch:
        """A packed batch of pair units: unit u is segments 2u (chosen), 2u + 1 (rejected).

        Both sides of a pair are whole segments of one row, adjacent; a row's padding is a
        segment of its own after them (``pair_ids`` and ``side`` -1), never part of a pair's.
        """
        units, _, _, unit_bounds = plan.packed_segments(index)
        ids = _pair_samples(units)
        starts = np.zeros(len(ids), dtype=np.int64)
        seq_len, repeats = int(self.options.seq_len or 0), self._repeats(plan, index, wrap, 2)
        batch = self._pack_numpy(ids, starts, None, 2 * unit_bounds, seq_len, repeats)
        meta = {k: batch.pop(k) for k in META_KEYS if k in batch}
        sample_ids = np.asarray(meta["sample_ids"])
        real = sample_ids >= 0
        meta["pair_ids"] = np.where(real, sample_ids // 2, -1)
        meta["side"] = np.where(real, sample_ids % 2, -1)
        self._add_attention(batch)
        return _to_batch(batch, meta)

    def _add_attention(self, batch: dict[str, Any]) -> None:
        """Add the keys of ``attention`` that keep a packed batch's segments apart."""
        if self.attention == "mask":
            batch["attention_mask"] = block_causal_mask(np.asarray(batch["position_ids"]))
        elif self.attention == "varlen":
            batch.update(varlen_keys(np.asarray(batch["position_ids"])))

    def _pack_numpy(
        self,
        ids: np.ndarray,
        starts: np.ndarray,
        taken: np.ndarray | None,
        row_bounds: np.ndarray,
        seq_len: int,
        repeats: np.ndarray | None = None,
    ) -> dict[str, Any]:
        """A packed batch on the numpy path: gathered, then laid out by collate.py."""
        if self.transform is not None and taken is not None and self.options.growth:
            return self._pack_grown_pieces(ids, starts, taken, row_bounds, seq_len, repeats)
        if self.transform is not None:  # flat and transformed (lengths may change), then laid out
            got = self._gather(ids, starts, taken, repeats=repeats)
            return pack_batch(
                got.tokens, got.lengths, ids, starts, row_bounds, seq_len, self.pad_id, got.mask,
                self.ids_dtype,
            )  # fmt: skip
        slots = (len(row_bounds) - 1) * seq_len
        every = self._sample_lengths() if self._pairs else self._all_lengths()
        lengths = every[ids] - starts if taken is None else taken
        laid_out = int(lengths.sum()) != slots  # rows with padding: gathered into their rows
        layout = (packed_layout(lengths, row_bounds, seq_len), slots) if laid_out else None
        got = self._gather(ids, starts, taken, layout)
        return pack_batch(
            got.tokens,
            got.lengths,
            ids,
            starts,
            row_bounds,
            seq_len,
            self.pad_id,
            got.mask,
            self.ids_dtype,
            laid_out,
        )

    def _pack_grown_pieces(
        self,
        ids: np.ndarray,
        starts: np.ndarray,
        taken: np.ndarray,
        row_bounds: np.ndarray,
        seq_len: int,
        repeats: np.ndarray | None,
    ) -> dict[str, Any]:
        """Concat pieces of documents that a transform may lengthen, laid out in rows.

        The plan cut each document as ``length + growth`` tokens, so a piece is read from the
        whole transformed document (seeded at start 0: every piece of it sees the same one),
        padded to that length with pad tokens that carry no loss.
        """
        got = self._gather(ids, None, None, repeats=repeats)  # whole documents, transformed
        ends = got.lengths  # (at most the stored length + growth: checked)
        taken = np.asarray(taken, dtype=np.int64)
        first = np.cumsum(taken) - taken
        # each slot's place in its document as planned, and whether the transform filled it
        pos = np.repeat(np.asarray(starts, dtype=np.int64) - first, taken)
        pos += np.arange(int(taken.sum()), dtype=np.int64)
        real = pos < np.repeat(ends, taken)
        src = np.repeat(got.offsets[:-1], taken) + np.minimum(pos, np.repeat(ends - 1, taken))
        src = np.maximum(src, 0)  # (an empty batch)
        source = got.tokens[src] if len(got.tokens) else np.zeros(len(src), got.tokens.dtype)
        tokens = np.where(real, source, self.pad_id).astype(got.tokens.dtype, copy=False)
        mask = real if got.mask is None else real & got.mask[src]
        return pack_batch(
            tokens, taken, ids, starts, row_bounds, seq_len, self.pad_id, mask, self.ids_dtype
        )


def dataset_state_of_loader(loader_state: dict[str, Any]) -> dict[str, Any] | None:
    """The dataset state (global cursor) in a torchdata ``StatefulDataLoader`` state, or None.

    The workers' positions together give the rank's global cursor, exact for any world size and
    ``num_workers`` to come.
    """
    if isinstance(loader_state.get("dataset_state"), dict) and "_num_yielded" in loader_state:
        return dict(loader_state["dataset_state"])
    snapshot = loader_state.get("_snapshot")
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("_worker_snapshots"), dict):
        return None
    workers = [w.get("dataset_state") if isinstance(w, dict) else None
               for w in snapshot["_worker_snapshots"].values()]  # fmt: skip
    if not workers or not all(isinstance(w, dict) for w in workers):
        raise StateError(
            "reader state: the StatefulDataLoader state holds no ShardDataset state for some "
            "workers; take the checkpoint with loader.state_dict() of a loader over a "
            "ShardDataset"
        )
    steps = loader_state.get("_steps_since_snapshot", 0)
    consumed = loader_state_cursor(workers, int(steps) if isinstance(steps, int) else 0)
    state = {k: v for k, v in workers[0].items() if k != "worker"}
    state["consumed"] = consumed
    return state


def loader_state_cursor(workers: list[dict[str, Any]], steps_since_snapshot: int = 0) -> int:
    """The global cursor of one rank's DataLoader worker states: ``start + world_size * taken``.

    ``steps_since_snapshot`` counts batches the loader yielded after the states were taken.
    """
    starts, worlds, epochs, taken = set(), set(), set(), steps_since_snapshot
    for state in workers:
        worker = state.get("worker")
        epochs.add(state.get("epoch"))
        worlds.add(state.get("world_size"))
        if isinstance(worker, dict):  # a worker that iterated
            starts.add(worker.get("start"))
            taken += int(worker.get("yielded", 0))
        else:  # a worker that has not started: at the cursor it was given
            starts.add(state.get("consumed"))
    if len(starts) != 1 or len(worlds) != 1 or len(epochs) != 1:
        raise StateError(
            f"reader state: the worker states of the StatefulDataLoader disagree (starts "
            f"{sorted(map(str, starts))}, world sizes {sorted(map(str, worlds))}, epochs "
            f"{sorted(map(str, epochs))}); they are not one loader's checkpoint: pass the "
            "dict loader.state_dict() returned, unmodified"
        )
    (start,), (world_size,) = starts, worlds
    if not isinstance(start, int) or not isinstance(world_size, int):
        raise StateError(
            f"reader state: start {start!r} / world_size {world_size!r} are not integers; "
            "pass the dict loader.state_dict() returned, unmodified"
        )
    return start + world_size * taken


#: The integer types ``ShardDataset(ids_dtype=...)`` delivers ids in.
IDS_DTYPES = ("int32", "int64")

#: Bookkeeping keys, kept under ``batch["meta"]`` (never model inputs).
META_KEYS = ("sample_ids", "sample_offsets", "cu_seqlens", "max_seqlen", "num_tokens")


class Batch(dict):  # type: ignore[type-arg]
    """One batch: a ``dict`` of model inputs plus ``"meta"``.

    A ``dict`` subclass so that a DataLoader left at ``batch_size=1`` fails loudly, and so that it
    pickles all its tensors as one storage (one shared-memory segment on a worker's queue).
    """

    def __copy__(self) -> Batch:
        return Batch(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        meta = self.get("meta")
        parts = {False: dict(self), True: dict(meta) if isinstance(meta, dict) else {}}
        keys = [(m, k) for m, part in parts.items() for k, v in part.items() if torch.is_tensor(v)]
        tensors = [parts[m][k] for m, k in keys]
        if not tensors or not all(_packable(t) for t in tensors):
            return super().__reduce_ex__(protocol)
        offsets, used = packed_offsets(tensors)
        flat = torch.empty(used, dtype=torch.uint8)
        specs = []
        for t, at in zip(tensors, offsets):
            packed_view(flat, at, t.dtype, t.shape).copy_(t)
            specs.append((at, t.dtype, tuple(t.shape)))
        for m, k in keys:
            parts[m][k] = None  # a placeholder keeping the key's place: rebuilt from flat
        if isinstance(meta, dict):
            parts[False]["meta"] = parts[True]
        return _rebuild_batch, (flat, specs, keys, parts[False])


def _packable(t: torch.Tensor) -> bool:
    """Whether a pickled ``Batch`` can carry ``t`` in its one storage (CPU, strided, no grad)."""
    return t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad


def _rebuild_batch(
    flat: torch.Tensor,
    specs: list[tuple[int, torch.dtype, tuple[int, ...]]],
    keys: list[tuple[bool, str]],
    items: dict[str, Any],
) -> Batch:
    """A pickled ``Batch`` again: its tensors are views of the one ``flat`` storage."""
    batch = Batch(items)
    meta = batch.get("meta")
    for (in_meta, key), (at, dtype, shape) in zip(keys, specs):
        (meta if in_meta else batch)[key] = packed_view(flat, at, dtype, shape)
    return batch


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a model that rejects unknown ones.

    Args:
        batch: a batch of [`ShardDataset`][shardcache.ShardDataset].

    Returns:
        A new dict: ``batch`` without its ``"meta"``.
    """
    return {k: v for k, v in batch.items() if k != "meta"}


def pair_logps(logits: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair of a preference batch, the summed log-probabilities of its two completions.

    What a DPO-style loss compares: for every sequence of the batch, the sum over its target
    tokens (labels other than -100: the completion, never the prompt or padding) of the
    log-probability the model gave it, the logits at position ``t`` scoring the label at
    ``t + 1`` of the same sequence. Pad mode: a sequence per row; pack mode: a segment of
    ``meta["cu_seqlens"]`` (a row's padding is a segment of no pair).

    Args:
        logits: the model's ``R x L x V`` logits over ``batch["input_ids"]`` (any float dtype;
            summed in float32).
        batch: a batch of a preference cache from [`ShardDataset`][shardcache.ShardDataset],
            pad or pack mode, with its ``labels`` and ``meta`` (``pair_ids``, ``side``).

    Returns:
        ``(chosen, rejected)``: float32 tensors with one value per pair of the batch, on the
        device of ``logits``; entry ``k`` of both is the batch's ``k``-th pair, whose id is
        the ``k``-th ``meta["pair_ids"]`` entry with ``meta["side"]`` 0.

    Raises:
        ConfigError: ``batch`` is not a batch of a preference cache, or ``logits`` do not match
            its ``labels``.
    """
    meta = batch.get("meta") if isinstance(batch, dict) else None
    if not isinstance(meta, dict) or "side" not in meta or "labels" not in batch:
        raise ConfigError(
            "pair_logps: batch has no labels and meta['side']; pass a batch that "
            "ShardDataset yields over a preference cache (built with --preference)"
        )
    labels = batch["labels"]
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(labels.shape):
        raise ConfigError(
            f"pair_logps: logits of shape {tuple(logits.shape)} for labels of shape "
            f"{tuple(labels.shape)}; pass the model's logits over this batch's input_ids "
            "(rows x length x vocabulary)"
        )
    device = logits.device
    rows, width = labels.shape
    targets = labels.to(device)[:, 1:]
    scored = logits[:, :-1].float()
    picked = scored.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token_logps = picked - torch.logsumexp(scored, dim=-1)
    valid = targets != IGNORE_INDEX
    side = meta["side"].to(device)
    if "cu_seqlens" in meta:  # pack mode: the segment of every target's flat position
        at = (
            torch.arange(1, width, device=device)
            + width * torch.arange(rows, device=device)[:, None]
        )
        cu = meta["cu_seqlens"].to(device=device, dtype=torch.int64)
        segment = torch.searchsorted(cu, at, right=True) - 1
    else:  # pad mode: a row per sequence
        segment = torch.arange(rows, device=device)[:, None].expand(rows, width - 1)
    sums = torch.zeros(len(side), dtype=torch.float32, device=device)
    sums.index_add_(0, segment[valid], token_logps[valid])
    return sums[side == 0], sums[side == 1]


class _SharedPosition:
    """``[generation, epoch, cursor, loaded]`` shared by a ShardDataset and its workers' copies.

    A shared mapping forks inherit, joined by a shared-memory tensor once pickled for spawned
    workers (without shared memory a copy keeps its position); the main process writes both.
    """

    def __init__(self) -> None:
        self._mapped: np.ndarray | None = np.frombuffer(mmap.mmap(-1, 32), dtype=np.int64)
        self._tensor: torch.Tensor | None = None

    def read(self) -> tuple[int, int, int, int]:
        source = self._tensor if self._tensor is not None else self._mapped
        assert source is not None  # (one of the two always exists)
        generation, epoch, cursor, loaded = (int(v) for v in source.tolist())
        return generation, epoch, cursor, loaded

    def write(self, epoch: int, cursor: int, loaded: bool) -> int:
        """Publish a position (generation written last); returns its generation."""
        generation = self.read()[0] + 1
        values = [generation, epoch, cursor, int(loaded)]
        for target in (self._mapped, self._tensor):
            if target is not None:
                target[1:] = (
                    torch.tensor(values[1:]) if isinstance(target, torch.Tensor) else values[1:]
                )
                target[0] = generation  # last: a reader sees a complete position
        return generation

    def __getstate__(self) -> dict[str, Any]:
        if self._tensor is None:
            try:
                self._tensor = torch.tensor(self.read(), dtype=torch.int64).share_memory_()
            except RuntimeError as err:  # e.g. no /dev/shm: the copy keeps its position
                logger.debug("shardcache: no shared memory for the reader position (%s)", err)
                return {"tensor": torch.tensor(self.read(), dtype=torch.int64)}
        return {"tensor": self._tensor}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._mapped = None
        self._tensor = state["tensor"]


def _data_identity(caches: list[Cache], *terms: Any) -> str:
    """What a plan depends on besides options, seed and epoch: length indexes, shards, ``terms``."""
    parts = [
        [c.manifest["index"]["lengths"]["sha256"], [[s["bucket"], s["rows"]] for s in c.shards]]
        for c in caches
    ]
    return hashlib.sha256(json.dumps([*parts, *terms] if terms else parts[0]).encode()).hexdigest()


def _split_rows(cache: Cache, split: str | None, splits: Split | None) -> np.ndarray | None:
    """The sample ids of side ``split`` of ``splits`` (both or neither; ConfigError otherwise)."""
    if split is None and splits is None:
        return None
    if split is None or splits is None:
        raise ConfigError(
            "split/splits: pass both, e.g. split='validation', "
            "splits=Split(validation=0.01, test=0.001) (the same Split for every side), "
            f"or neither; got split={split!r}, splits={splits!r}"
        )
    if not isinstance(splits, Split):
        raise ConfigError(f"splits: got {splits!r}, expected a shardcache.Split")
    check_split_name(split)
    return split_ids(cache, splits, split)


def _shard_index(
    cache: Cache, lengths: np.ndarray, rows: np.ndarray | None, pairs: bool = False
) -> ShardIndex:
    """The stream planner's view of a cache, or of the units ``rows`` (a split) of it.

    ``pairs``: a preference cache, whose units are pairs (``lengths`` and ``rows`` per pair; its
    shards are cut between pairs, so a shard's first pair is its first row halved).
    """
    shard_starts = np.asarray(cache.shard_starts, dtype=np.int64)
    if pairs:
        shard_starts = shard_starts // 2
    elif rows is None:
        tokens = np.fromiter((int(i["tokens"]) for i in cache.shards), np.int64)
        return ShardIndex(cache.shard_starts, tokens, cache.shard_buckets, lengths)
    if rows is None:
        starts, taken = shard_starts, np.asarray(lengths, dtype=np.int64)
    else:
        starts = np.searchsorted(rows, shard_starts, side="left").astype(np.int64)
        taken = np.asarray(lengths[rows], dtype=np.int64)
    cum = np.zeros(len(taken) + 1, dtype=np.int64)
    np.cumsum(taken, out=cum[1:])
    return ShardIndex(
        starts, cum[starts[1:]] - cum[starts[:-1]], cache.shard_buckets, lengths, rows
    )


def _pair_lengths(lengths: np.ndarray, combine: Any) -> np.ndarray:
    """Per pair, ``combine`` of its chosen and rejected lengths (np.maximum, np.add)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.asarray(combine(lengths[0::2], lengths[1::2]))


def _pair_samples(units: np.ndarray) -> np.ndarray:
    """The sample ids of pair units: 2u (chosen) then 2u + 1 (rejected), per unit."""
    return (2 * np.asarray(units, dtype=np.int64)[:, None] + np.arange(2)).ravel()


def _pair_units(cache: Cache, rows: np.ndarray) -> np.ndarray:
    """The pairs of a split's sample ids ``rows`` (ascending): both sides share one record."""
    units = rows[rows % 2 == 0] // 2
    if len(rows) != 2 * len(units) or not np.array_equal(rows, _pair_samples(units)):
        cache.close()
        raise ConfigError(
            f"split: {cache.path!r} holds pairs whose chosen and rejected sides have different "
            "document keys, so a split would part them; rebuild the cache with this version "
            "(both sides of a pair carry the pair's record)"
        )
    return units


def _check_pair_options(cache: Cache | MixedCache, options: PlanOptions) -> None:
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


class _PairSamples:
    """A plan of pair units seen as sample ids (for the read-ahead's shard lookup)."""

    def __init__(self, plan: EpochPlan | StreamPlan) -> None:
        self.plan = plan

    def batch(self, index: int) -> np.ndarray:
        """The sample ids of global batch ``index``."""
        return _pair_samples(self.plan.batch(index))


def _mark_filler(batch: Batch, filler: bool) -> None:
    """Flag an evaluation batch in ``meta["filler"]``; a filler's labels are all -100."""
    if filler:
        batch["labels"] = torch.full_like(batch["labels"], -100)
    batch["meta"]["filler"] = torch.tensor(filler)


def _check_eval(value: Any, shuffle: bool | None, options: PlanOptions | None) -> bool:
    """Check ``eval=``: a bool, and an evaluation pass is never shuffled."""
    if not isinstance(value, bool):
        raise ConfigError(f"eval: got {value!r}, expected True or False")
    if value and (shuffle or (options is not None and options.shuffle)):
        raise ConfigError(
            "eval: an evaluation pass reads in a fixed order, but shuffle=True was given; "
            "drop shuffle= (eval=True reads unshuffled) or pass shuffle=False"
        )
    return value


def _close_shards(cache: Cache | MixedCache) -> None:
    if isinstance(cache, MixedCache):
        cache.close_idle([set()] * len(cache.caches), 0)
    else:
        cache.close_idle(set(), 0)


def _check_attention(attention: str | None, mode: str) -> str | None:
    """Check ``attention``: required in pack mode (no silent default), refused in pad mode."""
    if mode == "pack":
        if attention is None:
            raise ConfigError(
                "attention: mode='pack' needs attention= one of "
                f"{', '.join(ATTENTION_MODES)}: 'mask' (4-D block-causal attention_mask; exact "
                "with sdpa/eager), 'varlen' (cu_seq_lens_* for flash attention; sdpa/eager "
                "need use_cache=False), 'none' (documents attend to each other). Without it, "
                "transformers lets every document attend to the ones packed before it"
            )
        check_choice("attention", attention, ATTENTION_MODES)
    elif attention is not None:
        raise ConfigError(
            f"attention: got {attention!r} with mode={mode!r}; it applies to mode='pack' only "
            "(padded rows carry a 2-D attention_mask that every model honours). Drop attention="
        )
    return attention


def _to_batch(arrays: dict[str, Any], meta: dict[str, Any]) -> Batch:
    """The numpy arrays of a collated batch as tensors sharing their memory."""
    batch = Batch()
    for key, value in arrays.items():
        batch[key] = torch.from_numpy(value) if type(value) is np.ndarray else value
    for key, value in meta.items():
        if type(value) is np.ndarray:
            meta[key] = torch.from_numpy(value)
    batch["meta"] = meta
    return batch


def _refuse_collate(batches: list[Batch], **_: Any) -> Batch:
    """Refuse a DataLoader with ``batch_size`` set: it would stack already whole batches."""
    raise ConfigError(
        f"DataLoader: it collated {len(batches)} ShardDataset batch(es) into one (its "
        "batch_size defaults to 1, which adds a leading dimension to every tensor). "
        "ShardDataset yields whole token-budget batches: use DataLoader(ds, batch_size=None), "
        "or shardcache.loader(path, ...), which configures it"
    )


def _register_collate_guard() -> None:
    # torch documents extending default_collate by editing default_collate_fn_map in place;
    # an exact-type entry wins over its generic Mapping rule. Absent (another torch): the
    # README and docstrings remain the guard.
    try:
        from torch.utils.data._utils.collate import default_collate_fn_map
    except ImportError:  # pragma: no cover - depends on the torch version
        return
    default_collate_fn_map[Batch] = _refuse_collate


_register_collate_guard()
kernels.warm_up()

"""Selection, the first stage of the read pipeline: what an epoch (a schedule window) reads.

A ``Selection`` owns the cache readers and answers, for the planner and the sample readers, the
questions that depend on *what* is read: the planning units (sequences, or preference pairs as
units) with their lengths and buckets, the documents an epoch chooses (a whole cache, a split
side, a mixture's weighted passes, a schedule's window, an evaluation pass), where those sit
in shards, and the identity a reader state records. One cache (``CacheSelection``) and a
mixture of caches (``MixtureSelection``) satisfy one protocol, so no stage downstream asks which
it has.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from typing import Any, Protocol

import numpy as np

from shardcache.errors import ConfigError, StateError
from shardcache.read.plan.epoch_plan import EpochPlan, PlanOptions, plan_epoch
from shardcache.read.plan.streams import ShardIndex
from shardcache.read.selection.mixed_cache import MixedCache
from shardcache.read.selection.mixture import (
    Mixture,
    MixtureIndex,
    Source,
    as_sources,
    mixture_changes,
    source_splits,
    warn_unweighted_eval,
)
from shardcache.read.selection.mixture_table import MixtureTable
from shardcache.read.selection.passes import EpochShards, SourceUnits
from shardcache.read.selection.schedule import (
    Schedule,
    ScheduleLayout,
    resolve_schedule,
    schedule_changes,
)
from shardcache.read.selection.splits import (
    Split,
    check_sides,
    check_split_name,
    split_ids,
    split_state,
)
from shardcache.read.selection.units import (
    OPEN_SHARDS,
    Units,
    cache_digest,
    check_pair_options,
    data_identity,
    pair_units,
)
from shardcache.store.cache import Cache, shards_within_file_limit
from shardcache.store.key import verify_manifest_key


class Selection(Protocol):
    """What an epoch reads, as the planner and the sample readers see it.

    Attributes:
        path: a label for messages: the cache's path, or ``mixture(a, b, ...)``.
        pairs: the units are preference pairs (unit ``u`` is sample ids ``2u``, ``2u + 1``).
        cache_digest: the identity of the data a reader state records.
        data_identity: what a plan depends on besides options, seed and epoch.
        cache_bytes: the bytes of every shard read (for ``fetched_over_share``).
        pad_id: the tokenizer's pad id.
        has_mask: the units carry chat loss masks.
        dtype: the token ids' dtype.
        max_token_id: the largest id every source's tokenizer has.
        columns: the per-token columns stored beside the tokens (any source's).
        mixture: a mixture's per-source numbers, or None.
        schedule: a scheduled mixture's layout, or None.
    """

    path: str
    pairs: bool
    cache_digest: str
    data_identity: str
    cache_bytes: int
    pad_id: int
    has_mask: bool
    dtype: np.dtype
    max_token_id: int
    columns: tuple[str, ...]
    mixture: MixtureTable | None
    schedule: ScheduleLayout | None

    def finish(self, options: PlanOptions) -> None:
        """Check pairs against the options and derive the unit arrays (after transform checks)."""

    def open(self) -> Cache | MixedCache:
        """The cache reader (opened again after ``close``)."""

    def is_open(self) -> bool:
        """Whether this process holds the reader (a remote cache's is opened per pass)."""

    def close(self) -> None:
        """Release the reader, its open shards and the arrays derived from it."""

    def close_shards(self) -> None:
        """Close the shards a finished pass opened (the next pass reopens what it reads)."""

    def sources(self) -> tuple[list[Cache], MixtureIndex | None]:
        """The caches read (one for one cache) and a mixture's map of ids to them (or None)."""

    def close_idle(self, keep: list[set[int] | None], room: int) -> Any:
        """Close every source's open shards but ``keep`` (per source), leaving ``room``."""

    def unit_lengths(self) -> np.ndarray:
        """The length of every planning unit: a sample id's, or a pair's per ``mode``."""

    def sample_lengths(self) -> np.ndarray:
        """The length of every sample id (a pair's two sides apart)."""

    def counted_lengths(self) -> np.ndarray:
        """The tokens every unit counts toward a mixture's targets (a pair's both sides)."""

    def unit_count(self) -> int:
        """The units the global plan is computed over (for the machine-wide plan store)."""

    def expected_units(self) -> int:
        """The units an epoch is expected to read (one block or more, for the planner)."""

    def plan_epoch(self, planning: PlanOptions, seed: int, epoch: int) -> EpochPlan:
        """The global plan of an epoch's units."""

    def shard_index(self, seed: int, epoch: int) -> ShardIndex:
        """An epoch's units by the shard that holds them (the stream planner's input)."""

    def kernel_sources(self) -> np.ndarray | None:
        """The compiled reader's source offsets (a mixture's), or None."""

    def annotate(self, meta: dict[str, Any]) -> None:
        """Turn ``meta["sample_ids"]`` into ids within their source (a mixture adds sources)."""

    def split_state(self) -> dict[str, Any] | None:
        """The split a reader state records, or None."""

    def state(self) -> dict[str, Any]:
        """What a reader state records of the selection beyond its digest."""

    def check_state(self, state: dict[str, Any], remix: bool) -> bool:
        """Whether ``state`` is of another mixture accepted by ``remix`` (else StateError)."""

    def check_epoch(self, epoch: int) -> None:
        """Refuse an epoch past a schedule's end (ConfigError)."""

    def epoch_options(self, options: PlanOptions, epoch: int) -> PlanOptions:
        """The batch options ``epoch`` is planned and collated with (a schedule phase's)."""

    def observe(self, ids: np.ndarray, pieces: np.ndarray | None, epoch: int) -> None:
        """Count a delivered batch's tokens per source (a scheduled mixture's stats)."""

    def schedule_stats(self) -> dict[str, Any] | None:
        """What was delivered per source against the schedule's shares, or None."""


def open_selection(
    path: str | os.PathLike[str] | list[Source],
    options: PlanOptions,
    *,
    expect: Any = None,
    split: str | None = None,
    splits: Split | None = None,
    eval: bool = False,
    tokens_per_epoch: int | None = None,
    schedule: Schedule | None = None,
) -> CacheSelection | MixtureSelection:
    """The selection of ``path``: one cache, or a mixture of ``Source`` (ConfigError, as named)."""
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
        return CacheSelection(os.fspath(path), options, expect, split, splits)
    return MixtureSelection(
        as_sources(path), options, expect, split, splits, eval, tokens_per_epoch, schedule
    )


class CacheSelection(Units):
    """One cache, or one side of its split."""

    mixture = None
    schedule = None
    _dropped = ("_cache", "_lengths", "_buckets", "_shard_index")

    def __init__(
        self,
        path: str,
        options: PlanOptions,
        expect: Any,
        split: str | None,
        splits: Split | None,
    ) -> None:
        self.path = path
        cache = Cache(path, open_shards=shards_within_file_limit(OPEN_SHARDS))
        if expect is not None:  # CacheKeyMismatch names the fields
            verify_manifest_key(cache.manifest, expect, path)
        self.cache_digest = cache_digest(cache.manifest)
        self.data_identity = data_identity([cache])
        #: the sample ids of the chosen side of ``splits`` (ascending), None without a split
        self._rows = _split_rows(cache, split, splits)
        self._split = split
        #: what a reader state records of the split (split_state), None without one
        self._split_json = None if splits is None else split_state(cache, splits)
        if self._split_json is not None:
            self.data_identity = data_identity([cache], self._split_json, split)
        self._cache = cache
        self._shard_index: ShardIndex | None = None
        self._described(cache)

    def finish(self, options: PlanOptions) -> None:
        """The pair checks and unit arrays, after the caller's checks of the open cache."""
        cache = self._cache
        self._setup(cache, options, cache.is_preference)
        if self.pairs and self._rows is not None:
            self._rows = pair_units(cache, self._rows)
        if not self.pairs:  # (pairs: check_pair_options)
            rows = self._rows
            lengths = self.unit_lengths
            self._check_fits(cache, lambda: lengths() if rows is None else lengths()[rows], options)

    @staticmethod
    def _caches(cache: Any) -> list[Cache]:
        return [cache]

    def _open_cache(self) -> Cache:
        return Cache(self.path, open_shards=shards_within_file_limit(OPEN_SHARDS))

    def close(self) -> None:
        """Release the reader, its open shards and the arrays derived from it."""
        super().close()
        self._shard_index = None

    def close_shards(self) -> None:
        """Close the shards a finished pass opened (the next pass reopens what it reads)."""
        if self._cache is not None:
            self._cache.close_idle(set(), 0)

    def sources(self) -> tuple[list[Cache], None]:
        """The caches read and a mixture's map of ids to them (None for one cache)."""
        cache: Cache = self.open()
        return [cache], None

    def close_idle(self, keep: list[set[int] | None], room: int) -> Any:
        """Close every source's open shards but ``keep``, leaving ``room``."""
        return self.open().close_idle(keep[0], room)

    def unit_count(self) -> int:
        """The units the global plan is computed over."""
        return len(self.unit_lengths() if self._rows is None else self._rows)

    expected_units = unit_count

    def plan_epoch(self, planning: PlanOptions, seed: int, epoch: int) -> EpochPlan:
        """The global plan of an epoch's units."""
        lengths, buckets = self.unit_lengths(), self.unit_buckets()
        rows = self._rows
        if rows is None:
            return plan_epoch(lengths, buckets, planning, seed, epoch)
        plan = plan_epoch(lengths[rows], buckets[rows], planning, seed, epoch)
        return dataclasses.replace(plan, sample_ids=rows[plan.sample_ids])

    def shard_index(self, seed: int, epoch: int) -> ShardIndex:
        """An epoch's units by the shard that holds them."""
        if self._shard_index is None:
            cache: Cache = self.open()
            self._shard_index = _shard_index(cache, self.unit_lengths(), self._rows, self.pairs)
        return self._shard_index

    def kernel_sources(self) -> None:
        """The compiled reader's source offsets (a mixture's), or None."""
        return None

    def annotate(self, meta: dict[str, Any]) -> None:
        """Turn ``meta['sample_ids']`` into ids within their source."""
        return None

    def split_state(self) -> dict[str, Any] | None:
        """The split a reader state records, or None."""
        if self._split_json is None:
            return None
        return {"name": self._split, **self._split_json}

    def state(self) -> dict[str, Any]:
        """What a reader state records of the selection beyond its digest."""
        return {}

    def check_state(self, state: dict[str, Any], remix: bool) -> bool:
        """Whether ``state`` is of another mixture accepted by ``remix`` (else StateError)."""
        return False

    def check_epoch(self, epoch: int) -> None:
        """Refuse an epoch past a schedule's end (ConfigError)."""
        return None

    def epoch_options(self, options: PlanOptions, epoch: int) -> PlanOptions:
        """The batch options ``epoch`` is planned and collated with: ``options``."""
        return options

    def observe(self, ids: np.ndarray, pieces: np.ndarray | None, epoch: int) -> None:
        """Count a delivered batch's tokens per source (a scheduled mixture's stats)."""
        return None

    def schedule_stats(self) -> None:
        """What was delivered per source against the schedule's shares, or None."""
        return None


class MixtureSelection(Units):
    """A mixture of caches: per-source passes by weight, a schedule's windows, split sides."""

    def __init__(
        self,
        sources: tuple[Source, ...],
        options: PlanOptions,
        expect: Any,
        split: str | None,
        splits: Split | None,
        eval: bool,
        tokens_per_epoch: int | None,
        schedule: Schedule | None,
    ) -> None:
        self._sources = sources
        self.path = f"mixture({', '.join(s.label for s in sources)})"
        self._source_splits = source_splits(sources, split, splits)
        self._split = split
        cache = self._open_cache(expect)
        self._cache = cache
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
        #: what a reader state records of each source's split (split_state), None without
        self._split_json: dict[str, Any] | None = None
        if self._source_splits is not None:
            assert split is not None
            pairs = list(zip(cache.caches, self._source_splits))
            rows = tuple(split_ids(c, own, split) for c, own in pairs)
            if not any(len(r) for r in rows):
                cache.close()
                check_sides(rows, self._source_splits, split, f"ShardDataset({self.path})")
            self._split_json = {s.label: split_state(c, own) for s, (c, own) in zip(sources, pairs)}
        table = cache.table(tokens_per_epoch, rows, split, once=eval)
        digests = tuple(cache_digest(c.manifest) for c in cache.caches)
        index = cache.index
        if all(kinds):
            # a mixture of preference caches plans pairs: unit u of source s is its pair
            # u - offsets[s], sample ids 2u and 2u + 1 of the mixture's (even) sample space
            index = MixtureIndex(cache.index.offsets // 2)
            if rows is not None:
                rows = tuple(pair_units(c, r) for c, r in zip(cache.caches, rows))
        layout = None
        if schedule is not None and not eval:
            layout = resolve_schedule(schedule, sources, [r.tokens for r in table.sources])
        if eval:
            warn_unweighted_eval(sources, tokens_per_epoch, schedule, f"ShardDataset({self.path})")
        self._mixture = Mixture(
            sources, table, index, digests, tokens_per_epoch, rows, eval, layout
        )
        self.mixture: MixtureTable | None = table
        self.schedule: ScheduleLayout | None = layout
        mixture_json = json.dumps(self._mixture.state(), sort_keys=True)
        shape_json = json.dumps(self._mixture.shape(), sort_keys=True)  # (no schedule)
        self.cache_digest = hashlib.sha256(shape_json.encode()).hexdigest()
        terms: tuple[Any, ...] = (mixture_json, table.tokens_per_epoch)
        if rows is not None or eval:  # other documents than the weighted whole caches
            terms = (*terms, self.split_state(), eval)
        self.data_identity = data_identity(cache.caches, *terms)
        #: a scheduled mixture's tokens per source this process read, by epoch (window)
        self._delivered: dict[int, np.ndarray] = {}
        self._units: list[SourceUnits] | None = None  # (source_units: this process's)
        self._described(cache)

    _dropped = ("_cache", "_lengths", "_buckets", "_units")

    def close(self) -> None:
        """Release the readers and the arrays derived from them."""
        super().close()
        self._units = None

    def finish(self, options: PlanOptions) -> None:
        """The pair checks and unit arrays, after the caller's checks of the open cache."""
        cache = self._cache
        phases = self._phases(cache, options)  # (a schedule's phases' options, checked)
        self._setup(cache, options, all(c.is_preference for c in cache.caches))
        if not self.pairs:  # (pairs: check_pair_options)
            for where, phase in phases:
                try:
                    self._check_fits(cache, self._read_lengths, phase)
                except ConfigError as err:
                    raise ConfigError(f"{where}{err}") from None

    def _read_lengths(self) -> np.ndarray:
        """The lengths of the units an epoch reads (each source's side, with a split)."""
        lengths, rows = self.unit_lengths(), self._mixture.rows
        if rows is None:
            return lengths
        starts = self._mixture.index.offsets
        return np.concatenate([lengths[starts[s] + r] for s, r in enumerate(rows)])

    @staticmethod
    def _caches(cache: Any) -> list[Cache]:
        return list(cache.caches)

    def _open_cache(self, expect: Any = None) -> MixedCache:
        open_shards = shards_within_file_limit(OPEN_SHARDS, len(self._sources))
        return MixedCache(self._sources, expect, open_shards=open_shards)

    def close_shards(self) -> None:
        """Close the shards a finished pass opened (the next pass reopens what it reads)."""
        if self._cache is not None:
            self._cache.close_idle([set()] * len(self._cache.caches), 0)

    def sources(self) -> tuple[list[Cache], MixtureIndex]:
        """The caches read and a mixture's map of ids to them (None for one cache)."""
        cache: MixedCache = self.open()
        return list(cache.caches), cache.index

    def close_idle(self, keep: list[set[int] | None], room: int) -> Any:
        """Close every source's open shards but ``keep``, leaving ``room``."""
        return self.open().close_idle(keep, room)

    def unit_count(self) -> int:
        """The units the global plan is computed over."""
        return len(self.unit_lengths())

    def expected_units(self) -> int:
        """The units an epoch is expected to read."""
        return self._mixture.expected_documents()

    def plan_epoch(self, planning: PlanOptions, seed: int, epoch: int) -> EpochPlan:
        """The global plan of an epoch's units."""
        args = (self.unit_lengths(), self.unit_buckets(), planning, seed, epoch)
        return self._mixture.plan(*args, units=self.source_units())

    def source_units(self) -> list[SourceUnits]:
        """Every source's units by shard (its side of a split), kept in this process."""
        if self._units is None:
            cache: MixedCache = self.open()
            halve = 2 if self.pairs else 1  # (a preference cache's shards are cut between pairs)
            starts = [np.asarray(c.shard_starts, dtype=np.int64) // halve for c in cache.caches]
            tokens: list[np.ndarray | None] = [
                None if self.pairs else np.fromiter((int(i["tokens"]) for i in c.shards), np.int64)
                for c in cache.caches
            ]
            self._units = self._mixture.units(
                self.counted_lengths(), self.unit_lengths(), starts, tokens
            )
        return self._units

    def shard_index(self, seed: int, epoch: int) -> EpochShards:
        """A mixture epoch by shard: counts and tokens now, a shard's rows when asked."""
        cache: MixedCache = self.open()
        epochs = self._mixture.epochs(self.source_units(), seed, epoch)
        step = 2 if self.pairs else 1  # (a pair's bucket is its first row's)

        def buckets(source: int, shard: int, local: np.ndarray) -> np.ndarray:
            return cache.shard_buckets(source, shard, local * step)

        return EpochShards(epochs, self._mixture.index.offsets, buckets)

    def kernel_sources(self) -> np.ndarray:
        """The compiled reader's source offsets (a mixture's), or None."""
        return self._mixture.index.offsets

    def annotate(self, meta: dict[str, Any]) -> None:
        """Turn ``meta['sample_ids']`` into ids within their source."""
        if "source_ids" in meta:  # (the compiled kernels did)
            return
        # the numpy path: mixture ids -> (source, sample id in the source)
        cache: MixedCache = self.open()
        source, local = cache.index.locate(np.asarray(meta["sample_ids"]))
        meta["sample_ids"] = local
        meta["source_ids"] = source
        if self.pairs:  # a pair's number in its source
            meta["pair_ids"] = np.where(local >= 0, local // 2, -1)

    def split_state(self) -> dict[str, Any] | None:
        """The split a reader state records, or None."""
        if self._source_splits is None:
            return None
        return {"name": self._split, "sources": self._split_json}

    def state(self) -> dict[str, Any]:
        """What a reader state records of the selection beyond its digest."""
        return {"mixture": self._mixture.state()}

    def check_state(self, state: dict[str, Any], remix: bool) -> bool:
        """Whether ``state`` is of another mixture accepted by ``remix`` (else StateError)."""
        changes = mixture_changes(state.get("mixture"), self._mixture.state())
        if not changes:
            return self._check_schedule_state(state, remix)
        listed = "; ".join(changes)
        if not remix:
            raise StateError(
                f"reader state: the mixture changed ({listed}); its plan uses other documents, "
                "so the position means another place in the data. Construct the ShardDataset "
                "with the sources, weights and caches of the state, or pass remix=True to "
                "continue from the same epoch and batch with the new mixture"
            )
        _warn(
            f"ShardDataset({self.path!r}): remix=True: continuing epoch {state.get('epoch')} at "
            f"global batch {state.get('consumed')} with the new mixture ({listed}); documents "
            "before and after that point may repeat or be skipped this epoch"
        )
        return True

    def _check_schedule_state(self, state: dict[str, Any], remix: bool) -> bool:
        """Accept a schedule changed only after the state's window (warned); else as a remix."""
        recorded = state.get("mixture")
        theirs = recorded.get("schedule") if isinstance(recorded, dict) else None
        layout = self.schedule
        ours = None if layout is None else layout.schedule.to_json()
        if theirs == ours:
            return False
        listed = "; ".join(schedule_changes(theirs, ours))
        epoch = state.get("epoch")
        if layout is not None and theirs is not None and isinstance(epoch, int) and epoch >= 0:
            try:
                old = resolve_schedule(
                    Schedule.from_json(theirs), self._mixture.sources, list(layout.tokens)
                )
            except ConfigError:
                old = None
            if old is not None and old.same_until(layout, epoch):
                _warn(
                    f"ShardDataset({self.path!r}): the schedule changed after the state's "
                    f"epoch {epoch} ({listed}); the windows read so far are the same, so the "
                    "stream up to here is unchanged and the new schedule applies from the first "
                    "window it changes"
                )
                return False
        if not remix:
            raise StateError(
                f"reader state: the schedule changed at or before the state's epoch {epoch} "
                f"({listed}); the windows already read would hold other documents, so the "
                "position means another place in the data. Change only points after the "
                "current window, construct the ShardDataset with the state's schedule "
                "(state['mixture']['schedule']), or pass remix=True to continue from the same "
                "epoch and batch with the new schedule"
            )
        _warn(
            f"ShardDataset({self.path!r}): remix=True: continuing epoch {epoch} at global batch "
            f"{state.get('consumed')} with the new schedule ({listed}); documents before and "
            "after that point may repeat or be skipped"
        )
        return True

    def check_epoch(self, epoch: int) -> None:
        """Refuse an epoch past a schedule's end (ConfigError)."""
        if self.schedule is not None:
            self.schedule.window_targets(epoch)  # (ConfigError past the run's end)

    def epoch_options(self, options: PlanOptions, epoch: int) -> PlanOptions:
        """The batch options ``epoch`` is planned and collated with: its schedule phase's."""
        layout = self.schedule
        if layout is None or not layout.schedule.sets_options:
            return options
        return layout.schedule.phase_options(options, layout.point_of(epoch))

    def _phases(self, cache: MixedCache, options: PlanOptions) -> list[tuple[str, PlanOptions]]:
        """Every phase's batch options with a prefix for its messages, checked for pairs.

        A preference mixture's phases keep the mode (a pair's planned length is per mode).
        """
        layout = self.schedule
        if layout is None or not layout.schedule.sets_options:
            return [("", options)]
        schedule = layout.schedule
        try:
            every = schedule.every_phase_options(options)
        except ConfigError:
            cache.close()
            raise
        phases = [
            (f"schedule point #{i + 1} (at_tokens={p.at_tokens:,}), its phase's options: ", o)
            for i, (p, o) in enumerate(zip(schedule.points, every))
        ]
        if all(c.is_preference for c in cache.caches):
            for where, phase in phases:
                if phase.mode != options.mode:
                    cache.close()
                    raise ConfigError(
                        f"{where}mode={phase.mode!r}, but the dataset's is {options.mode!r}; "
                        "a preference mixture plans a pair by its mode, so its phases keep "
                        "the dataset's mode: drop mode from the point"
                    )
                try:
                    check_pair_options(cache, phase)
                except ConfigError as err:
                    raise ConfigError(f"{where}{err}") from None
        return phases

    def observe(self, ids: np.ndarray, pieces: np.ndarray | None, epoch: int) -> None:
        """Add a global batch's tokens per source to this epoch's (a scheduled mixture's stats)."""
        if self.schedule is None:
            return
        ids = np.asarray(ids, dtype=np.int64)
        real = ids >= 0
        if pieces is not None:
            tokens = pieces[real]
        elif self.pairs:  # a pair unit counts both of its sides
            sides = self.sample_lengths()
            tokens = sides[2 * ids[real]].astype(np.int64) + sides[2 * ids[real] + 1]
        else:
            tokens = self.unit_lengths()[ids[real]]
        source, _ = self._mixture.index.locate(ids[real])
        counts = np.bincount(
            source,
            weights=np.asarray(tokens, dtype=np.float64),
            minlength=len(self._mixture.sources),
        )
        seen = self._delivered.setdefault(epoch, np.zeros(len(counts), dtype=np.int64))
        seen += counts.astype(np.int64)

    def schedule_stats(self) -> dict[str, Any] | None:
        """What was delivered per source against the schedule's shares, or None."""
        layout = self.schedule
        if layout is None:
            return None
        delivered = np.zeros(len(layout.labels), dtype=np.int64)
        expected = np.zeros(len(layout.labels), dtype=np.float64)
        for epoch, counts in self._delivered.items():
            delivered += counts
            expected += layout.shares_of(epoch) * float(counts.sum())
        total = max(int(delivered.sum()), 1)
        return {
            "epochs": sorted(self._delivered),
            "delivered_tokens": dict(zip(layout.labels, delivered.tolist())),
            "delivered_shares": dict(zip(layout.labels, (delivered / total).tolist())),
            "scheduled_shares": dict(zip(layout.labels, (expected / total).tolist())),
        }


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=5)


def _split_rows(cache: Cache, split: str | None, splits: Split | None) -> np.ndarray | None:
    """The sample ids of side ``split`` of ``splits`` (both or neither; ConfigError otherwise)."""
    if split is None and splits is None:
        return None
    if split is None or splits is None:
        cache.close()
        raise ConfigError(
            "split/splits: pass both, e.g. split='validation', "
            "splits=Split(validation=0.01, test=0.001) (the same Split for every side), "
            f"or neither; got split={split!r}, splits={splits!r}"
        )
    if not isinstance(splits, Split):
        cache.close()
        raise ConfigError(f"splits: got {splits!r}, expected a shardcache.Split")
    check_split_name(split)
    rows = split_ids(cache, splits, split)
    if not len(rows):
        cache.close()
        check_sides([rows], [splits], split, f"ShardDataset({cache.path!r})")
    return rows


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

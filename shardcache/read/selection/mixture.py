"""Weighted mixtures of caches: the sources, and which documents of each an epoch uses (pure numpy).

See docs/guide/mixtures.md for weights and repetitions; a source's token target per epoch is
``mixture_table``'s. A source with ``repetitions = k + f``
gives every document ``k`` times plus a window of a fixed permutation read cyclically: epochs
use other documents, each within ``ceil(tokens / r) + 1`` epochs (``r = target - k * tokens``),
none over ``k + 1`` times per epoch, and a source's tokens are within one longest document of
its target. Sample ids of a mixture's plan are mixture ids (``MixtureIndex``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import ConfigError
from shardcache.read.plan.epoch_plan import EpochPlan, PlanOptions, plan_epoch
from shardcache.read.selection.mixture_table import MixtureTable
from shardcache.read.selection.passes import (
    SourceEpoch,
    SourcePasses,
    SourceUnits,
    nearest_boundary,  # noqa: F401  (where callers found it)
    rotating_epoch,
)
from shardcache.read.selection.splits import Split, as_split, check_split_name

logger = logging.getLogger("shardcache")
#: A mixture's epoch of at least this many documents logs its planning (INFO) and shows its
#: progress on a terminal's stderr: it takes seconds, before the first batch of the epoch.
LOG_MIN_DOCUMENTS = 1_000_000


@dataclass(frozen=True)
class Source:
    """One cache of a mixture (validated at construction).

    Args:
        path: the cache folder or URL (``s3://...``).
        weight: the source's share of an epoch's tokens, before normalisation (> 0).
        max_repetitions: how often its tokens may be used in one epoch (> 0; above 1 upsamples).
        name: a label for tables, states and errors (default: the path's last part).
        expect: as ``ShardDataset(expect=...)``, for this source only.
        splits: this source's held-out fractions ([`Split`][shardcache.Split], or a mapping
            of its fields), in place of ``ShardDataset(splits=...)`` for this source only;
            the side read is ``ShardDataset(split=...)``'s.

    Raises:
        ConfigError: a value out of range.
    """

    path: str
    weight: float = 1.0
    max_repetitions: float = 1.0
    name: str | None = None
    expect: Any = None
    splits: Split | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ConfigError(f"Source.path: got {self.path!r}, expected a cache path or URL")
        object.__setattr__(self, "path", os.fspath(self.path))
        for field in ("weight", "max_repetitions"):
            value = getattr(self, field)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not _finite(value)
                or value <= 0
            ):
                raise ConfigError(
                    f"Source({self.path!r}).{field}: got {value!r}, expected a number > 0"
                )
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ConfigError(f"Source({self.path!r}).name: got {self.name!r}, expected a text")
        if self.splits is not None:
            object.__setattr__(
                self, "splits", as_split(self.splits, f"Source({self.path!r}).splits")
            )

    @property
    def label(self) -> str:
        """The name, or the last part of the path."""
        if self.name:
            return self.name
        tail = self.path.rstrip("/").rsplit("/", 1)[-1]
        return tail or self.path


def warn_unweighted_eval(
    sources: tuple[Source, ...], tokens_per_epoch: int | None, schedule: Any, where: str
) -> None:
    """Warn that an evaluation pass will not apply what the caller gave to weight a mixture.

    ``eval=True`` reads every document of every source (of its side) once, so unequal
    weights, ``tokens_per_epoch`` and a schedule change nothing it reads: said when the dataset
    is made, since silently they look applied (stacklevel: the ``ShardDataset(...)`` call).
    """
    ignored = []
    if len({s.weight for s in sources}) > 1:
        weights = ", ".join(f"{s.label} {s.weight:g}" for s in sources)
        ignored.append(f"the weights ({weights})")
    if tokens_per_epoch is not None:
        ignored.append(f"tokens_per_epoch={tokens_per_epoch}")
    if schedule is not None:
        ignored.append("the schedule")
    if ignored:
        warnings.warn(
            f"{where}: eval=True reads every document of every source once, so "
            f"{' and '.join(ignored)} are not applied and the loss is over the union of the "
            "sources; give the sources equal weights (and no tokens_per_epoch or schedule) to "
            "say that is meant, or make one eval ShardDataset per source for a loss per source "
            "(docs/guide/evaluation.md)",
            UserWarning,
            stacklevel=5,
        )


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float (an int beyond the float range is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def as_sources(value: Any) -> tuple[Source, ...]:
    """A mixture's sources from ``Source``s, paths or mappings; labels must be unique."""
    if isinstance(value, (str, os.PathLike)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"sources: got {type(value).__name__}, expected a list of Source")
    sources = []
    for item in value:
        if isinstance(item, Source):
            sources.append(item)
        elif isinstance(item, (str, os.PathLike)):
            sources.append(Source(os.fspath(item)))
        elif isinstance(item, dict):
            try:
                sources.append(Source(**item))
            except TypeError as err:
                raise ConfigError(
                    f"source {item!r}: {err}; the fields are path, weight, max_repetitions, "
                    "name, expect, splits"
                ) from None
        else:
            raise ConfigError(
                f"sources: got an entry {item!r}; give Source(...) objects, paths or mappings"
            )
    if not sources:
        raise ConfigError("sources: the mixture is empty; give at least one Source")
    labels = [s.label for s in sources]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ConfigError(
            f"sources: the label(s) {twice} name several sources; give each a unique "
            "Source(name=...)"
        )
    return tuple(sources)


def source_splits(
    sources: tuple[Source, ...], split: str | None, splits: Split | None
) -> tuple[Split, ...] | None:
    """Every source's split (its own ``Source.splits``, else ``splits``) when ``split`` is given.

    ConfigError: fractions without a side, a side without fractions, or a source without a split.
    """
    own = [s.label for s in sources if s.splits is not None]
    if split is None and splits is None and not own:
        return None
    if splits is not None and not isinstance(splits, Split):
        raise ConfigError(f"splits: got {splits!r}, expected a shardcache.Split")
    if split is None:
        given = "splits=" if splits is not None else f"Source(splits=...) of {own}"
        raise ConfigError(
            f"split: the mixture has held-out fractions ({given}) but no side to read; pass "
            "split='train', 'validation' or 'test' as well (the same fractions for every side)"
        )
    check_split_name(split)
    resolved = [s.splits if s.splits is not None else splits for s in sources]
    missing = [s.label for s, r in zip(sources, resolved) if r is None]
    if missing:
        raise ConfigError(
            f"split={split!r}: the source(s) {missing} have no held-out fractions; pass "
            "splits=Split(...) (every source without its own), or give each "
            "Source(..., splits=Split(...)) (Split() holds out nothing)"
        )
    return tuple(r for r in resolved if r is not None)


# --------------------------------------------------------------------------------------------
# Documents of an epoch
# --------------------------------------------------------------------------------------------


def source_seed(digest: str) -> int:
    """A source's permutation key, from its key digest (not its place: reordering keeps windows)."""
    return int.from_bytes(hashlib.sha256(digest.encode()).digest()[:8], "little")


def epoch_documents(
    lengths: np.ndarray, target: int, seed: int, key: int, epoch: int
) -> np.ndarray:
    """The local ids a source of one shard gives ``epoch`` (``passes.rotating_epoch``)."""
    return rotating_epoch(SourceUnits.of(lengths), target, seed, key, epoch).documents()


@dataclass(frozen=True)
class MixtureIndex:
    """The mixture id space: source ``s`` holds ids ``offsets[s] : offsets[s + 1]``."""

    offsets: np.ndarray

    @classmethod
    def of(cls, documents: list[int]) -> MixtureIndex:
        """The id space of sources holding ``documents[s]`` sequences each."""
        offsets = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum(np.asarray(documents, dtype=np.int64), out=offsets[1:])
        return cls(offsets)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, local id)`` of mixture ids, int64; a negative (padding) id gives ``-1``."""
        ids = np.asarray(ids, dtype=np.int64)
        source = self.offsets.searchsorted(ids, side="right")
        source -= 1
        local = ids - self.offsets[source]  # (a padding id's is fixed below)
        pad = source < 0
        if pad.any():
            source[pad] = -1
            local[pad] = -1
        return source, local


def mixture_documents(
    units: list[SourceUnits],
    index: MixtureIndex,
    table: MixtureTable,
    keys: tuple[int, ...],
    seed: int,
    epoch: int,
    once: bool = False,
) -> list[SourceEpoch]:
    """What ``epoch`` takes of every source (``passes.rotating_epoch``).

    ``units[s]``: source ``s``'s units (its side of a split); ``once``: every one of them
    once, in id order, whatever the table (an evaluation pass).
    """
    out = []
    for row, key, own in zip(table.sources, keys, units):
        if once:
            out.append(SourceEpoch(SourcePasses(own, seed, key, fixed=True), 1, 0, 0))
        else:
            out.append(rotating_epoch(own, row.tokens_per_epoch, seed, key, epoch))
    return out


def document_uses(
    chosen: np.ndarray,
    index: MixtureIndex,
    sizes: np.ndarray | None = None,
    whole_passes: bool = True,
) -> np.ndarray | None:
    """Which use of its document in the epoch each of ``chosen``'s ids is (int64).

    ``whole_passes``: a source's ids are whole passes in id order over the ``n`` documents it
    gives (``sizes[s]``: its side of a split; default all of it), then a window that holds no
    document twice, as ``mixture_documents`` gives them: its ``i``-th id is use ``i // n`` (no
    sort). Otherwise (a schedule's window: the end of one pass, then the start of the next,
    each in its own order) a copy's use is the number of copies before it in ``chosen``. None
    when no document repeats. A function of the epoch's ids alone: the same for any world size,
    workers or resume point.
    """
    chosen = np.asarray(chosen, dtype=np.int64)
    if not whole_passes:
        order = np.argsort(chosen, kind="stable")  # copies of a document: in their order
        ranked = chosen[order]
        new = np.ones(len(ranked), dtype=bool)
        new[1:] = ranked[1:] != ranked[:-1]
        if new.all():
            return None
        at = np.arange(len(ranked), dtype=np.int64)
        uses = np.empty(len(ranked), dtype=np.int64)
        uses[order] = at - np.maximum.accumulate(np.where(new, at, 0))
        return uses
    sizes = np.diff(index.offsets) if sizes is None else np.asarray(sizes, dtype=np.int64)
    source, _ = index.locate(chosen)
    taken = np.bincount(source, minlength=len(sizes))
    if (taken <= sizes).all():
        return None
    first = np.zeros(len(sizes), dtype=np.int64)  # each source's first place in ``chosen``
    np.cumsum(taken[:-1], out=first[1:])
    return (np.arange(len(chosen), dtype=np.int64) - first[source]) // np.maximum(sizes, 1)[source]


def mixture_epoch_plan(
    lengths: np.ndarray,
    buckets: np.ndarray,
    chosen: np.ndarray,
    options: PlanOptions,
    seed: int,
    epoch: int,
    index: MixtureIndex | None = None,
    sizes: np.ndarray | None = None,
    whole_passes: bool = True,
) -> EpochPlan:
    """``plan_epoch`` over the ``chosen`` mixture ids (repeats included), sample ids mapped back.

    With the mixture's ``index`` (``sizes``, ``whole_passes``: as ``document_uses``), the plan
    records each segment's use of its document (``EpochPlan.repeats``).
    """
    plan = plan_epoch(lengths[chosen], buckets[chosen], options, seed, epoch)
    repeats = None if index is None else document_uses(chosen, index, sizes, whole_passes)
    return EpochPlan(
        plan.batch_offsets,
        chosen[plan.sample_ids],
        plan.row_offsets,
        plan.seg_starts,
        plan.seg_lengths,
        None if repeats is None else repeats[plan.sample_ids],
    )


@dataclass(frozen=True)
class Mixture:
    """A mixture as a reader plans it (picklable: every DataLoader worker plans with it).

    ``rows``: per source, the local ids of the side of its split the mixture reads (None: all);
    ``once``: an evaluation pass, every one of them once (``table`` from ``once_table``).
    """

    sources: tuple[Source, ...]
    table: MixtureTable
    index: MixtureIndex
    digests: tuple[str, ...]
    tokens_per_epoch: int | None = None
    rows: tuple[np.ndarray, ...] | None = None
    once: bool = False
    #: a schedule resolved against the sources (``schedule.ScheduleLayout``): epoch ``w`` is its
    #: window ``w``; None: every epoch has the table's targets
    schedule: Any = None

    def expected_documents(self) -> int:
        """About how many documents an epoch (a schedule's largest window) plans over."""
        if self.schedule is not None and not self.once:
            return int(self.schedule.expected_documents([s.documents for s in self.table.sources]))
        return sum(round(s.repetitions * s.documents) for s in self.table.sources)

    def units(
        self,
        counted: np.ndarray,
        planned: np.ndarray | None = None,
        shard_starts: list[np.ndarray] | None = None,
        shard_tokens: list[np.ndarray | None] | None = None,
    ) -> list[SourceUnits]:
        """Every source's units, from mixture-wide arrays (views of them, not copies).

        ``counted``: every mixture id's tokens toward its source's target; ``planned``: its
        length to the planner (default ``counted``); ``shard_starts[s]``: source ``s``'s
        shards' first local ids, then its size (default: one shard); ``shard_tokens[s]``: its
        shards' counted tokens when known (a cache's manifest), else summed here.
        """
        out = []
        for s in range(len(self.sources)):
            lo, hi = int(self.index.offsets[s]), int(self.index.offsets[s + 1])
            mine = counted[lo:hi]
            plan = mine if planned is None or planned is counted else planned[lo:hi]
            out.append(
                SourceUnits.of(
                    mine,
                    plan,
                    None if shard_starts is None else shard_starts[s],
                    None if self.rows is None else self.rows[s],
                    None if shard_tokens is None else shard_tokens[s],
                )
            )
        return out

    def epochs(self, units: list[SourceUnits], seed: int, epoch: int) -> list[SourceEpoch]:
        """What ``epoch`` (a schedule's window) takes of every source (``units``: ``units()``)."""
        keys = tuple(source_seed(d) for d in self.digests)
        if self.schedule is not None and not self.once:
            return self.schedule.epochs(units, keys, seed, epoch)
        return mixture_documents(units, self.index, self.table, keys, seed, epoch, self.once)

    def documents(
        self,
        units: list[SourceUnits],
        seed: int,
        epoch: int,
        on_source: Callable[[str], None] | None = None,
    ) -> np.ndarray:
        """The mixture ids an epoch plans over, one per use of a document (``O(epoch)``)."""
        parts = []
        for s, (row, taken) in enumerate(zip(self.table.sources, self.epochs(units, seed, epoch))):
            parts.append(taken.documents() + int(self.index.offsets[s]))
            if on_source is not None:
                on_source(row.name)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def plan(
        self,
        lengths: np.ndarray,
        buckets: np.ndarray,
        options: PlanOptions,
        seed: int,
        epoch: int,
        units: list[SourceUnits],
    ) -> EpochPlan:
        """The global batches of an epoch (logged, with a progress bar, when it is large).

        ``lengths`` are what the planner packs or pads; ``units`` as for ``documents``.
        """
        started = time.perf_counter()
        expected = self.expected_documents()
        loud = expected >= LOG_MIN_DOCUMENTS
        if loud:
            logger.info(
                "shardcache: planning epoch %d of a mixture of %d sources: about %d documents",
                epoch, len(self.sources), expected,
            )  # fmt: skip
        progress = _PlanProgress(loud, epoch, len(self.sources), expected)
        try:
            chosen = self.documents(units, seed, epoch, progress.source_done)
            progress.batches_started()
            sizes = None if self.rows is None else [len(r) for r in self.rows]
            whole_passes = self.schedule is None or self.once  # (see document_uses)
            plan = mixture_epoch_plan(
                lengths, buckets, chosen, options, seed, epoch, self.index, sizes, whole_passes
            )
            progress.batches_done()
        finally:
            progress.close()
        if loud:
            logger.info(
                "shardcache: planned epoch %d in %.1f s: %d documents, %d global batches",
                epoch, time.perf_counter() - started, len(chosen), len(plan),
            )  # fmt: skip
        return plan

    def state(self) -> dict[str, Any]:
        """What a reader state records of the mixture (JSON-able), to detect a change on resume.

        A schedule's is under ``"schedule"`` (checked on its own: a future phase may change).
        """
        state = self.shape()
        if self.schedule is not None:
            state["schedule"] = self.schedule.schedule.to_json()
        return state

    def shape(self) -> dict[str, Any]:
        """The state without the schedule: the sources, their caches, weights and caps."""
        return {
            "tokens_per_epoch": self.tokens_per_epoch,
            "sources": [
                {
                    "name": s.label,
                    "digest": d,
                    "weight": float(s.weight),
                    "max_repetitions": float(s.max_repetitions),
                }
                for s, d in zip(self.sources, self.digests)
            ],
        }


class _PlanProgress:
    """A tqdm bar on stderr while an epoch is planned (drawn on a terminal only, if ``shown``)."""

    def __init__(self, shown: bool, epoch: int, sources: int, documents: int) -> None:
        self._bar: Any = None
        if shown:
            from tqdm import tqdm

            self._bar = tqdm(
                total=sources + 1,
                desc=f"shardcache: plan epoch {epoch} ({sources} sources, ~{documents:,} docs)",
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}{postfix}]",
                mininterval=0,  # a few steps, each drawn
                file=sys.stderr,
                disable=None,
                leave=False,
                dynamic_ncols=True,
            )

    def source_done(self, name: str) -> None:
        """Source ``name``'s documents are chosen."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"chose {name}'s documents", refresh=False)
            self._bar.update(1)

    def batches_started(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str("planning batches")

    def batches_done(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def mixture_changes(theirs: Any, ours: dict[str, Any]) -> list[str]:
    """The differences between a recorded ``Mixture.state`` and ours, a line each."""
    if not isinstance(theirs, dict):
        return [f"mixture: {theirs!r} -> {len(ours['sources'])} sources"]
    lines = []
    if theirs.get("tokens_per_epoch") != ours["tokens_per_epoch"]:
        lines.append(
            f"tokens_per_epoch: {theirs.get('tokens_per_epoch')!r} -> {ours['tokens_per_epoch']!r}"
        )
    before = {s.get("name"): s for s in theirs.get("sources") or [] if isinstance(s, dict)}
    after = {s["name"]: s for s in ours["sources"]}
    for name in [*after, *(n for n in before if n not in after)]:
        old, new = before.get(name), after.get(name)
        if old is None:
            lines.append(f"source {name!r}: added")
        elif new is None:
            lines.append(f"source {name!r}: removed")
        else:
            for field in ("digest", "weight", "max_repetitions"):
                if old.get(field) != new[field]:
                    what = "cache (key digest)" if field == "digest" else field
                    lines.append(f"source {name!r}: {what} {old.get(field)!r} -> {new[field]!r}")
    if not lines and [s.get("name") for s in theirs.get("sources") or []] != list(after):
        lines.append(
            f"source order: {[s.get('name') for s in theirs.get('sources') or []]} -> {list(after)}"
        )
    return lines

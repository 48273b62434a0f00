"""The samples stage of the read pipeline: a reader per sample kind gathers planned segments.

A reader turns planned units into the sample ids whose tokens it reads (a sequence is its own
unit; a preference pair is its two sides, adjacent), gathers their tokens and, where the cache
has them, their chat loss masks from the selection's shards, then runs the transform chain on
every segment. Every reader also gathers the per-token columns the selection's caches store
(``store/columns.py``: ``Gathered.extras``, a source without one reads its default) and keeps
them at their token positions through the transforms. The collators lay what it returns out
in rows.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from shardcache.errors import ConfigError
from shardcache.read.plan.epoch_plan import EpochPlan
from shardcache.read.samples.chain import WRAP_SHIFT, TransformChain
from shardcache.read.selection.selection import Selection
from shardcache.read.selection.units import pair_samples
from shardcache.store.cache import Gathered
from shardcache.store.columns import TOKEN_COLUMNS


def check_transforms(chain: TransformChain | None, selection: Selection) -> None:
    """Refuse a chain the selection's caches cannot take (closes the selection first)."""
    if chain is None:
        return
    try:
        chain.check_tokens(selection.max_token_id, selection.dtype)
    except Exception:
        selection.close()
        raise
    if selection.has_mask and not chain.keeps_mask:
        selection.close()
        raise ConfigError(
            f"transform: {chain!r} says it cannot keep loss masks (keeps_mask=False) but "
            f"{selection.path} is a chat cache whose labels follow them; use a transform that "
            "moves the mask with its tokens, or a plain-text cache"
        )
    columns = _columns(selection)
    if chain.max_growth and columns:
        selection.close()
        raise ConfigError(
            f"transform: {chain!r} declares max_growth={chain.max_growth} but {selection.path} "
            f"stores {_labels(columns)} per token, which stay at their positions through a "
            "transform: a transform of such a cache must keep each sequence's length "
            f"(max_growth=0); drop the transform, or build the cache without {_flags(columns)}"
        )


def _columns(selection: Selection) -> tuple[str, ...]:
    """The per-token columns the selection's cache (a mixture: any source) stores."""
    return selection.columns


def _labels(columns: tuple[str, ...]) -> str:
    """The columns' words for messages (``loss weights``)."""
    return " and ".join(TOKEN_COLUMNS[n].label for n in columns)


def _flags(columns: tuple[str, ...]) -> str:
    """The build flags that made the columns (``--weight-field``)."""
    return " and ".join(TOKEN_COLUMNS[n].build_flag for n in columns)


class SequenceReader:
    """Sequences (plain text, or chat with loss masks): a unit is one sample id.

    Args:
        selection: where the tokens are.
        ids_dtype: the dtype batches carry ids in.
        chain: the transforms, or None.
        seed: the plan's seed (a transform's generator is seeded by it).
        growth: the tokens the plan reserved per segment for the transforms.
    """

    #: sample ids (segments) a planned unit reads
    per_unit = 1

    def __init__(
        self,
        selection: Selection,
        ids_dtype: np.dtype,
        chain: TransformChain | None,
        seed: int,
        growth: int,
    ) -> None:
        self.selection = selection
        self.ids_dtype = ids_dtype
        self.chain = chain
        self.seed = seed
        self.growth = growth
        #: the per-token columns it gathers beside the mask (``Gathered.extras``)
        self.columns = _columns(selection)
        #: seconds spent gathering since the caller last reset it (stage timing)
        self.gather_s = 0.0

    def samples(self, units: np.ndarray) -> np.ndarray:
        """The sample ids of planned units, in the order their segments are laid out."""
        return np.asarray(units)

    def repeats(self, plan: EpochPlan, index: int, wrap: int) -> np.ndarray | None:
        """What seeds a transform per segment: its repetition, the batch's ``wrap`` above it.

        None without a transform.
        """
        if self.chain is None:
            return None
        repeats = plan.repeats_of(index)
        if self.per_unit != 1:
            repeats = np.repeat(repeats, self.per_unit)
        return repeats + (np.int64(wrap) << WRAP_SHIFT) if wrap else repeats

    def gather(
        self,
        sample_ids: np.ndarray,
        epoch: int,
        starts: np.ndarray | None = None,
        lengths: Any = None,
        layout: tuple[np.ndarray, int] | None = None,
        repeats: np.ndarray | None = None,
    ) -> Gathered:
        """``Cache.gather`` of segments (and chat loss masks), flat or placed by ``layout``.

        With transforms, flat (``layout`` is ignored: a transformed segment may be longer) and
        transformed; ``repeats`` gives each segment's repetition for its generator's seed.
        """
        began = time.perf_counter()
        cache = self.selection.open()
        chain = self.chain
        if chain is not None:
            layout = None
        got = cache.gather(
            sample_ids, starts, lengths, cache.has_mask, self.ids_dtype, layout,
            self.selection.pad_id, self.columns,
        )  # fmt: skip
        given = got
        if chain is not None:
            count = len(got.offsets) - 1
            first = np.zeros(count, np.int64) if starts is None else np.asarray(starts)
            uses = np.zeros(count, np.int64) if repeats is None else np.asarray(repeats)
            got = chain.apply(
                got, np.asarray(sample_ids), first, uses, self.seed, epoch, self.growth,
                self.selection.max_token_id,
            )  # fmt: skip
            if self.columns:
                got = self._moved(given, got)
        self.gather_s += time.perf_counter() - began
        return got

    def _moved(self, given: Gathered, got: Gathered) -> Gathered:
        """``got`` with ``given``'s per-token columns kept at their positions as the mask moved.

        A token the returned mask leaves untrainable gets the column's ``fill``, one it makes
        trainable that was not its ``trained`` value; a length change is a ``ConfigError``.
        """
        if not np.array_equal(given.offsets, got.offsets):
            k = int(np.flatnonzero(given.lengths != got.lengths)[0])
            raise ConfigError(
                f"transform: {self.chain!r} turned segment {k} of {int(given.lengths[k])} tokens "
                f"into {int(got.lengths[k])} tokens, but {self.selection.path} stores "
                f"{_labels(self.columns)} per token, which stay at their positions: a transform "
                "of such a cache must keep each sequence's length (pad or mask tokens instead "
                f"of adding or removing them), or build the cache without {_flags(self.columns)}"
            )
        was = np.ones(len(given.tokens), bool) if given.mask is None else given.mask
        now = np.ones(len(got.tokens), bool) if got.mask is None else got.mask
        extras = {}
        for name, values in given.extras.items():
            spec = TOKEN_COLUMNS[name]
            kept = np.where(was, values, spec.dtype.type(spec.trained))
            extras[name] = np.where(now, kept, spec.dtype.type(spec.fill)).astype(spec.dtype)
        return Gathered(got.tokens, got.offsets, got.mask, extras)


class PairReader(SequenceReader):
    """Preference pairs: unit ``u`` reads sample ids ``2u`` (chosen) and ``2u + 1`` (rejected)."""

    per_unit = 2

    def samples(self, units: np.ndarray) -> np.ndarray:
        """The sample ids of planned units: each pair's two sides, adjacent."""
        return pair_samples(units)


#: The sample readers by kind: a selection of pairs reads ``"pair"``, others ``"sequence"``.
READERS: dict[str, type[SequenceReader]] = {"sequence": SequenceReader, "pair": PairReader}


def sample_reader(
    selection: Selection,
    ids_dtype: np.dtype,
    chain: TransformChain | None,
    seed: int,
    growth: int,
) -> SequenceReader:
    """The reader of the selection's sample kind."""
    kind = "pair" if selection.pairs else "sequence"
    return READERS[kind](selection, ids_dtype, chain, seed, growth)

"""The samples stage of the read pipeline: a reader per sample kind gathers planned segments.

A reader turns planned units into the sample ids whose tokens it reads (a sequence is its own
unit; a preference pair is its two sides, adjacent), gathers their tokens and, where the cache
has them, their chat loss masks from the selection's shards, then runs the transform chain on
every segment. A cache with per-message loss weights has readers of its own that gather the
weights too (``Gathered.weights``) and move them with the tokens through the transforms. The
collators lay what it returns out in rows.
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
    if chain.max_growth and _weighted(selection):
        selection.close()
        raise ConfigError(
            f"transform: {chain!r} declares max_growth={chain.max_growth} but {selection.path} "
            "stores loss weights per token, which stay at their positions through a transform: "
            "a transform of a weighted cache must keep each sequence's length (max_growth=0); "
            "drop the transform, or build the cache without --weight-field"
        )


def _weighted(selection: Selection) -> bool:
    """Whether the selection's cache (a mixture: any source) stores loss weights."""
    return bool(getattr(selection.open(), "has_weights", False))


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
    #: whether it gathers loss weights (``Gathered.weights``) beside the mask
    weighted = False

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
            self.selection.pad_id, with_weights=self.weighted,
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
            got = self.transformed(given, got)
        self.gather_s += time.perf_counter() - began
        return got

    def transformed(self, given: Gathered, got: Gathered) -> Gathered:
        """What the chain made of ``given`` (here as it is: nothing else follows the tokens)."""
        return got


class PairReader(SequenceReader):
    """Preference pairs: unit ``u`` reads sample ids ``2u`` (chosen) and ``2u + 1`` (rejected)."""

    per_unit = 2

    def samples(self, units: np.ndarray) -> np.ndarray:
        """The sample ids of planned units: each pair's two sides, adjacent."""
        return pair_samples(units)


class WeightedReader(SequenceReader):
    """Chat sequences with per-message loss weights: the ``weights`` column gathered too.

    Through transforms, weights stay at their token positions (a transform must keep each
    segment's length: ``ConfigError`` otherwise); a token the returned mask leaves untrainable
    weighs 0, one it makes trainable that was not weighs 1.
    """

    weighted = True

    def transformed(self, given: Gathered, got: Gathered) -> Gathered:
        """``got`` with ``given``'s weights moved as its mask moved."""
        if not np.array_equal(given.offsets, got.offsets):
            k = int(np.flatnonzero(given.lengths != got.lengths)[0])
            raise ConfigError(
                f"transform: {self.chain!r} turned segment {k} of {int(given.lengths[k])} tokens "
                f"into {int(got.lengths[k])} tokens, but {self.selection.path} stores loss "
                "weights per token, which stay at their positions: a transform of a weighted "
                "cache must keep each sequence's length (pad or mask tokens instead of adding "
                "or removing them), or build the cache without --weight-field"
            )
        assert given.weights is not None and given.mask is not None and got.mask is not None
        kept = np.where(given.mask, given.weights, np.float32(1))
        weights = np.where(got.mask, kept, np.float32(0)).astype(np.float32, copy=False)
        return Gathered(got.tokens, got.offsets, got.mask, weights)


class WeightedPairReader(WeightedReader, PairReader):
    """Preference pairs with per-message loss weights: ``PairReader`` units, weights gathered."""


#: The sample readers by kind: a selection of pairs reads ``"pair"``, others ``"sequence"``;
#: a cache with loss weights (any source of a mixture) ``"weighted"`` / ``"weighted_pair"``.
READERS: dict[str, type[SequenceReader]] = {
    "sequence": SequenceReader,
    "pair": PairReader,
    "weighted": WeightedReader,
    "weighted_pair": WeightedPairReader,
}


def sample_reader(
    selection: Selection,
    ids_dtype: np.dtype,
    chain: TransformChain | None,
    seed: int,
    growth: int,
) -> SequenceReader:
    """The reader of the selection's sample kind."""
    kind = "pair" if selection.pairs else "sequence"
    if _weighted(selection):
        kind = "weighted_pair" if selection.pairs else "weighted"
    return READERS[kind](selection, ids_dtype, chain, seed, growth)

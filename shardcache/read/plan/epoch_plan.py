"""The epoch plan and its split over ranks and workers: pure numpy over the length index.

A plan depends on lengths, buckets, options, seed and epoch only, never on world size or worker
count. Rank ``r`` of ``W`` takes global batches ``c + r, c + r + W, ...`` from cursor ``c``,
dealt round-robin to DataLoader workers in the order the DataLoader collects: a rank's stream
does not depend on ``num_workers``, and "every rank took ``k`` batches" is cursor ``c + kW``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from shardcache.config import check_choice, check_int
from shardcache.errors import ConfigError
from shardcache.read.plan.packing import best_fit_bins, cut_batches, stable_order

#: Sequences per window. Larger windows sort more sequences of similar length together (less
#: padding in pad mode, tighter rows in best_fit) but mix the order less;
#: benchmarks/bench_read.py measures the efficiency a window size gives.
DEFAULT_WINDOW_SIZE = 4096
#: Rows a canonical stream shuffles together (``PlanOptions.shuffle_block``): the unit a rank
#: plans, holds and fetches at a time; benchmarks/bench_scale.py measures what it costs.
DEFAULT_SHUFFLE_BLOCK = 1 << 18
#: The most canonical streams an epoch may have.
MAX_STREAMS = 1 << 20
MODES = ("pad", "pack")
PACKINGS = ("best_fit", "concat")
TAILS = ("drop", "wrap")


@dataclass(frozen=True)
class PlanOptions:
    """How an epoch is cut into batches; validated at construction, round-trips through JSON.

    Args:
        max_tokens: bound on ``rows x padded length`` of every batch.
        shuffle: shuffle the epoch (seeded by seed and epoch).
        pad_to_multiple_of: round a pad batch's length up to a multiple of this.
        window_size: sequences sorted or packed together: larger windows pad less, mix less.
        mode: ``"pad"`` (whole sequences of one bucket, padded to the longest row) or
            ``"pack"`` (rows of exactly ``seq_len`` slots).
        seq_len: the row length; pack mode only, where it is required.
        packing: ``"best_fit"`` (whole sequences, best-fit decreasing per window) or
            ``"concat"`` (one stream cut every ``seq_len`` tokens; documents may span rows).
        tail: global batches that do not divide among ranks: ``"drop"`` or ``"wrap"``.
        streams: canonical streams (docs/guide/scale.md): each epoch the shards are dealt to
            this many streams and global batch ``j`` comes from stream ``j % streams``, so a
            rank of ``W`` dividing ``streams`` reads only ``1 / W`` of the cache. ``None``
            (default): the world size when the reader starts (kept by its state on resume);
            ``0``: one global plan over the whole cache, every rank reading from all shards.
        shuffle_block: rows a stream shuffles together: larger mixes more, and a rank plans,
            holds and fetches that many rows of each of its streams at a time.
        growth: tokens reserved for every sequence to grow by at read time: each is planned
            as ``length + growth`` tokens (with ``packing="concat"``, a document of that
            length is cut into the rows), so no batch exceeds ``max_tokens`` once a read-time
            transform lengthened it. ``ShardDataset`` raises it to its transform's
            ``max_growth``.

    Raises:
        ConfigError: a field out of range or not valid in its mode (the message names it).
    """

    max_tokens: int
    shuffle: bool = True
    pad_to_multiple_of: int = 1
    window_size: int = DEFAULT_WINDOW_SIZE
    mode: str = "pad"
    seq_len: int | None = None
    packing: str = "best_fit"
    tail: str = "drop"
    streams: int | None = None
    shuffle_block: int = DEFAULT_SHUFFLE_BLOCK
    growth: int = 0

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1)
        check_int("growth", self.growth, 0)
        if self.streams is not None:
            check_int("streams", self.streams, 0, MAX_STREAMS)
        check_int("shuffle_block", self.shuffle_block, 1)
        check_int("pad_to_multiple_of", self.pad_to_multiple_of, 1)
        check_int("window_size", self.window_size, 1)
        if not isinstance(self.shuffle, bool):
            raise ConfigError(f"shuffle: got {self.shuffle!r}, expected True or False")
        check_choice("mode", self.mode, MODES)
        check_choice("packing", self.packing, PACKINGS)
        check_choice("tail", self.tail, TAILS)
        if self.mode == "pad":
            if self.seq_len is not None:
                raise ConfigError(
                    f"seq_len: got {self.seq_len!r} with mode='pad'; seq_len sets the row "
                    "length of packed batches, so pass mode='pack' or drop seq_len"
                )
            return
        if self.seq_len is None:
            raise ConfigError(
                "seq_len: mode='pack' needs seq_len (the tokens per packed row), e.g. 4096"
            )
        check_int("seq_len", self.seq_len, 1)
        if self.seq_len > self.max_tokens:
            raise ConfigError(
                f"seq_len: {self.seq_len} exceeds max_tokens={self.max_tokens}; a batch holds "
                "max_tokens // seq_len rows, so raise max_tokens or lower seq_len"
            )
        if self.pad_to_multiple_of != 1:
            raise ConfigError(
                f"pad_to_multiple_of: got {self.pad_to_multiple_of} with mode='pack'; packed "
                "rows are exactly seq_len long, so choose seq_len as the multiple instead"
            )

    @property
    def rows_per_batch(self) -> int | None:
        """Rows of a full packed batch (``None`` in pad mode, where it varies)."""
        return None if self.seq_len is None else self.max_tokens // self.seq_len

    def padded(self, length: np.ndarray | int) -> np.ndarray | int:
        """Round a length up to a multiple of ``pad_to_multiple_of``.

        Args:
            length: a length or an array of them.

        Returns:
            The same type as ``length``.
        """
        m = self.pad_to_multiple_of
        return -(-length // m) * m

    def to_json(self) -> dict[str, Any]:
        """The options as a JSON-able dict.

        Returns:
            The fields by name.
        """
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanOptions:
        """The options ``to_json`` gave.

        Args:
            data: the fields by name.

        Returns:
            The options, checked.

        Raises:
            ConfigError: an unknown field, or an invalid value.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"plan options: unknown field(s) {unknown}; valid fields are {sorted(names)}"
            )
        return cls(**data)


@dataclass(frozen=True)
class EpochPlan:
    """Global batches of one epoch as CSR arrays over segments (a segment: part of one sequence).

    Attributes:
        batch_offsets: int64, one per batch plus one: batch ``i`` holds segments
            ``batch_offsets[i] : batch_offsets[i + 1]``.
        sample_ids: int64, the sequence of each segment.
        row_offsets: int64, one per row plus one, into segments; None: one segment per row.
        seg_starts: int64, each segment's first token in its sequence (None: 0).
        seg_lengths: int64, tokens each segment takes (None: the whole sequence).
        repeats: int64, which use of its sequence in the epoch each segment is (0 for the
            first; a mixture's upsampled source uses a document more than once), None: all 0.
    """

    batch_offsets: np.ndarray
    sample_ids: np.ndarray
    row_offsets: np.ndarray | None = None
    seg_starts: np.ndarray | None = None
    seg_lengths: np.ndarray | None = None
    repeats: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.batch_offsets) - 1

    def batch(self, index: int) -> np.ndarray:
        """The sample ids of one batch.

        Args:
            index: the global batch.

        Returns:
            One per segment (a view).
        """
        return self.sample_ids[self.batch_offsets[index] : self.batch_offsets[index + 1]]

    def segments(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The segments of one batch.

        Args:
            index: the global batch.

        Returns:
            ``(sample_ids, starts, lengths)``; ``lengths`` is None when all are whole sequences.
        """
        return self.packed_segments(index)[:3]

    def repeats_of(self, index: int) -> np.ndarray:
        """Which use of its sequence in the epoch each segment of one batch is (int64, from 0).

        Args:
            index: the global batch.

        Returns:
            One per segment.
        """
        lo, hi = int(self.batch_offsets[index]), int(self.batch_offsets[index + 1])
        if self.repeats is None:
            return np.zeros(hi - lo, dtype=np.int64)
        return self.repeats[lo:hi]

    def row_bounds(self, index: int) -> np.ndarray:
        """Where the rows of one batch begin.

        Args:
            index: the global batch.

        Returns:
            int64 segment offsets, one per row plus one, relative to the batch's first segment.
        """
        return self.packed_segments(index)[3]

    def packed_segments(
        self, index: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """``segments`` and ``row_bounds`` of one batch in one call.

        Args:
            index: the global batch.

        Returns:
            ``(sample_ids, starts, lengths, row_bounds)``.
        """
        lo, hi = int(self.batch_offsets[index]), int(self.batch_offsets[index + 1])
        if self.seg_starts is None:
            starts = np.zeros(hi - lo, dtype=np.int64)
        else:
            starts = self.seg_starts[lo:hi]
        lengths = None if self.seg_lengths is None else self.seg_lengths[lo:hi]
        if self.row_offsets is None:
            bounds = np.arange(hi - lo + 1, dtype=np.int64)
        else:
            first, last = np.searchsorted(self.row_offsets, (lo, hi)).tolist()
            bounds = self.row_offsets[first : last + 1] - lo
        return self.sample_ids[lo:hi], starts, lengths, bounds

    def token_count(self, lengths: np.ndarray, index: int) -> int:
        """The real (non-padding) tokens of one batch.

        Args:
            lengths: the length of every sample id.
            index: the global batch.

        Returns:
            The count.
        """
        ids, _, taken = self.segments(index)
        return int(lengths[ids].sum()) if taken is None else int(taken.sum())


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


def plan_epoch(
    lengths: np.ndarray,
    buckets: np.ndarray,
    options: PlanOptions,
    seed: int = 0,
    epoch: int = 0,
) -> EpochPlan:
    """The ordered global batches of an epoch.

    Pad mode sorts windows of a bucket longest first and keeps a window's batches together, so
    ranks get similar lengths at a step. Pack mode fills ``seq_len`` rows by ``options.packing``.

    Args:
        lengths: every sequence's length (the length index).
        buckets: every sequence's bucket.
        options: the batch options.
        seed: the seed.
        epoch: the epoch.

    Returns:
        The plan; a function of the arguments only.

    Raises:
        ConfigError: a sequence fits no batch or best_fit row, or the arrays differ in length.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = np.asarray(buckets)
    if len(lengths) != len(buckets):
        raise ConfigError(
            f"plan: {len(lengths)} lengths but {len(buckets)} bucket ids; they must match"
        )
    if len(lengths) == 0:
        return EpochPlan(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    rng = np.random.default_rng([seed, epoch]) if options.shuffle else None
    return plan_sequences(lengths, buckets, options, rng)


def plan_sequences(
    lengths: np.ndarray, buckets: np.ndarray, options: PlanOptions, rng: np.random.Generator | None
) -> EpochPlan:
    """The batches of some sequences (int64 lengths, at least one) shuffled by ``rng``."""
    planner = _PLANNERS[options.mode if options.mode == "pad" else options.packing]
    if options.growth:  # room for a read-time transform to lengthen every sequence
        lengths = lengths + options.growth
    return planner(lengths, buckets, options, rng)


def _plan_pad(
    lengths: np.ndarray, buckets: np.ndarray, options: PlanOptions, rng: np.random.Generator | None
) -> EpochPlan:
    longest = int(options.padded(int(lengths.max())))
    if longest > options.max_tokens:
        grown = f", {options.growth} of them reserved for a transform" if options.growth else ""
        raise ConfigError(
            f"max_tokens: {options.max_tokens} is smaller than the longest sequence "
            f"({int(lengths.max())} tokens{grown}, {longest} padded); raise max_tokens to at "
            f"least {longest} or rebuild the cache with --max-length "
            f"{options.max_tokens - options.growth}"
        )
    n = len(lengths)
    # 1. per bucket, a (shuffled) order; windows of window_size consecutive ids of a bucket
    order = np.arange(n, dtype=np.int64) if rng is None else rng.permutation(n)
    small = buckets.astype(np.uint8) if int(buckets.max()) < 256 else buckets
    order = order[np.argsort(small[order], kind="stable")]  # radix sort for uint8
    group_size = np.bincount(small, minlength=int(small.max()) + 1)
    group_size = group_size[group_size > 0]
    group_start = np.r_[0, np.cumsum(group_size)[:-1]]
    position = np.arange(n, dtype=np.int64) - np.repeat(group_start, group_size)
    windows_per_group = -(-group_size // options.window_size)
    window_base = np.r_[0, np.cumsum(windows_per_group)[:-1]]
    window = np.repeat(window_base, group_size) + position // options.window_size
    num_windows = int(windows_per_group.sum())
    # 3. windows shuffled
    rank = np.arange(num_windows) if rng is None else rng.permutation(num_windows)
    # 2. inside a window, longest first, ties by sample id
    sample_ids = _sort_windows(rank[window], lengths[order], order, num_windows)
    window_sizes = np.bincount(rank[window], minlength=num_windows)
    window_ends = np.cumsum(window_sizes)
    first_rows = lengths[sample_ids] if options.pad_to_multiple_of == 1 else None
    padded = first_rows if first_rows is not None else options.padded(lengths[sample_ids])
    starts = cut_batches(np.asarray(padded), window_ends, options.max_tokens)
    return EpochPlan(np.append(starts, n).astype(np.int64), sample_ids)


def _sort_windows(
    window: np.ndarray, lengths: np.ndarray, ids: np.ndarray, num_windows: int
) -> np.ndarray:
    """``ids`` by (window, length descending, id): one packed-key sort (lexsort on overflow)."""
    n = len(lengths)
    longest = int(lengths.max())
    if num_windows * (longest + 1) * n < 2**62:
        key = window * (longest + 1) + (longest - lengths)
        key *= n
        key += ids
        key.sort()
        return key % n
    return ids[np.lexsort((ids, -lengths, window))].astype(np.int64)


def _pack_order(n: int, rng: np.random.Generator | None) -> np.ndarray:
    return np.arange(n, dtype=np.int64) if rng is None else rng.permutation(n).astype(np.int64)


def _rows_to_batches(row_offsets: np.ndarray, rows_per_batch: int) -> np.ndarray:
    """Segment offsets of batches of ``rows_per_batch`` rows (the last may be short)."""
    num_rows = len(row_offsets) - 1
    return row_offsets[np.r_[np.arange(0, num_rows, rows_per_batch), num_rows]]


def _plan_best_fit(
    lengths: np.ndarray, buckets: np.ndarray, options: PlanOptions, rng: np.random.Generator | None
) -> EpochPlan:
    seq_len = int(options.seq_len or 0)
    if int(lengths.max()) > seq_len:
        grown, other = ", {} of them reserved for a transform", "use packing='concat', "
        if options.growth:
            grown, other = grown.format(options.growth), ""
        else:
            grown = ""
        raise ConfigError(
            f"seq_len: {seq_len} is smaller than the longest sequence ({int(lengths.max())} "
            f"tokens{grown}) and packing='best_fit' never splits a sequence; {other}raise "
            f"seq_len to at least {int(lengths.max())}, or rebuild the cache with --max-length "
            f"{seq_len - options.growth}"
        )
    n = len(lengths)
    order = _pack_order(n, rng)
    window = np.arange(n, dtype=np.int64) // options.window_size
    num_windows = int(window[-1]) + 1
    ids = _sort_windows(window, lengths[order], order, num_windows)  # longest first, then id
    bounds = np.minimum(np.arange(num_windows + 1, dtype=np.int64) * options.window_size, n)
    bins = best_fit_bins(lengths[ids], bounds, seq_len)
    # rows (bins) of every window shuffled, one rng.permutation per window in window order;
    # the global row number of an item orders windows, then shuffled rows, items stable
    num_bins = np.maximum.reduceat(bins, bounds[:-1]) + 1
    base = np.zeros(num_windows + 1, dtype=np.int64)
    np.cumsum(num_bins, out=base[1:])
    item_base = np.repeat(base[:-1], np.diff(bounds))
    if rng is not None:
        perms = [rng.permutation(k) for k in num_bins.tolist()]
        bins = np.concatenate(perms)[item_base + bins]
    row = item_base + bins
    sample_ids = ids[stable_order(row, int(base[-1]))]
    row_offsets = np.zeros(int(base[-1]) + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=int(base[-1])), out=row_offsets[1:])
    batch_offsets = _rows_to_batches(row_offsets, int(options.rows_per_batch or 1))
    return EpochPlan(batch_offsets.astype(np.int64), sample_ids, row_offsets)


def _plan_concat(
    lengths: np.ndarray, buckets: np.ndarray, options: PlanOptions, rng: np.random.Generator | None
) -> EpochPlan:
    seq_len = int(options.seq_len or 0)
    order = _pack_order(len(lengths), rng)
    doc_len = lengths[order]  # (int64: plan_epoch)
    doc_end = np.cumsum(doc_len)
    total = int(doc_end[-1])
    num_rows = -(-total // seq_len)
    # Segments begin at 0 and at every cut: a document's end (but the last) or a row's end
    # (r * seq_len, 0 < r < num_rows), the two merged with equal cuts once. The two runs are
    # sorted, so every cut's place in the merge is arithmetic (no sort, no searchsorted over
    # the documents).
    doc_cut = doc_end[:-1]
    row_below = np.minimum((doc_cut - 1) // seq_len, num_rows - 1)  # row cuts < a doc cut
    # per row r (its cut at r * seq_len): how many doc cuts lie at or below it, and how many
    # rows below it are doc cuts too (a cut on both runs is one cut: a document's end)
    docs_upto = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_below, minlength=num_rows)[:num_rows], out=docs_upto[1:])
    on_row = doc_cut % seq_len == 0
    shared = np.zeros(num_rows + 1, dtype=np.int64)  # shared[r]: rows 1..r-1 on a doc cut
    np.cumsum(np.bincount(doc_cut[on_row] // seq_len, minlength=num_rows)[:num_rows],
              out=shared[1:])  # fmt: skip
    # a cut's place: the cuts below it of its own run, plus those of the other run, less the
    # rows below it that are doc cuts too (counted in both)
    doc_at = np.arange(len(doc_cut), dtype=np.int64) + row_below - shared[row_below + 1]
    rows = np.arange(1, num_rows, dtype=np.int64)
    row_on_doc = shared[rows + 1] - shared[rows] > 0
    # (docs_upto[r] counts the doc cuts <= r * seq_len: one too many when one is on it)
    row_at = docs_upto[rows] - row_on_doc + rows - 1 - shared[rows]
    num_segs = len(doc_cut) + len(rows) - int(row_on_doc.sum()) + 1
    seg_begin = np.empty(num_segs, dtype=np.int64)
    doc = np.empty(num_segs, dtype=np.int64)  # the document each segment is a piece of
    seg_begin[0] = doc[0] = 0
    seg_begin[1 + doc_at] = doc_cut
    doc[1 + doc_at] = np.arange(1, len(doc_cut) + 1, dtype=np.int64)
    free = ~row_on_doc
    seg_begin[1 + row_at[free]] = rows[free] * seq_len
    doc[1 + row_at[free]] = docs_upto[rows[free]]
    seg_end = np.empty(num_segs, dtype=np.int64)
    seg_end[:-1] = seg_begin[1:]
    seg_end[-1] = total
    seg_starts = seg_begin - (doc_end - doc_len)[doc]  # one gather of documents' begins
    # row r starts with the segment beginning at r * seq_len
    row_offsets = np.empty(num_rows + 1, dtype=np.int64)
    row_offsets[0] = 0
    row_offsets[1:num_rows] = 1 + row_at
    row_offsets[num_rows] = num_segs
    batch_offsets = _rows_to_batches(row_offsets, int(options.rows_per_batch or 1))
    return EpochPlan(
        batch_offsets.astype(np.int64),
        order[doc],
        row_offsets,
        seg_starts,
        seg_end - seg_begin,
    )


_Planner = Callable[[np.ndarray, np.ndarray, PlanOptions, "np.random.Generator | None"], EpochPlan]
_PLANNERS: dict[str, _Planner] = {
    "pad": _plan_pad,
    "best_fit": _plan_best_fit,
    "concat": _plan_concat,
}


# --------------------------------------------------------------------------------------------
# Split over ranks and workers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpochSplit:
    """How global batches from ``start`` are dealt to ranks (``tail``: drop or wrap the rest)."""

    num_batches: int
    world_size: int
    start: int
    tail: str
    batches_per_rank: int

    def for_rank(self, rank: int) -> np.ndarray:
        """The int64 global batches rank ``rank`` yields, in order; ConfigError if out of range."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(
                f"rank: got {rank}, expected 0 <= rank < world_size={self.world_size}"
            )
        virtual = self.start + rank + self.world_size * np.arange(self.batches_per_rank)
        if self.tail == "wrap" and self.num_batches:
            virtual = np.where(
                virtual < self.num_batches,
                virtual,
                (virtual - self.num_batches) % self.num_batches,
            )
        return virtual.astype(np.int64)

    @property
    def end(self) -> int:
        """The global cursor once every rank has taken all its batches."""
        return self.start + self.batches_per_rank * self.world_size

    @property
    def dropped(self) -> np.ndarray:
        """Global batches no rank delivers."""
        return np.arange(min(self.end, self.num_batches), self.num_batches, dtype=np.int64)

    @property
    def repeated(self) -> np.ndarray:
        """Global batches delivered twice."""
        extra = max(self.end - max(self.num_batches, self.start), 0)
        return (np.arange(extra, dtype=np.int64) % max(self.num_batches, 1)).astype(np.int64)


def split_epoch(
    num_batches: int, world_size: int, start: int = 0, tail: str = "drop"
) -> EpochSplit:
    """Deal an epoch's global batches to ranks from cursor ``start``, each rank the same count."""
    check_int("world_size", world_size, 1)
    check_int("num_batches", num_batches, 0)
    check_int("start", start, 0)
    check_choice("tail", tail, TAILS)
    remaining = max(num_batches - start, 0)
    per_rank = remaining // world_size if tail == "drop" else -(-remaining // world_size)
    return EpochSplit(num_batches, world_size, start, tail, per_rank)


def worker_batches(rank_batches: np.ndarray, worker_id: int, num_workers: int) -> np.ndarray:
    """A DataLoader worker's share of a rank's batches: every ``num_workers``-th one, as a view."""
    if not 0 <= worker_id < num_workers:
        raise ConfigError(
            f"worker_id: got {worker_id}, expected 0 <= worker_id < num_workers={num_workers}"
        )
    return rank_batches[worker_id::num_workers]

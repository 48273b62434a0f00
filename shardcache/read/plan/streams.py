"""Canonical streams: an epoch plan each rank computes, and reads, only its part of.

Each epoch the shards are permuted (seeded by seed and epoch) and their rows, in that order,
are cut by tokens into ``C`` streams; a stream is cut into blocks of ``shuffle_block`` rows, and
each block is planned on its own by the global planner (``plan.plan_sequences``: every mode and
packing) with a seed of its own. Global batch ``j`` is batch ``j // C`` of stream ``j % C`` while
every stream has one; the longer streams' last batches follow (``StreamPlan``), so an epoch
holds every batch of every stream once. Ranks take global batches ``c + r + kW`` as with the
global plan, so when ``W`` divides ``C`` a rank reads only the shards of its ``C / W`` streams
(about ``1 / W`` of the cache per epoch) but for its share of the longer streams' last batches;
any ``W`` and ``num_workers`` read the same global sequence.

Memory is the shard table (``O(shards)``) plus the block plans in use; the only ``O(epoch)``
cost is time: the batch count of every block, which a rank may compute for its own streams and
exchange (``own_streams``). One stream of one block is exactly ``plan_epoch``'s plan.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from shardcache.read.plan.epoch_plan import EpochPlan, PlanOptions, plan_sequences

#: Mixed into the seed of the shard permutation so that it never equals a block's stream.
_LAYOUT_KEY = 0x5354524D


@dataclass(frozen=True)
class ShardIndex:
    """What the stream planner reads of a cache: rows per shard, tokens, buckets, lengths.

    Shard ``x`` holds rows ``starts[x]:starts[x + 1]``; row ``i`` is sample id ``i`` (or
    ``rows[i]`` when given: a split side's ids, ascending). ``lengths`` is indexed by sample id
    and may be a memory map: only read rows are touched. ``buckets`` holds one bucket per shard
    (a cache's shards are bucket-pure). A mixture's epoch is read through the same interface
    (``num_shards``, ``starts``, ``tokens``, ``shard_rows``, ``shard_lengths``) by
    ``passes.EpochShards``, which computes a shard's rows when asked.
    """

    starts: np.ndarray
    tokens: np.ndarray
    buckets: np.ndarray
    lengths: np.ndarray
    rows: np.ndarray | None = None

    @property
    def num_shards(self) -> int:
        """Shards in the table."""
        return len(self.starts) - 1

    def row_lengths(self, first: int, last: int) -> np.ndarray:
        """Lengths of rows ``first:last`` (int64)."""
        ids = np.arange(first, last) if self.rows is None else self.rows[first:last]
        return np.asarray(self.lengths[ids], dtype=np.int64)

    def shard_rows(
        self, shard: int, lo: int, hi: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Rows ``lo:hi`` of a shard: sample ids, lengths, buckets, repetitions (None: none)."""
        first = int(self.starts[shard])
        rows = np.arange(first + lo, first + hi, dtype=np.int64)
        ids = rows if self.rows is None else np.asarray(self.rows[rows], dtype=np.int64)
        lengths = np.asarray(self.lengths[ids], dtype=np.int64)
        buckets = np.full(len(ids), self.buckets[shard], dtype=np.int32)
        return ids, lengths, buckets, None

    def shard_lengths(self, shard: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Lengths of rows ``lo:hi`` of a shard (int64)."""
        first, last = int(self.starts[shard]), int(self.starts[shard + 1])
        return self.row_lengths(first + lo, last if hi is None else first + hi)


class StreamLayout:
    """An epoch's streams: the permuted shards, and each stream's range of permuted rows."""

    def __init__(
        self, index: ShardIndex, streams: int, block: int, seed: int, epoch: int, shuffle: bool
    ) -> None:
        self.index, self.streams, self.block = index, streams, block
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        num_shards = index.num_shards
        if shuffle:
            rng = np.random.default_rng([seed, epoch, _LAYOUT_KEY])
            self.perm = rng.permutation(num_shards).astype(np.int64)
        else:
            self.perm = np.arange(num_shards, dtype=np.int64)
        rows = np.diff(index.starts)[self.perm]
        #: rows before each permuted shard (the permuted row space), one more than shards
        self.row_cum = np.zeros(num_shards + 1, dtype=np.int64)
        np.cumsum(rows, out=self.row_cum[1:])
        token_cum = np.zeros(num_shards + 1, dtype=np.int64)
        np.cumsum(np.asarray(index.tokens, dtype=np.int64)[self.perm], out=token_cum[1:])
        total = int(token_cum[-1])
        #: each stream's first permuted row, one more than streams
        self.bounds = np.zeros(streams + 1, dtype=np.int64)
        self.bounds[-1] = self.row_cum[-1]
        for s in range(1, streams):  # the first row boundary at or after s / C of the tokens
            target = total * s // streams
            p = int(np.searchsorted(token_cum, target, side="right")) - 1
            p = min(p, num_shards - 1)
            x = int(self.perm[p])
            inside = np.cumsum(index.shard_lengths(x))
            q = int(np.searchsorted(inside, target - int(token_cum[p]), side="left")) + 1
            q = 0 if target <= int(token_cum[p]) else min(q, len(inside))
            self.bounds[s] = max(int(self.row_cum[p]) + q, int(self.bounds[s - 1]))
        sizes = np.diff(self.bounds)
        #: blocks of each stream
        self.blocks = -(-sizes // block)

    def block_rows(self, stream: int, block: int) -> tuple[int, int]:
        """The permuted rows ``[first, last)`` of one block of one stream."""
        first = int(self.bounds[stream]) + block * self.block
        return first, min(first + self.block, int(self.bounds[stream + 1]))

    def block_ids(self, stream: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The sample ids (ascending) and buckets of one block."""
        ids, buckets, _, _ = self.block_rows_of(stream, block)
        return ids, buckets

    def block_rows_of(
        self, stream: int, block: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """``block_ids``, each id's length and its repetition (None: every id used once).

        A mixture's repeated document is adjacent rows of its shard: the k-th of them is
        repetition k, wherever the block and stream boundaries fall.
        """
        first, last = self.block_rows(stream, block)
        p0 = int(np.searchsorted(self.row_cum, first, side="right")) - 1
        p1 = int(np.searchsorted(self.row_cum, last, side="left"))
        lo = np.maximum(self.row_cum[p0:p1], first) - self.row_cum[p0:p1]
        hi = np.minimum(self.row_cum[p0 + 1 : p1 + 1], last) - self.row_cum[p0:p1]
        pieces = [
            self.index.shard_rows(int(x), int(a), int(b))
            for x, a, b in zip(self.perm[p0:p1], lo, hi)
            if b > a
        ]
        if not pieces:
            empty = np.zeros(0, dtype=np.int64)
            return empty, np.zeros(0, dtype=np.int32), empty, None
        ids = np.concatenate([p[0] for p in pieces])
        order = np.argsort(ids, kind="stable")
        lengths = np.concatenate([p[1] for p in pieces])[order]
        buckets = np.concatenate([p[2] for p in pieces])[order]
        repeats = None
        if any(p[3] is not None for p in pieces):
            repeats = np.concatenate(
                [np.zeros(len(p[0]), np.int64) if p[3] is None else p[3] for p in pieces]
            )[order]
        return ids[order], buckets, lengths, repeats

    def block_tokens(self, stream: int, block: int) -> int:
        """The tokens of one block, reading lengths only of the shards it takes in part."""
        first, last = self.block_rows(stream, block)
        p0 = int(np.searchsorted(self.row_cum, first, side="right")) - 1
        p1 = int(np.searchsorted(self.row_cum, last, side="left"))
        total = 0
        for p in range(p0, p1):
            lo, hi = int(self.row_cum[p]), int(self.row_cum[p + 1])
            x = int(self.perm[p])
            if first <= lo and hi <= last:
                total += int(self.index.tokens[x])
            else:
                a, b = max(first, lo) - lo, min(last, hi) - lo
                total += int(self.index.shard_lengths(x, a, b).sum())
        return total

    def shards_of_stream(self, stream: int) -> np.ndarray:
        """The shards a stream reads (a boundary shard belongs to both of its streams)."""
        first, last = int(self.bounds[stream]), int(self.bounds[stream + 1])
        if last <= first:
            return np.zeros(0, dtype=np.int64)
        p0 = int(np.searchsorted(self.row_cum, first, side="right")) - 1
        p1 = int(np.searchsorted(self.row_cum, last, side="left"))
        return self.perm[p0:p1]


def plan_block(layout: StreamLayout, options: PlanOptions, stream: int, block: int) -> EpochPlan:
    """One block's batches, its sample ids global; one stream of one block is ``plan_epoch``."""
    ids, buckets, lengths, repeats = layout.block_rows_of(stream, block)
    if len(ids) == 0:
        return EpochPlan(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    rng = None
    if layout.shuffle:
        single = layout.streams == 1 and int(layout.blocks[0]) == 1
        key = [layout.seed, layout.epoch] if single else [layout.seed, layout.epoch, stream, block]
        rng = np.random.default_rng(key)
    plan = plan_sequences(lengths, buckets, options, rng)
    return EpochPlan(
        plan.batch_offsets, ids[plan.sample_ids], plan.row_offsets, plan.seg_starts,
        plan.seg_lengths, None if repeats is None else repeats[plan.sample_ids],
    )  # fmt: skip


def own_streams(streams: int, rank: int, world_size: int) -> list[int]:
    """The streams whose batch counts rank ``rank`` computes when ranks share the work."""
    return list(range(rank, streams, world_size))


def batch_rows(plan: EpochPlan) -> tuple[np.ndarray, np.ndarray]:
    """Each batch's first row and its rows (int64; a pad row is one unit)."""
    offsets = np.asarray(plan.batch_offsets, dtype=np.int64)
    first = offsets if plan.row_offsets is None else np.searchsorted(plan.row_offsets, offsets)
    first = np.asarray(first, dtype=np.int64)
    return first[:-1], np.diff(first)


def splittable(plan: EpochPlan) -> int:
    """Batches of a plan that ``split_batches`` may cut in two (those of two rows or more)."""
    return int((batch_rows(plan)[1] >= 2).sum())


def split_batches(plan: EpochPlan, extra: int) -> EpochPlan:
    """``plan`` with ``extra`` of its batches cut in two between rows: ``extra`` more batches.

    The batches with the most rows are cut (the later one first among equals), each at its
    middle row, the first half taking the odd row: every half is within the budget its batch
    was (fewer rows, no longer row), and the segments, their order and their repeats are the
    plan's. ``extra`` is at most ``splittable(plan)``.
    """
    if extra <= 0:
        return plan
    first, rows = batch_rows(plan)
    candidates = np.flatnonzero(rows >= 2)
    if extra > len(candidates):
        raise ValueError(f"split_batches: {extra} cuts asked of {len(candidates)} splittable")
    order = np.lexsort((-candidates, -rows[candidates]))
    chosen = candidates[order[:extra]]
    middle = first[chosen] + (rows[chosen] + 1) // 2
    cuts = middle if plan.row_offsets is None else np.asarray(plan.row_offsets)[middle]
    offsets = np.sort(np.r_[np.asarray(plan.batch_offsets, dtype=np.int64), cuts])
    return EpochPlan(
        offsets, plan.sample_ids, plan.row_offsets, plan.seg_starts, plan.seg_lengths,
        plan.repeats,
    )  # fmt: skip


def count_batches(
    layout: StreamLayout, options: PlanOptions, streams: list[int] | None = None
) -> dict[int, np.ndarray]:
    """Every block's batches and splittable batches, of some streams (all by default).

    Returns, by stream, an int64 array of shape ``(2, blocks)``: row 0 each block's batch
    count, row 1 how many of them ``split_batches`` may cut in two. One block in memory.
    """
    chosen = range(layout.streams) if streams is None else streams
    if options.mode == "pack" and options.packing == "concat":
        # concat cuts one stream of tokens into rows whatever the order: a closed form
        seq_len, rows_per_batch = int(options.seq_len or 1), int(options.rows_per_batch or 1)

        def concat_counts(tokens: int) -> tuple[int, int]:
            rows = -(-tokens // seq_len)
            batches = -(-rows // rows_per_batch)
            if rows_per_batch < 2 or not batches:
                return batches, 0
            last = rows - (batches - 1) * rows_per_batch  # (every batch before it is full)
            return batches, batches - 1 + int(last >= 2)

        def block_total(s: int, b: int) -> int:  # (each document planned ``growth`` longer)
            first, last = layout.block_rows(s, b)
            return layout.block_tokens(s, b) + options.growth * (last - first)

        def count(s: int, b: int) -> tuple[int, int]:
            return concat_counts(block_total(s, b))

    else:

        def count(s: int, b: int) -> tuple[int, int]:
            plan = plan_block(layout, options, s, b)
            return len(plan), splittable(plan)

    out = {}
    for s in chosen:
        got = [count(s, b) for b in range(int(layout.blocks[s]))]
        out[s] = np.array(got, dtype=np.int64).reshape(-1, 2).T.copy()
    return out


def stream_cuts(counts: np.ndarray, longest: int) -> np.ndarray:
    """Batches of each block a stream cuts in two to have ``longest`` batches, last block first.

    ``counts``: the stream's ``count_batches`` (row 0 batches, row 1 splittable); a stream that
    cannot cut enough cuts all it can. Only the stream's own counts and ``longest`` decide.
    """
    batches, cuttable = counts
    need = longest - int(batches.sum())
    taken = np.zeros(len(batches), dtype=np.int64)
    for b in range(len(batches) - 1, -1, -1):
        if need <= 0:
            break
        taken[b] = min(need, int(cuttable[b]))
        need -= int(taken[b])
    return taken


def cut_offsets(counts: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """The first batch of each block of a stream once ``taken`` batches are cut, then its length."""
    off = np.zeros(len(taken) + 1, dtype=np.int64)
    np.cumsum(counts[0] + taken, out=off[1:])
    return off


def seek_batch(
    layout: StreamLayout, options: PlanOptions, stream: int, k: int, longest: int
) -> tuple[EpochPlan, int]:
    """Batch ``k`` of one stream, planning that stream alone: ``StreamPlan.stream_batch``'s answer.

    ``longest``: the epoch's longest stream's batches (``StreamPlan.stream_batches.max()``),
    which with the stream's own block counts decides its cuts. Counts the stream's blocks and
    plans the one holding the batch, so locating a batch of a huge epoch costs one stream's
    planning, not the epoch's (a rewind of a step whose epoch's streams are whole rounds).
    """
    counts = count_batches(layout, options, [stream])[stream]
    taken = stream_cuts(counts, longest)
    off = cut_offsets(counts, taken)
    if not 0 <= k < int(off[-1]):
        raise IndexError(f"batch {k} of stream {stream}, which has {int(off[-1])}")
    block = int(np.searchsorted(off, k, side="right")) - 1
    plan = split_batches(plan_block(layout, options, stream, block), int(taken[block]))
    return plan, k - int(off[block])


class StreamPlan:
    """The global batches of one epoch over canonical streams, planned block by block.

    It answers what an ``EpochPlan`` answers (``len``, ``batch``, ``segments``, ``row_bounds``,
    ``packed_segments``, ``token_count``) for a global batch index, planning the block that
    holds it on first use and keeping the last ``keep`` blocks (default: two per stream).

    Streams of equal tokens differ by a few batches (padding, a window's last batch). A
    shorter stream cuts some of its batches in two between rows (``split_batches``: the same
    sequences, each half within the budget) until it is as long as the longest, so a rank
    never reads another's shards to even out and nothing is left out. Every batch of every
    stream is then in the plan once: batch ``k`` of the streams that have one, in stream order,
    then batch ``k + 1`` (``(k, stream)`` order): rounds of ``C`` (global batch ``j`` is batch
    ``j // C`` of stream ``j % C``, so a rank of ``W`` dividing ``C`` reads its own streams),
    then, where a stream had too few batches of two rows to cut, the longer streams' last
    batches, dealt to all ranks like the rest. Evening the ranks out is the global plan's
    (``split_epoch``: at most ``W - 1`` batches dropped or repeated). Memory is ``O(C)`` plus
    the block counts: the batch of an index is found over the distinct stream lengths.
    """

    def __init__(
        self,
        layout: StreamLayout,
        options: PlanOptions,
        counts: dict[int, np.ndarray] | None = None,
        keep: int | None = None,
    ) -> None:
        self.layout, self.options = layout, options
        if counts is None:
            counts = count_batches(layout, options)
        missing = sorted(set(range(layout.streams)) - set(counts))
        if missing:
            raise ValueError(f"stream plan: no batch counts for streams {missing[:8]}")
        self._counts = {s: np.asarray(c, dtype=np.int64).reshape(2, -1) for s, c in counts.items()}
        planned = np.array(
            [int(self._counts[s][0].sum()) for s in range(layout.streams)], dtype=np.int64
        )
        # every stream as long as the longest: a shorter one cuts some of its batches in two,
        # from its last block back (what it cannot cut follows the rounds, see below)
        longest = int(planned.max()) if len(planned) else 0
        self.splits: dict[int, np.ndarray] = {}
        self.block_offsets = []
        for s in range(layout.streams):
            self.splits[s] = taken = stream_cuts(self._counts[s], longest)
            self.block_offsets.append(cut_offsets(self._counts[s], taken))
        per_stream = np.array([int(o[-1]) for o in self.block_offsets], dtype=np.int64)
        self.stream_batches = per_stream
        #: batches added by cutting batches in two (over the planned ones)
        self.split_total = int(per_stream.sum() - planned.sum())
        # levels: the distinct stream lengths (and 0); between two levels the same streams
        # have a k-th batch, ``alive`` of them, and ``level_start`` is the first global index
        levels = np.unique(np.r_[0, per_stream])
        self._levels = levels
        ascending = np.sort(per_stream)
        self._alive = len(per_stream) - np.searchsorted(ascending, levels[:-1], side="right")
        self._level_start = np.zeros(len(levels), dtype=np.int64)
        np.cumsum(np.diff(levels) * self._alive, out=self._level_start[1:])
        self._total = int(per_stream.sum())
        #: global batches of whole rounds (every stream's k-th batch in turn)
        self.full = int(levels[1] if len(levels) > 1 else 0) * layout.streams
        # (default: two blocks of every stream, what reading the global order in turn needs)
        self.keep = max(int(keep), 1) if keep is not None else 2 * layout.streams + 2
        self._blocks: OrderedDict[tuple[int, int], EpochPlan] = OrderedDict()

    def __len__(self) -> int:
        return self._total

    def stream_batch(self, stream: int, k: int) -> tuple[EpochPlan, int]:
        """The block plan holding batch ``k`` of a stream, and the batch's index in it."""
        off = self.block_offsets[stream]
        block = int(np.searchsorted(off, k, side="right")) - 1
        key = (stream, block)
        plan = self._blocks.get(key)
        if plan is None:
            plan = plan_block(self.layout, self.options, stream, block)
            plan = split_batches(plan, int(self.splits[stream][block]))
            self._blocks[key] = plan
            while len(self._blocks) > self.keep:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(key)
        return plan, k - int(off[block])

    def counts(self) -> dict[int, np.ndarray]:
        """``count_batches`` of every stream (what another process may build this from)."""
        return {s: c.copy() for s, c in self._counts.items()}

    def stream_of(self, index: int) -> tuple[int, int]:
        """``(stream, batch within the stream)`` of a global batch."""
        if not 0 <= index < self._total:
            raise IndexError(f"global batch {index} of a plan of {self._total}")
        streams = self.layout.streams
        if index < self.full:
            return index % streams, index // streams
        level = int(np.searchsorted(self._level_start, index, side="right")) - 1
        alive = int(self._alive[level])
        step, nth = divmod(index - int(self._level_start[level]), alive)
        k = int(self._levels[level]) + step
        return int(np.flatnonzero(self.stream_batches > k)[nth]), k

    def locate(self, index: int) -> tuple[EpochPlan, int]:
        """The block plan holding a global batch, and the batch's index in it."""
        return self.stream_batch(*self.stream_of(index))

    def batch(self, index: int) -> np.ndarray:
        """The sample ids of one global batch."""
        plan, local = self.locate(index)
        return plan.batch(local)

    def segments(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(sample_ids, starts, lengths)`` of one global batch (as ``EpochPlan.segments``)."""
        plan, local = self.locate(index)
        return plan.segments(local)

    def row_bounds(self, index: int) -> np.ndarray:
        """Where the rows of one global batch begin (as ``EpochPlan.row_bounds``)."""
        plan, local = self.locate(index)
        return plan.row_bounds(local)

    def repeats_of(self, index: int) -> np.ndarray:
        """Each segment's repetition in one global batch (as ``EpochPlan.repeats_of``)."""
        plan, local = self.locate(index)
        return plan.repeats_of(local)

    def packed_segments(
        self, index: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """Segments and row bounds of one global batch (as ``EpochPlan.packed_segments``)."""
        plan, local = self.locate(index)
        return plan.packed_segments(local)

    def token_count(self, lengths: np.ndarray, index: int) -> int:
        """The real tokens of one global batch."""
        plan, local = self.locate(index)
        return plan.token_count(lengths, local)


def order_mixing(
    order: np.ndarray, shard_starts: np.ndarray, groups: int = 32, slices: int = 20
) -> dict[str, float]:
    """How far an epoch's order is from a global shuffle (docs/guide/scale.md, "The knob").

    Shards fall into ``groups`` runs of consecutive shards (about the input files) and the order
    into ``slices`` equal time slices. ``tv``: the total-variation distance between a slice's
    distribution over the groups and the whole epoch's, averaged over slices (0: every slice
    mixes like the epoch; near 1: each slice from its own files); ``tv_max`` the worst slice;
    ``spearman``: the rank correlation of a sequence's position with its sample id.
    """
    order = np.asarray(order, dtype=np.int64)
    n = len(order)
    shard = np.searchsorted(shard_starts, order, side="right") - 1
    group = shard * groups // (len(shard_starts) - 1)
    when = np.arange(n, dtype=np.int64) * slices // n
    joint = np.bincount(when * groups + group, minlength=slices * groups).reshape(slices, groups)
    per_slice = joint / np.maximum(joint.sum(axis=1, keepdims=True), 1)
    overall = np.bincount(group, minlength=groups) / n
    tv = 0.5 * np.abs(per_slice - overall).sum(axis=1)
    ranks = np.empty(n, dtype=np.float64)
    ranks[np.argsort(order, kind="stable")] = np.arange(n, dtype=np.float64)
    spearman = float(np.corrcoef(np.arange(n, dtype=np.float64), ranks)[0, 1])
    return {"tv": float(tv.mean()), "tv_max": float(tv.max()), "spearman": spearman}

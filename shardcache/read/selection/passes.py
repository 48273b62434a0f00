"""A mixture source's passes, shard-major: what a window takes, shard by shard, without the epoch.

A source reads an endless stream of its documents (units: sequences, or preference pairs, of
its split side when it has one): pass after pass. A pass is **shard-major**: the source's shards
in a permuted order, each shard's documents in a permuted order of their own (as Mosaic
Streaming shuffles shards, then samples within them). A window of the stream (the documents
between two token positions, each moved to the nearest document boundary) is then a run of
whole shards and at most two pieces of shards at its ends, so what an epoch takes of a source,
shard by shard, is known from ``O(shards)`` numbers and the documents of the (at most two) end
shards of each partial pass: a rank asks for the rows of the shards its streams read, one shard
at a time, and never holds an epoch's ids (``SourceEpoch``). The passes are a pure function of
the seed, the source's key and the pass number (or one fixed order for every pass).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: Mixed into a shard's own permutation seed, so that it never equals a pass's shard order.
_WITHIN_KEY = 0x53484152


def nearest_boundary(bounds: np.ndarray, position: int) -> int:
    """Index of the entry of sorted ``bounds`` nearest to ``position`` (ties: the lower)."""
    i = int(np.searchsorted(bounds, position, side="left"))
    if i == 0:
        return 0
    if i >= len(bounds):
        return len(bounds) - 1
    return i if int(bounds[i]) - position < position - int(bounds[i - 1]) else i - 1


@dataclass(frozen=True)
class SourceUnits:
    """A source's units by shard: what its passes permute.

    ``shard_starts``: the units before each shard (one more than shards), in unit positions
    ``0 .. n``; ``side``: unit position -> local id (a split side's ids, ascending; None: the
    identity); ``counted``: per local id, the tokens it counts toward the source's target;
    ``planned``: per local id, the length the planner packs or pads (may be ``counted``); both
    may be memory maps, read only at the shards asked. ``counted_tokens`` and
    ``planned_tokens``: their sums per shard.
    """

    shard_starts: np.ndarray
    counted: np.ndarray
    planned: np.ndarray
    counted_tokens: np.ndarray
    planned_tokens: np.ndarray
    side: np.ndarray | None = None

    @classmethod
    def of(
        cls,
        counted: np.ndarray,
        planned: np.ndarray | None = None,
        shard_starts: np.ndarray | None = None,
        side: np.ndarray | None = None,
        counted_tokens: np.ndarray | None = None,
    ) -> SourceUnits:
        """A source's units; per-shard sums computed unless given (``counted_tokens``).

        ``shard_starts`` are in local ids (a cache's shard starts; default: one shard of all);
        with a ``side`` they are turned into unit positions.
        """
        n_local = len(counted)
        if shard_starts is None:
            shard_starts = np.array([0, n_local], dtype=np.int64)
        starts = np.asarray(shard_starts, dtype=np.int64)
        if side is not None:
            side = np.asarray(side, dtype=np.int64)
            starts = np.searchsorted(side, starts, side="left").astype(np.int64)
            counted_tokens = None
        planned = counted if planned is None else planned

        def sums(values: np.ndarray) -> np.ndarray:
            taken = values if side is None else np.asarray(values)[side]
            cum = np.zeros(len(taken) + 1, dtype=np.int64)
            np.cumsum(taken, out=cum[1:])  # (a memory map is read once, in order)
            return cum[starts[1:]] - cum[starts[:-1]]

        if counted_tokens is None:
            counted_tokens = sums(counted)
        counted_tokens = np.asarray(counted_tokens, dtype=np.int64)
        planned_tokens = counted_tokens if planned is counted else sums(planned)
        return cls(starts, counted, planned, counted_tokens, planned_tokens, side)

    @property
    def size(self) -> int:
        """Units (documents) of the source."""
        return int(self.shard_starts[-1])

    @property
    def shard_sizes(self) -> np.ndarray:
        """Units per shard."""
        return np.diff(self.shard_starts)

    @property
    def total(self) -> int:
        """Counted tokens of all units."""
        return int(self.counted_tokens.sum())

    def local(self, positions: np.ndarray) -> np.ndarray:
        """Local ids of unit positions."""
        return positions if self.side is None else self.side[positions]


class SourcePasses:
    """A source's endless stream of units, pass after pass, each pass shard-major.

    Args:
        units: the source's units by shard.
        seed: the reader's seed.
        key: the source's key (``mixture.source_seed``).
        fixed: every pass in one order (a mixture's rotating window); else pass ``c`` in its
            own order (a schedule's passes).
    """

    def __init__(self, units: SourceUnits, seed: int, key: int, fixed: bool) -> None:
        self.units, self.seed, self.key, self.fixed = units, seed, key, fixed
        self.n = units.size
        self._orders: dict[int, tuple[np.ndarray, ...]] = {}

    def _base(self, cycle: int) -> list[int]:
        return [self.seed, self.key] if self.fixed else [self.seed, self.key, cycle]

    def order(self, cycle: int) -> tuple[np.ndarray, ...]:
        """Pass ``cycle``'s shard order and where each shard falls in it (``O(shards)``).

        ``(perm, units, tokens, before)``: the shards in order, the units and counted tokens
        before each place, and the units before each shard (indexed by shard).
        """
        cycle = 0 if self.fixed else cycle
        got = self._orders.get(cycle)
        if got is None:
            shards = len(self.units.shard_starts) - 1
            perm = np.random.default_rng(self._base(cycle)).permutation(shards).astype(np.int64)
            units = np.zeros(shards + 1, dtype=np.int64)
            np.cumsum(self.units.shard_sizes[perm], out=units[1:])
            tokens = np.zeros(shards + 1, dtype=np.int64)
            np.cumsum(self.units.counted_tokens[perm], out=tokens[1:])
            before = np.empty(shards, dtype=np.int64)
            before[perm] = units[:-1]
            got = (perm, units, tokens, before)
            if len(self._orders) >= 4:
                self._orders.pop(next(iter(self._orders)))
            self._orders[cycle] = got
        return got

    def within(self, cycle: int, shard: int) -> np.ndarray:
        """Unit positions of ``shard`` in pass ``cycle``'s order of them."""
        first, last = int(self.units.shard_starts[shard]), int(self.units.shard_starts[shard + 1])
        rng = np.random.default_rng([*self._base(cycle), shard, _WITHIN_KEY])
        return rng.permutation(last - first).astype(np.int64) + first

    def boundary(self, position: int) -> int:
        """The stream index of the document boundary nearest token ``position`` (ties: lower)."""
        total = self.units.total
        if self.n == 0 or total == 0:
            return 0
        cycle, inside = divmod(int(position), total)
        perm, units, tokens, _ = self.order(cycle)
        p = min(int(np.searchsorted(tokens, inside, side="right")) - 1, len(perm) - 1)
        shard = int(perm[p])
        inner = self.within(cycle, shard)
        bounds = np.zeros(len(inner) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self.units.counted[self.units.local(inner)]), out=bounds[1:])
        bounds += int(tokens[p])
        return cycle * self.n + int(units[p]) + nearest_boundary(bounds, inside)

    def _cycles(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """``(cycle, first, last, repeat)``: the passes ``[lo, hi)`` touches, in-pass ranges.

        Whole passes in the middle come as one entry of ``repeat`` passes from ``cycle`` on.
        """
        n = self.n
        if hi <= lo or n == 0:
            return []
        c0, c1 = lo // n, (hi - 1) // n
        if c0 == c1:
            return [(c0, lo - c0 * n, hi - c0 * n, 1)]
        out = [(c0, lo - c0 * n, n, 1)]
        if c1 - c0 > 1:
            out.append((c0 + 1, 0, n, c1 - c0 - 1))
        out.append((c1, 0, hi - c1 * n, 1))
        return out

    def _pieces(self, cycle: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """In pass ``cycle``, units ``[a, b)``: each shard's first and last unit in its order."""
        perm, units, _, _ = self.order(cycle)
        lo = np.clip(a - units[:-1], 0, np.diff(units))
        hi = np.clip(b - units[:-1], 0, np.diff(units))
        take = hi > lo
        return perm[take], lo[take], hi[take]

    def _split(self, lo: int, hi: int) -> tuple[int, list[tuple[int, ...]]]:
        """Stream ``[lo, hi)`` as whole passes and the pieces of the passes taken in part.

        ``(whole, [(cycle, shards, first, last), ...])``: ``_pieces`` of each partial pass.
        """
        whole, parts = 0, []
        for cycle, a, b, repeat in self._cycles(lo, hi):
            if a == 0 and b == self.n:
                whole += repeat
            else:
                parts.append((cycle, *self._pieces(cycle, a, b)))
        return whole, parts

    def shard_counts(self, lo: int, hi: int) -> np.ndarray:
        """Units of each shard in stream ``[lo, hi)`` (int64, one per shard)."""
        whole, parts = self._split(lo, hi)
        counts = whole * self.units.shard_sizes
        for _, shards, first, last in parts:
            np.add.at(counts, shards, last - first)
        return counts

    def shard_tokens(self, lo: int, hi: int) -> np.ndarray:
        """Planned tokens of each shard in stream ``[lo, hi)`` (int64, one per shard)."""
        whole, parts = self._split(lo, hi)
        every = self.units.planned_tokens
        tokens = whole * every
        for cycle, shards, first, last in parts:
            full = (first == 0) & (last == self.units.shard_sizes[shards])
            np.add.at(tokens, shards[full], every[shards[full]])
            for x, f, t in zip(shards[~full], first[~full], last[~full]):  # (two at most)
                inner = self.within(cycle, int(x))[int(f) : int(t)]
                planned = np.asarray(self.units.planned[self.units.local(inner)], dtype=np.int64)
                tokens[int(x)] += int(planned.sum())
        return tokens

    def shard_uses(self, shard: int, lo: int, hi: int) -> np.ndarray:
        """How often stream ``[lo, hi)`` takes each unit of ``shard`` (int64, in unit order)."""
        first, last = int(self.units.shard_starts[shard]), int(self.units.shard_starts[shard + 1])
        uses = np.zeros(last - first, dtype=np.int64)
        for cycle, a, b, repeat in self._cycles(lo, hi):
            if a == 0 and b == self.n:
                uses += repeat
                continue
            at = int(self.order(cycle)[3][shard])  # (units before the shard in this pass)
            f = min(max(a - at, 0), last - first)
            t = min(max(b - at, 0), last - first)
            if f == 0 and t == last - first:
                uses += 1
            elif t > f:
                uses[self.within(cycle, shard)[f:t] - first] += 1  # (a permutation: no repeats)
        return uses

    def positions(self, lo: int, hi: int) -> np.ndarray:
        """Unit positions of stream ``[lo, hi)`` in stream order (``O(hi - lo)``)."""
        parts = []
        for cycle, a, b, repeat in self._cycles(lo, hi):
            for c in range(cycle, cycle + repeat):  # (whole passes: each in its own order)
                shards, f, t = self._pieces(c, a, b)
                for x, i, j in zip(shards, f, t):
                    parts.append(self.within(c, int(x))[int(i) : int(j)])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class SourceEpoch:
    """What one epoch (a schedule's window) takes of a source.

    Every unit ``whole`` times, then the units ``[lo, hi)`` of the source's stream of passes.
    """

    passes: SourcePasses
    whole: int
    lo: int
    hi: int

    @property
    def units(self) -> SourceUnits:
        """The source's units."""
        return self.passes.units

    def shard_counts(self) -> np.ndarray:
        """Units taken of each shard, uses included."""
        return self.whole * self.units.shard_sizes + self.passes.shard_counts(self.lo, self.hi)

    def shard_tokens(self) -> np.ndarray:
        """Planned tokens taken of each shard, uses included."""
        return self.whole * self.units.planned_tokens + self.passes.shard_tokens(self.lo, self.hi)

    def shard_ids(self, shard: int) -> np.ndarray:
        """The local ids taken of ``shard``, sorted, a copy per use (no sort: counted)."""
        units = self.units
        first, last = int(units.shard_starts[shard]), int(units.shard_starts[shard + 1])
        uses = self.passes.shard_uses(shard, self.lo, self.hi) + self.whole
        return units.local(np.repeat(np.arange(first, last, dtype=np.int64), uses))

    def documents(self) -> np.ndarray:
        """The local ids taken: the whole uses in id order, then the stream's in its order."""
        units = self.units
        parts = []
        if self.whole:
            parts.append(units.local(np.tile(np.arange(units.size, dtype=np.int64), self.whole)))
        parts.append(units.local(self.passes.positions(self.lo, self.hi)))
        return np.concatenate(parts)


def rotating_epoch(units: SourceUnits, target: int, seed: int, key: int, epoch: int) -> SourceEpoch:
    """A weighted mixture's epoch of a source: whole uses, then its window of a fixed order.

    ``target`` tokens: ``target // total`` whole uses of every unit, then a window of
    ``target % total`` tokens of one fixed pass order read cyclically (epoch ``e`` from token
    ``e * rest``), each end at the nearest document boundary and never a unit twice.
    """
    total = units.total
    passes = SourcePasses(units, seed, key, fixed=True)
    if units.size == 0 or target <= 0 or total == 0:
        return SourceEpoch(passes, 0, 0, 0)
    whole, rest = divmod(int(target), total)
    if not rest:
        return SourceEpoch(passes, whole, 0, 0)
    first = passes.boundary(epoch * rest)
    last = min(passes.boundary((epoch + 1) * rest), first + units.size)  # never a unit twice
    return SourceEpoch(passes, whole, first, last)


def stream_window(units: SourceUnits, first: int, last: int, seed: int, key: int) -> SourceEpoch:
    """A schedule window of a source: its units between token positions ``first`` and ``last``.

    The stream is pass 0, pass 1, ... each in its own shard-major order; both positions are
    moved to the nearest document boundary.
    """
    passes = SourcePasses(units, seed, key, fixed=False)
    if units.size == 0 or last <= first or units.total == 0:
        return SourceEpoch(passes, 0, 0, 0)
    return SourceEpoch(passes, 0, passes.boundary(first), passes.boundary(last))


class EpochShards:
    """A mixture epoch by shard, as the stream planner reads it (``streams.ShardIndex``'s role).

    Shard ``x`` (every source's shards in turn) holds the units the epoch takes of it, uses
    included, as rows ``starts[x]:starts[x + 1]`` of a virtual row space, in id order (a unit
    used ``k`` times is ``k`` adjacent rows: repetitions ``0 .. k - 1``). Counts and tokens are
    ``O(shards)``; a shard's rows are computed when first asked (the last few are kept), so a
    rank touches only the shards its streams read.

    Args:
        epochs: what the epoch takes of each source.
        offsets: the mixture id space (``MixtureIndex.offsets``).
        buckets: ``buckets(source, shard, local_ids)``: those units' buckets (int32).
        keep: shards kept computed.
    """

    def __init__(
        self,
        epochs: list[SourceEpoch],
        offsets: np.ndarray,
        buckets: Callable[[int, int, np.ndarray], np.ndarray],
        keep: int = 8,
    ) -> None:
        self.epochs, self.offsets, self._buckets, self._keep = epochs, offsets, buckets, keep
        counts = [e.shard_counts() for e in epochs]
        sizes = np.array([len(c) for c in counts], dtype=np.int64)
        #: each source's first shard (one more than sources)
        self.source_shards = np.zeros(len(epochs) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.source_shards[1:])
        every = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
        self.starts = np.zeros(len(every) + 1, dtype=np.int64)
        np.cumsum(every, out=self.starts[1:])
        tokens = [e.shard_tokens() for e in epochs]
        self.tokens = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
        self._rows: OrderedDict[int, tuple[np.ndarray, ...]] = OrderedDict()

    @property
    def num_shards(self) -> int:
        """Shards of every source."""
        return len(self.starts) - 1

    def _shard(self, shard: int) -> tuple[np.ndarray, ...]:
        """Shard ``shard``'s ``(ids, lengths, buckets, repeats)`` (repeats: empty if none)."""
        got = self._rows.get(shard)
        if got is not None:
            self._rows.move_to_end(shard)
            return got
        s = int(np.searchsorted(self.source_shards, shard, side="right")) - 1
        g = shard - int(self.source_shards[s])
        epoch = self.epochs[s]
        local = epoch.shard_ids(g)
        lengths = np.asarray(epoch.units.planned[local], dtype=np.int64)
        buckets = np.asarray(self._buckets(s, g, local), dtype=np.int32)
        repeats = np.zeros(0, dtype=np.int64)
        if len(local) > 1:
            again = np.r_[False, local[1:] == local[:-1]]
            if again.any():  # the k-th copy of a unit (adjacent: sorted) is repetition k
                at = np.arange(len(local), dtype=np.int64)
                repeats = at - np.maximum.accumulate(np.where(again, 0, at))
        got = (local + int(self.offsets[s]), lengths, buckets, repeats)
        self._rows[shard] = got
        while len(self._rows) > self._keep:
            self._rows.popitem(last=False)
        return got

    def shard_rows(
        self, shard: int, lo: int, hi: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Rows ``lo:hi`` of a shard: mixture ids, lengths, buckets, repetitions (None: none)."""
        ids, lengths, buckets, repeats = self._shard(shard)
        return ids[lo:hi], lengths[lo:hi], buckets[lo:hi], repeats[lo:hi] if len(repeats) else None

    def shard_lengths(self, shard: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Planned lengths of rows ``lo:hi`` of a shard (int64)."""
        return self._shard(shard)[1][lo:hi]

"""The epoch plan: pure numpy over the length index, no I/O.

Given every sequence's length and bucket, a seed, an epoch and the batch options, the plan is
the ordered list of *global* batches of that epoch, each a list of sample ids:

1. within each bucket, sample ids are shuffled (seeded by ``(seed, epoch)``) and cut into
   windows of ``window_size`` sequences;
2. inside a window, sequences are sorted by length, longest first, and cut greedily into
   batches whose padded size ``rows x padded_length`` stays within ``max_tokens``;
3. the windows are shuffled; a window's batches stay consecutive, so batches handed out at the
   same step (to different ranks) have similar lengths.

The plan depends only on (lengths, buckets, seed, epoch, options), never on the number of
ranks or workers; splitting it among them is the reader's job. It is stored as two arrays
(CSR: ``batch_offsets`` into ``sample_ids``), so a plan of 10 million sequences costs
~100 MB of int64 and no Python object per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardcache.errors import ConfigError

DEFAULT_WINDOW_SIZE = 4096


@dataclass(frozen=True)
class PlanOptions:
    """How an epoch is cut into batches."""

    max_tokens: int
    shuffle: bool = True
    pad_to_multiple_of: int = 1
    window_size: int = DEFAULT_WINDOW_SIZE

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens: got {self.max_tokens!r}, expected an integer >= 1")
        if not isinstance(self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 1:
            raise ConfigError(
                f"pad_to_multiple_of: got {self.pad_to_multiple_of!r}, expected an integer >= 1"
            )
        if not isinstance(self.window_size, int) or self.window_size < 1:
            raise ConfigError(f"window_size: got {self.window_size!r}, expected an integer >= 1")

    def padded(self, length: np.ndarray | int) -> np.ndarray | int:
        m = self.pad_to_multiple_of
        return -(-length // m) * m


@dataclass(frozen=True)
class EpochPlan:
    """Global batches of one epoch: batch ``i`` is ``sample_ids[batch_offsets[i]:...[i+1]]``."""

    batch_offsets: np.ndarray  # int64, len = num_batches + 1
    sample_ids: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.batch_offsets) - 1

    def batch(self, index: int) -> np.ndarray:
        return self.sample_ids[self.batch_offsets[index] : self.batch_offsets[index + 1]]


def _windows(
    buckets: np.ndarray, options: PlanOptions, rng: np.random.Generator | None
) -> list[np.ndarray]:
    windows: list[np.ndarray] = []
    order = np.argsort(buckets, kind="stable")
    bounds = np.flatnonzero(np.diff(buckets[order])) + 1
    for ids in np.split(order, bounds):
        if not len(ids):
            continue
        if rng is not None:
            ids = rng.permutation(ids)
        windows += [
            ids[i : i + options.window_size] for i in range(0, len(ids), options.window_size)
        ]
    return windows


def plan_epoch(
    lengths: np.ndarray,
    buckets: np.ndarray,
    options: PlanOptions,
    seed: int = 0,
    epoch: int = 0,
) -> EpochPlan:
    """The ordered global batches of ``epoch`` (see the module docstring)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = np.asarray(buckets)
    if len(lengths) != len(buckets):
        raise ConfigError(
            f"plan: {len(lengths)} lengths but {len(buckets)} bucket ids; they must match"
        )
    if len(lengths) == 0:
        return EpochPlan(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    longest = int(options.padded(int(lengths.max())))
    if longest > options.max_tokens:
        raise ConfigError(
            f"max_tokens: {options.max_tokens} is smaller than the longest sequence "
            f"({int(lengths.max())} tokens, {longest} padded); raise max_tokens to at least "
            f"{longest} or rebuild the cache with --max-length {options.max_tokens}"
        )
    rng = np.random.default_rng([seed, epoch]) if options.shuffle else None
    windows = _windows(buckets, options, rng)
    if rng is not None:
        windows = [windows[i] for i in rng.permutation(len(windows))]
    ordered = []
    for ids in windows:
        # longest first, ties by sample id: deterministic and independent of the sort kind
        ordered.append(ids[np.lexsort((ids, -lengths[ids]))])
    sample_ids = np.concatenate(ordered)
    window_ends = np.cumsum([len(w) for w in ordered])
    padded = np.asarray(options.padded(lengths[sample_ids]), dtype=np.int64)
    starts = _cut_batches(padded, window_ends, options.max_tokens)
    batch_offsets = np.append(starts, len(sample_ids)).astype(np.int64)
    return EpochPlan(batch_offsets, sample_ids)


def _cut_batches(padded: np.ndarray, window_ends: np.ndarray, max_tokens: int) -> np.ndarray:
    """Batch start positions: within each window (sorted longest first), the first row of a
    batch sets its padded length L and the batch takes ``max_tokens // L`` rows."""
    rows = max_tokens // padded  # rows a batch may hold if it starts at this position
    starts: list[int] = []
    begin = 0
    for end in window_ends.tolist():
        i = begin
        while i < end:
            starts.append(i)
            i += int(rows[i])
        begin = end
    return np.asarray(starts, dtype=np.int64)

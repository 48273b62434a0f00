"""What a packing policy is given and returns, and the steps policies share.

A policy reads its options through ``PolicyOptions`` (``PlanOptions`` has every member), so
``PlanOptions``, which checks ``mode`` and ``packing`` against the registry, and the policies
the registry holds never import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from shardcache.read.plan.plan_arrays import EpochPlan


class PolicyOptions(Protocol):
    """The ``PlanOptions`` members a packing policy reads."""

    @property
    def max_tokens(self) -> int:
        """Bound on ``rows x padded length`` of every batch."""
        ...

    @property
    def window_size(self) -> int:
        """Sequences sorted or packed together."""
        ...

    @property
    def seq_len(self) -> int | None:
        """The row length (pack mode)."""
        ...

    @property
    def pad_to_multiple_of(self) -> int:
        """A pad batch's length is a multiple of this."""
        ...

    @property
    def growth(self) -> int:
        """Tokens already added to every length for a read-time transform."""
        ...

    @property
    def rows_per_batch(self) -> int | None:
        """Rows of a full packed batch (None in pad mode)."""
        ...

    def padded(self, length: np.ndarray | int) -> np.ndarray | int:
        """A length rounded up to a multiple of ``pad_to_multiple_of``."""
        ...


#: A policy: ``(lengths, buckets, options, rng) -> EpochPlan`` over int64 lengths (at least one,
#: growth already added), shuffled by ``rng`` (None: no shuffle); a function of its arguments.
Planner = Callable[[np.ndarray, np.ndarray, PolicyOptions, "np.random.Generator | None"], EpochPlan]


def sort_windows(
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


def pack_order(n: int, rng: np.random.Generator | None) -> np.ndarray:
    """The order a pack policy takes ``n`` sequences in: shuffled by ``rng``, else as given."""
    return np.arange(n, dtype=np.int64) if rng is None else rng.permutation(n).astype(np.int64)


def rows_to_batches(row_offsets: np.ndarray, rows_per_batch: int) -> np.ndarray:
    """Segment offsets of batches of ``rows_per_batch`` rows (the last may be short)."""
    num_rows = len(row_offsets) - 1
    return row_offsets[np.r_[np.arange(0, num_rows, rows_per_batch), num_rows]]

"""Length buckets (pure numpy).

A bucket edge list ``(e0, e1, ..., ek)`` defines ``k + 2`` buckets: bucket 0 holds lengths
``1..e0``, bucket ``i`` holds ``e(i-1)+1 .. e(i)``, and the last bucket holds everything above
``ek``. When the build caps sequences at ``max_length``, edges at or above it are dropped and
``max_length`` becomes the last edge, so no bucket is empty by construction.
"""

from __future__ import annotations

import numpy as np


def effective_edges(edges: tuple[int, ...], max_length: int | None) -> tuple[int, ...]:
    """The bucket edges a build uses.

    Args:
        edges: the edges asked for, increasing.
        max_length: the longest sequence (None: no limit).

    Returns:
        The edges below ``max_length``, then ``max_length`` itself; ``edges`` without one.
    """
    if max_length is None:
        return tuple(edges)
    kept = tuple(e for e in edges if e < max_length)
    return (*kept, max_length)


def bucket_ranges(edges: tuple[int, ...], max_length: int | None) -> list[tuple[int, int | None]]:
    """The length range of every bucket.

    Args:
        edges: the edges used (:func:`effective_edges`).
        max_length: the longest sequence (None: a last, open-ended bucket).

    Returns:
        Inclusive ``(min_length, max_length)`` per bucket; None: unbounded.
    """
    ranges: list[tuple[int, int | None]] = []
    low = 1
    for edge in edges:
        ranges.append((low, edge))
        low = edge + 1
    if max_length is None:
        ranges.append((low, None))
    return ranges


def assign_buckets(lengths: np.ndarray, edges: tuple[int, ...]) -> np.ndarray:
    """The bucket of every length: the first whose upper edge is >= the length.

    Args:
        lengths: sequence lengths.
        edges: the edges used.

    Returns:
        int32 bucket indices.
    """
    return np.searchsorted(np.asarray(edges, dtype=np.int64), lengths, side="left").astype(np.int32)

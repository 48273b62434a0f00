"""Length buckets (pure numpy).

Edges ``(e0, ..., ek)`` define ``k + 2`` buckets: ``1..e0``, then ``e(i-1)+1 .. e(i)``, then
everything above ``ek``. With a ``max_length`` cap, edges at or above it are dropped and
``max_length`` becomes the last edge, so no bucket is empty by construction.
"""

from __future__ import annotations

import numpy as np


def effective_edges(edges: tuple[int, ...], max_length: int | None) -> tuple[int, ...]:
    """The edges a build uses: those below ``max_length``, then ``max_length`` if set."""
    if max_length is None:
        return tuple(edges)
    kept = tuple(e for e in edges if e < max_length)
    return (*kept, max_length)


def bucket_ranges(edges: tuple[int, ...], max_length: int | None) -> list[tuple[int, int | None]]:
    """Inclusive ``(min, max)`` lengths of every bucket; max None for an open last one."""
    ranges: list[tuple[int, int | None]] = []
    low = 1
    for edge in edges:
        ranges.append((low, edge))
        low = edge + 1
    if max_length is None:
        ranges.append((low, None))
    return ranges


def assign_buckets(lengths: np.ndarray, edges: tuple[int, ...]) -> np.ndarray:
    """The int32 bucket of every length: the first whose upper edge is >= the length."""
    return np.searchsorted(np.asarray(edges, dtype=np.int64), lengths, side="left").astype(np.int32)

"""Best-fit-decreasing packing of an epoch's windows and other per-item planning loops.

Each numba kernel gives exactly its Python reference's result (ties too): plans never depend
on numba being installed.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from shardcache.config import check_choice

BEST_FIT_METHODS = ("auto", "jit", "loop")
#: Below this many sequences "auto" uses the loop: the kernel's first compilation costs more.
JIT_MIN_SEQUENCES = 100_000


def best_fit_bins(
    sizes: np.ndarray, bounds: np.ndarray, capacity: int, method: str = "auto"
) -> np.ndarray:
    """Every item's best-fit-decreasing row, numbered from 0 in each window.

    An item (windows sorted decreasing) goes to the open row with the least free space that fits
    it, among equals the row that reached that space last; else to a new row.
    """
    check_choice("method", method, BEST_FIT_METHODS)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    bounds = np.ascontiguousarray(bounds, dtype=np.int64)
    bins = np.empty(len(sizes), dtype=np.int64)
    kernel = None
    if method == "jit" or (method == "auto" and len(sizes) >= JIT_MIN_SEQUENCES):
        kernel = _kernel(required=method == "jit")
    if kernel is not None:
        kernel(sizes, bounds, int(capacity), bins)
        return bins
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        bins[lo:hi] = _best_fit_decreasing(sizes[lo:hi], capacity)
    return bins


def _best_fit_decreasing(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """The Python reference of ``best_fit_bins`` for one window."""
    bins = np.empty(len(sizes), dtype=np.int64)
    big = int(np.searchsorted(-sizes, -(capacity // 2), side="left"))  # sizes > capacity // 2
    bins[:big] = np.arange(big)
    spaces = (capacity - sizes[:big]).tolist()
    free: list[int] = sorted(s for s in spaces if s > 0)
    # free space -> bins with that much free space (LIFO); full bins are not tracked
    holders: dict[int, list[int]] = {}
    for b, space in enumerate(spaces):
        holders.setdefault(space, []).append(b)
    next_bin = big
    for i, size in enumerate(sizes[big:].tolist(), start=big):
        j = bisect.bisect_left(free, size)
        if j < len(free):
            space = free.pop(j)
            b = holders[space].pop()
        else:
            space, b = capacity, next_bin
            next_bin += 1
        bins[i] = b
        left = space - size
        if left > 0:
            bisect.insort(free, left)
            holders.setdefault(left, []).append(b)
    return bins


def stable_order(keys: np.ndarray, num_keys: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for int64 keys in ``[0, num_keys)``."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    compiled = _compiled_counting() if len(keys) >= JIT_MIN_SEQUENCES else None
    if compiled is None:
        return np.argsort(keys, kind="stable")
    out = np.empty(len(keys), dtype=np.int64)
    compiled(keys, int(num_keys), out)
    return out


def _counting_kernel(keys: np.ndarray, num_keys: int, out: np.ndarray) -> None:  # pragma: no cover
    """Stable counting sort of ``keys`` into ``out`` (numba compiles it)."""
    start = np.zeros(num_keys + 1, dtype=np.int64)
    for k in keys:
        start[k + 1] += 1
    for k in range(num_keys):
        start[k + 1] += start[k]
    for i in range(len(keys)):
        k = keys[i]
        out[start[k]] = i
        start[k] += 1


def cut_batches(padded: np.ndarray, window_ends: np.ndarray, max_tokens: int) -> np.ndarray:
    """The first row of every pad-mode batch.

    A batch takes ``max_tokens // L`` rows (``L``: its first row's padded length) within a window.
    """
    padded = np.ascontiguousarray(padded, dtype=np.int64)
    ends = np.ascontiguousarray(window_ends, dtype=np.int64)
    compiled = _jit(_cut_kernel) if len(padded) >= JIT_MIN_SEQUENCES else None
    if compiled is None:
        return _cut_loop(padded, ends, max_tokens)
    out = np.empty(len(padded), dtype=np.int64)
    count = compiled(padded, ends, int(max_tokens), out)
    return out[:count].copy()


def _cut_loop(padded: np.ndarray, window_ends: np.ndarray, max_tokens: int) -> np.ndarray:
    starts: list[int] = []
    begin = 0
    for end in window_ends.tolist():
        i = begin
        while i < end:
            starts.append(i)
            i = min(i + max_tokens // int(padded[i]), end)
        begin = end
    return np.asarray(starts, dtype=np.int64)


def _cut_kernel(
    padded: np.ndarray, window_ends: np.ndarray, max_tokens: int, out: np.ndarray
) -> int:  # pragma: no cover - compiled by numba (its result is compared with the loop)
    count = 0
    begin = 0
    for end in window_ends:
        i = begin
        while i < end:
            out[count] = i
            count += 1
            i = min(i + max_tokens // padded[i], end)
        begin = end
    return count


# 64-bit de Bruijn sequence: index of the lowest set bit with one multiply and a table
_DEBRUIJN = 0x03F79D71B4CB0A89
_DEBRUIJN_TABLE = np.zeros(64, dtype=np.int64)
for _i in range(64):
    _DEBRUIJN_TABLE[((_DEBRUIJN << _i) & 0xFFFFFFFFFFFFFFFF) >> 58] = _i


def _windows_kernel(
    sizes: np.ndarray, bounds: np.ndarray, capacity: int, bins: np.ndarray, table: np.ndarray
) -> None:  # pragma: no cover - compiled by numba (its result is compared with the loop)
    """Best-fit-decreasing of every window (numba compiles it); the same rows as the loop.

    Free space ``v`` is bit ``v - 1`` of ``words`` (``summary``: a bit per non-empty word); ``top``
    and ``below`` chain the rows of each free space, last reached first: the loop's LIFO lists.
    """
    one = np.uint64(1)
    full = np.uint64(0xFFFFFFFFFFFFFFFF)
    magic = np.uint64(_DEBRUIJN)
    shift58 = np.uint64(58)
    n_words = (capacity + 63) // 64
    n_summary = (n_words + 63) // 64
    words = np.zeros(n_words, dtype=np.uint64)
    summary = np.zeros(n_summary, dtype=np.uint64)
    top = np.empty(capacity, dtype=np.int64)
    longest = 0
    for w in range(len(bounds) - 1):
        longest = max(longest, bounds[w + 1] - bounds[w])
    below = np.empty(max(longest, 1), dtype=np.int64)
    for w in range(len(bounds) - 1):
        words[:] = 0
        summary[:] = 0
        top[:] = -1
        next_bin = 0
        for i in range(bounds[w], bounds[w + 1]):
            size = sizes[i]
            # the smallest free space >= size: the next set bit at or after size - 1
            found = -1
            p = size - 1
            j = p >> 6
            if j < n_words:
                m = words[j] & (full << np.uint64(p & 63))
                if m != 0:
                    low = m & (~m + one)
                    found = (j << 6) + table[(low * magic) >> shift58]
                else:
                    k = j + 1
                    s = k >> 6
                    if s < n_summary:
                        m = summary[s] & (full << np.uint64(k & 63))
                        while True:
                            if m != 0:
                                low = m & (~m + one)
                                jj = (s << 6) + table[(low * magic) >> shift58]
                                mw = words[jj]
                                low = mw & (~mw + one)
                                found = (jj << 6) + table[(low * magic) >> shift58]
                                break
                            s += 1
                            if s >= n_summary:
                                break
                            m = summary[s]
            if found >= 0:
                b = top[found]
                top[found] = below[b]
                if top[found] < 0:  # no row left with this free space: clear its bit
                    jw = found >> 6
                    words[jw] &= ~(one << np.uint64(found & 63))
                    if words[jw] == 0:
                        summary[jw >> 6] &= ~(one << np.uint64(jw & 63))
                space = found + 1
            else:
                b = next_bin
                next_bin += 1
                space = capacity
            bins[i] = b
            left = space - size
            if left > 0:
                q = left - 1
                below[b] = top[q]
                top[q] = b
                jw = q >> 6
                words[jw] |= one << np.uint64(q & 63)
                summary[jw >> 6] |= one << np.uint64(jw & 63)


@functools.cache
def _jit(function: Callable[..., Any]) -> Callable[..., Any] | None:
    try:
        import numba
    except ImportError:
        return None
    return numba.njit(cache=True, nogil=True)(function)


def _compiled() -> Callable[..., Any] | None:
    return _jit(_windows_kernel)


def _compiled_counting() -> Callable[..., Any] | None:
    return _jit(_counting_kernel)


def _kernel(required: bool) -> Callable[[np.ndarray, np.ndarray, int, np.ndarray], None] | None:
    compiled = _compiled()
    if compiled is None:
        if required:
            raise ImportError(
                "best_fit_bins(method='jit') needs numba: pip install 'shardcache[fast]'"
            )
        return None
    return lambda sizes, bounds, capacity, bins: compiled(
        sizes, bounds, capacity, bins, _DEBRUIJN_TABLE
    )

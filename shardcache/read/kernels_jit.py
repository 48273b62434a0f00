"""The numba kernels behind :mod:`shardcache.read.kernels` (imported only when numba is
installed: ``pip install 'shardcache[fast]'``).

:func:`pack` and :func:`pad` write one batch from memory-mapped shards: see
:mod:`shardcache.read.kernels` for what they produce, how they are checked and why they read
shards through raw addresses. Compiled once per machine (``cache=True``: ~1-2 s the first
time, then loaded from numba's cache). Results below zero are error codes.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from shardcache.read.collate import IGNORE_INDEX

BAD_SEGMENT = -1  # a segment outside its sequence
BAD_SOURCE = -2  # a shard not open, or a read past its end
BAD_ROW = -3  # a row holding more values than its width

_jit = numba.njit(nogil=True, cache=True)
#: helpers are inlined into the kernels: one cached object per kernel to load (a cached
#: function with compiled callees took ~0.15 s to load in a fresh process)
_inline = numba.njit(inline="always")


def _pointer_intrinsic(item: Any) -> Any:
    @intrinsic
    def as_pointer(typingctx: Any, address: Any) -> Any:  # pragma: no cover - compiled
        pointer = types.CPointer(item)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(pointer))

        return pointer(types.int64), codegen

    return as_pointer


as_uint16_pointer = _pointer_intrinsic(types.uint16)
as_uint32_pointer = _pointer_intrinsic(types.uint32)


# The copies below run one simple loop per output over views: LLVM vectorises those (5.7 us
# for 32k tokens into int32 ids, int64 labels and int32 positions), not one loop writing all
# three through offset indices (53 us, measured).


@_inline
def _copy_segment(
    values: np.ndarray,
    src: int,
    take: int,
    dst: int,
    ids_out: np.ndarray,
    labels_out: np.ndarray,
    positions_out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    if take <= 0:
        return
    source = values[src : src + take]
    ids = ids_out[dst : dst + take]
    labels = labels_out[dst : dst + take]
    positions = positions_out[dst : dst + take]
    for j in range(take):
        ids[j] = source[j]
    for j in range(take):
        labels[j] = source[j]
    for j in range(take):
        positions[j] = j
    labels[0] = IGNORE_INDEX  # a segment's first token is never a target


@_inline
def _fill_padding(
    start: int, count: int, pad_id: int, ids_out: np.ndarray, labels_out: np.ndarray
) -> None:  # pragma: no cover - compiled
    ids = ids_out[start : start + count]
    labels = labels_out[start : start + count]
    for j in range(count):
        ids[j] = pad_id
    for j in range(count):
        labels[j] = IGNORE_INDEX


@_inline
def _copy_row(
    values: np.ndarray,
    src: int,
    take: int,
    row: int,
    width: int,
    pad_id: int,
    ids_out: np.ndarray,
    mask_out: np.ndarray,
    labels_out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    source = values[src : src + take]
    ids = ids_out[row : row + take]
    labels = labels_out[row : row + take]
    mask = mask_out[row : row + width]
    for j in range(take):
        ids[j] = source[j]
    for j in range(take):
        labels[j] = source[j]
    for j in range(take):
        mask[j] = 1
    for j in range(take, width):
        mask[j] = 0
    _fill_padding(row + take, width - take, pad_id, ids_out, labels_out)


@_jit
def pack(
    wide: bool,
    addresses: np.ndarray,
    sizes: np.ndarray,
    file_starts: np.ndarray,
    lengths: np.ndarray,
    shard: np.ndarray,
    sample_ids: np.ndarray,
    starts: np.ndarray,
    taken: np.ndarray,
    has_taken: bool,
    bounds: np.ndarray,
    seq_len: int,
    pad_id: int,
    ids_out: np.ndarray,
    labels_out: np.ndarray,
    positions_out: np.ndarray,
    cu_out: np.ndarray,
    sample_out: np.ndarray,
    offset_out: np.ndarray,
) -> tuple[int, int]:  # pragma: no cover - compiled
    """Rows of ``seq_len`` slots from segments (``wide``: uint32 shards, else uint16);
    returns (segments including padding runs, the longest segment) or (error code, 0)."""
    num_rows = len(bounds) - 1
    dst = 0
    out = 0
    longest = 0
    cu_out[0] = 0
    for r in range(num_rows):
        row_end = dst + seq_len
        for k in range(bounds[r], bounds[r + 1]):
            sample = sample_ids[k]
            first = starts[k]
            full = np.int64(lengths[sample])
            take = taken[k] if has_taken else full - first
            if first < 0 or take < 0 or first + take > full:
                return BAD_SEGMENT, 0
            if dst + take > row_end:
                return BAD_ROW, 0
            s = shard[k]
            address = addresses[s]
            size = sizes[s]
            src = np.int64(file_starts[sample]) + first
            if address == 0 or src + take > size:
                return BAD_SOURCE, 0
            if wide:
                values32 = numba.carray(as_uint32_pointer(address), size)
                _copy_segment(values32, src, take, dst, ids_out, labels_out, positions_out)
            else:
                values16 = numba.carray(as_uint16_pointer(address), size)
                _copy_segment(values16, src, take, dst, ids_out, labels_out, positions_out)
            dst += take
            sample_out[out] = sample
            offset_out[out] = first
            cu_out[out + 1] = dst
            longest = max(longest, take)
            out += 1
        pad = row_end - dst
        if pad > 0:  # the row's padding run: a segment of its own
            _fill_padding(dst, pad, pad_id, ids_out, labels_out)
            positions = positions_out[dst:row_end]
            for j in range(pad):
                positions[j] = j
            dst = row_end
            sample_out[out] = -1
            offset_out[out] = -1
            cu_out[out + 1] = dst
            longest = max(longest, pad)
            out += 1
    return out, longest


@_jit
def pad(
    wide: bool,
    addresses: np.ndarray,
    sizes: np.ndarray,
    file_starts: np.ndarray,
    lengths: np.ndarray,
    shard: np.ndarray,
    sample_ids: np.ndarray,
    width: int,
    pad_id: int,
    ids_out: np.ndarray,
    mask_out: np.ndarray,
    labels_out: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """One whole sequence per row of ``width`` slots, then padding (``wide``: uint32 shards);
    returns 0 or an error code."""
    for r in range(len(sample_ids)):
        sample = sample_ids[r]
        take = np.int64(lengths[sample])
        if take > width:
            return BAD_ROW
        s = shard[r]
        address = addresses[s]
        size = sizes[s]
        src = np.int64(file_starts[sample])
        if address == 0 or src + take > size:
            return BAD_SOURCE
        row = r * width
        if wide:
            values32 = numba.carray(as_uint32_pointer(address), size)
            _copy_row(values32, src, take, row, width, pad_id, ids_out, mask_out, labels_out)
        else:
            values16 = numba.carray(as_uint16_pointer(address), size)
            _copy_row(values16, src, take, row, width, pad_id, ids_out, mask_out, labels_out)
    return 0

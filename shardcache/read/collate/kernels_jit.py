"""The numba kernels behind ``shardcache.read.collate.kernels`` (imported only with numba).

``pack`` and ``pad`` (``cache=True``: compiled once per machine) return 0, ``NEED_SHARD`` (open
the shard in ``info[3]`` and call again) or an error code below zero. For a mixture, source
``s`` holds ids ``source_offsets[s] : source_offsets[s + 1]``.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from shardcache.read.collate.layout import IGNORE_INDEX
from shardcache.store.cache import NO_MASK

BAD_SEGMENT = -1  # a segment outside its sequence
BAD_SOURCE = -2  # a shard not open, or a read past its end
BAD_ROW = -3  # a row holding more values than its width
BAD_ID = -4  # a token id above the tokenizer's largest (a damaged or foreign shard)
NEED_SHARD = 1  # a shard to open first (its index in info[3]); then call again

# the GIL stays held: a kernel reads shards by address, and no other thread may close one
_jit = numba.njit(cache=True)
#: helpers are inlined into the kernels: one cached object per kernel to load (cached
#: functions with compiled callees load slowly in a fresh process)
_inline = numba.njit(inline="always")


def _pointer_intrinsic(item: Any) -> Any:
    @intrinsic
    def as_pointer(typingctx: Any, address: Any) -> Any:  # pragma: no cover - compiled
        pointer = types.CPointer(item)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(pointer))

        return pointer(types.int64), codegen

    return as_pointer


as_uint8_pointer = _pointer_intrinsic(types.uint8)
as_uint16_pointer = _pointer_intrinsic(types.uint16)
as_uint32_pointer = _pointer_intrinsic(types.uint32)


@intrinsic
def _prefetch(typingctx: Any, address: Any) -> Any:  # pragma: no cover - compiled
    """``llvm.prefetch`` of the cache line at ``address``: a hint that never faults."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        kind = ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32])
        function = builder.module.declare_intrinsic("llvm.prefetch", [byte_pointer], kind)
        read, keep, data = (ir.Constant(i32, v) for v in (0, 3, 1))
        builder.call(function, [builder.inttoptr(args[0], byte_pointer), read, keep, data])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


# Prefetching: a batch's rows or segments lie anywhere in the mapped shards, and a copy loop
# that waits for each one's first cache lines is latency-bound: the next rows' first lines
# are prefetched while this one is copied.
#: how many rows / segments ahead of the copy their first bytes are prefetched
PREFETCH_AHEAD = 8
#: how many 64-byte lines of each (4 KiB; the hardware prefetcher follows a longer run)
PREFETCH_LINES = 64


@_inline
def _prefetch_source(address: int, nbytes: int) -> None:  # pragma: no cover - compiled
    for line in range(min(PREFETCH_LINES, (nbytes + 63) // 64)):
        _prefetch(address + 64 * line)


# The copies below run one simple loop per output over views: LLVM vectorises those, not one
# loop writing all three outputs through offset indices.


@_inline
def _copy_segment(
    values: np.ndarray,
    take: int,
    dst: int,
    ids_out: np.ndarray,
    labels_out: np.ndarray,
    positions_out: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """Copy one segment (``values``: its tokens); returns its largest id (0 when empty)."""
    if take <= 0:
        return 0
    ids = ids_out[dst : dst + take]
    labels = labels_out[dst : dst + take]
    positions = positions_out[dst : dst + take]
    top = 0
    for j in range(take):
        value = values[j]
        ids[j] = value
        top = max(top, value)
    for j in range(take):
        labels[j] = values[j]
    for j in range(take):
        positions[j] = j
    labels[0] = IGNORE_INDEX  # a segment's first token is never a target
    return top


@_inline
def _mask_labels(
    address: int, bit: int, take: int, labels: np.ndarray
) -> None:  # pragma: no cover - compiled
    """-100 on the labels whose mask bit is 0 (from bit ``bit`` at ``address``, LSB first)."""
    bits = numba.carray(as_uint8_pointer(address + (bit >> 3)), ((bit & 7) + take + 7) >> 3)
    first = bit & 7
    for j in range(take):
        at = first + j
        if not (bits[at >> 3] >> (at & 7)) & 1:
            labels[j] = IGNORE_INDEX


@_inline
def _mask_bit(start: int, first: int, take: int, nbytes: int) -> int:  # pragma: no cover
    """First loss-mask bit of a segment (``NO_MASK`` as is), or -2 when outside the shard."""
    if start == NO_MASK:
        return NO_MASK
    bit = start + first
    if start < 0 or (bit + take + 7) >> 3 > nbytes:
        return -2
    return bit


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
    take: int,
    row: int,
    width: int,
    pad_id: int,
    ids_out: np.ndarray,
    mask_out: np.ndarray,
    labels_out: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """Copy one sequence into its padded row of ids, mask and labels; returns its largest id.

    One simple loop per output and part; the labels are written while the row is in cache.
    """
    ids = ids_out[row : row + take]
    top = 0
    for j in range(take):
        value = values[j]
        ids[j] = value
        top = max(top, value)
    labels = labels_out[row : row + take]
    for j in range(take):
        labels[j] = values[j]
    mask = mask_out[row : row + take]
    for j in range(take):
        mask[j] = 1
    rest = width - take
    padding = ids_out[row + take : row + width]
    for j in range(rest):
        padding[j] = pad_id
    padding_labels = labels_out[row + take : row + width]
    for j in range(rest):
        padding_labels[j] = IGNORE_INDEX
    padding_mask = mask_out[row + take : row + width]
    for j in range(rest):
        padding_mask[j] = 0
    return top


@_inline
def _locate(
    sample: int,
    shard_starts: np.ndarray,
    addresses: np.ndarray,
    last_used: np.ndarray,
    stamp: int,
    info: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """The shard of ``sample`` if open (stamped as used), else -1 with the shard in ``info[3]``."""
    s = np.searchsorted(shard_starts, sample, side="right") - 1
    if addresses[s] == 0:
        info[3] = s
        return -1
    last_used[s] = stamp
    return s


@_inline
def _write_sample(
    sample: int,
    source_offsets: np.ndarray,
    at: int,
    sample_out: np.ndarray,
    source_out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """Write plan id ``sample`` (-1: padding) at ``at``; for a mixture as (source, id in source)."""
    if len(source_offsets) == 0:
        sample_out[at] = sample
    elif sample < 0:
        sample_out[at] = -1
        source_out[at] = -1
    else:
        s = np.searchsorted(source_offsets, sample, side="right") - 1
        sample_out[at] = sample - source_offsets[s]
        source_out[at] = s


@_jit
def pack(
    wide: bool,
    addresses: np.ndarray,
    sizes: np.ndarray,
    last_used: np.ndarray,
    stamp: int,
    shard_starts: np.ndarray,
    file_starts: np.ndarray,
    lengths: np.ndarray,
    mask_starts: np.ndarray,
    batch_offsets: np.ndarray,
    sample_ids: np.ndarray,
    seg_starts: np.ndarray,
    seg_lengths: np.ndarray,
    row_offsets: np.ndarray,
    source_offsets: np.ndarray,
    index: int,
    seq_len: int,
    pad_id: int,
    max_id: int,
    ids_out: np.ndarray,
    labels_out: np.ndarray,
    positions_out: np.ndarray,
    cu_out: np.ndarray,
    sample_out: np.ndarray,
    source_out: np.ndarray,
    offset_out: np.ndarray,
    info: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """Write packed batch ``index`` of the plan in rows of ``seq_len`` slots.

    Outputs are flat, preallocated with room for a padding run per row. Empty ``seg_starts`` /
    ``seg_lengths`` / ``row_offsets``: whole sequences, one per row. On success ``info`` holds
    (rows, segments with padding runs, longest segment, -, tokens copied).
    """
    lo = batch_offsets[index]
    hi = batch_offsets[index + 1]
    if len(row_offsets):
        r_lo = np.searchsorted(row_offsets, lo)
        r_hi = np.searchsorted(row_offsets, hi)
        num_rows = r_hi - r_lo
    else:
        r_lo = 0
        num_rows = hi - lo
    num_samples = len(lengths)
    if num_rows * seq_len > len(ids_out) or (hi - lo) + num_rows + 1 > len(cu_out):
        return BAD_ROW
    if (hi - lo) + num_rows > len(sample_out) or (
        len(source_offsets) and (hi - lo) + num_rows > len(source_out)
    ):
        return BAD_ROW
    itemsize = 4 if wide else 2
    masked = len(mask_starts) > 0
    # first every segment located and checked (no token read), then copied with the
    # segments ahead prefetched
    where = np.empty(hi - lo, dtype=np.int64)
    takes = np.empty(hi - lo, dtype=np.int64)
    mask_bits = np.empty(hi - lo if masked else 0, dtype=np.int64)
    bases = np.empty(hi - lo if masked else 0, dtype=np.int64)
    for k in range(lo, hi):
        sample = sample_ids[k]
        if sample < 0 or sample >= num_samples:
            return BAD_SEGMENT
        first = seg_starts[k] if len(seg_starts) else 0
        full = np.int64(lengths[sample])
        take = seg_lengths[k] if len(seg_lengths) else full - first
        if first < 0 or take < 0 or first + take > full:
            return BAD_SEGMENT
        s = _locate(sample, shard_starts, addresses, last_used, stamp, info)
        if s < 0:
            return NEED_SHARD
        src = np.int64(file_starts[sample]) + first
        if src + take > sizes[s]:
            return BAD_SOURCE
        where[k - lo] = addresses[s] + src * itemsize
        takes[k - lo] = take
        if masked:
            bit = _mask_bit(mask_starts[sample], first, take, sizes[s] * itemsize)
            if bit < NO_MASK:
                return BAD_SOURCE
            mask_bits[k - lo] = bit
            bases[k - lo] = addresses[s]
    for k in range(min(PREFETCH_AHEAD, hi - lo)):
        _prefetch_source(where[k], takes[k] * itemsize)
    dst = 0
    out = 0
    longest = 0
    tokens = 0
    for k in range(hi - lo):
        tokens += takes[k]
    cu_out[0] = 0
    for r in range(num_rows):
        if len(row_offsets):
            k_lo = row_offsets[r_lo + r]
            k_hi = row_offsets[r_lo + r + 1]
        else:
            k_lo = lo + r
            k_hi = lo + r + 1
        row_end = dst + seq_len
        for k in range(k_lo - lo, k_hi - lo):
            ahead = k + PREFETCH_AHEAD
            if ahead < hi - lo:
                _prefetch_source(where[ahead], takes[ahead] * itemsize)
            take = takes[k]
            if dst + take > row_end:
                return BAD_ROW
            if wide:
                values32 = numba.carray(as_uint32_pointer(where[k]), take)
                top = _copy_segment(values32, take, dst, ids_out, labels_out, positions_out)
            else:
                values16 = numba.carray(as_uint16_pointer(where[k]), take)
                top = _copy_segment(values16, take, dst, ids_out, labels_out, positions_out)
            if top > max_id:
                return BAD_ID
            if masked and mask_bits[k] != NO_MASK:
                _mask_labels(bases[k], mask_bits[k], take, labels_out[dst : dst + take])
            dst += take
            _write_sample(sample_ids[lo + k], source_offsets, out, sample_out, source_out)
            offset_out[out] = seg_starts[lo + k] if len(seg_starts) else 0
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
            _write_sample(-1, source_offsets, out, sample_out, source_out)
            offset_out[out] = -1
            cu_out[out + 1] = dst
            longest = max(longest, pad)
            out += 1
    info[0] = num_rows
    info[1] = out
    info[2] = longest
    info[4] = tokens
    return 0


@_jit
def pad(
    wide: bool,
    addresses: np.ndarray,
    sizes: np.ndarray,
    last_used: np.ndarray,
    stamp: int,
    shard_starts: np.ndarray,
    file_starts: np.ndarray,
    lengths: np.ndarray,
    mask_starts: np.ndarray,
    batch_offsets: np.ndarray,
    sample_ids: np.ndarray,
    source_offsets: np.ndarray,
    index: int,
    multiple: int,
    pad_id: int,
    max_id: int,
    ids_out: np.ndarray,
    mask_out: np.ndarray,
    labels_out: np.ndarray,
    sample_out: np.ndarray,
    source_out: np.ndarray,
    info: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """Write pad batch ``index``: one sequence per row, width the longest rounded to ``multiple``.

    Arguments as for ``pack``; on success ``info`` holds (rows, width, tokens copied).
    """
    lo = batch_offsets[index]
    hi = batch_offsets[index + 1]
    num_rows = hi - lo
    num_samples = len(lengths)
    itemsize = 4 if wide else 2
    masked = len(mask_starts) > 0
    # first every row located and checked (no token read), then copied with the rows ahead
    # prefetched
    where = np.empty(num_rows, dtype=np.int64)
    takes = np.empty(num_rows, dtype=np.int64)
    mask_bits = np.empty(num_rows if masked else 0, dtype=np.int64)
    bases = np.empty(num_rows if masked else 0, dtype=np.int64)
    width = 0
    tokens = 0
    for r in range(num_rows):
        sample = sample_ids[lo + r]
        if sample < 0 or sample >= num_samples:
            return BAD_SEGMENT
        take = np.int64(lengths[sample])
        s = _locate(sample, shard_starts, addresses, last_used, stamp, info)
        if s < 0:
            return NEED_SHARD
        src = np.int64(file_starts[sample])
        if src + take > sizes[s]:
            return BAD_SOURCE
        where[r] = addresses[s] + src * itemsize
        takes[r] = take
        tokens += take
        width = max(width, take)
        if masked:
            bit = _mask_bit(mask_starts[sample], 0, take, sizes[s] * itemsize)
            if bit < NO_MASK:
                return BAD_SOURCE
            mask_bits[r] = bit
            bases[r] = addresses[s]
    width = -(-width // multiple) * multiple
    if num_rows * width > len(ids_out) or num_rows > len(sample_out):
        return BAD_ROW
    if len(source_offsets) and num_rows > len(source_out):
        return BAD_ROW
    for r in range(min(PREFETCH_AHEAD, num_rows)):
        _prefetch_source(where[r], takes[r] * itemsize)
    for r in range(num_rows):
        ahead = r + PREFETCH_AHEAD
        if ahead < num_rows:
            _prefetch_source(where[ahead], takes[ahead] * itemsize)
        take = takes[r]
        if wide:
            values32 = numba.carray(as_uint32_pointer(where[r]), take)
            top = _copy_row(values32, take, r * width, width, pad_id, ids_out, mask_out, labels_out)
        else:
            values16 = numba.carray(as_uint16_pointer(where[r]), take)
            top = _copy_row(values16, take, r * width, width, pad_id, ids_out, mask_out, labels_out)
        if top > max_id:
            return BAD_ID
        _write_sample(sample_ids[lo + r], source_offsets, r, sample_out, source_out)
    if masked:
        for r in range(num_rows):
            if mask_bits[r] == NO_MASK:
                continue
            row = r * width
            _mask_labels(bases[r], mask_bits[r], takes[r], labels_out[row : row + takes[r]])
    info[0] = num_rows
    info[1] = width
    info[2] = tokens
    return 0

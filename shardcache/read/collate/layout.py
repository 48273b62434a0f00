"""Batch collation on the numpy path: gathered tokens of planned segments -> batch arrays.

Pure numpy, no file access, a fixed number of numpy calls a batch; ``kernels`` builds the same
arrays (batch contents: ``shardcache.read.dataset``). The per-token columns a reader gathers
(``store/columns.py``) are laid out beside the labels, each under its ``batch_key``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shardcache.store.columns import TOKEN_COLUMNS

#: The label of a position that carries no loss (the Hugging Face / PyTorch ignore index).
IGNORE_INDEX = -100


def pad_batch(
    tokens: np.ndarray,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    pad_id: int,
    width: int | None = None,
    loss_mask: np.ndarray | None = None,
    ids_dtype: np.dtype | type = np.int64,
    laid_out: bool = False,
    extras: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray | int]:
    """Pad whole sequences into one ``len(lengths) x width`` batch (``width`` None: the longest).

    ``laid_out``: ``tokens`` (and ``loss_mask``, ``extras``) are already in their padded rows, as
    ``Cache.gather(layout=...)`` leaves them; else concatenated. Each of ``extras`` (per-token
    columns by name) adds an array under its ``batch_key``, shaped as ``labels``, of the
    column's dtype and its ``fill`` where they are -100.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if width is None:
        width = int(lengths.max())
    shape = (len(lengths), width)
    mask = _ramp(width, np.dtype(np.int64))[None, :width] < lengths[:, None]
    if laid_out:
        input_ids = tokens.astype(ids_dtype, copy=False).reshape(shape)
        keep = mask if loss_mask is None else loss_mask.reshape(shape)
        labels = np.where(keep, input_ids, IGNORE_INDEX).astype(np.int64, copy=False)
    else:
        # one boolean scatter each (row-major, so in row order) instead of a copy per row
        input_ids = np.full(shape, pad_id, dtype=ids_dtype)
        input_ids[mask] = tokens
        labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        if loss_mask is None:
            labels[mask] = tokens
        else:  # (int64 first: -100 does not fit the unsigned cache dtype)
            labels[mask] = np.where(loss_mask, tokens.astype(np.int64), IGNORE_INDEX)
    batch: dict[str, np.ndarray | int] = {
        "input_ids": input_ids,
        "attention_mask": mask.astype(ids_dtype),
        "labels": labels,
        "sample_ids": np.array(sample_ids, dtype=np.int64),  # a copy: plans may be read-only
        "num_tokens": int(lengths.sum()),
    }
    _lay_extras(batch, labels, extras, None if laid_out else mask)
    return batch


def _lay_extras(
    batch: dict[str, np.ndarray | int],
    labels: np.ndarray,
    extras: Mapping[str, np.ndarray] | None,
    slots: np.ndarray | None,
) -> None:
    """Add each per-token column to ``batch`` shaped as ``labels``, its ``fill`` where -100.

    The values are laid out in the rows already (``slots`` None) or go to the ``slots`` set.
    """
    for name, values in (extras or {}).items():
        spec = TOKEN_COLUMNS[name]
        fill = spec.dtype.type(spec.fill)
        if slots is None:
            laid = values.reshape(labels.shape)
        else:
            laid = np.full(labels.shape, fill, dtype=spec.dtype)
            laid[slots] = values
        batch[spec.batch_key] = np.where(labels != IGNORE_INDEX, laid, fill).astype(
            spec.dtype, copy=False
        )


def pack_batch(
    tokens: np.ndarray,
    seg_lengths: np.ndarray,
    sample_ids: np.ndarray,
    starts: np.ndarray,
    row_bounds: np.ndarray,
    seq_len: int,
    pad_id: int,
    loss_mask: np.ndarray | None = None,
    ids_dtype: np.dtype | type = np.int64,
    laid_out: bool = False,
    extras: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray | int]:
    """Lay segments out in ``len(row_bounds) - 1`` rows of exactly ``seq_len`` slots.

    Row ``r`` holds segments ``row_bounds[r] : row_bounds[r + 1]``; ``laid_out`` and
    ``extras`` as for ``pad_batch`` (a segment's first token, never a target, gets the fill).
    When every row is full, ``input_ids`` is ``tokens`` itself, reshaped.
    """
    seg_lengths = np.asarray(seg_lengths, dtype=np.int64)
    num_rows = len(row_bounds) - 1
    real = None
    if loss_mask is None and not laid_out and len(tokens) == num_rows * seq_len:
        # every row full: the segments are the slots, in order; no padding, no scatter
        lengths_out = seg_lengths
        sample = np.array(sample_ids, dtype=np.int64)  # copies: plans may be read-only
        offsets = np.array(starts, dtype=np.int64)
        flat = tokens.astype(ids_dtype, copy=False).reshape(num_rows, seq_len)
        labels = flat.reshape(-1).astype(np.int64)
    else:
        lengths_out, sample, offsets, used = _with_padding_runs(
            seg_lengths, sample_ids, starts, row_bounds, seq_len
        )
        real = _ramp(seq_len, np.dtype(np.int64))[None, :seq_len] < used[:, None]
        if laid_out:
            flat = tokens.astype(ids_dtype, copy=False).reshape(num_rows, seq_len)
            keep = real if loss_mask is None else loss_mask.reshape(num_rows, seq_len)
        else:
            flat = np.full((num_rows, seq_len), pad_id, dtype=ids_dtype)
            flat[real] = tokens
            if loss_mask is not None:  # chat: only the trainable turns carry a loss
                keep = np.zeros_like(real)
                keep[real] = loss_mask
            else:
                keep = real
        labels = np.where(keep, flat, IGNORE_INDEX).astype(np.int64).reshape(-1)
    cu_seqlens = np.zeros(len(lengths_out) + 1, dtype=np.int64)
    np.cumsum(lengths_out, out=cu_seqlens[1:])
    labels[cu_seqlens[:-1]] = IGNORE_INDEX  # a segment's first token is never a target
    shape = (num_rows, seq_len)
    labels = labels.reshape(shape)
    batch: dict[str, np.ndarray | int] = {
        "input_ids": flat,
        "labels": labels,
        "position_ids": restarting_positions(cu_seqlens, ids_dtype).reshape(shape),
        "cu_seqlens": cu_seqlens.astype(np.int32),
        "max_seqlen": int(lengths_out.max()),
        "sample_ids": sample,
        "sample_offsets": offsets,
        "num_tokens": int(seg_lengths.sum()),
    }
    _lay_extras(batch, labels, extras, None if laid_out or real is None else real)
    return batch


def packed_layout(seg_lengths: np.ndarray, row_bounds: np.ndarray, seq_len: int) -> np.ndarray:
    """Each segment's start in the flat ``rows x seq_len`` slots: a gather's ``layout``."""
    seg_lengths = np.asarray(seg_lengths, dtype=np.int64)
    bounds = np.asarray(row_bounds, dtype=np.int64)
    begin = np.cumsum(seg_lengths) - seg_lengths  # compact start of every segment
    row_of_seg = np.repeat(np.arange(len(bounds) - 1), bounds[1:] - bounds[:-1])
    row_begin = begin[bounds[:-1]] if len(begin) else begin
    return row_of_seg * seq_len + begin - row_begin[row_of_seg]


def _with_padding_runs(
    seg_lengths: np.ndarray,
    sample_ids: np.ndarray,
    starts: np.ndarray,
    row_bounds: np.ndarray,
    seq_len: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A batch's segments with a padding run (ids -1) after every row that is not full."""
    bounds = np.asarray(row_bounds, dtype=np.int64)
    num_rows = len(bounds) - 1
    num_segs = len(seg_lengths)
    seg_end = np.zeros(num_segs + 1, dtype=np.int64)
    np.cumsum(seg_lengths, out=seg_end[1:])
    used = seg_end[bounds[1:]] - seg_end[bounds[:-1]]  # tokens per row
    pad = seq_len - used
    has_pad = pad > 0
    pads_before = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(has_pad, out=pads_before[1:])
    row_of_seg = np.repeat(np.arange(num_rows), bounds[1:] - bounds[:-1])
    real_at = np.arange(num_segs) + pads_before[row_of_seg]
    pad_at = (bounds[1:] + pads_before[:-1])[has_pad]
    total_segs = num_segs + int(pads_before[-1])
    lengths_out = np.empty(total_segs, dtype=np.int64)
    lengths_out[real_at] = seg_lengths
    lengths_out[pad_at] = pad[has_pad]
    sample = np.full(total_segs, -1, dtype=np.int64)
    sample[real_at] = sample_ids
    offsets = np.full(total_segs, -1, dtype=np.int64)
    offsets[real_at] = starts
    return lengths_out, sample, offsets, used


_ramps: dict[np.dtype, np.ndarray] = {}


def _ramp(length: int, dtype: np.dtype) -> np.ndarray:
    """A cached read-only ``arange`` of ``dtype``, at least ``length`` long."""
    ramp = _ramps.get(dtype)
    if ramp is None or len(ramp) < length:
        ramp = np.arange(max(length, 1 << 16), dtype=dtype)
        ramp.flags.writeable = False
        _ramps[dtype] = ramp
    return ramp


def restarting_positions(cu_seqlens: np.ndarray, dtype: np.dtype | type = np.int64) -> np.ndarray:
    """Position ids ``0, 1, ...`` restarting at every segment of ``cu_seqlens`` (from 0)."""
    dtype = np.dtype(dtype)
    total = int(cu_seqlens[-1])
    starts = cu_seqlens[:-1].astype(dtype)
    return _ramp(total, dtype)[:total] - np.repeat(starts, cu_seqlens[1:] - cu_seqlens[:-1])

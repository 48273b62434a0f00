"""Batch collation: planned sequences + their token arrays -> the arrays of one batch.

Pure numpy, no torch and no file access: the caller (``ShardDataset``) gathers the tokens of
the segments the plan chose into one flat array (``Cache.gather``: one copy per shard touched;
for chat caches also the stored loss masks), passes it here with the segment lengths, and turns
the returned arrays into tensors.

Vectorised: a batch costs a fixed number of numpy calls whatever its number of rows and
segments: tokens land in their slots with one boolean scatter (slots are row-major and every
row's tokens precede its padding), position ids are ``arange - repeat(segment start)``,
labels one ``where`` plus one scatter of the segment starts. There is no Python loop per
sequence or per segment (the previous version looped per segment: ~1 us each, the largest
cost of a packed batch of short documents). What a batch holds is documented in
``shardcache.read.dataset``; in short:

:func:`pad_batch` (``mode="pad"``): whole sequences, one per row, padded to a common width.
``input_ids``, ``attention_mask`` (1 on tokens), ``labels`` (-100 on padding and, with loss
masks, outside the trainable turns) and ``sample_ids``, all int64.

:func:`pack_batch` (``mode="pack"``): rows of exactly ``seq_len`` slots made of segments, the
padding run at a row's end a segment of its own. ``input_ids``, ``labels`` (-100 on padding,
on the first token of every segment, and outside trainable turns), ``position_ids`` (restart
at every segment), int32 ``cu_seqlens`` (segment boundaries in the flattened batch),
``max_seqlen`` (a Python int), and per segment ``sample_ids`` / ``sample_offsets`` (-1 for
padding).
"""

from __future__ import annotations

import numpy as np

#: The label of a position that carries no loss (the Hugging Face / PyTorch ignore index).
IGNORE_INDEX = -100


def pad_batch(
    tokens: np.ndarray,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    pad_id: int,
    width: int | None = None,
    loss_mask: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Pad whole sequences into one ``len(lengths) x width`` batch.

    ``tokens`` holds the rows' ids concatenated (row ``i`` has ``lengths[i]``). ``width``
    defaults to the longest row (``ShardDataset`` passes it rounded up to
    ``pad_to_multiple_of``); ``loss_mask`` (bool per token, aligned with ``tokens``; chat
    caches) keeps the labels of trainable tokens only.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if width is None:
        width = int(lengths.max())
    mask = np.arange(width)[None, :] < lengths[:, None]
    # one boolean scatter (row-major, so in row order) instead of a copy per row
    input_ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
    input_ids[mask] = tokens
    if loss_mask is not None:
        trainable = np.zeros_like(mask)
        trainable[mask] = loss_mask
        labels = np.where(trainable, input_ids, IGNORE_INDEX)
    else:
        labels = np.where(mask, input_ids, IGNORE_INDEX)
    return {
        "input_ids": input_ids,
        "attention_mask": mask.astype(np.int64),
        "labels": labels,
        "sample_ids": np.array(sample_ids, dtype=np.int64),  # a copy: plans may be read-only
    }


def pack_batch(
    tokens: np.ndarray,
    seg_lengths: np.ndarray,
    sample_ids: np.ndarray,
    starts: np.ndarray,
    row_bounds: np.ndarray,
    seq_len: int,
    pad_id: int,
    loss_mask: np.ndarray | None = None,
) -> dict[str, np.ndarray | int]:
    """Lay segments out in ``len(row_bounds) - 1`` rows of exactly ``seq_len`` slots.

    ``tokens`` holds the segments' ids concatenated (segment ``k`` has ``seg_lengths[k]``
    tokens: offset ``starts[k]`` of sequence ``sample_ids[k]``, see ``EpochPlan.segments``);
    ``row_bounds`` cuts the segments into rows (``EpochPlan.row_bounds``). ``loss_mask`` (bool
    per token, aligned with ``tokens``; chat caches) keeps the labels of trainable tokens only.
    """
    seg_lengths = np.asarray(seg_lengths, dtype=np.int64)
    bounds = np.asarray(row_bounds, dtype=np.int64)
    num_rows = len(bounds) - 1
    num_segs = len(seg_lengths)
    seg_end = np.zeros(num_segs + 1, dtype=np.int64)
    np.cumsum(seg_lengths, out=seg_end[1:])
    used = seg_end[bounds[1:]] - seg_end[bounds[:-1]]  # tokens per row
    pad = seq_len - used
    has_pad = pad > 0
    # final segment list: each row's segments, then its padding run (when it has one)
    pads_before = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(has_pad, out=pads_before[1:])
    row_of_seg = np.repeat(np.arange(num_rows), np.diff(bounds))
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
    # slots: row-major; a row's tokens come first, its padding after
    cu_seqlens = np.zeros(total_segs + 1, dtype=np.int64)
    np.cumsum(lengths_out, out=cu_seqlens[1:])
    positions = np.arange(num_rows * seq_len, dtype=np.int64)
    positions -= np.repeat(cu_seqlens[:-1], lengths_out)
    if not total_segs - num_segs and loss_mask is None:
        # every row full (concat: all but the epoch's last batch): no scatter, no mask
        flat = tokens.astype(np.int64).reshape(num_rows, seq_len)
        labels = flat.reshape(-1).copy()
    else:
        real = np.arange(seq_len)[None, :] < used[:, None]
        flat = np.full((num_rows, seq_len), pad_id, dtype=np.int64)
        flat[real] = tokens
        if loss_mask is not None:  # chat: only the trainable turns carry a loss
            keep = np.zeros_like(real)
            keep[real] = loss_mask
        else:
            keep = real
        labels = np.where(keep, flat, IGNORE_INDEX).reshape(-1)
    labels[cu_seqlens[:-1]] = IGNORE_INDEX  # a segment's first token is never a target
    shape = (num_rows, seq_len)
    return {
        "input_ids": flat,
        "labels": labels.reshape(shape),
        "position_ids": positions.reshape(shape),
        "cu_seqlens": cu_seqlens.astype(np.int32),
        "max_seqlen": int(lengths_out.max()),
        "sample_ids": sample,
        "sample_offsets": offsets,
    }

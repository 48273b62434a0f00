"""Batch collation: planned sequences + their token arrays -> the arrays of one batch.

Pure numpy, no torch and no file access: the caller (``ShardDataset``) reads the token arrays
(and, for chat caches, the stored loss masks) of the sample ids the plan chose, passes them
here, and turns the returned arrays into tensors. What a batch holds is documented in
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

from collections.abc import Sequence

import numpy as np

#: The label of a position that carries no loss (the Hugging Face / PyTorch ignore index).
IGNORE_INDEX = -100


def pad_batch(
    rows: Sequence[np.ndarray],
    sample_ids: np.ndarray,
    pad_id: int,
    width: int | None = None,
    loss_masks: Sequence[np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Pad whole sequences into one ``len(rows) x width`` batch.

    ``width`` defaults to the longest row (``ShardDataset`` passes it rounded up to
    ``pad_to_multiple_of``); ``loss_masks`` (one boolean array per row, chat caches) keep the
    labels of trainable tokens only.
    """
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if width is None:
        width = int(lengths.max())
    mask = np.arange(width)[None, :] < lengths[:, None]
    # one boolean scatter (row-major, so in row order) instead of a copy per row: rows of
    # short buckets number in the hundreds per batch
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    input_ids[mask] = np.concatenate(rows)
    if loss_masks is not None:
        trainable = np.zeros_like(mask)
        trainable[mask] = np.concatenate(loss_masks)
        labels = np.where(trainable, input_ids, IGNORE_INDEX)
    else:
        labels = np.where(mask, input_ids, IGNORE_INDEX)
    return {
        "input_ids": input_ids,
        "attention_mask": mask.astype(np.int64),
        "labels": labels,
        "sample_ids": np.asarray(sample_ids, dtype=np.int64),
    }


def pack_batch(
    pieces: Sequence[np.ndarray],
    sample_ids: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray | None,
    row_bounds: np.ndarray,
    seq_len: int,
    pad_id: int,
    loss_masks: Sequence[np.ndarray] | None = None,
) -> dict[str, np.ndarray | int]:
    """Lay segments out in ``len(row_bounds) - 1`` rows of exactly ``seq_len`` slots.

    ``pieces`` are the whole sequences of the segments (``EpochPlan.segments``: ``sample_ids``,
    ``starts``, and ``lengths``, ``None`` when every segment is a whole sequence); segment ``k``
    is ``pieces[k][starts[k] : starts[k] + lengths[k]]``. ``row_bounds`` cuts the segments into
    rows (``EpochPlan.row_bounds``). ``loss_masks`` (one boolean array per piece, chat caches)
    keep the labels of trainable tokens only.
    """
    if lengths is not None:
        cuts = list(zip(starts.tolist(), lengths.tolist()))
        pieces = [p[s : s + n] for p, (s, n) in zip(pieces, cuts)]
        if loss_masks is not None:
            loss_masks = [m[s : s + n] for m, (s, n) in zip(loss_masks, cuts)]
    bounds = np.asarray(row_bounds).tolist()
    num_rows = len(bounds) - 1
    # segments in flat order with the padding run of each row as a segment of its own
    parts: list[np.ndarray] = []
    loss_parts: list[np.ndarray] = []
    seg_len: list[int] = []
    seg_sample: list[int] = []
    seg_offset: list[int] = []
    id_list, start_list = np.asarray(sample_ids).tolist(), np.asarray(starts).tolist()
    for r in range(num_rows):
        used = 0
        for k in range(bounds[r], bounds[r + 1]):
            piece = pieces[k]
            parts.append(piece)
            if loss_masks is not None:
                loss_parts.append(loss_masks[k])
            used += len(piece)
            seg_len.append(len(piece))
            seg_sample.append(id_list[k])
            seg_offset.append(start_list[k])
        if used < seq_len:
            parts.append(np.full(seq_len - used, pad_id, dtype=np.int64))
            loss_parts.append(np.zeros(seq_len - used, dtype=bool))
            seg_len.append(seq_len - used)
            seg_sample.append(-1)
            seg_offset.append(-1)
    flat = np.concatenate(parts).astype(np.int64, copy=False)
    seg_lengths = np.asarray(seg_len, dtype=np.int64)
    cu_seqlens = np.zeros(len(seg_lengths) + 1, dtype=np.int64)
    np.cumsum(seg_lengths, out=cu_seqlens[1:])
    sample = np.asarray(seg_sample, dtype=np.int64)
    positions = np.arange(len(flat), dtype=np.int64) - np.repeat(cu_seqlens[:-1], seg_lengths)
    labels = flat.copy()
    labels[cu_seqlens[:-1]] = IGNORE_INDEX  # a segment's first token is never a target
    for k in np.flatnonzero(sample < 0).tolist():
        labels[cu_seqlens[k] : cu_seqlens[k + 1]] = IGNORE_INDEX
    if loss_masks is not None:  # chat: only the trainable turns carry a loss
        labels[~np.concatenate(loss_parts)] = IGNORE_INDEX
    shape = (num_rows, seq_len)
    return {
        "input_ids": flat.reshape(shape),
        "labels": labels.reshape(shape),
        "position_ids": positions.reshape(shape),
        "cu_seqlens": cu_seqlens.astype(np.int32),
        "max_seqlen": int(seg_lengths.max()),
        "sample_ids": sample,
        "sample_offsets": np.asarray(seg_offset, dtype=np.int64),
    }

"""The ``concat`` packing: the (shuffled) sequences as one stream cut every ``seq_len`` tokens.

Documents may span rows (a segment is the part of one document in one row); only the last row
is short. The cuts are merged arithmetically, with no sort over the documents.
"""

from __future__ import annotations

import numpy as np

from shardcache.read.plan.plan_arrays import EpochPlan
from shardcache.read.plan.policies.base import PolicyOptions, pack_order, rows_to_batches


def plan_concat(
    lengths: np.ndarray,
    buckets: np.ndarray,
    options: PolicyOptions,
    rng: np.random.Generator | None,
) -> EpochPlan:
    """Rows of ``seq_len`` tokens cut from one stream of the sequences (segments per row)."""
    seq_len = int(options.seq_len or 0)
    order = pack_order(len(lengths), rng)
    doc_len = lengths[order]  # (int64: plan_epoch)
    doc_end = np.cumsum(doc_len)
    total = int(doc_end[-1])
    num_rows = -(-total // seq_len)
    # Segments begin at 0 and at every cut: a document's end (but the last) or a row's end
    # (r * seq_len, 0 < r < num_rows), the two merged with equal cuts once. The two runs are
    # sorted, so every cut's place in the merge is arithmetic (no sort, no searchsorted over
    # the documents).
    doc_cut = doc_end[:-1]
    row_below = np.minimum((doc_cut - 1) // seq_len, num_rows - 1)  # row cuts < a doc cut
    # per row r (its cut at r * seq_len): how many doc cuts lie at or below it, and how many
    # rows below it are doc cuts too (a cut on both runs is one cut: a document's end)
    docs_upto = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_below, minlength=num_rows)[:num_rows], out=docs_upto[1:])
    on_row = doc_cut % seq_len == 0
    shared = np.zeros(num_rows + 1, dtype=np.int64)  # shared[r]: rows 1..r-1 on a doc cut
    np.cumsum(np.bincount(doc_cut[on_row] // seq_len, minlength=num_rows)[:num_rows],
              out=shared[1:])  # fmt: skip
    # a cut's place: the cuts below it of its own run, plus those of the other run, less the
    # rows below it that are doc cuts too (counted in both)
    doc_at = np.arange(len(doc_cut), dtype=np.int64) + row_below - shared[row_below + 1]
    rows = np.arange(1, num_rows, dtype=np.int64)
    row_on_doc = shared[rows + 1] - shared[rows] > 0
    # (docs_upto[r] counts the doc cuts <= r * seq_len: one too many when one is on it)
    row_at = docs_upto[rows] - row_on_doc + rows - 1 - shared[rows]
    num_segs = len(doc_cut) + len(rows) - int(row_on_doc.sum()) + 1
    seg_begin = np.empty(num_segs, dtype=np.int64)
    doc = np.empty(num_segs, dtype=np.int64)  # the document each segment is a piece of
    seg_begin[0] = doc[0] = 0
    seg_begin[1 + doc_at] = doc_cut
    doc[1 + doc_at] = np.arange(1, len(doc_cut) + 1, dtype=np.int64)
    free = ~row_on_doc
    seg_begin[1 + row_at[free]] = rows[free] * seq_len
    doc[1 + row_at[free]] = docs_upto[rows[free]]
    seg_end = np.empty(num_segs, dtype=np.int64)
    seg_end[:-1] = seg_begin[1:]
    seg_end[-1] = total
    seg_starts = seg_begin - (doc_end - doc_len)[doc]  # one gather of documents' begins
    # row r starts with the segment beginning at r * seq_len
    row_offsets = np.empty(num_rows + 1, dtype=np.int64)
    row_offsets[0] = 0
    row_offsets[1:num_rows] = 1 + row_at
    row_offsets[num_rows] = num_segs
    batch_offsets = rows_to_batches(row_offsets, int(options.rows_per_batch or 1))
    return EpochPlan(
        batch_offsets.astype(np.int64),
        order[doc],
        row_offsets,
        seg_starts,
        seg_end - seg_begin,
    )

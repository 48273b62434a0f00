"""An epoch plan's data: global batches as CSR arrays over segments, read by every stage.

The packing policies (``plan/policies/``) build it and the reader, the plan store and the
readahead read it; it holds arrays only, so it imports nothing of the planner that fills it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EpochPlan:
    """Global batches of one epoch as CSR arrays over segments (a segment: part of one sequence).

    Attributes:
        batch_offsets: int64, one per batch plus one: batch ``i`` holds segments
            ``batch_offsets[i] : batch_offsets[i + 1]``.
        sample_ids: int64, the sequence of each segment.
        row_offsets: int64, one per row plus one, into segments; None: one segment per row.
        seg_starts: int64, each segment's first token in its sequence (None: 0).
        seg_lengths: int64, tokens each segment takes (None: the whole sequence).
        repeats: int64, which use of its sequence in the epoch each segment is (0 for the
            first; a mixture's upsampled source uses a document more than once), None: all 0.
    """

    batch_offsets: np.ndarray
    sample_ids: np.ndarray
    row_offsets: np.ndarray | None = None
    seg_starts: np.ndarray | None = None
    seg_lengths: np.ndarray | None = None
    repeats: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.batch_offsets) - 1

    def batch(self, index: int) -> np.ndarray:
        """The sample ids of one batch.

        Args:
            index: the global batch.

        Returns:
            One per segment (a view).
        """
        return self.sample_ids[self.batch_offsets[index] : self.batch_offsets[index + 1]]

    def segments(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The segments of one batch.

        Args:
            index: the global batch.

        Returns:
            ``(sample_ids, starts, lengths)``; ``lengths`` is None when all are whole sequences.
        """
        return self.packed_segments(index)[:3]

    def repeats_of(self, index: int) -> np.ndarray:
        """Which use of its sequence in the epoch each segment of one batch is (int64, from 0).

        Args:
            index: the global batch.

        Returns:
            One per segment.
        """
        lo, hi = int(self.batch_offsets[index]), int(self.batch_offsets[index + 1])
        if self.repeats is None:
            return np.zeros(hi - lo, dtype=np.int64)
        return self.repeats[lo:hi]

    def row_bounds(self, index: int) -> np.ndarray:
        """Where the rows of one batch begin.

        Args:
            index: the global batch.

        Returns:
            int64 segment offsets, one per row plus one, relative to the batch's first segment.
        """
        return self.packed_segments(index)[3]

    def packed_segments(
        self, index: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """``segments`` and ``row_bounds`` of one batch in one call.

        Args:
            index: the global batch.

        Returns:
            ``(sample_ids, starts, lengths, row_bounds)``.
        """
        lo, hi = int(self.batch_offsets[index]), int(self.batch_offsets[index + 1])
        if self.seg_starts is None:
            starts = np.zeros(hi - lo, dtype=np.int64)
        else:
            starts = self.seg_starts[lo:hi]
        lengths = None if self.seg_lengths is None else self.seg_lengths[lo:hi]
        if self.row_offsets is None:
            bounds = np.arange(hi - lo + 1, dtype=np.int64)
        else:
            first, last = np.searchsorted(self.row_offsets, (lo, hi)).tolist()
            bounds = self.row_offsets[first : last + 1] - lo
        return self.sample_ids[lo:hi], starts, lengths, bounds

    def token_count(self, lengths: np.ndarray, index: int) -> int:
        """The real (non-padding) tokens of one batch.

        Args:
            lengths: the length of every sample id.
            index: the global batch.

        Returns:
            The count.
        """
        ids, _, taken = self.segments(index)
        return int(lengths[ids].sum()) if taken is None else int(taken.sum())

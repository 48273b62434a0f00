"""The ``best_fit`` packing: whole sequences, best-fit decreasing into ``seq_len`` rows per window.

A sequence is never split (ConfigError for one longer than ``seq_len``); each window's rows are
shuffled, and batches take ``max_tokens // seq_len`` rows in order.
"""

from __future__ import annotations

import numpy as np

from shardcache.errors import ConfigError
from shardcache.read.plan.packing import best_fit_bins, stable_order
from shardcache.read.plan.plan_arrays import EpochPlan
from shardcache.read.plan.policies.base import (
    PolicyOptions,
    pack_order,
    rows_to_batches,
    sort_windows,
)


def plan_best_fit(
    lengths: np.ndarray,
    buckets: np.ndarray,
    options: PolicyOptions,
    rng: np.random.Generator | None,
) -> EpochPlan:
    """Rows of whole sequences packed best-fit decreasing per window (ConfigError: too long)."""
    seq_len = int(options.seq_len or 0)
    if int(lengths.max()) > seq_len:
        grown, other = ", {} of them reserved for a transform", "use packing='concat', "
        if options.growth:
            grown, other = grown.format(options.growth), ""
        else:
            grown = ""
        raise ConfigError(
            f"seq_len: {seq_len} is smaller than the longest sequence ({int(lengths.max())} "
            f"tokens{grown}) and packing='best_fit' never splits a sequence; {other}raise "
            f"seq_len to at least {int(lengths.max())}, or rebuild the cache with --max-length "
            f"{seq_len - options.growth}"
        )
    n = len(lengths)
    order = pack_order(n, rng)
    window = np.arange(n, dtype=np.int64) // options.window_size
    num_windows = int(window[-1]) + 1
    ids = sort_windows(window, lengths[order], order, num_windows)  # longest first, then id
    bounds = np.minimum(np.arange(num_windows + 1, dtype=np.int64) * options.window_size, n)
    bins = best_fit_bins(lengths[ids], bounds, seq_len)
    # rows (bins) of every window shuffled, one rng.permutation per window in window order;
    # the global row number of an item orders windows, then shuffled rows, items stable
    num_bins = np.maximum.reduceat(bins, bounds[:-1]) + 1
    base = np.zeros(num_windows + 1, dtype=np.int64)
    np.cumsum(num_bins, out=base[1:])
    item_base = np.repeat(base[:-1], np.diff(bounds))
    if rng is not None:
        perms = [rng.permutation(k) for k in num_bins.tolist()]
        bins = np.concatenate(perms)[item_base + bins]
    row = item_base + bins
    sample_ids = ids[stable_order(row, int(base[-1]))]
    row_offsets = np.zeros(int(base[-1]) + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=int(base[-1])), out=row_offsets[1:])
    batch_offsets = rows_to_batches(row_offsets, int(options.rows_per_batch or 1))
    return EpochPlan(batch_offsets.astype(np.int64), sample_ids, row_offsets)

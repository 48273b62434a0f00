"""Pad mode's policy: whole sequences of one bucket, each batch padded to its longest row.

Per bucket, sequences are (shuffled and) cut into windows of ``window_size``; the windows are
shuffled and each sorted longest first, so a window's batches hold similar lengths and ranks get
similar lengths at a step; a batch takes rows while ``rows x padded longest <= max_tokens``.
"""

from __future__ import annotations

import numpy as np

from shardcache.errors import ConfigError
from shardcache.read.plan.packing import cut_batches
from shardcache.read.plan.plan_arrays import EpochPlan
from shardcache.read.plan.policies.base import PolicyOptions, sort_windows


def plan_pad(
    lengths: np.ndarray,
    buckets: np.ndarray,
    options: PolicyOptions,
    rng: np.random.Generator | None,
) -> EpochPlan:
    """Batches of whole sequences of one bucket (ConfigError: one longer than max_tokens)."""
    longest = int(options.padded(int(lengths.max())))
    if longest > options.max_tokens:
        grown = f", {options.growth} of them reserved for a transform" if options.growth else ""
        raise ConfigError(
            f"max_tokens: {options.max_tokens} is smaller than the longest sequence "
            f"({int(lengths.max())} tokens{grown}, {longest} padded); raise max_tokens to at "
            f"least {longest} or rebuild the cache with --max-length "
            f"{options.max_tokens - options.growth}"
        )
    n = len(lengths)
    # 1. per bucket, a (shuffled) order; windows of window_size consecutive ids of a bucket
    order = np.arange(n, dtype=np.int64) if rng is None else rng.permutation(n)
    small = buckets.astype(np.uint8) if int(buckets.max()) < 256 else buckets
    order = order[np.argsort(small[order], kind="stable")]  # radix sort for uint8
    group_size = np.bincount(small, minlength=int(small.max()) + 1)
    group_size = group_size[group_size > 0]
    group_start = np.r_[0, np.cumsum(group_size)[:-1]]
    position = np.arange(n, dtype=np.int64) - np.repeat(group_start, group_size)
    windows_per_group = -(-group_size // options.window_size)
    window_base = np.r_[0, np.cumsum(windows_per_group)[:-1]]
    window = np.repeat(window_base, group_size) + position // options.window_size
    num_windows = int(windows_per_group.sum())
    # 3. windows shuffled
    rank = np.arange(num_windows) if rng is None else rng.permutation(num_windows)
    # 2. inside a window, longest first, ties by sample id
    sample_ids = sort_windows(rank[window], lengths[order], order, num_windows)
    window_sizes = np.bincount(rank[window], minlength=num_windows)
    window_ends = np.cumsum(window_sizes)
    first_rows = lengths[sample_ids] if options.pad_to_multiple_of == 1 else None
    padded = first_rows if first_rows is not None else options.padded(lengths[sample_ids])
    starts = cut_batches(np.asarray(padded), window_ends, options.max_tokens)
    return EpochPlan(np.append(starts, n).astype(np.int64), sample_ids)

"""best_fit packing: the compiled kernel equals the reference loop, and best_fit plans equal
the plans of the per-window implementation they replaced (bit-identical batches)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache.read.plan import packing
from shardcache.read.plan.epoch_plan import PlanOptions, plan_epoch
from shardcache.read.plan.packing import best_fit_bins


def _windows(sizes: list[int], window: int) -> tuple[np.ndarray, np.ndarray]:
    n = len(sizes)
    bounds = np.unique(np.minimum(np.arange(0, n + window, window), n))
    parts = [np.sort(np.asarray(sizes[a:b]))[::-1] for a, b in itertools.pairwise(bounds)]
    return np.concatenate(parts).astype(np.int64), bounds


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 200).flatmap(
        lambda cap: st.tuples(
            st.just(cap),
            st.lists(st.integers(1, cap), min_size=1, max_size=300),
            st.integers(1, 64),
        )
    )
)
def test_jit_kernel_equals_the_loop(case):
    pytest.importorskip("numba")
    capacity, sizes, window = case
    flat, bounds = _windows(sizes, window)
    want = best_fit_bins(flat, bounds, capacity, method="loop")
    assert np.array_equal(best_fit_bins(flat, bounds, capacity, method="jit"), want)
    # every row holds at most capacity tokens
    for lo, hi in itertools.pairwise(bounds):
        assert np.bincount(want[lo:hi], weights=flat[lo:hi]).max() <= capacity


def test_capacities_beyond_one_summary_word():
    pytest.importorskip("numba")
    rng = np.random.default_rng(3)
    for capacity in (4095, 4096, 4097, 70_000, 300_000):
        sizes = rng.integers(1, capacity // 3, 2000).tolist()
        flat, bounds = _windows(sizes, 512)
        want = best_fit_bins(flat, bounds, capacity, method="loop")
        assert np.array_equal(best_fit_bins(flat, bounds, capacity, method="jit"), want)


def _reference_best_fit_plan(lengths, options, seed, epoch):
    """The previous _plan_best_fit: a lexsort and the loop per window."""
    rng = np.random.default_rng([seed, epoch]) if options.shuffle else None
    n = len(lengths)
    order = np.arange(n, dtype=np.int64) if rng is None else rng.permutation(n).astype(np.int64)
    rows, row_sizes = [], []
    for lo in range(0, n, options.window_size):
        ids = order[lo : lo + options.window_size]
        ids = ids[np.lexsort((ids, -lengths[ids]))]
        bins = best_fit_bins(lengths[ids], np.array([0, len(ids)]), options.seq_len, method="loop")
        num_bins = int(bins.max()) + 1
        if rng is not None:
            bins = rng.permutation(num_bins)[bins]
        by_row = np.argsort(bins, kind="stable")
        rows.append(ids[by_row])
        row_sizes.append(np.bincount(bins, minlength=num_bins))
    sample_ids = np.concatenate(rows)
    row_offsets = np.r_[0, np.cumsum(np.concatenate(row_sizes))].astype(np.int64)
    per = options.rows_per_batch
    batch_offsets = row_offsets[
        np.r_[np.arange(0, len(row_offsets) - 1, per), len(row_offsets) - 1]
    ]
    return batch_offsets, sample_ids, row_offsets


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 64), min_size=1, max_size=400),
    st.integers(1, 50),
    st.integers(0, 5),
    st.booleans(),
    st.sampled_from(["loop", "jit"]),
)
def test_best_fit_plans_equal_the_previous_implementation(lengths, window, seed, shuffle, how):
    if how == "jit":
        pytest.importorskip("numba")
    lengths = np.asarray(lengths, dtype=np.int64)
    options = PlanOptions(
        max_tokens=256, mode="pack", seq_len=64, window_size=window, shuffle=shuffle
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packing, "JIT_MIN_SEQUENCES", 0 if how == "jit" else 10**12)
        plan = plan_epoch(lengths, np.zeros(len(lengths), np.int32), options, seed, epoch=1)
    batch_offsets, sample_ids, row_offsets = _reference_best_fit_plan(lengths, options, seed, 1)
    assert np.array_equal(plan.batch_offsets, batch_offsets)
    assert np.array_equal(plan.sample_ids, sample_ids)
    assert np.array_equal(plan.row_offsets, row_offsets)


def test_compiled_batch_cuts_equal_the_loop():
    pytest.importorskip("numba")

    rng = np.random.default_rng(5)
    for _ in range(20):
        n = int(rng.integers(1, 3000))
        padded = np.sort(rng.integers(1, 600, n))[::-1].copy()
        ends = np.unique(np.r_[rng.integers(1, n + 1, int(rng.integers(1, 20))), n])
        want = packing._cut_loop(padded, ends, 2048)
        out = np.empty(n, dtype=np.int64)
        count = packing._jit(packing._cut_kernel)(padded, ends, 2048, out)
        assert np.array_equal(out[:count], want)

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache import ConfigError, PlanOptions, plan_epoch


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=400),
    st.integers(300, 5000),
    st.integers(1, 64),
    st.integers(1, 8),
    st.booleans(),
    st.integers(0, 3),
)
def test_budget_and_exact_coverage(lengths, max_tokens, window, multiple, shuffle, seed):
    lengths = np.asarray(lengths)
    buckets = np.searchsorted([16, 64, 128], lengths)
    options = PlanOptions(
        max_tokens=max(max_tokens, 300 + multiple),
        shuffle=shuffle,
        pad_to_multiple_of=multiple,
        window_size=window,
    )
    plan = plan_epoch(lengths, buckets, options, seed=seed)
    assert sorted(plan.sample_ids.tolist()) == list(range(len(lengths)))  # each once
    for i in range(len(plan)):
        ids = plan.batch(i)
        assert len(ids) >= 1
        width = -(-int(lengths[ids].max()) // multiple) * multiple
        assert len(ids) * width <= options.max_tokens
        assert len(set(buckets[ids].tolist())) == 1  # one bucket per batch


def test_deterministic_and_reshuffled_per_epoch():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 500, size=3000)
    buckets = np.searchsorted([128, 256], lengths)
    options = PlanOptions(max_tokens=2048, window_size=256)
    a = plan_epoch(lengths, buckets, options, seed=1, epoch=0)
    b = plan_epoch(lengths, buckets, options, seed=1, epoch=0)
    c = plan_epoch(lengths, buckets, options, seed=1, epoch=1)
    assert np.array_equal(a.sample_ids, b.sample_ids)
    assert np.array_equal(a.batch_offsets, b.batch_offsets)
    assert not np.array_equal(a.sample_ids, c.sample_ids)


def test_unshuffled_plan_follows_sample_order_within_windows():
    lengths = np.array([5, 3, 8, 1])
    plan = plan_epoch(lengths, np.zeros(4, dtype=int), PlanOptions(max_tokens=8, shuffle=False))
    assert [plan.batch(i).tolist() for i in range(len(plan))] == [[2], [0], [1, 3]]


def test_sequence_longer_than_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="max_tokens: 100 is smaller than the longest"):
        plan_epoch(np.array([50, 101]), np.zeros(2, dtype=int), PlanOptions(max_tokens=100))


def test_empty_cache_plans_no_batches():
    plan = plan_epoch(np.zeros(0, dtype=int), np.zeros(0, dtype=int), PlanOptions(max_tokens=8))
    assert len(plan) == 0


@pytest.mark.parametrize(
    "field,value", [("max_tokens", 0), ("pad_to_multiple_of", 0), ("window_size", -1)]
)
def test_options_validated(field, value):
    kwargs = {"max_tokens": 10, field: value}
    with pytest.raises(ConfigError, match=field):
        PlanOptions(**kwargs)

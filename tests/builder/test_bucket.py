from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from shardcache.builder.bucket import assign_buckets, bucket_ranges, effective_edges


def test_effective_edges_cap_at_max_length():
    assert effective_edges((64, 128, 256), None) == (64, 128, 256)
    assert effective_edges((64, 128, 256), 128) == (64, 128)
    assert effective_edges((64, 128, 256), 100) == (64, 100)
    assert bucket_ranges((64, 100), 100) == [(1, 64), (65, 100)]
    assert bucket_ranges((64,), None) == [(1, 64), (65, None)]


@given(
    st.lists(st.integers(1, 5000), min_size=1, unique=True).map(sorted),
    st.lists(st.integers(1, 10000), max_size=50),
)
def test_every_length_lands_in_its_range(edges, lengths):
    edges = tuple(edges)
    ranges = bucket_ranges(edges, None)
    for length, b in zip(lengths, assign_buckets(np.asarray(lengths), edges)):
        low, high = ranges[b]
        assert low <= length and (high is None or length <= high)

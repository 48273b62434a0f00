"""The mixture arithmetic (read/mixture.py): targets, documents per epoch, the id space, the
plan over the chosen documents. Pure numpy: no cache on disk."""

from __future__ import annotations

import io
import itertools
import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache import ConfigError
from shardcache.read.plan.epoch_plan import PlanOptions
from shardcache.read.selection.mixture import (
    Mixture,
    MixtureIndex,
    Source,
    as_sources,
    epoch_documents,
    mixture_changes,
    mixture_documents,
    mixture_epoch_plan,
    source_seed,
)
from shardcache.read.selection.mixture_table import solve_mixture


def _lengths(n: int, seed: int, high: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, high, size=n).astype(np.uint32)


def test_weights_are_token_shares_normalised_and_the_default_epoch_is_the_largest_that_fits():
    sources = (Source("a", weight=6), Source("b", weight=3), Source("c", weight=1))
    table = solve_mixture(sources, [10, 10, 10], [1000, 1000, 1000])
    assert [round(s.share, 6) for s in table.sources] == [0.6, 0.3, 0.1]
    # "a" binds: 0.6 * E <= 1000 * 1
    assert table.tokens_per_epoch == math.floor(1000 / 0.6)
    assert [s.tokens_per_epoch for s in table.sources] == [1000, 500, 167]
    assert table.sources[0].repetitions == 1.0
    assert all(s.tokens_per_epoch <= s.max_repetitions * s.tokens for s in table.sources)


def test_max_repetitions_lets_a_small_source_be_upsampled():
    sources = (Source("web", weight=0.5), Source("math", weight=0.5, max_repetitions=4))
    table = solve_mixture(sources, [100, 10], [10_000, 1_000])
    assert table.tokens_per_epoch == 8_000  # math binds: 0.5 * E <= 4 * 1000
    assert [s.repetitions for s in table.sources] == [0.4, 4.0]


def test_an_impossible_request_names_the_source_its_tokens_the_need_and_the_fixes():
    sources = (Source("web", weight=0.9), Source("math", weight=0.1))
    with pytest.raises(ConfigError) as err:
        solve_mixture(sources, [100, 10], [10_000, 500], tokens_per_epoch=10_000)
    text = str(err.value)
    for part in ("'math'", "500", "1,000", "max_repetitions", "weight", "tokens_per_epoch"):
        assert part in text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"weight": 0}, "weight"), ({"weight": -1.0}, "weight"),
     ({"max_repetitions": 0}, "max_repetitions"), ({"weight": True}, "weight"),
     ({"weight": float("nan")}, "weight"), ({"weight": 10**400}, "weight"),
     ({"max_repetitions": float("inf")}, "max_repetitions")],
)  # fmt: skip
def test_source_values_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Source("x", **kwargs)


def test_extreme_finite_weights_are_normalised_without_overflow():
    table = solve_mixture((Source("a", weight=1e308), Source("b", weight=1e308)), [10, 10],
                          [1000, 1000])  # fmt: skip
    assert [s.share for s in table.sources] == [0.5, 0.5]
    assert table.tokens_per_epoch == 2000
    exact = solve_mixture((Source("a", weight=6), Source("b", weight=3)), [10, 10], [1000, 1000])
    scaled = solve_mixture(
        (Source("a", weight=6e300), Source("b", weight=3e300)), [10, 10], [1000, 1000]
    )
    assert scaled.to_json()["sources"][0]["share"] == exact.to_json()["sources"][0]["share"]


@pytest.mark.parametrize("weight", [5e-324, 1e-300])
def test_a_source_whose_share_gives_it_no_token_is_refused(weight):
    sources = (Source("a"), Source("tiny", weight=weight))
    with pytest.raises(ConfigError, match=r"'tiny'.*no token.*raise its weight"):
        solve_mixture(sources, [10, 10], [1000, 1000])
    with pytest.raises(ConfigError, match=r"'tiny'.*no token"):
        solve_mixture(sources, [10, 10], [1000, 1000], tokens_per_epoch=500)


def test_a_huge_cap_binds_nothing_and_an_unbounded_epoch_is_refused():
    sources = (Source("a", max_repetitions=1e308), Source("b"))
    table = solve_mixture(sources, [10, 10], [1000, 1000])
    assert table.tokens_per_epoch == 2000  # b binds
    with pytest.raises(ConfigError, match=r"'a'.*max_repetitions.*tokens_per_epoch"):
        solve_mixture((Source("a", max_repetitions=1e308),), [10], [1000])
    with pytest.raises(ConfigError, match=r"tokens_per_epoch.*2\*\*63"):
        solve_mixture(sources, [10, 10], [1000, 1000], tokens_per_epoch=2**63)


def test_sources_need_unique_labels_and_accept_paths_and_mappings():
    assert [s.label for s in as_sources(["data/web/", {"path": "s3://b/code", "weight": 2}])] == [
        "web",
        "code",
    ]
    with pytest.raises(ConfigError, match="unique"):
        as_sources(["a/web", "b/web"])
    with pytest.raises(ConfigError, match="empty"):
        as_sources([])
    with pytest.raises(ConfigError, match="list of Source"):
        as_sources("web")


def test_an_empty_source_is_refused():
    with pytest.raises(ConfigError, match="no tokens"):
        solve_mixture((Source("a"), Source("b")), [3, 0], [30, 0])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    fraction=st.floats(0.05, 3.5),
    seed=st.integers(0, 3),
    lseed=st.integers(0, 100),
)
def test_every_epoch_is_within_one_document_of_its_target_and_never_overuses(
    n, fraction, seed, lseed
):
    lengths = _lengths(n, lseed)
    total = int(lengths.sum())
    target = max(1, round(fraction * total))
    cap = math.ceil(target / total)
    for epoch in range(4):
        ids = epoch_documents(lengths, target, seed, 7, epoch)
        tokens = int(lengths[ids].sum())
        assert abs(tokens - target) <= int(lengths.max())
        assert np.bincount(ids, minlength=n).max() <= max(cap, 1)
        assert np.array_equal(ids, epoch_documents(lengths, target, seed, 7, epoch))  # pure


def test_a_subsampled_source_uses_other_documents_every_epoch_and_all_of_them_in_time():
    lengths = _lengths(200, 1)
    target = int(lengths.sum()) // 4
    seen = set()
    epochs = [set(epoch_documents(lengths, target, 0, 1, e).tolist()) for e in range(6)]
    for a, b in itertools.pairwise(epochs):
        assert a != b and len(a & b) < len(a) // 4  # the window moved on
    for e in epochs[:5]:
        seen |= e
    assert seen == set(range(200))  # ceil(1 / 0.25) + 1 epochs see every document


def test_whole_passes_use_every_document_and_integer_caps_hold_exactly():
    lengths = _lengths(30, 2)
    total = int(lengths.sum())
    ids = epoch_documents(lengths, 3 * total, 0, 1, 5)
    assert np.array_equal(np.bincount(ids), np.full(30, 3))
    ids = epoch_documents(lengths, 2 * total + total // 2, 0, 1, 5)
    assert set(np.bincount(ids, minlength=30).tolist()) <= {2, 3}


def test_the_permutation_key_comes_from_the_digest_not_the_place_in_the_list():
    assert source_seed("abc") == source_seed("abc") != source_seed("abd")


def test_mixture_ids_map_back_to_source_and_local_id():
    index = MixtureIndex.of([3, 0, 5])
    source, local = index.locate(np.array([0, 2, 3, 7, -1]))
    assert source.tolist() == [0, 0, 2, 2, -1]
    assert local.tolist() == [0, 2, 0, 4, -1]


@pytest.mark.parametrize(
    "options",
    [PlanOptions(max_tokens=128), PlanOptions(max_tokens=128, mode="pack", seq_len=64),
     PlanOptions(max_tokens=128, mode="pack", seq_len=32, packing="concat")],
)  # fmt: skip
def test_the_plan_covers_exactly_the_chosen_documents(options):
    parts = [_lengths(40, 3), _lengths(25, 4), _lengths(10, 5)]
    lengths = np.concatenate(parts).astype(np.int64)
    buckets = (lengths > 25).astype(np.int32)
    sources = (Source("a", 5), Source("b", 3), Source("c", 2, max_repetitions=3))
    table = solve_mixture(sources, [len(p) for p in parts], [int(p.sum()) for p in parts])
    mixture = Mixture(sources, table, MixtureIndex.of([len(p) for p in parts]), ("x", "y", "z"))
    chosen = mixture.documents(mixture.units(lengths), 0, 1)
    plan = mixture_epoch_plan(lengths, buckets, chosen, options, 0, 1)
    firsts = plan.sample_ids  # concat: a document's pieces; count the pieces that start it
    if plan.seg_starts is not None:
        firsts = plan.sample_ids[plan.seg_starts == 0]
    got = np.sort(firsts)
    assert np.array_equal(got, np.sort(chosen))
    keys = tuple(source_seed(d) for d in ("x", "y", "z"))
    taken = mixture_documents(mixture.units(lengths), mixture.index, table, keys, 0, 1)
    again = [t.documents() + o for t, o in zip(taken, mixture.index.offsets)]
    assert np.array_equal(chosen, np.concatenate(again))


def test_changes_of_a_mixture_are_listed_field_by_field():
    sources = (Source("a", 1), Source("b", 1))
    table = solve_mixture(sources, [1, 1], [10, 10])
    ours = Mixture(sources, table, MixtureIndex.of([1, 1]), ("d1", "d2")).state()
    assert mixture_changes(ours, ours) == []
    theirs = {**ours, "sources": [dict(ours["sources"][0], weight=3.0), ours["sources"][1]]}
    assert mixture_changes(theirs, ours) == ["source 'a': weight 3.0 -> 1.0"]
    theirs = {**ours, "sources": [ours["sources"][0], dict(ours["sources"][1], digest="old")]}
    assert mixture_changes(theirs, ours) == ["source 'b': cache (key digest) 'old' -> 'd2'"]
    assert mixture_changes({**ours, "sources": ours["sources"][:1]}, ours) == ["source 'b': added"]
    assert mixture_changes(None, ours)


def test_a_large_mixture_epoch_logs_its_planning(caplog, monkeypatch):
    from shardcache.read.selection import mixture as mixture_module

    monkeypatch.setattr(mixture_module, "LOG_MIN_DOCUMENTS", 10)
    parts = [_lengths(20, 1), _lengths(20, 2)]
    sources = (Source("a"), Source("b"))
    table = solve_mixture(sources, [20, 20], [int(p.sum()) for p in parts])
    mixture = Mixture(sources, table, MixtureIndex.of([20, 20]), ("x", "y"))
    lengths = np.concatenate(parts).astype(np.int64)
    with caplog.at_level("INFO", logger="shardcache"):
        mixture.plan(
            lengths,
            np.zeros(40, np.int32),
            PlanOptions(max_tokens=128),
            0,
            3,
            mixture.units(lengths),
        )
    assert "planning epoch 3 of a mixture of 2 sources" in caplog.text
    assert "global batches" in caplog.text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_a_large_mixture_epoch_shows_its_planning_on_a_terminal(monkeypatch, terminal):
    from shardcache.read.selection import mixture as mixture_module

    monkeypatch.setattr(mixture_module, "LOG_MIN_DOCUMENTS", 10)
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    parts = [_lengths(20, 1), _lengths(20, 2)]
    sources = (Source("a"), Source("b"))
    table = solve_mixture(sources, [20, 20], [int(p.sum()) for p in parts])
    mixture = Mixture(sources, table, MixtureIndex.of([20, 20]), ("x", "y"))
    lengths = np.concatenate(parts).astype(np.int64)
    options = PlanOptions(max_tokens=128)
    mixture.plan(lengths, np.zeros(40, np.int32), options, 0, 3, mixture.units(lengths))
    shown = stderr.getvalue()
    if terminal:  # a step per source, one for the batches
        assert "plan epoch 3 (2 sources" in shown
        assert "3/3" in shown
    else:
        assert shown == ""


def test_document_uses_numbers_each_copy_of_a_document():
    from shardcache.read.selection.mixture import document_uses, epoch_documents

    index = MixtureIndex.of([3, 2])
    chosen = np.array([0, 1, 2, 0, 1, 2, 1, 3, 4])  # source 0: two passes and a window
    assert document_uses(chosen, index).tolist() == [0, 0, 0, 1, 1, 1, 2, 0, 0]
    assert document_uses(np.array([2, 0, 4]), index) is None  # nothing repeats
    # what epoch_documents gives: every (document, use) once, for any epoch
    lengths = np.arange(1, 8, dtype=np.int64)
    for epoch in range(4):
        docs = epoch_documents(lengths, int(lengths.sum() * 2.6), 0, 5, epoch)
        uses = document_uses(docs, MixtureIndex.of([7]))
        pairs = list(zip(docs.tolist(), uses.tolist()))
        assert len(set(pairs)) == len(pairs) and max(uses) == 2

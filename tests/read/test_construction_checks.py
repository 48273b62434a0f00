"""Issue 58: a read that cannot work is refused (or one that ignores what it was given is warned
about) when the ``ShardDataset`` is made, naming its real cause, not at ``len(ds)``, in a
trainer's set-up or as an empty epoch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from shardcache import ConfigError, ShardDataset, Source, Split, open_cache
from shardcache.read.selection.splits import split_ids


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    from conftest import make_texts, write_records
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    out = {}
    for name, docs, seed, extra in (
        ("a", 40, 0, {}),
        ("b", 25, 1, {}),
        ("capped", 40, 0, {"max_length": 64, "truncation": "split"}),
    ):
        folder = tmp_path_factory.mktemp(name)
        records = [{"text": t} for t in make_texts(docs, seed=seed)]
        path = write_records(str(folder / "docs.jsonl"), records, "jsonl")
        values = {"input": path, "tokenizer": tokenizer_dir, "output": str(folder / "cache"),
                  "workers": 1, **extra}  # fmt: skip
        build_cache(build_options_from_mapping(values))
        out[name] = str(folder / "cache")
    return out


def _longest(path: str, rows: np.ndarray | None = None) -> int:
    with open_cache(path) as cache:
        lengths = np.asarray(cache.lengths)
        return int((lengths if rows is None else lengths[rows]).max())


# --- a split side with no document ----------------------------------------------------------


def test_an_empty_split_side_is_refused_naming_the_side_and_its_fraction(caches):
    # before: an eval pass yielded nothing and warned "use a smaller max_tokens, fewer ranks,
    # or tail='wrap'", none of which helps
    pattern = (
        r"'validation' side of Split\(validation=0\b.*holds no document "
        r"\(validation=0\.0\).*Split\(validation=\.\.\.\) a fraction"
    )
    with pytest.raises(ConfigError, match=pattern):
        ShardDataset(caches["a"], 256, split="validation", splits=Split(), eval=True)
    with pytest.raises(ConfigError, match=r"'test' side .* \(test=0\.0\)"):
        ShardDataset(caches["a"], 256, split="test", splits=Split(validation=0.2))
    with pytest.raises(ConfigError, match=r"validation=1e-12 draws none of the documents.*raise"):
        ShardDataset(caches["a"], 256, split="validation", splits=Split(validation=1e-12))
    # a side with documents reads them
    ds = ShardDataset(caches["a"], 256, split="validation", splits=Split(0.3), eval=True)
    assert len(ds) > 0


def test_a_mixture_is_refused_only_when_no_source_s_side_holds_a_document(caches):
    named = [Source(caches["a"], name="a"), Source(caches["b"], name="b")]
    pattern = r"mixture\(a, b\)\): the 'validation' side .*no document"
    with pytest.raises(ConfigError, match=pattern):
        ShardDataset(named, 256, split="validation", splits=Split(), eval=True)
    # one source's side empty: the other's is read (an eval pass reads each side once)
    named[1] = Source(caches["b"], name="b", splits=Split())
    ds = ShardDataset(named, 256, split="validation", splits=Split(0.3), eval=True)
    assert len(ds) > 0


# --- a budget or row below the longest sequence ---------------------------------------------


def test_a_budget_below_the_longest_sequence_is_refused_at_construction(caches):
    longest = _longest(caches["a"])
    # before: ShardDataset(...) returned, and len(ds) (a trainer's set-up) raised
    with pytest.raises(ConfigError, match=rf"max_tokens: {longest - 1} is smaller than the "
                       rf"longest sequence \({longest} tokens"):  # fmt: skip
        ShardDataset(caches["a"], longest - 1)
    with pytest.raises(ConfigError, match=rf"seq_len: {longest - 1} is smaller than the longest "
                       rf"sequence \({longest} tokens\) and packing='best_fit'"):  # fmt: skip
        ShardDataset(caches["a"], 4 * longest, mode="pack", seq_len=longest - 1, attention="none")
    both = max(longest, _longest(caches["b"]))
    with pytest.raises(ConfigError, match=rf"max_tokens: {both - 1} is smaller"):
        ShardDataset([Source(caches["a"], name="a"), Source(caches["b"], name="b")], both - 1)
    # at the longest, and with concat (which cuts sequences), it reads
    assert len(ShardDataset(caches["a"], longest)) > 0
    concat = ShardDataset(caches["a"], 4 * longest, mode="pack", seq_len=longest - 1,
                          packing="concat", attention="none")  # fmt: skip
    assert len(concat) > 0


def test_only_the_sequences_a_split_side_reads_must_fit(caches):
    longest = _longest(caches["a"])
    with open_cache(caches["a"]) as cache:
        found = [
            (split, rows)
            for split in (Split(validation=0.3, seed=s) for s in range(40))
            if _longest(caches["a"], rows := split_ids(cache, split, "validation")) < longest
        ]
    assert found, "no seed keeps the longest sequence off the validation side"
    split, rows = found[0]
    side = _longest(caches["a"], rows)
    ds = ShardDataset(caches["a"], side, split="validation", splits=split, eval=True)
    assert len(ds) > 0
    with pytest.raises(ConfigError, match=rf"max_tokens: {side} is smaller.*\({longest} tokens"):
        ShardDataset(caches["a"], side, split="train", splits=split)


# --- an evaluation pass over a weighted mixture ---------------------------------------------


def test_an_eval_pass_over_a_weighted_mixture_warns_that_the_weights_are_not_applied(caches):
    weighted = [Source(caches["a"], name="a", weight=0.7),
                Source(caches["b"], name="b", weight=0.3)]  # fmt: skip
    pattern = (
        r"mixture\(a, b\)\): eval=True reads every document of every source once, so "
        r"the weights \(a 0\.7, b 0\.3\) are not applied"
    )
    with pytest.warns(UserWarning, match=pattern):
        ShardDataset(weighted, 256, eval=True)
    even = [Source(caches["a"], name="a"), Source(caches["b"], name="b")]
    with pytest.warns(UserWarning, match=r"so tokens_per_epoch=1000 are not applied"):
        ShardDataset(even, 256, eval=True, tokens_per_epoch=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardDataset(even, 256, eval=True)  # nothing ignored: no warning
        ShardDataset(weighted, 256)  # a weighted training read: the weights apply


def test_the_length_index_is_read_only_when_the_manifest_s_bound_does_not_fit(caches):
    from shardcache import PlanOptions
    from shardcache.read.selection.units import check_fits, longest_bound

    def unread() -> np.ndarray:
        raise AssertionError("the lengths were read although the bound fits")

    options = PlanOptions(max_tokens=512)
    check_fits(unread, options, bound=512)
    check_fits(lambda: np.array([100, 300]), options, bound=1024)  # read: they fit
    with pytest.raises(ConfigError, match=r"max_tokens: 512 is smaller .* \(600 tokens"):
        check_fits(lambda: np.array([100, 600]), options, bound=1024)
    with pytest.raises(ConfigError, match=r"\(600 tokens"):
        check_fits(lambda: np.array([600]), options)
    with open_cache(caches["a"]) as cache:  # the upper end of the highest bucket it holds
        top = max(int(s["bucket"]) for s in cache.manifest["shards"])
        assert longest_bound([cache]) == cache.manifest["buckets"]["ranges"][top][1]
        assert longest_bound([cache]) >= _longest(caches["a"])
    with open_cache(caches["capped"]) as cache:
        assert longest_bound([cache]) == 64 == _longest(caches["capped"])
    assert len(ShardDataset(caches["capped"], 64)) > 0
    with pytest.raises(ConfigError, match=r"max_tokens: 63 is smaller .* \(64 tokens"):
        ShardDataset(caches["capped"], 63)

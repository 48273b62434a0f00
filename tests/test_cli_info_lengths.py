"""``shardcache info --lengths``: the histogram is the length index, the costs are the reader's."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from click.testing import CliRunner

from shardcache.cli import main
from shardcache.store.cache import open_cache


@pytest.fixture()
def cache_path(corpus, tokenizer_dir, build_cache):
    folder, _ = corpus("jsonl", n_files=2, docs=60)
    return build_cache(folder, tokenizer_dir, max_length=40, truncation="split",
                       buckets="8,16,40")  # fmt: skip


def _info(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["info", *args])
    return result.exit_code, result.output


def test_histogram_counts_are_the_length_index(cache_path):
    code, out = _info(cache_path, "--lengths", "--bins", "3", "--max-tokens", "160", "--json")
    assert code == 0, out
    rows = json.loads(out)["lengths"]["histogram"]
    with open_cache(cache_path) as cache:
        lengths, buckets = np.asarray(cache.lengths, dtype=np.int64), cache.buckets()
    assert sum(r["sequences"] for r in rows) == len(lengths)
    assert sum(r["tokens"] for r in rows) == int(lengths.sum())
    for r in rows:
        inside = (buckets == r["bucket"]) & (lengths >= r["min_length"])
        inside &= lengths <= r["max_length"]
        assert r["sequences"] == int(inside.sum())
        assert r["tokens"] == int(lengths[inside].sum())
    for b in np.unique(buckets).tolist():  # a bucket's bins are disjoint and cover it
        bins = [(r["min_length"], r["max_length"]) for r in rows if r["bucket"] == b]
        assert all(hi + 1 == lo for (_, hi), (lo, _) in itertools.pairwise(bins))
        assert (
            bins[0][0] <= lengths[buckets == b].min() <= lengths[buckets == b].max() <= bins[-1][1]
        )


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_costs_are_what_the_reader_yields(cache_path, mode):
    from shardcache import ShardDataset

    code, out = _info(cache_path, "--lengths", "--max-tokens", "160", "--seq-len", "80", "--json")
    assert code == 0, out
    cost = json.loads(out)["lengths"][mode]
    options = {"mode": mode}
    if mode == "pack":
        options.update(seq_len=80, attention="none")
    slots = tokens = batches = 0
    with ShardDataset(cache_path, 160, seed=0, streams=0, rank=0, world_size=1, **options) as ds:
        for batch in ds:
            batches += 1
            slots += batch["input_ids"].numel()
            tokens += batch["meta"]["num_tokens"]
    assert (cost["batches"], cost["slots"], cost["tokens"]) == (batches, slots, tokens)
    if mode == "pad":
        assert cost["padding"] == slots - tokens
        assert sum(b["slots"] for b in cost["buckets"].values()) == slots
    else:
        assert cost["fill"] == pytest.approx(tokens / slots)


def test_text_output_and_usage_errors(cache_path):
    code, out = _info(cache_path, "--lengths", "--max-tokens", "160")
    assert code == 0, out
    assert "pad cost" in out and "of the slots hold tokens" in out and "#" in out
    code, out = _info(cache_path, "--max-tokens", "160")
    assert code == 2 and "--lengths" in out
    code, out = _info(cache_path, "--lengths", "--max-tokens", "8")
    assert code == 2 and "longest sequence" in out


def test_plot_writes_a_png_or_names_the_extra(cache_path, tmp_path):
    path = tmp_path / "lengths.png"
    code, out = _info(cache_path, "--lengths", "--plot", str(path))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 1 and "pip install 'shardcache[plot]'" in out and not path.exists()
        return
    assert code == 0, out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""Mixtures of preference caches: pairs are the units, a repetition repeats a pair whole; a
preference cache mixed with a non-preference one is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_resumable, make_string_pairs, make_texts, write_records
from shardcache import ConfigError, ShardDataset, Source, Split, open_cache
from shardcache.read.selection.splits import split_ids

#: An eval pass over these weighted sources on purpose: the warning that the weights do not
#: apply is tested in tests/read/test_construction_checks.py.
UNWEIGHTED_EVAL = pytest.mark.filterwarnings("ignore:.*eval=True reads every document:UserWarning")

PACK = {"mode": "pack", "seq_len": 64, "attention": "varlen"}


def build(folder, records, tokenizer_dir, **values) -> str:
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    path = write_records(str(folder / "in.jsonl"), records, "jsonl")
    out = str(folder / "cache")
    build_cache(build_options_from_mapping({
        "input": path, "tokenizer": tokenizer_dir, "output": out, "workers": 1, **values,
    }))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def small_pairs(tmp_path_factory, tokenizer_dir) -> str:
    """A second preference cache: 80 pairs, upsampled by the mixtures below."""
    folder = tmp_path_factory.mktemp("prefs-small")
    return build(folder, make_string_pairs(80, seed=9), tokenizer_dir, kind="preference",
                 buckets="16,32", shard_size=4096)  # fmt: skip


@pytest.fixture(scope="module")
def mixture(pairs_cache, small_pairs) -> list[Source]:
    return [Source(pairs_cache, weight=1.0, name="big"),
            Source(small_pairs, weight=0.5, max_repetitions=4.0, name="small")]  # fmt: skip


def pairs_of(batch, caches) -> list[tuple[int, int]]:
    """(source, pair) of every pair of a batch, each whole: chosen then rejected, adjacent, read
    from its own source."""
    meta = batch["meta"]
    keys = ("sample_ids", "source_ids", "pair_ids", "side")
    ids, sources, pairs, side = (meta[k].tolist() for k in keys)
    if "cu_seqlens" in meta:
        cu, flat = meta["cu_seqlens"].tolist(), batch["input_ids"].reshape(-1)
        tokens = [flat[cu[k] : cu[k + 1]].tolist() for k in range(len(ids))]
    else:
        mask = batch["attention_mask"].bool()
        tokens = [batch["input_ids"][r][mask[r]].tolist() for r in range(len(ids))]
    out = []
    for k, s in enumerate(side):
        if s != 0:
            assert s == 1 or ids[k] == -1
            continue
        assert side[k + 1] == 1 and (sources[k], pairs[k]) == (sources[k + 1], pairs[k + 1])
        assert ids[k : k + 2] == [2 * pairs[k], 2 * pairs[k] + 1]
        for j in (k, k + 1):
            assert tokens[j] == caches[sources[j]].read(ids[j]).tolist()
        out.append((sources[k], pairs[k]))
    return out


@pytest.mark.parametrize("streams", [0, 3])
@pytest.mark.parametrize("extra", [{}, PACK])
def test_a_mixture_of_preference_caches_reads_whole_pairs(mixture, streams, extra):
    caches = [open_cache(s.path) for s in mixture]
    ds = ShardDataset(mixture, 256, seed=1, streams=streams, shuffle_block=64, **extra)
    table = ds.mixture
    assert table is not None
    assert [s.documents for s in table.sources] == [c.num_sequences // 2 for c in caches]
    seen = [p for b in ds for p in pairs_of(b, caches)]
    per_source = [[p for s, p in seen if s == k] for k in range(2)]
    # the big source once at most, the small one upsampled: pairs repeated whole, none lost
    assert len(per_source[0]) == len(set(per_source[0]))
    small = np.bincount(per_source[1], minlength=caches[1].num_sequences // 2)
    assert small.max() >= 2
    if streams == 0:  # the global plan drops nothing: the small source's shares are exact
        assert small.min() >= int(table.sources[1].repetitions)
    lengths = [np.asarray(c.lengths, dtype=np.int64) for c in caches]
    tokens = [sum(int(lengths[s][2 * p] + lengths[s][2 * p + 1]) for p in per_source[s])
              for s in range(2)]  # fmt: skip
    for row, got in zip(table.sources, tokens):
        if streams == 0:
            longest = int((lengths[0][0::2] + lengths[0][1::2]).max())
            assert abs(got - row.tokens_per_epoch) <= 2 * longest
        else:  # (streams even out: a few batches may drop)
            assert got <= row.tokens_per_epoch + 64 and got > 0.8 * row.tokens_per_epoch


def test_resume_is_exact(mixture):
    def make():
        return ShardDataset(mixture, 128, seed=5, rank=1, world_size=2, streams=2)

    full = assert_resumable(
        make, lambda ds: ds, key=lambda b: b["meta"]["sample_ids"].tolist(), steps=[0, 2, 7, 15]
    )
    assert len(full) > 15


def test_ranks_equal_batches_no_pair_split(mixture):
    caches = [open_cache(s.path) for s in mixture]
    counts = []
    for rank in range(3):
        ds = ShardDataset(mixture, 128, seed=2, rank=rank, world_size=3, streams=3, **PACK)
        batches = list(ds)
        counts.append(len(batches))
        for b in batches:
            pairs_of(b, caches)
    assert len(set(counts)) == 1 and counts[0] > 2


def test_a_preference_cache_with_a_text_cache_is_refused(
    pairs_cache, tmp_path_factory, tokenizer_dir
):
    folder = tmp_path_factory.mktemp("mix-text")
    text = build(folder, [{"text": t} for t in make_texts(20, seed=3, max_words=20)],
                 tokenizer_dir)  # fmt: skip
    with pytest.raises(ConfigError, match=r"\['pairs'\] are preference caches and \['plain'\]"):
        ShardDataset([Source(pairs_cache, name="pairs"), Source(text, name="plain")], 256)


# ---- held-out splits of every source -----------------------------------------------------------

SPLIT = Split(validation=0.25, test=0.1)


def side_pairs(mixture, name: str) -> set[tuple[int, int]]:
    """(source, pair) of every pair on side ``name`` of ``SPLIT`` in each source."""
    out = set()
    for s, source in enumerate(mixture):
        with open_cache(source.path) as cache:
            rows = split_ids(cache, SPLIT, name)
        assert np.array_equal(rows[1::2], rows[0::2] + 1)  # both sides of a pair, together
        out |= {(s, int(r) // 2) for r in rows[0::2]}
    return out


@pytest.mark.parametrize("extra", [{"streams": 0}, {**PACK, "streams": 2}])
def test_a_weighted_split_mixture_reads_whole_pairs_of_its_side(mixture, extra):
    caches = [open_cache(s.path) for s in mixture]
    ds = ShardDataset(mixture, 256, seed=4, split="train", splits=SPLIT, **extra)
    table = ds.mixture
    assert table is not None
    want = side_pairs(mixture, "train")
    assert [r.documents for r in table.sources] == [
        sum(1 for s, _ in want if s == k) for k in range(2)
    ]
    seen = [p for b in ds for p in pairs_of(b, caches)]
    assert set(seen) <= want
    assert len({p for p in seen if p[0] == 0}) == len([p for p in seen if p[0] == 0])
    assert max(seen.count(p) for p in seen if p[0] == 1) >= 2  # the small side upsampled


@UNWEIGHTED_EVAL
@pytest.mark.parametrize("extra", [{"streams": 0}, {**PACK, "streams": 3}])
def test_an_eval_pass_reads_every_pair_of_every_side_once(mixture, extra):
    caches = [open_cache(s.path) for s in mixture]
    want = side_pairs(mixture, "validation")
    seen, counts = [], []
    for rank in range(2):
        ds = ShardDataset(mixture, 128, split="validation", splits=SPLIT, eval=True, rank=rank,
                          world_size=2, **extra)  # fmt: skip
        batches = list(ds)
        counts.append(len(batches))
        seen += [p for b in batches if not bool(b["meta"]["filler"]) for p in pairs_of(b, caches)]
    assert counts[0] == counts[1]
    assert sorted(seen) == sorted(want)


def test_mix_counts_pairs_of_each_side(mixture, tmp_path):
    from click.testing import CliRunner

    from shardcache.cli import main

    recipe = tmp_path / "prefs.toml"
    recipe.write_text(
        'max_tokens = 256\nsplit = "train"\n[splits]\nvalidation = 0.25\ntest = 0.1\n'
        + "".join(
            f'[[source]]\npath = "{s.path}"\nname = "{s.label}"\nweight = {s.weight}\n'
            f"max_repetitions = {s.max_repetitions}\n"
            for s in mixture
        )
    )
    got = CliRunner().invoke(main, ["mix", str(recipe), "--json"])
    assert got.exit_code == 0, got.output
    shown = json.loads(got.output)
    ds = ShardDataset(mixture, 256, split="train", splits=SPLIT)
    assert shown["sources"] == ds.mixture.to_json()["sources"]
    want = side_pairs(mixture, "train")
    assert [r["documents"] for r in shown["sources"]] == [
        sum(1 for s, _ in want if s == k) for k in range(2)
    ]


@pytest.mark.parametrize("extra", [{}, PACK])
def test_a_scheduled_preference_mixture_reads_whole_pairs_and_counts_both_sides(mixture, extra):
    from shardcache import Schedule

    caches = [open_cache(s.path) for s in mixture]
    lengths = [np.asarray(c.lengths, dtype=np.int64) for c in caches]
    small = int(lengths[1].sum())  # both sides of every pair of the small source
    schedule = Schedule(
        [{"at_tokens": 0, "weights": {"big": 1.0}}, {"at_tokens": small, "weights": {"small": 1}}],
        window_tokens=small // 2,
        total_tokens=2 * small,
    )
    ds = ShardDataset(mixture, 256, seed=1, schedule=schedule, **extra)
    assert ds.epochs == 4
    per_window = []
    for epoch in range(ds.epochs):
        ds.set_epoch(epoch)
        pairs = [p for b in ds for p in pairs_of(b, caches)]
        per_window.append({s for s, _ in pairs})
        got = sum(int(lengths[s][2 * p] + lengths[s][2 * p + 1]) for s, p in pairs)
        longest = int(max((x[0::2] + x[1::2]).max() for x in lengths))
        assert abs(got - small // 2) <= longest  # a window's tokens count both sides of a pair
    assert per_window == [{0}, {0}, {1}, {1}]
    delivered = ds.stats()["schedule"]["delivered_tokens"]
    assert delivered["small"] > 0 and abs(delivered["big"] - small) <= 2 * longest

"""Stream tails keep the data: over canonical streams an epoch leaves out at most what the
global plan would (``W - 1`` batches), every rank still yields the same count."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import write_word_corpus
from shardcache import ShardDataset, open_cache
from shardcache.read.plan.streams import StreamPlan

PACK = {"mode": "pack", "seq_len": 64, "attention": "none"}
MODES = {"pad": {}, "best_fit": PACK, "concat": {**PACK, "packing": "concat"}}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tokenizer_dir):
    """About a hundred small shards with lengths spread wide, so streams' batch counts differ."""
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    corpus = write_word_corpus(str(tmp_path_factory.mktemp("tails-corpus")), seed=1)
    out = str(tmp_path_factory.mktemp("tails") / "cache")
    values = {
        "input": corpus, "tokenizer": tokenizer_dir, "output": out, "workers": 1,
        "max_length": 64, "truncation": "split", "buckets": "8,16,32", "shard_size": 4096,
    }  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return out


def _ids(plan, batches) -> np.ndarray:
    got = [plan.batch(int(j)) for j in batches]
    return np.concatenate(got) if got else np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("world", [3, 8, 64])
def test_an_epoch_over_streams_leaves_out_at_most_w_minus_1_batches(cache, mode, world):
    rows = len(open_cache(cache).lengths)
    ranks = [
        ShardDataset(cache, 256, seed=4, rank=r, world_size=world, **MODES[mode])
        for r in range(world)
    ]
    plan = ranks[0].plan()
    assert isinstance(plan, StreamPlan) and ranks[0].options.streams == world
    # the plan holds every sequence (pad, best_fit: exactly once; concat: pieces of each)
    planned = _ids(plan, range(len(plan)))
    if mode == "concat":  # documents cut into rows: every token once
        lengths = np.asarray(open_cache(cache).lengths)
        tokens = sum(plan.token_count(lengths, j) for j in range(len(plan)))
        assert tokens == int(lengths.sum())
        assert set(planned.tolist()) == set(range(rows))
    else:
        assert sorted(planned.tolist()) == list(range(rows))
    split = ranks[0].split()
    assert len({ds.batches_per_rank() for ds in ranks}) == 1
    if world <= 8:  # streams as long as the longest (batches cut in two): whole rounds only,
        assert len(plan) == plan.full and not len(split.dropped)  # no rank reads another's
    assert len(split.dropped) <= world - 1 and len(split.repeated) == 0
    delivered = [j for ds in ranks for j in split.for_rank(ds.rank).tolist()]
    assert sorted(delivered) == list(range(len(plan) - len(split.dropped)))
    report = ranks[0].tail_report()
    assert report["dropped_batches"] == len(split.dropped) <= world - 1
    left_out = rows - len(set(_ids(plan, delivered).tolist()))
    assert left_out == report["dropped_segments"] or mode == "concat"


def test_wrap_repeats_at_most_w_minus_1_batches(cache):
    world = 8
    ds = ShardDataset(cache, 256, seed=4, rank=0, world_size=world, tail="wrap")
    plan = ds.plan()
    rows = len(open_cache(cache).lengths)
    assert sorted(_ids(plan, range(len(plan))).tolist()) == list(range(rows))  # none twice
    split = ds.split()
    assert len(split.repeated) <= world - 1 and len(split.dropped) == 0
    report = ds.tail_report()
    assert report["repeated_batches"] == len(split.repeated)


def test_the_tail_report_counts_from_a_resume_point(cache):
    first = ShardDataset(cache, 256, seed=1, rank=0, world_size=4)
    state = json.loads(json.dumps(first.state_dict(steps=2)))
    again = ShardDataset(cache, 256, seed=1, rank=0, world_size=3)
    again.load_state_dict(state)
    report = again.tail_report()
    split = again.split(start=state["consumed"])
    assert report["batches_per_rank"] == split.batches_per_rank == len(again)
    assert report["dropped_batches"] == len(split.dropped)
    assert report["start"] == 8

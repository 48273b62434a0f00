"""ShardDataset over canonical streams: every guarantee of the global plan, read locally."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import write_word_corpus
from shardcache import ShardDataset, Source, open_cache
from shardcache.read.plan.streams import StreamPlan

PACK = {"mode": "pack", "seq_len": 64, "attention": "none"}


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory, corpus_module, tokenizer_dir):
    """A cache of about a hundred small shards (the unit a stream takes)."""
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = corpus_module
    out = str(tmp_path_factory.mktemp("streams") / "cache")
    values = {
        "input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": 1,
        "max_length": 64, "truncation": "split", "buckets": "8,16,32", "shard_size": 4096,
    }  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return out


@pytest.fixture(scope="module")
def corpus_module(tmp_path_factory):
    return write_word_corpus(str(tmp_path_factory.mktemp("corpus")), seed=0)


def _key(batch) -> tuple:
    meta = batch["meta"]
    return tuple(meta["sample_ids"].tolist()) + tuple(batch["input_ids"].flatten().tolist())


def _epoch(ds, num_workers=0):
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
    return [_key(b) for b in loader]


@pytest.mark.parametrize("extra", [{}, PACK, {**PACK, "packing": "concat"}])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_ranks_together_read_the_one_rank_epoch(many_shards, extra, world):
    assert len(open_cache(many_shards).shards) >= 50

    def make(rank, w):
        return ShardDataset(many_shards, 256, seed=5, rank=rank, world_size=w, streams=8, **extra)

    one = make(0, 1)
    assert isinstance(one.plan(), StreamPlan)
    small = ShardDataset(many_shards, 256, seed=5, **extra)  # one stream of one block
    assert small.options.streams == 1 and not isinstance(small.plan(), StreamPlan)
    whole = [_key(one.collate_batch(one.plan(), j)) for j in range(len(one.plan()))]
    ranks = [_epoch(make(r, world)) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1  # equal batches per rank
    kept = len(whole) - len(whole) % world  # tail="drop": the documented remainder
    delivered = sorted(b for r in ranks for b in r)
    assert delivered == sorted(whole[:kept])


def test_resume_from_eight_to_six_to_three_ranks_and_two_workers_to_none(many_shards):
    def make(rank, w):
        return ShardDataset(many_shards, 256, seed=2, rank=rank, world_size=w)  # streams: 8

    first = [make(r, 8) for r in range(8)]
    assert first[0].options.streams == 8
    whole = first[0].plan()
    order = [_key(first[0].collate_batch(whole, j)) for j in range(len(whole))]
    seen: list[tuple] = []
    per = first[0].batches_per_rank()
    for ds in first:  # each rank takes 3 batches through 2 workers
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        it = iter(loader)
        seen += [_key(next(it)) for _ in range(3)]
        del it
    state = json.loads(json.dumps(first[0].state_dict(steps=3)))
    assert state["plan"]["streams"] == 8 and per > 3
    second = [make(r, 6) for r in range(6)]
    for ds in second:
        ds.load_state_dict(state)
        assert ds.options.streams == 8  # the run's streams, not the new world size
    for ds in second:
        it = iter(ds)
        seen += [_key(next(it)) for _ in range(2)]
    state = json.loads(json.dumps(second[0].state_dict(steps=2)))
    rest = []
    for r in range(3):
        ds = make(r, 3)
        ds.load_state_dict(state)
        rest += _epoch(ds, num_workers=0)
    cursor = 8 * 3 + 6 * 2
    kept = cursor + (len(order) - cursor) // 3 * 3
    assert sorted(seen + rest) == sorted(order[:kept])


def test_a_rank_reads_only_its_streams_shards(many_shards):
    cache = open_cache(many_shards)
    world = 4
    for rank in range(world):
        ds = ShardDataset(many_shards, 256, seed=1, rank=rank, world_size=world)
        plan = ds.plan()
        allowed = set()
        for s in range(rank, 4, world):
            allowed |= set(plan.layout.shards_of_stream(s).tolist())
        mine = ds.split().for_rank(rank)
        read = set()
        for j in mine.tolist():
            ids = plan.batch(j)
            shards = np.searchsorted(cache.shard_starts, ids, side="right") - 1
            if j < plan.full:
                assert set(shards.tolist()) <= allowed
            read |= set(shards.tolist())
        # about a quarter of the cache's shards (boundary shards and the tail beyond)
        assert len(read) <= len(cache.shards) / world * 1.5


def test_streams_zero_is_the_global_plan_and_states_of_older_versions_load(many_shards):
    ds = ShardDataset(many_shards, 256, seed=3, streams=0)
    old = ds.state_dict()
    old["plan"].pop("streams")
    old["plan"].pop("shuffle_block")
    again = ShardDataset(many_shards, 256, seed=3)  # auto: takes the state's (global) plan
    again.load_state_dict(old)
    assert again.options.streams == 0
    assert [_key(b) for b in again] == [_key(b) for b in ds]


def test_a_mixture_reads_over_streams_and_keeps_its_shares(many_shards, tmp_path):
    sources = [Source(many_shards, weight=0.7, name="a"), Source(many_shards, weight=0.3)]
    with warnings.catch_warnings():  # (the same cache twice may be warned about)
        warnings.simplefilter("ignore")
        glob = ShardDataset(sources, 256, seed=0, streams=0)
        flow = ShardDataset(sources, 256, seed=0, streams=4)

    def documents(ds):
        plan = ds.plan()
        got = []
        for j in range(len(plan)):
            got += plan.batch(j).tolist()
        return sorted(got)

    assert documents(flow) == documents(glob)  # the same documents, repeats included
    batches = _epoch(flow)
    assert len(batches) == len(flow.plan())


def test_stats_report_bytes_against_the_rank_share(many_shards):
    ds = ShardDataset(many_shards, 256, seed=0, rank=1, world_size=4)
    stats = ds.stats()
    total = sum(int(s["bytes"]) for s in open_cache(many_shards).shards)
    assert stats["share_bytes"] == pytest.approx(total / 4)
    assert stats["fetched_over_share"] == 0.0  # a local cache fetches nothing


def test_the_next_epoch_is_counted_in_the_background(many_shards):
    small = ShardDataset(many_shards, 256, seed=0, streams=2)
    small.plan()
    assert small._planner._counting is None  # one block's rows: counted at once, no thread
    ds = ShardDataset(many_shards, 256, seed=0, streams=2, shuffle_block=100)
    ds.plan()
    assert ds._planner._counting is not None
    ds._planner._counting.join()
    assert 1 in ds._planner._counts
    ds.set_epoch(1)
    counts = ds._planner._counts[1]
    planned = sum(int(c[0].sum()) for c in counts.values())
    assert len(ds.plan()) == planned + ds.plan().split_total  # every batch, some cut in two
    assert ds.plan().counts().keys() == counts.keys()


def _prepare_worker(rank, path, init, out):
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        ds = ShardDataset(path, 256, seed=7, rank=rank, world_size=2, streams=4)
        ds.prepare()
        plan = ds.plan()
        with open(out + str(rank), "w") as f:
            json.dump([plan.batch(j).tolist() for j in range(len(plan))], f)
    finally:
        torch.distributed.destroy_process_group()


def test_prepare_shares_the_counting_among_ranks(many_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(tmp_path / "store"))  # no shared counts
    init = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "plan")
    torch.multiprocessing.spawn(_prepare_worker, args=(many_shards, init, out), nprocs=2)
    alone = ShardDataset(many_shards, 256, seed=7, streams=4)
    expected = [alone.plan().batch(j).tolist() for j in range(len(alone.plan()))]
    for rank in range(2):
        with open(out + str(rank)) as f:
            assert json.load(f) == expected
    assert os.path.exists(tmp_path / "store")


def test_shorter_streams_cut_batches_in_two_so_every_stream_is_as_long(many_shards):
    ds = ShardDataset(many_shards, 256, seed=3, streams=8)
    plan = ds.plan()
    planned = np.array([int(c[0].sum()) for c in plan.counts().values()])
    assert planned.min() < planned.max()  # (the fixture's streams differ in length)
    assert plan.stream_batches.tolist() == [int(planned.max())] * 8
    assert plan.split_total == int((planned.max() - planned).sum())
    assert len(plan) == plan.full == 8 * int(planned.max())  # whole rounds: all local
    assert [plan.stream_of(j) for j in range(len(plan))] == [
        (j % 8, j // 8) for j in range(len(plan))
    ]
    report = ds.tail_report()
    assert report["split_batches"] == plan.split_total and report["dropped_batches"] == 0


def _late_group_worker(rank, path, init, out):
    ds = ShardDataset(path, 256, seed=7)  # built before the process group (Lightning's way)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        with open(out + str(rank), "w") as f:
            json.dump([ds.world_size, ds.options.streams], f)
    finally:
        torch.distributed.destroy_process_group()


def test_streams_follow_a_process_group_started_before_anything_is_planned(
    many_shards, tmp_path, monkeypatch
):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    init = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "seen")
    torch.multiprocessing.spawn(_late_group_worker, args=(many_shards, init, out), nprocs=2)
    for rank in range(2):
        with open(out + str(rank)) as f:
            assert json.load(f) == [2, 2]

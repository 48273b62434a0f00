"""Held-out splits, evaluation passes and read-time transforms (issue 46)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from torch.utils.data import DataLoader

from conftest import eval_pass
from shardcache import ConfigError, ShardDataset, Split, StateError, open_cache
from shardcache.read.collate.collator import compiled_table
from shardcache.read.selection.splits import SPLIT_NAMES, split_ids, split_summary

SPLIT = Split(validation=0.2, test=0.1)
PACK = {"mode": "pack", "seq_len": 64, "attention": "none"}


@pytest.fixture(scope="module")
def corpus_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    for f in range(3):
        with open(folder / f"part-{f}.jsonl", "w") as out:
            for d in range(200):
                n = int(rng.integers(1, 90))  # some longer than max_length: split in pieces
                out.write(json.dumps({"text": " ".join(rng.choice(words, n)) + f" d{f}-{d}"}))
                out.write("\n")
    return str(folder)


@pytest.fixture(scope="module")
def caches(tmp_path_factory, corpus_module, tokenizer_dir):
    """The same corpus built twice with other shard sizes and bucket edges."""
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    out = []
    for i, layout in enumerate(
        [{"buckets": "8,16,32", "shard_size": 4096}, {"buckets": "12,40", "shard_size": 20000}]
    ):
        path = str(tmp_path_factory.mktemp(f"split{i}") / "cache")
        values = {
            "input": corpus_module, "tokenizer": tokenizer_dir, "output": path, "workers": 1,
            "max_length": 64, "truncation": "split", **layout,
        }  # fmt: skip
        build_cache(build_options_from_mapping(values))
        out.append(path)
    return out


def _documents(path):
    """(file, record) and side of every sequence, by sample id."""
    with open_cache(path) as cache:
        docs = [(s.provenance.source, s.provenance.record) for s in cache.iter_sequences()]
        labels = SPLIT.labels(cache.document_keys())
    return docs, labels


def test_every_document_is_on_one_side_and_a_rebuild_keeps_it_there(caches):
    sides = []
    for path in caches:
        docs, labels = _documents(path)
        by_doc: dict[tuple[str, int], set[int]] = {}
        for doc, label in zip(docs, labels.tolist()):
            by_doc.setdefault(doc, set()).add(label)
        assert all(len(v) == 1 for v in by_doc.values())  # pieces of a document together
        assert len(by_doc) == 600 and len(docs) > len(by_doc)  # (some documents were split)
        sides.append({doc: next(iter(v)) for doc, v in by_doc.items()})
    assert sides[0] == sides[1]  # other shard sizes and bucket edges: the same sides
    counts = np.bincount(list(sides[0].values()), minlength=3)
    assert abs(counts[0] / 600 - 0.2) < 0.06 and abs(counts[1] / 600 - 0.1) < 0.05
    # the sides partition the cache
    with open_cache(caches[0]) as cache:
        parts = [split_ids(cache, SPLIT, name) for name in SPLIT_NAMES]
        together = np.sort(np.concatenate(parts))
        assert np.array_equal(together, np.arange(cache.num_sequences))
        summary = split_summary(cache, SPLIT)
    assert sum(summary[n]["documents"] for n in SPLIT_NAMES) == 600


def test_another_seed_draws_other_documents(caches):
    with open_cache(caches[0]) as cache:
        a = split_ids(cache, SPLIT, "validation")
        b = split_ids(cache, Split(validation=0.2, test=0.1, seed=1), "validation")
    assert not np.array_equal(a, b)


def _ids(batches):
    return [i for b in batches for i in b["meta"]["sample_ids"].tolist() if i >= 0]  # -1: empty


@pytest.mark.parametrize("streams", [0, 1, 4])
@pytest.mark.parametrize("extra", [{}, PACK])
def test_a_split_dataset_reads_exactly_its_side(caches, streams, extra):
    with open_cache(caches[0]) as cache:
        want = split_ids(cache, SPLIT, "validation")
    ds = ShardDataset(caches[0], 256, seed=3, split="validation", splits=SPLIT, streams=streams,
                      **extra)  # fmt: skip
    got = _ids(DataLoader(ds, batch_size=None))
    plan = ds.plan()
    for stream, k in getattr(plan, "dropped", list)():  # what evening the streams left out
        block, i = plan.stream_batch(stream, k)
        got += [int(x) for x in block.batch(i) if x >= 0]
    assert sorted(got) == want.tolist()  # one rank drops nothing else: the side, exactly once
    train = ShardDataset(caches[0], 256, seed=3, split="train", splits=SPLIT, streams=streams)
    assert not set(_ids(DataLoader(train, batch_size=None))) & set(want.tolist())


def test_split_options_are_checked(caches):
    with pytest.raises(ConfigError, match="pass both"):
        ShardDataset(caches[0], 256, split="validation")
    with pytest.raises(ConfigError, match="expected one of"):
        ShardDataset(caches[0], 256, split="valid", splits=SPLIT)
    with pytest.raises(ConfigError, match="sum to less than 1"):
        Split(validation=0.6, test=0.4)
    with pytest.raises(ConfigError, match="shuffle"):
        ShardDataset(caches[0], 256, eval=True, shuffle=True)


def test_a_state_of_another_split_is_refused(caches):
    a = ShardDataset(caches[0], 256, split="validation", splits=SPLIT)
    b = ShardDataset(caches[0], 256, split="train", splits=SPLIT)
    with pytest.raises(StateError, match="split"):
        b.load_state_dict(a.state_dict())
    plain = ShardDataset(caches[0], 256)
    with pytest.raises(StateError, match="split"):
        plain.load_state_dict(a.state_dict())


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("extra", [{"streams": 0}, {"streams": 6}, {**PACK, "streams": 0}])
def test_an_eval_pass_covers_its_split_once_with_equal_batches_per_rank(
    caches, world, workers, extra
):
    with open_cache(caches[0]) as cache:
        want = split_ids(cache, SPLIT, "validation").tolist()

    def make(rank):
        return ShardDataset(caches[0], 512, split="validation", splits=SPLIT, eval=True,
                            rank=rank, world_size=world, **extra)  # fmt: skip

    real = eval_pass(make, world, workers, lambda b: [b])
    assert sorted(_ids(real)) == want  # every sequence of the split exactly once


def test_an_eval_pass_with_fewer_batches_than_ranks_yields_fillers(caches):
    ds = [ShardDataset(caches[0], 16384, split="test", splits=SPLIT, eval=True, rank=r, streams=0,
                       world_size=64) for r in range(64)]  # fmt: skip
    total = len(ds[0].plan())
    assert total < 64
    fillers = [bool(b["meta"]["filler"]) for d in ds for b in d]
    assert fillers.count(False) == total and len(fillers) == 64


# ---- transforms ----------------------------------------------------------------------------


def reverse_some(ids, mask, rng):
    """A length-preserving transform: reverse a random span."""
    if len(ids) > 2:
        a, b = sorted(rng.integers(0, len(ids), 2).tolist())
        ids[a : b + 1] = ids[a : b + 1][::-1].copy()
    return ids, mask


def _key(batch):
    return (
        tuple(batch["meta"]["sample_ids"].tolist()),
        tuple(batch["input_ids"].flatten().tolist()),
    )


@pytest.mark.parametrize("extra", [{}, {**PACK, "packing": "concat"}])
def test_a_transform_changes_sequences_and_resumes_exactly(caches, extra):
    from tests.conftest import assert_resumable

    def make():
        return ShardDataset(caches[0], 256, seed=1, transform=reverse_some, **extra)

    plain = [_key(b) for b in ShardDataset(caches[0], 256, seed=1, **extra)]
    full = assert_resumable(make, lambda ds: iter(ds), _key, steps=[0, 3, 17])
    assert [k[0] for k in full] == [k[0] for k in plain]  # the same plan
    assert [k[1] for k in full] != [k[1] for k in plain]  # other tokens
    # two workers, and another epoch: seeded per sequence, not per process
    two = [_key(b) for b in DataLoader(make(), batch_size=None, num_workers=2)]
    assert two == full
    later = make()
    later.set_epoch(1)
    assert [_key(b) for b in later] != full


def test_a_transformed_stream_resumes_at_another_world_size(caches):
    def make(rank, world):
        return ShardDataset(caches[0], 256, seed=2, transform=reverse_some, rank=rank,
                            world_size=world, streams=6, tail="wrap")  # fmt: skip

    def reads(ds, rank, world, start=0):
        """``(global batch, wrap) -> key`` of a rank's batches: a batch that tail="wrap" reads
        again (its place past the plan's end) is transformed anew, so the wrap is in the key."""
        split = ds.split(start=start)
        wraps = (start + rank + world * np.arange(split.batches_per_rank)) // len(ds.plan())
        return {(j, w): _key(b) for j, w, b in zip(split.for_rank(rank).tolist(), wraps, ds)}

    whole = {}
    for r in range(2):
        whole.update(reads(make(r, 2), r, 2))
    first = make(0, 2)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict(steps=4)
    rest = {}
    for r in range(3):
        ds = make(r, 3)
        ds.load_state_dict(state)
        rest.update(reads(ds, r, 3, state["consumed"]))
    for j, key in rest.items():
        assert key == whole.get(j, key)  # the same read of a global batch: the same tokens
    assert len(set(rest) & set(whole)) > 3


def test_a_transform_may_shorten_but_not_grow_past_its_declared_growth(caches):
    shorter = ShardDataset(caches[0], 256, transform=lambda ids, mask, rng: (ids[:1], mask))
    assert int(next(iter(shorter))["attention_mask"].sum(dim=1).max()) == 1
    ds = ShardDataset(caches[0], 256, transform=lambda ids, mask, rng: (ids[:0], mask))
    with pytest.raises(ConfigError, match=r"of \d+ tokens, but it declared max_growth=0"):
        next(iter(ds))
    ds = ShardDataset(caches[0], 256, transform=lambda ids, mask, rng: (np.r_[ids, ids], mask))
    with pytest.raises(ConfigError, match=r"declared max_growth=0.*1 to \d+ tokens"):
        next(iter(ds))


def test_no_transform_keeps_the_compiled_path(caches):
    ds = ShardDataset(caches[0], 256)
    next(iter(ds))
    with_transform = ShardDataset(caches[0], 256, transform=reverse_some)
    next(iter(with_transform))
    assert not with_transform.reads_compiled
    assert ds.reads_compiled == (
        compiled_table(ds._selection, ds.kernels) is not None
    )  # unchanged without one


def test_info_shows_each_side_of_a_split(caches):
    from click.testing import CliRunner

    from shardcache.cli import main

    runner = CliRunner()
    got = runner.invoke(main, ["info", caches[0], "--split", "validation=0.2,test=0.1", "--json"])
    assert got.exit_code == 0, got.output
    splits = json.loads(got.output)["splits"]
    with open_cache(caches[0]) as cache:
        assert splits == split_summary(cache, SPLIT)
        assert sum(splits[n]["tokens"] for n in SPLIT_NAMES) == cache.num_tokens
    text = runner.invoke(main, ["info", caches[0], "--split", "validation=0.2,test=0.1"])
    assert text.exit_code == 0 and "split validation" in text.output
    bad = runner.invoke(main, ["info", caches[0], "--split", "valid=0.2"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    bad = runner.invoke(main, ["info", caches[0], "--split", "validation=0.7,test=0.5"])
    assert bad.exit_code == 2 and "sum to less than 1" in bad.output

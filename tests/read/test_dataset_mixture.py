"""ShardDataset over a mixture of caches: token shares, repetition caps, rotation of a
subsample, ranks x workers, elastic resume, tokenizer and state checks, held-out splits per
source and evaluation passes."""

from __future__ import annotations

import collections
import gc
import itertools
import json
import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import eval_pass, make_texts, write_records
from shardcache import (
    CacheKeyMismatch,
    ConfigError,
    ShardDataset,
    Source,
    Split,
    StateError,
    open_cache,
)
from shardcache.read.selection.mixture import MixtureIndex
from shardcache.read.selection.splits import SPLIT_NAMES, split_ids
from shardcache.store.key import CacheKey

#: An eval pass over these weighted sources on purpose: the warning that the weights do not
#: apply is tested in tests/read/test_construction_checks.py.
UNWEIGHTED_EVAL = pytest.mark.filterwarnings("ignore:.*eval=True reads every document:UserWarning")

BUILD = {"max_length": 64, "truncation": "split", "buckets": "8,16,32", "workers": 1}


def _build(root, name: str, tokenizer: str, docs: int, seed: int) -> str:
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = root / f"corpus-{name}"
    folder.mkdir()
    texts = make_texts(docs, seed=seed)
    write_records(str(folder / "part.jsonl"), [{"text": t} for t in texts], "jsonl")
    out = str(root / name)
    values = {"input": str(folder), "tokenizer": tokenizer, "output": out, **BUILD}
    build_cache(build_options_from_mapping(values))
    return out


def three_caches(root, tokenizer: str) -> dict[str, str]:
    """Three caches of different data, one tokenizer: web (large), code, math (small)."""
    sizes = {"web": (150, 1), "code": (60, 2), "math": (20, 3)}
    return {name: _build(root, name, tokenizer, d, s) for name, (d, s) in sizes.items()}


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """web, code and math (``three_caches``)."""
    return three_caches(tmp_path_factory.mktemp("mixture"), tokenizer_dir)


def _sources(caches, web=0.5, code=0.3, math_=0.2) -> list[Source]:
    return [
        Source(caches["web"], weight=web),
        Source(caches["code"], weight=code, max_repetitions=2),
        Source(caches["math"], weight=math_, max_repetitions=3),
    ]


PACKED = {"mode": "pack", "seq_len": 64, "attention": "none"}
CONCAT = {"mode": "pack", "seq_len": 48, "packing": "concat", "attention": "none"}


def _segments(batch) -> list[tuple[int, int, int]]:
    """(source, sample id, tokens) of every row (pad) or segment (pack), padding left out."""
    meta = batch["meta"]
    if "cu_seqlens" in meta:
        lengths = (meta["cu_seqlens"][1:] - meta["cu_seqlens"][:-1]).tolist()
    else:
        lengths = batch["attention_mask"].sum(dim=1).tolist()
    pairs = zip(meta["source_ids"].tolist(), meta["sample_ids"].tolist(), lengths)
    return [(s, i, n) for s, i, n in pairs if s >= 0]


def _key(batch) -> tuple[tuple[int, int], ...]:
    return tuple((s, i) for s, i, _ in _segments(batch))


def _plan_keys(ds: ShardDataset, batches) -> list[tuple[tuple[int, int], ...]]:
    index = MixtureIndex.of([s.documents for s in ds.mixture.sources])
    plan = ds.plan()
    keys = []
    for b in batches:
        source, local = index.locate(plan.batch(int(b)))
        keys.append(tuple(zip(source.tolist(), local.tolist())))
    return keys


@pytest.mark.parametrize("extra", [{}, PACKED, CONCAT], ids=["pad", "best_fit", "concat"])
def test_token_shares_over_an_epoch_equal_the_plan_and_the_weights(caches, extra):
    ds = ShardDataset(_sources(caches), max_tokens=256, seed=3, **extra)
    table = ds.mixture
    delivered = collections.Counter()
    opened = [open_cache(s.path) for s in table.sources]
    mixed_batches = 0
    for batch in ds:
        meta = batch["meta"]
        mixed_batches += len({s for s, _, _ in _segments(batch)}) > 1
        assert meta["source_ids"].shape == meta["sample_ids"].shape
        assert meta["source_ids"].dtype == torch.int64
        for s, _, n in _segments(batch):
            delivered[s] += n
        if not extra:  # pad rows are whole sequences of their source
            for row, (s, i) in enumerate(_key(batch)):
                want = np.asarray(opened[s].read(i), dtype=np.int64)
                assert batch["input_ids"][row, : len(want)].tolist() == want.tolist()
    lengths = [np.asarray(c.lengths, dtype=np.int64) for c in opened]
    index = MixtureIndex.of([len(x) for x in lengths])
    source, local = index.locate(ds.plan().sample_ids)
    planned = collections.Counter()
    plan = ds.plan()
    pieces = (
        plan.seg_lengths
        if plan.seg_lengths is not None
        else np.array([lengths[s][i] for s, i in zip(source, local)])
    )
    for s, n in zip(source.tolist(), pieces.tolist()):
        planned[s] += n
    assert delivered == planned  # one rank, tail "drop" drops nothing: the whole plan
    for s, row in enumerate(table.sources):
        assert abs(delivered[s] - row.share * table.tokens_per_epoch) <= lengths[s].max() + 1
    assert len(delivered) == 3
    assert mixed_batches > 0  # documents of different sources are shuffled together


def test_pack_segments_read_the_right_tokens_of_their_source(caches):
    ds = ShardDataset(_sources(caches), max_tokens=256, seed=1, **CONCAT)
    opened = [open_cache(s.path) for s in ds.mixture.sources]
    for batch in ds:
        meta = batch["meta"]
        flat = batch["input_ids"].reshape(-1).tolist()
        bounds = meta["cu_seqlens"].tolist()
        for k, (s, i, at) in enumerate(
            zip(meta["source_ids"].tolist(), meta["sample_ids"].tolist(),
                meta["sample_offsets"].tolist())
        ):  # fmt: skip
            if s < 0:
                continue
            piece = flat[bounds[k] : bounds[k + 1]]
            assert piece == np.asarray(opened[s].read(i))[at : at + len(piece)].tolist()


def test_max_repetitions_is_never_exceeded_and_upsampling_repeats_whole_passes(caches):
    sources = [
        Source(caches["web"], weight=0.2),
        Source(caches["math"], weight=0.8, max_repetitions=3),
    ]
    ds = ShardDataset(sources, max_tokens=256, seed=0)
    web, math_ = ds.mixture.sources
    assert math_.repetitions == 3.0 and web.repetitions < 1
    for epoch in range(3):
        ds.set_epoch(epoch)
        uses = collections.Counter(k for batch in ds for k in _key(batch))
        assert max(n for (s, _), n in uses.items() if s == 0) == 1
        assert {n for (s, _), n in uses.items() if s == 1} == {3}
        assert sum(1 for s, _ in uses if s == 1) == math_.documents


def test_a_subsampled_source_shows_other_documents_each_epoch_and_all_in_time(caches):
    ds = ShardDataset(_sources(caches), max_tokens=256, seed=0, tokens_per_epoch=1500)
    web = ds.mixture.sources[0]
    assert web.repetitions < 0.5
    seen, epochs = set(), []
    for epoch in range(math.ceil(1 / web.repetitions) + 1):
        ds.set_epoch(epoch)
        docs = {i for batch in ds for s, i in _key(batch) if s == 0}
        epochs.append(docs)
        seen |= docs
    assert all(a != b for a, b in itertools.pairwise(epochs))
    assert seen == set(range(web.documents))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_and_workers_get_equal_batches_whose_union_is_the_plan(caches, world, num_workers):
    streams = []
    for rank in range(world):
        ds = ShardDataset(_sources(caches), 256, seed=4, rank=rank, world_size=world, streams=world)
        loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
        streams.append([_key(b) for b in loader])
        assert streams[-1] == _plan_keys(ds, ds.split().for_rank(rank))
    assert len({len(s) for s in streams}) == 1
    whole = ShardDataset(_sources(caches), 256, seed=4, streams=world)  # the ranks' plan
    kept = len(whole.plan()) - len(whole.plan()) % world
    assert sorted(k for s in streams for k in s) == sorted(_plan_keys(whole, range(kept)))
    uses = collections.Counter(k for s in streams for b in s for k in b)
    caps = [math.ceil(r.repetitions) for r in whole.mixture.sources]
    assert all(n <= caps[s] for (s, _), n in uses.items())


def _resume_stream(make, world, new_world, num_workers, new_workers, steps, how):
    """Every rank of ``world`` takes ``steps`` batches, rank 0's state resumes ``new_world``
    ranks; returns (delivered before, delivered after)."""
    head, state = [], None
    for rank in range(world):
        ds = make(rank, world)
        if how == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            loader = StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)
            it = iter(loader)
            head += [_key(next(it)) for _ in range(steps)]
            taken = json.loads(json.dumps(loader.state_dict()))
            del it, loader
            gc.collect()
        elif how == "dataloader":
            loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
            it = iter(loader)
            head += [_key(next(it)) for _ in range(steps)]
            taken = json.loads(json.dumps(ds.state_dict(steps=steps)))
            del it, loader
            gc.collect()
        else:  # a plain loop in-process
            it = iter(ds)
            head += [_key(next(it)) for _ in range(steps)]
            taken = json.loads(json.dumps(ds.state_dict()))
        state = state or taken
    rest = []
    for rank in range(new_world):
        ds = make(rank, new_world)
        ds.load_state_dict(state)
        rest += [_key(b) for b in DataLoader(ds, batch_size=None, num_workers=new_workers)]
    return head, rest


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("how", ["loop", "dataloader", "stateful"])
@pytest.mark.parametrize("extra", [{}, PACKED], ids=["pad", "pack"])
def test_resume_at_another_world_size_and_workers_gives_the_remainder(caches, how, extra):
    def make(rank, world):  # the streams of the run (2 ranks) at every world size
        return ShardDataset(
            _sources(caches), 256, seed=6, rank=rank, world_size=world, streams=2, **extra
        )

    plan = make(0, 1).plan()
    rng = np.random.default_rng(len(how) + len(extra))
    workers = 0 if how == "loop" else 2
    for steps in sorted({1, int(rng.integers(2, make(0, 2).batches_per_rank()))}):
        head, rest = _resume_stream(make, 2, 3, workers, 0, steps, how)
        tail = (len(plan) - 2 * steps) % 3
        expected = _plan_keys(make(0, 1), range(len(plan) - tail))
        assert sorted(head + rest) == sorted(expected), f"after {steps} steps"
        assert len(head) == 2 * steps


def test_sources_with_another_tokenizer_are_refused_with_the_diff(
    caches, tmp_path, bos_tokenizer_dir
):
    other = _build(tmp_path, "bos", bos_tokenizer_dir, 10, 9)
    with pytest.raises(CacheKeyMismatch, match=r"'bos'.*another tokenizer") as err:
        ShardDataset([Source(caches["web"]), Source(other)], max_tokens=256)
    assert "tokenizer." in str(err.value)  # the changed fields are listed
    assert err.value.differences


def test_the_same_cache_under_two_names_warns(caches, tmp_path):
    import shutil
    import warnings

    twice = [Source(caches["web"], name="a"), Source(caches["web"] + "/", name="b")]
    with pytest.warns(UserWarning, match=r"'a'.*'b'.*the same cache.*twice"):
        ShardDataset(twice, 256)
    copy = str(tmp_path / "web-copy")  # a copy: the same documents under another path
    shutil.copytree(caches["web"], copy)
    with pytest.warns(UserWarning, match=r"'web'.*'web-copy'.*the same cache"):
        ShardDataset([Source(caches["web"]), Source(copy)], 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardDataset(_sources(caches), 256)


def test_expect_is_checked_per_source(caches, tmp_path, bos_tokenizer_dir):
    other = _build(tmp_path, "bos", bos_tokenizer_dir, 10, 9)
    wrong = CacheKey.from_json(open_cache(other).manifest["key"])
    right = CacheKey.from_json(open_cache(caches["code"]).manifest["key"])
    ShardDataset([Source(caches["web"]), Source(caches["code"], expect=right)], 256)
    with pytest.raises(CacheKeyMismatch, match="code"):
        ShardDataset([Source(caches["web"]), Source(caches["code"], expect=wrong)], 256)


def test_a_changed_weight_is_refused_unless_remix(caches):
    ds = ShardDataset(_sources(caches), 256, seed=2)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    assert [s["name"] for s in state["mixture"]["sources"]] == ["web", "code", "math"]
    changed = ShardDataset(_sources(caches, code=0.4), 256, seed=2)
    with pytest.raises(StateError, match=r"source 'code': weight 0.3 -> 0.4.*remix=True"):
        changed.load_state_dict(state)
    remixed = ShardDataset(_sources(caches, code=0.4), 256, seed=2, remix=True)
    with pytest.warns(UserWarning, match="remix=True: continuing epoch 0 at global batch 3"):
        remixed.load_state_dict(state)
    rest = [_key(b) for b in remixed]
    assert rest == _plan_keys(remixed, range(3, len(remixed.plan())))
    same = ShardDataset(_sources(caches), 256, seed=2)
    same.load_state_dict(state)  # the same mixture: no question asked


def test_a_changed_source_cache_is_refused(caches, tmp_path, tokenizer_dir):
    ds = ShardDataset(_sources(caches), 256, seed=2)
    state = ds.state_dict()
    rebuilt = _build(tmp_path, "code", tokenizer_dir, 61, 2)  # same name, other data
    sources = _sources(caches)
    sources[1] = Source(rebuilt, weight=0.3, max_repetitions=2)
    with pytest.raises(StateError, match=r"source 'code': cache \(key digest\)"):
        ShardDataset(sources, 256, seed=2).load_state_dict(state)
    single = ShardDataset(caches["web"], 256, seed=2)
    with pytest.raises(StateError, match="digest"):
        single.load_state_dict(state)


def test_the_mixture_table_says_what_each_source_gives(caches):
    ds = ShardDataset(_sources(caches), 256)
    table = ds.mixture
    assert [s.name for s in table.sources] == ["web", "code", "math"]
    for row, name in zip(table.sources, ("web", "code", "math")):
        cache = open_cache(caches[name])
        assert row.documents == cache.num_sequences
        assert row.tokens == int(np.asarray(cache.lengths, dtype=np.int64).sum())
        assert row.repetitions == pytest.approx(row.tokens_per_epoch / row.tokens)
        assert row.repetitions <= row.max_repetitions
    assert sum(s.share for s in table.sources) == pytest.approx(1)
    assert ShardDataset(caches["web"], 256).mixture is None
    fixed = ShardDataset(_sources(caches), 256, tokens_per_epoch=1000)
    assert fixed.mixture.tokens_per_epoch == 1000
    assert [s.tokens_per_epoch for s in fixed.mixture.sources] == [500, 300, 200]
    with pytest.raises(ConfigError, match="tokens_per_epoch"):
        ShardDataset(caches["web"], 256, tokens_per_epoch=1000)
    with pytest.raises(ConfigError, match=r"source 'web'.*holds [0-9,]+ and max_repetitions"):
        ShardDataset(_sources(caches), 256, tokens_per_epoch=10**7)


def test_spawned_workers_read_the_same_stream(caches):
    ds = ShardDataset(_sources(caches), 256, seed=8)
    inline = [_key(b) for b in ds]
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    assert [_key(b) for b in loader] == inline


def _assert_same_epochs(compiled: ShardDataset, numpy_path: ShardDataset) -> None:
    """Two epochs of the compiled reader equal the numpy path's, batch for batch."""
    from conftest import assert_batches_equal

    for epoch in range(2):
        compiled.set_epoch(epoch)
        numpy_path.set_epoch(epoch)
        got, want = _batches(compiled), _batches(numpy_path)
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            assert_batches_equal(a, b)


def _batches(ds) -> list:
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()} for b in ds]


@pytest.mark.parametrize("open_shards", [256, 3, 2, 1])
@pytest.mark.parametrize("extra", [{}, PACKED, CONCAT], ids=["pad", "best_fit", "concat"])
def test_the_compiled_reader_builds_the_same_batches_as_the_numpy_path(
    caches, extra, open_shards, monkeypatch
):
    """One table over every source's shards: the same batches as the numpy path, also when
    each source keeps one shard open (shards close and reopen between and inside batches)."""
    from shardcache.read.selection import units as dataset_module

    monkeypatch.setattr(dataset_module, "OPEN_SHARDS", open_shards)
    compiled = ShardDataset(_sources(caches), 256, seed=5, **extra)
    assert compiled.reads_compiled
    numpy_path = ShardDataset(_sources(caches), 256, seed=5, **extra)
    numpy_path.kernels = False
    assert not numpy_path.reads_compiled
    _assert_same_epochs(compiled, numpy_path)


@pytest.mark.parametrize("extra", [{}, PACKED, CONCAT], ids=["pad", "best_fit", "concat"])
def test_the_compiled_reader_writes_source_ids_itself(caches, extra, monkeypatch):
    """The kernels write every row's or segment's source and id within it: a compiled
    mixture batch never maps mixture ids back in numpy, and says the same as the plan."""
    ds = ShardDataset(_sources(caches), 256, seed=2, **extra)
    plan_keys = _plan_keys(ds, range(len(ds.plan())))

    def refuse(*args, **kwargs):
        raise AssertionError("a compiled batch's source ids were computed in numpy")

    monkeypatch.setattr(MixtureIndex, "locate", refuse)
    assert ds.reads_compiled
    batches = list(ds)
    assert [_key(b) for b in batches] == plan_keys
    for batch in batches:
        meta = batch["meta"]
        assert meta["source_ids"].dtype == meta["sample_ids"].dtype == torch.int64
        assert meta["source_ids"].shape == meta["sample_ids"].shape
        assert ((meta["source_ids"] == -1) == (meta["sample_ids"] == -1)).all()


@pytest.mark.parametrize("extra", [{}, PACKED], ids=["pad", "pack"])
def test_a_mixture_reads_with_the_kernels_a_single_cache_loaded(caches, extra):
    """A mixture's table and plan have the types of a single cache's (a read-only length
    index), so its first batch compiles no kernel of its own."""
    from shardcache.read.collate import kernels_jit

    next(iter(ShardDataset(caches["web"], 256, **extra)))
    loaded = (set(kernels_jit.pad.signatures), set(kernels_jit.pack.signatures))
    mixed = ShardDataset(_sources(caches), 256, **extra)
    next(iter(mixed))
    assert mixed.reads_compiled
    assert (set(kernels_jit.pad.signatures), set(kernels_jit.pack.signatures)) == loaded


@pytest.fixture(scope="module")
def chat_and_text(tmp_path_factory, chatml_tokenizer_dir) -> tuple[str, str]:
    """A plain-text cache and a chat cache (loss on assistant turns) of one tokenizer."""
    from conftest import make_conversations
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    root = tmp_path_factory.mktemp("chat-and-text")
    text = _build(root, "text", chatml_tokenizer_dir, 40, 5)
    chats = root / "chats"
    chats.mkdir()
    records = [{"messages": m} for m in make_conversations(30, seed=4)]
    write_records(str(chats / "c.jsonl"), records, "jsonl")
    chat = str(root / "chat")
    values = {"input": str(chats), "tokenizer": chatml_tokenizer_dir, "output": chat,
              "workers": 1, "chat": True, "max_length": 64, "truncation": "truncate"}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return text, chat


@pytest.mark.parametrize("compiled", [True, False], ids=["kernels", "numpy"])
def test_chat_and_plain_text_sources_mix_with_their_own_loss_masks(chat_and_text, compiled):
    """A chat cache (loss on assistant turns) and a plain-text cache of one tokenizer: each
    row's labels follow its own source (the chat mask; every token of plain text), on the
    compiled and the numpy path."""
    text, chat = chat_and_text
    ds = ShardDataset([Source(text, weight=0.5), Source(chat, weight=0.5)], 256, seed=1)
    ds.kernels = compiled
    assert ds.reads_compiled == compiled
    opened = [open_cache(text), open_cache(chat)]
    seen = set()
    for batch in ds:
        for row, (s, i) in enumerate(_key(batch)):
            ids = np.asarray(opened[s].read(i), dtype=np.int64)
            labels = batch["labels"][row, : len(ids)].numpy()
            mask = opened[s].read_masks(np.array([i]))[0] if s == 1 else np.ones(len(ids), bool)
            assert np.array_equal(labels, np.where(mask, ids, -100))
            seen.add(s)
    assert seen == {0, 1}


@pytest.mark.parametrize("open_shards", [256, 1])
@pytest.mark.parametrize("extra", [{}, PACKED, CONCAT], ids=["pad", "best_fit", "concat"])
def test_chat_and_plain_text_sources_give_the_numpy_paths_batches_compiled(
    chat_and_text, extra, open_shards, monkeypatch
):
    from shardcache.read.selection import units as dataset_module

    monkeypatch.setattr(dataset_module, "OPEN_SHARDS", open_shards)
    sources = [Source(p, weight=0.5) for p in chat_and_text]
    compiled = ShardDataset(sources, 256, seed=6, **extra)
    numpy_path = ShardDataset(sources, 256, seed=6, **extra)
    numpy_path.kernels = False
    assert compiled.reads_compiled
    _assert_same_epochs(compiled, numpy_path)


def test_a_closed_mixture_forgets_its_shards_and_the_dataset_reopens_it(caches):
    from shardcache.read.selection.mixed_cache import MixedCache

    mixed = MixedCache(tuple(_sources(caches)))
    table = mixed.mapped_table()
    assert table is not None and not table.addresses.any()
    last = len(table.addresses) - 1  # a shard of the last source
    assert mixed.open_mapped(last) and table.addresses[last] != 0
    assert table.file_starts[table.shard_starts[last] : table.shard_starts[last + 1]].any()
    mixed.close()
    assert not table.addresses.any()  # no address of an unmapped shard survives
    ds = ShardDataset(_sources(caches), 256, seed=5, **PACKED)
    first = [_key(b) for b in ds]
    ds.close()
    assert [_key(b) for b in ds] == first


# ---- held-out splits per source -------------------------------------------------------------

SPLIT = Split(validation=0.2, test=0.1)
NAMES = ("web", "code", "math")  # the sources of ``_sources``, in order


def _side(caches, name: str, split: Split = SPLIT, source: int | None = None) -> set:
    """(source, sample id) of every source's side ``name``, as that cache split alone reads it."""
    out = set()
    for s, key in enumerate(NAMES):
        if source is None or s == source:
            with open_cache(caches[key]) as cache:
                out |= {(s, int(i)) for i in split_ids(cache, split, name)}
    return out


def _real(ds) -> list[tuple[int, int]]:
    """(source, sample id) of every sequence of an evaluation pass, fillers left out."""
    return [k for b in ds if not bool(b["meta"]["filler"]) for k in _key(b)]


@pytest.mark.parametrize(
    "extra",
    [{"streams": 0}, {"streams": 4}, {**PACKED, "streams": 0}],
    ids=["global", "streams", "pack"],
)
@UNWEIGHTED_EVAL
def test_an_eval_pass_over_a_split_mixture_reads_every_source_s_side_once(caches, extra):
    everything: set = set()
    for name in SPLIT_NAMES:
        ds = ShardDataset(_sources(caches), 256, split=name, splits=SPLIT, eval=True, **extra)
        got = _real(ds)
        assert len(got) == len(set(got))  # no weights or repetitions: each sequence once
        assert set(got) == _side(caches, name)  # document by document, each source's own split
        assert not everything & set(got)  # the sides are disjoint over all documents
        everything |= set(got)
        table = ds.mixture
        assert [r.repetitions for r in table.sources] == [1.0, 1.0, 1.0]
        assert table.tokens_per_epoch == sum(r.tokens for r in table.sources)
    sizes = [open_cache(caches[key]).num_sequences for key in NAMES]
    assert everything == {(s, i) for s, n in enumerate(sizes) for i in range(n)}


@UNWEIGHTED_EVAL
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_an_eval_pass_over_a_mixture_covers_its_side_once_with_equal_batches_per_rank(
    caches, world, workers
):
    def make(rank):
        return ShardDataset(_sources(caches), 256, split="validation", splits=SPLIT, eval=True,
                            rank=rank, world_size=world, streams=2, **PACKED)  # fmt: skip

    real = eval_pass(make, world, workers, _key)
    assert sorted(real) == sorted(_side(caches, "validation"))


@pytest.mark.parametrize("extra", [{}, PACKED], ids=["pad", "pack"])
def test_a_weighted_mixture_of_a_side_uses_only_that_side_and_all_of_it(caches, extra):
    ds = ShardDataset(_sources(caches), 256, seed=1, split="validation", splits=SPLIT, **extra)
    side = _side(caches, "validation")
    table = ds.mixture  # the table of the sides: what each source's validation side holds
    for s, (row, key) in enumerate(zip(table.sources, NAMES)):
        mine = sorted(i for t, i in side if t == s)
        lengths = np.asarray(open_cache(caches[key]).lengths, dtype=np.int64)
        assert (row.documents, row.tokens) == (len(mine), int(lengths[mine].sum()))
        assert row.repetitions <= row.max_repetitions
    seen: set = set()
    for epoch in range(math.ceil(1 / min(r.repetitions for r in table.sources)) + 1):
        ds.set_epoch(epoch)
        got = collections.Counter(k for b in ds for k in _key(b))
        assert set(got) <= side
        caps = [math.ceil(r.repetitions) for r in table.sources]
        assert all(n <= caps[s] for (s, _), n in got.items())
        seen |= set(got)
    assert seen == side  # every held-out document, in time
    train = ShardDataset(_sources(caches), 256, seed=1, split="train", splits=SPLIT, streams=3)
    assert not {k for b in train for k in _key(b)} & side


@UNWEIGHTED_EVAL
def test_a_source_s_own_split_replaces_the_dataset_s(caches):
    own = Split(validation=0.5, seed=7)
    sources = _sources(caches)
    sources[2] = Source(caches["math"], weight=0.2, max_repetitions=3, splits=own)
    ds = ShardDataset(sources, 256, split="validation", splits=SPLIT, eval=True)
    want = _side(caches, "validation", SPLIT, 0) | _side(caches, "validation", SPLIT, 1)
    assert set(_real(ds)) == want | _side(caches, "validation", own, 2)
    as_mapping = Source(caches["math"], splits={"validation": 0.5, "seed": 7})
    assert as_mapping.splits == own  # (a recipe's table)
    with pytest.raises(ConfigError, match=r"\['web', 'code'\] have no held-out fractions"):
        ShardDataset(sources, 256, split="validation")
    with pytest.raises(ConfigError, match=r"no side to read"):
        ShardDataset(sources, 256)
    with pytest.raises(ConfigError, match=r"no side to read"):
        ShardDataset(_sources(caches), 256, splits=SPLIT)
    with pytest.raises(ConfigError, match=r"expected one of"):
        ShardDataset(_sources(caches), 256, split="valid", splits=SPLIT)
    with pytest.raises(ConfigError, match=r"Source\(.*\)\.splits: unknown field\(s\) \['train'\]"):
        Source(caches["math"], splits={"train": 0.5})


@UNWEIGHTED_EVAL
def test_a_source_with_an_empty_side_is_refused_by_weights_and_read_for_nothing_by_eval(caches):
    sources = _sources(caches)
    sources[2] = Source(caches["math"], weight=0.2, splits=Split())  # holds nothing out
    with pytest.raises(ConfigError, match=r"source 'math'.*'validation' side holds no document"):
        ShardDataset(sources, 256, split="validation", splits=SPLIT)
    ds = ShardDataset(sources, 256, split="validation", splits=SPLIT, eval=True)
    assert ds.mixture.sources[2].documents == 0
    assert set(_real(ds)) == _side(caches, "validation", SPLIT, 0) | _side(
        caches, "validation", SPLIT, 1
    )
    train = ShardDataset(sources, 256, split="train", splits=SPLIT)  # all of math is train
    assert train.mixture.sources[2].documents == open_cache(caches["math"]).num_sequences


def test_a_split_mixture_resumes_exactly_and_refuses_another_split(caches):
    from conftest import assert_resumable

    def make(**kwargs):
        options = {"split": "validation", "splits": SPLIT, **PACKED, **kwargs}
        return ShardDataset(_sources(caches), 256, seed=2, **options)

    full = assert_resumable(make, iter, _key)  # at every step (the side is a few batches)
    assert len(full) >= 2 and {k for b in full for k in b} <= _side(caches, "validation")
    state = json.loads(json.dumps(make().state_dict()))
    assert state["split"]["sources"]["math"] == SPLIT.to_json()
    for other in (
        {"split": "train"},
        {"splits": Split(validation=0.2, test=0.1, seed=1)},
        {"split": None, "splits": None},
    ):
        with pytest.raises(StateError, match="split"):
            make(**other).load_state_dict(state)
    sources = _sources(caches)
    sources[2] = Source(caches["math"], weight=0.2, max_repetitions=3, splits=Split(0.2))
    with pytest.raises(StateError, match="split"):  # one source's split differs
        ShardDataset(
            sources, 256, seed=2, split="validation", splits=SPLIT, **PACKED
        ).load_state_dict(state)
    with pytest.raises(StateError, match="split"):  # remix takes other weights, not other sides
        make(remix=True).load_state_dict({**state, "split": {**state["split"], "name": "test"}})


@UNWEIGHTED_EVAL
def test_an_eval_pass_over_a_whole_mixture_reads_every_sequence_once(caches):
    ds = ShardDataset(_sources(caches), 256, eval=True, tokens_per_epoch=10**7)  # (ignored)
    got = _real(ds)
    sizes = [open_cache(caches[key]).num_sequences for key in NAMES]
    assert sorted(got) == [(s, i) for s, n in enumerate(sizes) for i in range(n)]
    assert [r.documents for r in ds.mixture.sources] == sizes


def _length_files(root) -> list:
    folder = root / "mixtures"
    return sorted(folder.iterdir()) if folder.exists() else []


def test_a_mixture_s_length_index_is_one_file_per_machine(caches, tmp_path, monkeypatch):
    """The sources' lengths in turn, written once under $SHARDCACHE_CACHE_DIR/mixtures and
    memory-mapped; a file cut short is written again; an unwritable folder reads them in memory.
    The batches are the same in every case."""
    root = tmp_path / "machine"
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(root))
    sources = [Source(caches["web"], name="web"), Source(caches["math"], name="math")]
    expected = np.concatenate([np.asarray(open_cache(caches[n]).lengths) for n in ("web", "math")])

    def read() -> tuple[np.ndarray, list]:
        ds = ShardDataset(sources, 64, seed=3)
        lengths = ds._selection.open().lengths
        batches = [b["input_ids"].tolist() for b in ds]
        ds.close()
        return lengths, batches

    lengths, batches = read()
    (written,) = _length_files(root)
    assert isinstance(lengths, np.memmap) and np.array_equal(lengths, expected)
    stamp = written.stat().st_mtime_ns
    assert read()[1] == batches and written.stat().st_mtime_ns == stamp  # (read, not rewritten)
    with open(written, "r+b") as f:  # a crash left it short
        f.truncate(written.stat().st_size // 2)
    lengths, again = read()
    assert again == batches and np.array_equal(lengths, expected)
    assert isinstance(lengths, np.memmap)  # (written again, not read in memory from now on)
    assert written.stat().st_size > 0 and np.load(written, mmap_mode="r").shape == expected.shape
    locked = tmp_path / "read-only"
    locked.mkdir()
    (locked / "mixtures").write_text("not a folder")  # (the folder cannot be made)
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(locked))
    lengths, again = read()
    assert not isinstance(lengths, np.memmap) and np.array_equal(lengths, expected)
    assert again == batches


def test_a_rank_of_a_mixture_over_streams_never_lists_the_epoch(caches, monkeypatch):
    """Over canonical streams a rank reads a mixture epoch by shard (``EpochShards``): the
    epoch's list of document ids (what the global plan plans over) is never made, and the
    streams hold exactly its documents, repeats included."""
    from shardcache.read.selection.mixture import Mixture

    sources = [Source(caches["web"], name="web", weight=1, max_repetitions=3),
               Source(caches["math"], name="math", weight=2, max_repetitions=3)]  # fmt: skip
    whole = ShardDataset(sources, 64, seed=5, streams=0)
    whole.set_epoch(1)
    want = sorted(whole._selection._mixture.documents(whole._selection.source_units(), 5, 1))

    def listed(*args, **kwargs):
        raise AssertionError("a rank listed the mixture epoch's documents")

    monkeypatch.setattr(Mixture, "documents", listed)
    for rank in range(3):  # every rank's plan holds the epoch's documents, each use once
        ds = ShardDataset(sources, 64, seed=5, rank=rank, world_size=3, streams=3)
        ds.set_epoch(1)
        plan = ds.plan()
        assert sorted(int(i) for j in range(len(plan)) for i in plan.batch(j)) == want
        assert len(list(ds)) == ds.batches_per_rank() > 0


def test_a_mixture_of_other_bucket_edges_plans_by_their_union_over_streams(
    caches, tmp_path, tokenizer_dir
):
    """Sources built with other bucket edges: every sequence is in the bucket of the union
    of the edges, and a pad batch of the streams' plan holds one such bucket only."""
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = tmp_path / "corpus"
    folder.mkdir()
    write_records(str(folder / "p.jsonl"), [{"text": t} for t in make_texts(80, seed=9)], "jsonl")
    other = str(tmp_path / "other")
    values = {"input": str(folder), "tokenizer": tokenizer_dir, "output": other,
              **BUILD, "buckets": "12,24"}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    sources = [Source(caches["web"], name="web"), Source(other, name="other")]
    edges = np.array([8, 12, 16, 24, 32, 64])  # (both caches' bucket ends)
    ds = ShardDataset(sources, 64, seed=1, rank=0, world_size=2, streams=2)
    lengths = ds._selection.sample_lengths()
    plan = ds.plan()
    for j in range(len(plan)):
        ids = plan.batch(j)
        assert len(set(np.searchsorted(edges, lengths[ids]).tolist())) == 1, j
    whole = ShardDataset(sources, 64, seed=1, streams=0)
    every = sorted(int(i) for j in range(len(whole.plan())) for i in whole.plan().batch(j))
    assert sorted(int(i) for j in range(len(plan)) for i in plan.batch(j)) == every

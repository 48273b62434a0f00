"""The compiled batch kernels (shardcache.read.collate.kernels) against the numpy path they replace:
every batch of whole epochs, in every mode, both id types, uint16 and uint32 shards, shuffled
or not, must be identical; a kernel that meets a bad segment hands the batch back to the numpy
path, which raises the descriptive error."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import assert_batches_equal
from shardcache import ShardDataset
from shardcache.read.collate import kernels
from shardcache.read.collate.collator import Compiled
from shardcache.store.cache import Cache

pytest.importorskip("numba")

MODES = [
    {"mode": "pad"},
    {"mode": "pad", "pad_to_multiple_of": 8},
    {"mode": "pack", "packing": "concat", "seq_len": 48, "attention": "none"},
    {"mode": "pack", "packing": "best_fit", "seq_len": 64, "attention": "none"},
    {"mode": "pack", "packing": "concat", "seq_len": 32, "attention": "mask"},
]


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tokenizer_dir, big_vocab_dir, chatml_tokenizer_dir):
    """A uint16 cache (short documents split to 64 tokens, small shards), a uint32 one, and a
    chat cache (loss masks; small shards, several record batches each)."""
    from conftest import make_conversations, make_texts, write_records
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = tmp_path_factory.mktemp("kernel-corpus")
    for f in range(3):
        texts = make_texts(60, seed=40 + f)
        write_records(str(folder / f"p{f}.jsonl"), [{"text": t} for t in texts], "jsonl")
    words = folder / "words"
    words.mkdir()
    rng = np.random.default_rng(0)
    write_records(
        str(words / "w.jsonl"),
        [{"text": " ".join(f"w{i}" for i in rng.integers(0, 65530, rng.integers(1, 90)))}
         for _ in range(150)],
        "jsonl",
    )  # fmt: skip
    out = {}
    for name, source, tok in (("u16", folder, tokenizer_dir), ("u32", words, big_vocab_dir)):
        target = str(tmp_path_factory.mktemp(f"kernel-{name}") / "cache")
        values = {"input": str(source), "tokenizer": tok, "output": target, "workers": 1,
                  "max_length": 64, "truncation": "split", "buckets": "8,16,32",
                  "shard_size": "4KiB"}  # fmt: skip
        build_cache(build_options_from_mapping(values))
        out[name] = target
    chats = folder / "chats"
    chats.mkdir()
    records = [{"messages": m} for m in make_conversations(120, seed=3)]
    write_records(str(chats / "c.jsonl"), records, "jsonl")
    target = str(tmp_path_factory.mktemp("kernel-chat") / "cache")
    values = {"input": str(chats), "tokenizer": chatml_tokenizer_dir, "output": target,
              "workers": 1, "chat": True, "max_length": 64, "truncation": "truncate",
              "buckets": "16,32", "shard_size": "4KiB"}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    out["chat"] = target
    return out


def _epoch(path: str, compiled: bool, **options) -> list[dict]:
    ds = ShardDataset(path, max_tokens=256, **options)
    ds.kernels = compiled
    return list(ds)


@pytest.mark.parametrize("name", ["u16", "u32", "chat"])
@pytest.mark.parametrize("options", MODES, ids=lambda o: "-".join(map(str, o.values())))
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
def test_kernels_give_the_numpy_batches(caches, name, options, shuffle, ids_dtype):
    path = caches[name]
    assert Cache(path).dtype == np.dtype(np.uint32 if name == "u32" else np.uint16)
    assert Cache(path).has_mask == (name == "chat")
    fast = _epoch(path, True, shuffle=shuffle, ids_dtype=ids_dtype, **options)
    reference = _epoch(path, False, shuffle=shuffle, ids_dtype=ids_dtype, **options)
    assert len(fast) == len(reference) > 1
    for a, b in zip(fast, reference):
        assert_batches_equal(a, b)
        for key, value in b.items():
            if hasattr(value, "dtype"):
                assert a[key].dtype == value.dtype, key


def test_the_kernels_take_the_batches(caches, monkeypatch):
    """The comparison above is not numpy against numpy: with kernels on, no batch of a
    memory-mapped cache, plain text or chat, goes through Cache.gather."""
    calls = []
    real = Cache.gather
    monkeypatch.setattr(
        Cache, "gather", lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    )
    for options in MODES:
        assert _epoch(caches["u16"], True, shuffle=True, **options)
        assert _epoch(caches["chat"], True, shuffle=True, **options)
    assert calls == []
    assert _epoch(caches["u16"], False, shuffle=True, **MODES[0])
    assert calls


def test_a_segment_outside_its_sequence_is_the_numpy_paths_error(caches):
    """A plan the kernel refuses (a segment past its sequence's end) raises the numpy path's
    descriptive error from the kernel's refusal code, without reading the batch again."""
    ds = ShardDataset(caches["u16"], max_tokens=256, mode="pack", packing="concat", seq_len=48,
                      attention="none")  # fmt: skip
    plan = ds.plan()
    compiled = Compiled(ds._selection, ds.options.max_tokens).of(plan)
    assert compiled.pack(0, 48, 0, np.dtype(np.int32)) is not None
    late = plan.seg_starts.copy()
    late[0] += 1000  # the same lengths, from past the sequence's end
    bad = type(plan)(plan.batch_offsets, plan.sample_ids, plan.row_offsets, late, plan.seg_lengths)
    with pytest.raises(IndexError, match="past the end"):
        Compiled(ds._selection, ds.options.max_tokens).of(bad).pack(0, 48, 0, np.dtype(np.int32))
    ds._selection._cache.gather = None  # the numpy path is not taken
    with pytest.raises(IndexError, match="past the end"):
        ds.collate_batch(bad, 0)
    reference = ShardDataset(caches["u16"], max_tokens=256, mode="pack", packing="concat",
                             seq_len=48, attention="none")  # fmt: skip
    reference.kernels = False
    with pytest.raises(IndexError, match="past the end"):
        reference.collate_batch(bad, 0)


def test_shards_open_on_demand_and_closed_ones_are_never_read(caches):
    """A batch whose shards are not open opens them; the LRU closes the least recently
    used, whose address becomes zero, so a kernel can never read a closed shard. A batch over
    more shards than stay open is read on the numpy path."""
    path = caches["u16"]
    options = {"max_tokens": 256, "shuffle": True, "mode": "pack", "packing": "concat",
               "seq_len": 48, "attention": "none"}  # fmt: skip
    ds = ShardDataset(path, **options)
    reference = ShardDataset(path, **options)
    reference.kernels = False
    plan = ds.plan()
    starts = ds._selection._cache.shard_starts
    touched = [
        len(set(np.searchsorted(starts, plan.segments(i)[0], side="right").tolist()))
        for i in range(len(plan))
    ]
    most = max(touched)
    assert len(ds._selection._cache.shards) > 2 * most
    ds._selection._cache = Cache(path, open_shards=most)
    table = ds._selection._cache.mapped_table()
    gathered = []
    real = ds._selection._cache.gather
    ds._selection._cache.gather = lambda *a, **k: gathered.append(1) or real(*a, **k)
    for index in range(len(plan)):
        assert_batches_equal(ds.collate_batch(plan, index), reference.collate_batch(plan, index))
        assert touched[index] <= np.count_nonzero(table.addresses) <= most
    assert not gathered
    ds._selection._cache = Cache(path, open_shards=most - 1)
    real = ds._selection._cache.gather
    ds._selection._cache.gather = lambda *a, **k: gathered.append(1) or real(*a, **k)
    for index in range(len(plan)):
        assert_batches_equal(ds.collate_batch(plan, index), reference.collate_batch(plan, index))
    assert 0 < len(gathered) < len(plan)


def test_token_ids_above_the_tokenizer_are_refused(caches, monkeypatch):
    """The kernels check every id they copy (the store leaves that to them)."""
    from shardcache.errors import CorruptShardError

    ds = ShardDataset(caches["u16"], max_tokens=256, mode="pack", packing="concat", seq_len=48,
                      attention="none")  # fmt: skip
    ds._selection._cache = Cache(caches["u16"])
    monkeypatch.setattr(ds._selection._cache, "_max_id", 3)
    monkeypatch.setattr(
        ds._selection._cache._shards, "reader_options", {"max_token_id": 3, "with_mask": False}
    )
    ds._selection._cache.gather = None  # the kernel's refusal names the file, not a numpy re-read
    with pytest.raises(CorruptShardError, match="record batch 0 holds token id"):
        next(iter(ds))


def test_kernels_that_fail_to_load_leave_the_numpy_path(caches, monkeypatch, caplog):
    """A numba that cannot compile or load the kernels turns them off with a warning; reading
    goes on through numpy."""
    from shardcache.read.collate import kernels_jit

    monkeypatch.setattr(kernels, "disabled", None)
    kernels._compiled.cache_clear()

    def broken(*args):
        raise RuntimeError("LLVM exploded")

    monkeypatch.setattr(kernels_jit, "pack", broken)
    with caplog.at_level("WARNING", logger="shardcache"):
        kernels.warm_up()
    assert "LLVM exploded" in caplog.text and not kernels.available(np.dtype(np.uint16))
    ds = ShardDataset(caches["u16"], max_tokens=256, mode="pack", packing="concat", seq_len=48,
                      attention="none")  # fmt: skip
    assert (
        Compiled(ds._selection, ds.options.max_tokens).of(ds.plan()) is None and len(list(ds)) > 1
    )
    monkeypatch.setattr(kernels, "disabled", None)
    kernels._compiled.cache_clear()


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory, tokenizer_dir):
    """A cache of more than 64 small shards (4 KiB: enough text that they are full ones)."""
    from conftest import make_texts, write_records
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = tmp_path_factory.mktemp("many-corpus")
    for f in range(24):
        texts = make_texts(360, seed=70 + f)
        write_records(str(folder / f"p{f}.jsonl"), [{"text": t} for t in texts], "jsonl")
    target = str(tmp_path_factory.mktemp("many") / "cache")
    values = {"input": str(folder), "tokenizer": tokenizer_dir, "output": target, "workers": 1,
              "max_length": 64, "truncation": "split", "buckets": "8,16,32",
              "shard_size": "4KiB"}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return target


def test_a_pass_opens_each_shard_once_and_closes_them_at_its_end(many_shards, monkeypatch):
    """Every shard of a cache that fits in the open-shard LRU is opened once per pass (with an
    LRU smaller than the cache, 64 against 75 shards, once, a pass paid some opens twice),
    and the dataset closes them when the pass ends: no descriptor or mapping outlives it."""
    from shardcache.store import shards as shards_module

    path = many_shards
    opened = []
    init = shards_module.ShardReader.__init__

    def counting(self, file, *args, **kwargs):
        opened.append(os.path.basename(file))
        init(self, file, *args, **kwargs)

    monkeypatch.setattr(shards_module.ShardReader, "__init__", counting)
    ds = ShardDataset(path, max_tokens=256, shuffle=False, mode="pack", packing="concat",
                      seq_len=48, attention="none")  # fmt: skip
    names = [s["name"] for s in ds._selection._cache.shards]
    assert len(names) > 64  # more than the old LRU held
    first = list(ds)
    assert sorted(opened) == sorted(names)
    assert ds._selection._cache._shards._open == {}
    opened.clear()
    second = list(ds)
    assert sorted(opened) == sorted(names)
    assert ds._selection._cache._shards._open == {}
    for a, b in zip(first, second, strict=True):
        assert_batches_equal(a, b)

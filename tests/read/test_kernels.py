"""The compiled batch kernels (shardcache.read.kernels) against the numpy path they replace:
every batch of whole epochs, in every mode, both id types, uint16 and uint32 shards, shuffled
or not, must be identical; a kernel that meets a bad segment hands the batch back to the numpy
path, which raises the descriptive error."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_batches_equal
from shardcache import ShardDataset
from shardcache.read import kernels
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
def caches(tmp_path_factory, tokenizer_dir, big_vocab_dir):
    """A uint16 cache (short documents split to 64 tokens, small shards) and a uint32 one."""
    from conftest import make_texts, write_records
    from shardcache.build.run import build_cache
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
    return out


def _epoch(path: str, compiled: bool, **options) -> list[dict]:
    ds = ShardDataset(path, max_tokens=256, **options)
    ds.kernels = compiled
    return list(ds)


@pytest.mark.parametrize("name", ["u16", "u32"])
@pytest.mark.parametrize("options", MODES, ids=lambda o: "-".join(map(str, o.values())))
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
def test_kernels_give_the_numpy_batches(caches, name, options, shuffle, ids_dtype):
    path = caches[name]
    assert Cache(path).dtype == np.dtype(np.uint16 if name == "u16" else np.uint32)
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
    plain-text memory-mapped cache goes through Cache.gather."""
    calls = []
    real = Cache.gather
    monkeypatch.setattr(
        Cache, "gather", lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    )
    for options in MODES:
        assert _epoch(caches["u16"], True, shuffle=True, **options)
    assert calls == []
    assert _epoch(caches["u16"], False, shuffle=True, **MODES[0])
    assert calls


def test_a_segment_outside_its_sequence_is_the_numpy_paths_error(caches):
    """A plan the kernel refuses (a segment past its sequence's end) is read again on the
    numpy path, which raises the descriptive error."""
    ds = ShardDataset(caches["u16"], max_tokens=256, mode="pack", packing="concat", seq_len=48,
                      attention="none")  # fmt: skip
    plan = ds.plan()
    ids, starts, taken, bounds = plan.packed_segments(0)
    sources = ds._cache.mapped_sources(ids)
    assert kernels.pack_into(sources, ids, starts, taken, bounds, 48, 0, np.int32) is not None
    take = np.asarray(taken if taken is not None else ds._lengths[ids] - starts)
    late = np.asarray(starts).copy()
    late[0] += 1000  # the same lengths, from past the sequence's end
    assert kernels.pack_into(sources, ids, late, take, bounds, 48, 0, np.int32) is None
    with pytest.raises(IndexError, match="past the end"):
        ds._pack_numpy(ids, late, take, bounds, 48)


def test_a_closed_shard_is_never_read(caches):
    """Addresses of shards the LRU closed are zero: the kernel refuses them."""
    cache = Cache(caches["u16"], open_shards=2)
    ids = np.arange(cache.num_sequences, dtype=np.int64)
    first = cache.mapped_sources(ids[:1])
    assert first is not None and first.addresses[first.shard[0]] != 0
    assert cache.mapped_sources(ids) is None  # more shards than the LRU keeps open
    for sample in range(0, cache.num_sequences, 7):
        cache.mapped_sources(ids[sample : sample + 1])
    open_now = np.flatnonzero(cache._flat_addresses)
    assert 1 <= len(open_now) <= 2

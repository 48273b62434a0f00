from __future__ import annotations

import os

import numpy as np
import pytest
from transformers import AutoTokenizer

import shardcache.build as build_module
from shardcache import CacheError, CacheNotFoundError, open_cache
from shardcache.build import build_cache as build
from shardcache.config import build_options_from_mapping


def _reference(tokenizer_dir: str, text: str) -> list[int]:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok(text)["input_ids"]
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    return ids if ids and ids[-1] == eos else [*ids, eos]


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.zst", "json.gz", "parquet"])
def test_every_document_exactly_once_with_tokenizer_ids(fmt, corpus, build_cache, tokenizer_dir):
    folder, expected = corpus(fmt, n_files=3, docs=30)
    cache = open_cache(build_cache(folder, tokenizer_dir, batch_docs=7))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    seen = {}
    for seq in cache.iter_sequences():
        key = (seq.provenance.source, seq.provenance.record)
        assert key not in seen, f"{key} stored twice"
        seen[key] = seq.ids
    assert set(seen) == set(expected)
    for key, ids in seen.items():
        assert ids.tolist() == [*tok(expected[key])["input_ids"], tok.eos_token_id]
    assert cache.manifest["totals"]["documents"] == len(expected)


def test_wordpiece_ids_match_transformers_and_ignore_saved_truncation(
    corpus, build_cache, wordpiece_dir
):
    # tokenizer.json carries truncation max_length=16 and fixed padding: transformers'
    # tokenizer(text) ignores them, and so must the build (the key records them: issue 3).
    folder, expected = corpus("jsonl", n_files=1, docs=40)
    cache = open_cache(build_cache(folder, wordpiece_dir))
    lengths = []
    for seq in cache.iter_sequences():
        text = expected[(seq.provenance.source, seq.provenance.record)]
        assert seq.ids.tolist() == _reference(wordpiece_dir, text)  # [CLS] ... [SEP], no 2nd SEP
        lengths.append(len(seq.ids))
    assert max(lengths) > 16
    backend = cache.manifest["tokenizer"]["backend_truncation"]
    assert backend["max_length"] == 16


def test_no_add_special_tokens_then_sep_appended(corpus, build_cache, wordpiece_dir):
    folder, expected = corpus("jsonl", n_files=1, docs=10)
    cache = open_cache(build_cache(folder, wordpiece_dir, add_special_tokens=False))
    tok = AutoTokenizer.from_pretrained(wordpiece_dir)
    for seq in cache.iter_sequences():
        text = expected[(seq.provenance.source, seq.provenance.record)]
        plain = tok(text, add_special_tokens=False)["input_ids"]
        assert seq.ids.tolist() == [*plain, tok.sep_token_id]


def test_bos_from_post_processor_and_no_append_eos(corpus, build_cache, bos_tokenizer_dir):
    folder, expected = corpus("jsonl", n_files=1, docs=10)
    cache = open_cache(build_cache(folder, bos_tokenizer_dir, append_eos=False))
    tok = AutoTokenizer.from_pretrained(bos_tokenizer_dir)
    for seq in cache.iter_sequences():
        text = expected[(seq.provenance.source, seq.provenance.record)]
        assert seq.ids.tolist() == tok(text)["input_ids"]
        assert seq.ids[0] == tok.bos_token_id and seq.ids[-1] != tok.eos_token_id


def test_token_dtype_uint16_and_uint32(tmp_path, build_cache, tokenizer_dir, big_vocab_dir):
    from conftest import write_records

    path = write_records(str(tmp_path / "a.jsonl"), [{"text": "w1 w65529 <extra_9> w7"}], "jsonl")
    small = open_cache(build_cache(path, tokenizer_dir))
    assert small.dtype == np.uint16
    big = open_cache(build_cache(path, big_vocab_dir))
    assert big.manifest["tokenizer"]["max_token_id"] > 65535
    assert big.dtype == np.uint32
    ids = next(big.iter_sequences()).ids
    tok = AutoTokenizer.from_pretrained(big_vocab_dir)
    assert ids.tolist() == [*tok("w1 w65529 <extra_9> w7")["input_ids"], tok.eos_token_id]
    assert int(ids.max()) > 65535


@pytest.mark.parametrize("strategy", ["truncate", "drop", "split"])
def test_truncation_strategies_end_to_end(strategy, corpus, build_cache, tokenizer_dir):
    folder, expected = corpus("jsonl", n_files=1, docs=60)
    limit = 24
    cache = open_cache(build_cache(folder, tokenizer_dir, max_length=limit, truncation=strategy))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    full = {k: [*tok(t)["input_ids"], tok.eos_token_id] for k, t in expected.items()}
    stored: dict[tuple[str, int], list[tuple[int, list[int]]]] = {}
    for seq in cache.iter_sequences():
        assert 1 <= len(seq.ids) <= limit
        key = (seq.provenance.source, seq.provenance.record)
        stored.setdefault(key, []).append((seq.provenance.piece, seq.ids.tolist()))
    long_docs = {k for k, ids in full.items() if len(ids) > limit}
    assert long_docs, "the corpus must contain documents longer than max_length"
    stats = cache.manifest["stats"]
    if strategy == "truncate":
        assert set(stored) == set(full)
        for key, [(piece, ids)] in stored.items():
            want = (
                full[key] if key not in long_docs else [*full[key][: limit - 1], tok.eos_token_id]
            )
            assert piece == 0 and ids == want
        assert stats["truncated_documents"] == len(long_docs)
        assert stats["lost_tokens"] == sum(len(full[k]) - limit for k in long_docs)
    elif strategy == "drop":
        assert set(stored) == set(full) - long_docs
        assert stats["dropped_documents"] == len(long_docs)
        assert stats["lost_tokens"] == sum(len(full[k]) for k in long_docs)
    else:
        assert set(stored) == set(full)
        for key, pieces in stored.items():
            pieces.sort()
            assert [p for p, _ in pieces] == list(range(len(pieces)))
            assert [t for _, ids in pieces for t in ids] == full[key]
        assert stats["split_documents"] == len(long_docs)
        assert stats["lost_tokens"] == 0


def test_buckets_hold_their_lengths(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=50)
    cache = open_cache(build_cache(folder, tokenizer_dir, buckets="4,16,64"))
    ranges = cache.manifest["buckets"]["ranges"]
    assert ranges == [[1, 4], [5, 16], [17, 64], [65, None]]
    buckets = cache.buckets()
    for seq in cache.iter_sequences():
        low, high = ranges[buckets[seq.sample_id]]
        assert low <= len(seq.ids) <= (high or 10**9)
    assert np.array_equal(cache.lengths, [len(s.ids) for s in cache.iter_sequences()])


def test_shards_rotate_at_target_size_and_compress(corpus, build_cache, tokenizer_dir):
    folder, expected = corpus("jsonl", n_files=1, docs=200)
    plain = open_cache(build_cache(folder, tokenizer_dir, shard_size=4096, buckets="1000"))
    assert len(plain.shards) >= 2
    # every shard but the last reached the target (token bytes), none is empty
    assert all(s["tokens"] * 2 >= 4096 for s in plain.shards[:-1])
    assert all(s["rows"] > 0 for s in plain.shards)
    packed = open_cache(
        build_cache(folder, tokenizer_dir, shard_size=4096, buckets="1000", compression="zstd")
    )
    a = [s.ids.tolist() for s in plain.iter_sequences()]
    b = [s.ids.tolist() for s in packed.iter_sequences()]
    assert a == b and len(a) == len(expected)


def test_interrupted_build_leaves_no_manifest(monkeypatch, corpus, tmp_path, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=10)
    out = str(tmp_path / "out")
    options = build_options_from_mapping(
        {"input": folder, "tokenizer": tokenizer_dir, "output": out}
    )

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed before commit")

    monkeypatch.setattr(build_module, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        build(options)
    assert os.listdir(os.path.join(out, "shards"))  # work was written...
    assert not os.path.exists(os.path.join(out, "manifest.json"))  # ...but never committed
    with pytest.raises(CacheNotFoundError, match="never committed"):
        open_cache(out)


def test_existing_cache_needs_force(corpus, build_cache, tokenizer_dir):
    import dataclasses

    folder, _ = corpus("jsonl", n_files=1, docs=5)
    out = build_cache(folder, tokenizer_dir)
    options = build_options_from_mapping(
        {"input": folder, "tokenizer": tokenizer_dir, "output": out}
    )
    with pytest.raises(CacheError, match="--force"):
        build(options)
    build(dataclasses.replace(options, force=True))
    assert open_cache(out).num_sequences == 5


def test_no_tmp_files_or_pickles_left(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=20)
    out = build_cache(folder, tokenizer_dir)
    names = [f for _, _, files in os.walk(out) for f in files]
    assert not [n for n in names if n.endswith((".tmp", ".pkl", ".pickle"))]

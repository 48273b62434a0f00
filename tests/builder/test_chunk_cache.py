"""The chunk memo of this package's backends: ids in order, each chunk encoded once, bounded,
shared by threads; the added-token check; the merge of two encodings; the ASCII table learned
from a normalizer.

The chunk encoder here is a plain function of the chunk (its code points, and its length), so
every expected id is computed independently of the cache. The backends over it are tested
against HF in test_wordpiece.py and test_split_words.py."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from conftest import make_texts, run_in_threads
from shardcache.builder import chunk_cache
from shardcache.builder.chunk_cache import AddedTokens, ChunkCache, ascii_table, interleave


def _ids(chunk: str) -> list[int]:
    return [len(chunk), *map(ord, chunk)]


def _expected(chunk_lists: list[list[str]]) -> list[list[int]]:
    return [[i for chunk in chunks for i in _ids(chunk)] for chunks in chunk_lists]


def _split(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    return [t.tolist() for t in np.split(tokens, np.cumsum(lengths)[:-1])] if len(lengths) else []


def _counting() -> tuple[ChunkCache, list[str]]:
    calls: list[str] = []
    return ChunkCache(lambda chunk: calls.append(chunk) or _ids(chunk)), calls


def test_ids_in_order_each_chunk_encoded_once():
    """Texts with repeated, empty and long chunks: ids in text and chunk order; a chunk is
    encoded once unless it is longer than CACHED_CHUNK_CHARS."""
    cache, calls = _counting()
    long = "x" * (chunk_cache.CACHED_CHUNK_CHARS + 1)
    chunk_lists = [["a", "bb", "a"], [], ["bb", long, "ccc"], [long], ["a"]]
    for _ in range(2):
        tokens, lengths = cache.encode(chunk_lists)
        assert tokens.dtype == np.uint32 and lengths.dtype == np.int64
        assert _split(tokens, lengths) == _expected(chunk_lists)
    assert sorted(calls) == sorted(["a", "bb", "ccc", long, long, long, long])


def test_bounded_cache_and_threads_give_the_same_ids(monkeypatch):
    """With a cache a few chunks long (started again between batches) and two threads sharing
    it, every batch still gets its ids."""
    monkeypatch.setattr(chunk_cache, "CACHE_CHUNKS", 8)
    monkeypatch.setattr(chunk_cache, "CACHE_IDS", 64)
    cache, calls = _counting()
    texts = [t.split() for t in make_texts(300, seed=4)]
    batches = [texts[i : i + 16] for i in range(0, len(texts), 16)]
    errors: list[int] = []

    def run() -> None:
        for k, batch in enumerate(batches):
            if _split(*cache.encode(batch)) != _expected(batch):
                errors.append(k)

    run_in_threads(run)
    assert errors == []
    distinct = {c for batch in texts for c in batch}
    assert len(calls) > len(distinct)  # the bound made it start again


def test_cache_is_shared_by_threads():
    """A build encodes each partition in a new thread: the second thread finds the first
    one's chunks and encodes none again."""
    cache, calls = _counting()
    chunk_lists = [t.split() for t in make_texts(50, seed=6)]
    for _ in range(2):
        thread = threading.Thread(target=cache.encode, args=(chunk_lists,))
        thread.start()
        thread.join()
    assert calls and sorted(calls) == sorted({c for chunks in chunk_lists for c in chunks})


def test_texts_without_chunks_go_whole_and_keep_their_place():
    """``encode_or_whole``: None sends a text to ``whole``; the result is in text order."""
    cache, _ = _counting()
    texts = ["a b", "<x> whole", "c", "", "<x>"]
    chunk_lists = [["a", "b"], None, ["c"], [], None]
    got = cache.encode_or_whole(
        texts, chunk_lists, lambda whole: (np.asarray([9] * len(whole), np.uint32),
                                           np.ones(len(whole), np.int64)),
    )  # fmt: skip
    assert _split(*got) == [_ids("a") + _ids("b"), [9], _ids("c"), [], [9]]


def test_interleave_merges_groups_in_position_order():
    rng = random.Random(1)
    n = 50
    positions = list(range(n))
    rng.shuffle(positions)
    a, b = sorted(positions[:20]), sorted(positions[20:])
    ids = {i: [i] * rng.randint(0, 3) for i in range(n)}

    def flat(group: list[int]) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.asarray([len(ids[i]) for i in group], np.int64)
        tokens = np.asarray([t for i in group for t in ids[i]], np.uint32)
        return tokens, lengths

    out = interleave(n, (np.asarray(a), flat(a)), (np.asarray(b), flat(b)))
    assert _split(*out) == [ids[i] for i in range(n)]


@pytest.mark.parametrize(
    ("text", "raw", "normalized"),
    [
        ("plain text", False, False),
        ("a <extra_id_57> b", True, False),
        ("<extra_id_", False, False),
        ("<extra_id_100>", False, False),  # holds none of <extra_id_0..99>
        ("a<extra_id_10>0>", True, False),
        ("x</s>", True, False),
        ("hello world", False, True),
        ("HELLO world", False, False),
    ],
)
def test_added_tokens_found_once_per_start(text, raw, normalized):
    """Tokens sharing a two-character start are found as well as tokens alone."""
    added = [{"content": f"<extra_id_{i}>"} for i in range(100)]
    added += [{"content": "</s>", "normalized": False}, {"content": ""}]
    added += [{"content": "Hello World", "normalized": True}]
    tokens = AddedTokens(added, str.lower)
    assert tokens.normalized == ("hello world",)
    assert tokens.in_raw(text) is raw
    assert tokens.in_normalized(text) is normalized


def test_ascii_table_reads_each_character_between_letters():
    """A per-character normalizer gives its own map; a Strip-like step, which only acts at a
    text's ends, does not touch a space between letters; a normalizer that changes the
    letters around a character gives no table."""
    assert ascii_table(str) == {}
    assert ascii_table(str.lower) == {ord(c): c.lower() for c in map(chr, range(65, 91))}
    assert ascii_table(lambda text: text.strip()) == {}
    assert ascii_table(lambda text: text.replace("\t", "  ")) == {9: "  "}
    assert ascii_table(str.upper) is None
    assert ascii_table(lambda text: text.replace("ab", "x")) is None


def test_ascii_table_of_hf_normalizers_is_their_per_character_output():
    """HF's BertNormalizer (control characters dropped, whitespace to a space, lowercase)
    and NFKC: the table equals each character normalized alone, and translating every ASCII
    character equals HF's output of the same string."""
    from tokenizers import normalizers

    ascii_chars = "".join(map(chr, range(128)))
    for normalizer in (normalizers.BertNormalizer(lowercase=True), normalizers.NFKC()):
        table = ascii_table(normalizer.normalize_str)
        assert table is not None
        alone = {ord(c): normalizer.normalize_str(c) for c in ascii_chars}
        assert table == {code: out for code, out in alone.items() if out != chr(code)}
        assert ascii_chars.translate(table) == normalizer.normalize_str(ascii_chars)

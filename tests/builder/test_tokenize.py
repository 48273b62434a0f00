from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardcache import ConfigError, TokenizerError
from shardcache.builder.sources import TextBatch
from shardcache.builder.tokenize import (
    TextEncoder,
    TruncationStats,
    append_end_token,
    apply_truncation,
    max_token_id,
    token_dtype,
)
from shardcache.config import TokenizeOptions

EOS = 9


def _flat(seqs):
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    tokens = np.array([t for s in seqs for t in s], dtype=np.uint16)
    return tokens, lengths


def _split(tokens, lengths):
    out, start = [], 0
    for n in lengths.tolist():
        out.append(tokens[start : start + n].tolist())
        start += n
    return out


def test_append_end_token_never_doubles():
    tokens, lengths = _flat([[1, 2], [3, EOS], [], [EOS]])
    t, n = append_end_token(tokens, lengths, EOS)
    assert _split(t, n) == [[1, 2, EOS], [3, EOS], [EOS], [EOS]]


seqs_strategy = st.lists(st.lists(st.integers(0, 8), max_size=30), max_size=12)


@given(seqs_strategy, st.integers(2, 12))
def test_split_pieces_concatenate_to_the_sequence(seqs, limit):
    tokens, lengths = _flat(seqs)
    stats = TruncationStats()
    enc = apply_truncation(
        tokens, lengths, TokenizeOptions("t", max_length=limit, truncation="split"), EOS, stats
    )
    pieces = _split(enc.tokens, enc.lengths)
    assert all(1 <= len(p) <= limit for p in pieces)
    rebuilt: dict[int, list[int]] = {}
    for doc, piece, ids in zip(enc.doc_index.tolist(), enc.piece.tolist(), pieces):
        assert piece == len(rebuilt.get(doc, [])) // limit
        rebuilt.setdefault(doc, []).extend(ids)
    assert rebuilt == {i: s for i, s in enumerate(seqs) if s}
    assert stats.split_documents == sum(len(s) > limit for s in seqs)
    assert stats.empty_documents == sum(not s for s in seqs)


@given(seqs_strategy, st.integers(2, 12))
def test_truncate_keeps_prefix_and_end_marker(seqs, limit):
    seqs = [[*s, EOS] for s in seqs]
    tokens, lengths = _flat(seqs)
    stats = TruncationStats()
    enc = apply_truncation(tokens, lengths, TokenizeOptions("t", max_length=limit), EOS, stats)
    out = _split(enc.tokens, enc.lengths)
    for s, o in zip(seqs, out):
        assert o == (s if len(s) <= limit else [*s[: limit - 1], EOS])
    assert stats.lost_tokens == sum(max(0, len(s) - limit) for s in seqs)
    assert stats.truncated_documents == sum(len(s) > limit for s in seqs)


@given(seqs_strategy, st.integers(2, 12))
def test_drop_removes_only_long_documents(seqs, limit):
    tokens, lengths = _flat(seqs)
    stats = TruncationStats()
    options = TokenizeOptions("t", max_length=limit, truncation="drop")
    enc = apply_truncation(tokens, lengths, options, EOS, stats)
    kept = [s for s in seqs if 0 < len(s) <= limit]
    assert _split(enc.tokens, enc.lengths) == kept
    assert stats.dropped_documents == sum(len(s) > limit for s in seqs)
    assert stats.lost_tokens == sum(len(s) for s in seqs if len(s) > limit)


def test_token_dtype_boundary():
    assert token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32


def test_slow_tokenizer_is_refused():
    slow = types.SimpleNamespace(is_fast=False)
    with pytest.raises(TokenizerError, match=r"slow .*needs a fast one"):
        TextEncoder(TokenizeOptions("some/slow-tok"), hf_tokenizer=slow)


def test_missing_tokenizer_folder(tmp_path):
    with pytest.raises(TokenizerError, match="no such folder"):
        TextEncoder(TokenizeOptions(str(tmp_path / "absent")))


def test_backend_settings_recorded_and_switched_off(wordpiece_dir):
    encoder = TextEncoder(TokenizeOptions(wordpiece_dir))
    assert encoder.backend_truncation["max_length"] == 16
    assert encoder.backend_padding is not None
    ids = encoder.encode_texts(["data " * 40])[0]
    assert len(ids) == 42  # [CLS] + 40 + [SEP]: neither truncated to 16 nor padded


def test_no_end_token_needs_no_append_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="--no-append-eos"):
        TextEncoder(TokenizeOptions(str(tmp_path)))
    encoder = TextEncoder(TokenizeOptions(str(tmp_path), append_eos=False))
    assert encoder.eos_id is None


def test_named_class_loader_matches_autotokenizer(
    tokenizer_dir, bos_tokenizer_dir, wordpiece_dir, big_vocab_dir, chatml_tokenizer_dir
):
    from transformers import AutoTokenizer

    from shardcache.builder.tokenize import load_hf_tokenizer

    text = "data 🙂 東京 <eos> w7 [SEP] café"
    for folder in (tokenizer_dir, bos_tokenizer_dir, wordpiece_dir, big_vocab_dir,
                   chatml_tokenizer_dir):  # fmt: skip
        ours, auto = load_hf_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        assert type(ours) is type(auto)
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
        assert ours.special_tokens_map == auto.special_tokens_map


def test_max_token_id_reads_the_json_as_get_vocab_does(
    tokenizer_dir, bos_tokenizer_dir, wordpiece_dir, big_vocab_dir, chatml_tokenizer_dir
):
    import json

    from tokenizers import Tokenizer, models

    for folder in (tokenizer_dir, bos_tokenizer_dir, wordpiece_dir, big_vocab_dir,
                   chatml_tokenizer_dir):  # fmt: skip
        encoder = TextEncoder(TokenizeOptions(folder))
        vocab = encoder.backend.get_vocab(with_added_tokens=True)
        assert encoder.max_token_id == max(vocab.values()), folder
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0)], 0))
    unigram.add_special_tokens(["<eos>"])
    wordlevel = Tokenizer(models.WordLevel({"a": 0, "b": 7, "[UNK]": 3}, unk_token="[UNK]"))
    for backend in (unigram, wordlevel):
        expected = max(backend.get_vocab(with_added_tokens=True).values())
        assert max_token_id(json.loads(backend.to_str()), backend) == expected
    # an unknown model layout falls back to get_vocab
    assert max_token_id({"model": {"type": "Other"}}, wordlevel) == 7


def test_own_tokenizer_backend_is_used_a_callers_is_not_mutated(wordpiece_dir):
    """A tokenizer the encoder loads is its own (no 0.6 s clone); a caller's keeps its
    saved truncation and padding."""
    from shardcache.builder.tokenize import load_hf_tokenizer

    owned = TextEncoder(TokenizeOptions(wordpiece_dir))
    assert owned.backend is owned.hf.backend_tokenizer
    hf = load_hf_tokenizer(wordpiece_dir)
    encoder = TextEncoder(TokenizeOptions(wordpiece_dir), hf_tokenizer=hf)
    assert encoder.backend is not hf.backend_tokenizer
    assert hf.backend_tokenizer.truncation["max_length"] == 16
    assert encoder.backend.truncation is None and encoder.backend.padding is None
    assert owned.encode_texts(["data " * 40])[0].tolist() == hf("data " * 40)["input_ids"]


def test_encode_ahead_reads_ahead_in_order_and_reraises_upstream_errors(tokenizer_dir):
    import threading

    from shardcache.builder.tokenize import encode_ahead

    encoder = TextEncoder(TokenizeOptions(tokenizer_dir))
    readers: set[str] = set()

    def batches(n: int, fail: bool = False):
        for i in range(n):
            readers.add(threading.current_thread().name)
            yield TextBatch([f"data {i}", "w7 café"], np.arange(2 * i, 2 * i + 2), "a.jsonl")
        if fail:
            raise OSError("disk gone")

    got = [(batch.texts[0], ids[0].tolist()) for batch, ids in encode_ahead(encoder, batches(5))]
    assert [text for text, _ in got] == [f"data {i}" for i in range(5)]
    assert [ids for _, ids in got] == [encoder.encode_texts([f"data {i}"])[0].tolist()
                                       for i in range(5)]  # fmt: skip
    assert readers == {"shardcache-read"}  # upstream read in its own thread
    with pytest.raises(OSError, match="disk gone"):
        list(encode_ahead(encoder, batches(3, fail=True)))
    stream = encode_ahead(encoder, batches(10_000))  # an early close stops the threads
    next(stream)
    stream.close()


def test_a_build_interrupted_mid_encode_waits_for_it_at_exit(tokenizer_dir, tmp_path):
    """An error or Ctrl-C leaves encode_ahead without waiting for the encode in flight; its
    threads are not daemons, so interpreter shutdown waits for them to see the stop. A daemon
    thread still inside the Rust encoder at finalization was killed by a forced unwind as it
    took the GIL back, and the process aborted ("FATAL: exception not rethrown", exit -6)."""
    import subprocess
    import sys

    script = f"""
import threading, time
import numpy as np
from shardcache.builder.sources import TextBatch
from shardcache.builder.tokenize import TextEncoder, encode_ahead
from shardcache.config import TokenizeOptions
encoder = TextEncoder(TokenizeOptions({tokenizer_dir!r}))
encode = encoder.encode_texts
started = threading.Event()
def slow(texts, keys):
    started.set()
    time.sleep(0.5)  # an encode still running when the consumer gives up
    return encode(texts, keys)
encoder.encode_texts = slow
def batches():
    for i in range(100):
        yield TextBatch([f"data {{i}}"], np.arange(i, i + 1), "a.jsonl")
stream = encode_ahead(encoder, batches())
try:
    next(stream)
    started.clear()
    started.wait(5)
    raise KeyboardInterrupt
except KeyboardInterrupt:
    stream.close()
    ours = [t for t in threading.enumerate() if t.name.startswith("shardcache-")]
    print("daemons:", [t.name for t in ours if t.daemon])
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "daemons: []" in result.stdout

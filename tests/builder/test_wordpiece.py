"""The WordPiece backend: HF's ids (without special tokens) for every text, ASCII or not.

WordPiece tokenizers are trained in-process; each test compares with the same tokenizer's
``encode_batch``. The backend's choice of backend (the gate, builds) is tested in
test_backends.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import assert_same_ids_as_hf, make_texts, run_in_threads
from shardcache.builder import chunk_cache
from shardcache.builder.hf_backend import HFBackend
from shardcache.builder.wordpiece import AsciiWordPiece

CODE = [
    "def f(x):\n    return {'k': [x ** 2, x // 3]}  # comment\r\n\tif a != b: pass",
    "for (int i = 0; i < n; ++i) { s += a[i] >> 2; }  /* ok */ <tool_call> $HOME ~user `x`",
    "self.assertEqual(os.path.join(base_dir, 'data.json'), expected)  # noqa: E501",
]


def _tokenizer(**normalizer: bool | None):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(**normalizer)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=600, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator([*make_texts(400, seed=3), *CODE * 20, "Ünïcödé café naïve"], trainer)
    return tok


@pytest.fixture(
    scope="module",
    params=[{"lowercase": True}, {"lowercase": False}, {"lowercase": False, "strip_accents": True}],
    ids=["uncased", "cased", "cased-stripped"],
)
def tok(request):
    return _tokenizer(**request.param)


def _backend(tok) -> AsciiWordPiece:
    return AsciiWordPiece(json.loads(tok.to_str()), HFBackend(tok))


def _hf(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def test_every_pair_of_ascii_characters_encodes_as_hf(tok):
    """Every ASCII character (controls, whitespace, punctuation) next to every other, alone
    and between words: the per-character tables are HF's."""
    backend = _backend(tok)
    pairs = [chr(a) + chr(b) for a in range(128) for b in range(128)]
    for context in ("{}", "the{}quick fox", "x {} Café"):
        assert_same_ids_as_hf(tok, backend, [context.format(p) for p in pairs])


def test_long_and_unknown_words_encode_as_hf(tok):
    """Words at and over the 100-character limit, longer than any vocabulary entry, made of
    characters the vocabulary lacks, digits and runs of punctuation."""
    rng = random.Random(5)
    letters = "abcdefghijklmnopqrstuvwxyzQXZ0123456789"
    texts = ["a" * 99, "a" * 100, "a" * 101, "b" * 100 + "!" + "c" * 100, "x" * 5000]
    texts += ["".join(rng.choice(letters) for _ in range(rng.randint(1, 140))) for _ in range(300)]
    texts += ["...!!!???---___" * 10, "\x00\x01\x7f", "\t\n\r\x0b\x0c\x1c\x1d\x1e\x1f", ""]
    assert_same_ids_as_hf(tok, _backend(tok), texts)


def test_every_vocabulary_entry_encodes_as_hf(tok):
    """Each entry as a word, each continuation after a first piece, and the longest entry of
    the vocabulary (a whole word, added here) alone and inside longer words."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    longest = "pneumonoultramicroscopic"
    vocab[longest] = len(vocab)
    vocab["##silicovolcanoconiosis"] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(data))
    texts = [e[2:] if e.startswith("##") else e for e in vocab]
    texts += [f"a{e[2:]} the{e[2:]}x" for e in vocab if e.startswith("##")]
    texts += [longest, longest + "silicovolcanoconiosis", "x" + longest, longest[:-1], longest * 3]
    assert_same_ids_as_hf(tok, AsciiWordPiece(data, HFBackend(tok)), texts)


def test_non_ascii_text_encodes_as_hf(tok):
    """Texts with non-ASCII characters: chunks between ASCII spaces that hold one are HF's,
    including whitespace and controls that Python splits at and HF does not."""
    texts = [
        "a\x85b c\u00a0d e\u3000f g\u2028h i\u1680j k\u180el",
        "naïve CAFÉ cafe\u0301 e\x00\u0301 \u0301start end\u0301 ΟΔΥΣΣΕΥΣ ΣΣ Σ",
        "abc東京def 数据处理 ｆｕｌｌｗｉｄｔｈ ﬁ Ⅻ 🙂👍🏽 \U000e0080 \u0378 \ufffd",
        "mixed ascii words, then: München (Bayern) — “quotes” and ‘these’… done.",
        *CODE,
    ]
    rng = random.Random(9)
    alphabet = [*"abc XYZ.,!\t\n", "é", "ß", "İ", "Σ", "東", "\u0301", "\u00a0", "\x85", "🙂"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(400)]
    backend = _backend(tok)
    assert_same_ids_as_hf(tok, backend, texts)
    assert_same_ids_as_hf(tok, backend, texts)  # from the cache


def test_added_tokens_in_text_encode_as_hf():
    """Added tokens are matched before normalization: a text holding one is HF's whole, for
    tokens matched raw and tokens matched after normalization."""
    from tokenizers import AddedToken

    tok = _tokenizer(lowercase=True)
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    tok.add_tokens([AddedToken("Hello World", normalized=True)])
    tok.add_tokens([AddedToken("<x>", normalized=False)])
    backend = _backend(tok)
    texts = ["a [CLS] b[SEP]c", "HELLO WORLD and hello world", "a<x>b", "Héllo World x", "<X>"]
    assert_same_ids_as_hf(tok, backend, texts)
    assert backend.encode_flat(["hello world"])[0].tolist() == [tok.token_to_id("Hello World")]


def test_bounded_cache_and_threads_encode_as_hf(tok, monkeypatch):
    """With caches a few chunks long (emptied between batches) and two threads sharing the
    backend, every batch still encodes as HF."""
    monkeypatch.setattr(chunk_cache, "CACHE_CHUNKS", 8)
    monkeypatch.setattr(chunk_cache, "CACHE_IDS", 64)
    backend = _backend(tok)
    texts = [*make_texts(300, seed=4), *CODE * 5, "über naïve"]
    batches = [texts[i : i + 16] for i in range(0, len(texts), 16)]
    want = [_hf(tok, b) for b in batches]
    errors: list[str] = []

    def run() -> None:
        for batch, expected in zip(batches, want):
            tokens, lengths = backend.encode_flat(batch)
            if [t.tolist() for t in np.split(tokens, np.cumsum(lengths)[:-1])] != expected:
                errors.append(batch[0][:40])

    run_in_threads(run)
    assert errors == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "BPE"}, "not WordPiece"),
        ({"normalizer": "NFKC"}, "not BertNormalizer"),
        ({"pre_tokenizer": "Whitespace"}, "not Bert"),
        ({"clean_text": False}, "str.split splits at"),
    ],
)
def test_refuses_a_tokenizer_it_cannot_follow(change, message):
    """Another model, normalizer or pre-tokenizer, or a BERT normalizer that keeps control
    characters Python splits at (clean_text off): refused at load, so the gate keeps HF."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = _tokenizer(clean_text=change.get("clean_text", True))
    if "normalizer" in change:
        tok.normalizer = normalizers.NFKC()
    if "pre_tokenizer" in change:
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    data = json.loads(tok.to_str())
    if "model" in change:
        data["model"]["type"] = "BPE"
        tok = Tokenizer(models.BPE())
    with pytest.raises(ValueError, match=message):
        AsciiWordPiece(data, HFBackend(tok))

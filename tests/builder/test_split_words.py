"""The split-at-whitespace backend: HF's ids (without special tokens) for every text, for each
pre-tokenizer it takes.

Tokenizers are trained in-process; each test compares with the same tokenizer's
``encode_batch``. The gate and builds are tested in test_backends.py."""

from __future__ import annotations

import io
import json
import random
import sys

import pytest

from conftest import assert_same_ids_as_hf, make_texts
from shardcache.builder.hf_backend import HFBackend
from shardcache.builder.split_words import SplitWords, words

CODE = [
    "def f(x):\n    return {'k': [x ** 2, x // 3]}  # comment\r\n\tif a != b: pass",
    "for (int i = 0; i < n; ++i) { s += a[i] >> 2; }  /* ok */ $HOME ~user `x` 2024-12-03",
]
TRAIN = [*make_texts(300, seed=3), *CODE * 20, "Ünïcödé café naïve 東京 数据处理 ▁x"]

#: Every character Python or HF counts as whitespace, the separators HF keeps in a word, the
#: Metaspace marker, combining marks, CJK, emoji, fullwidth, compatibility characters.
HARD = [
    "".join(f"a{chr(c)}b " for c in range(sys.maxunicode + 1) if chr(c).isspace()),
    "x\x1cy\x1dz\x1e w\x1f v \x1c \x85a\u00a0b\u3000c\u2028d\u1680e\u180ef\u200bg",
    "a▁b ▁ ▁▁ c▁ ▁d naïve CAFÉ cafe\u0301 e\x00\u0301 \u0301start end\u0301 ΟΔΥΣΣΕΥΣ Σ",
    "abc東京def 数据处理 ｆｕｌｌｗｉｄｔｈ ﬁ Ⅻ ① 🙂👍🏽 \U000e0080 \u0378 \ufffd",
    "many     spaces\n\n\n\t\t  and\r\n\r\nlines   ",
    "a {2,}b  {2,} x{2,}",
    "   ",
    "",
    "x" * 3000 + " " + "東" * 500,
    *CODE,
]


def _train(tok, model_kind: str):
    from tokenizers import trainers

    specials = ["<pad>", "</s>", "<unk>"]
    if model_kind == "unigram":
        trainer = trainers.UnigramTrainer(
            vocab_size=600, special_tokens=specials, unk_token="<unk>", show_progress=False
        )
    elif model_kind == "wordpiece":
        trainer = trainers.WordPieceTrainer(
            vocab_size=600, special_tokens=specials, show_progress=False
        )
    else:
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(TRAIN, trainer)
    return tok


def _t5_sentencepiece(converter: str = "t5"):
    """T5 as its converter wrote it, from a SentencePiece Unigram model trained here with T5's
    normalization rule: the real precompiled charsmap (nmt_nfkc), then Replace(" {2,}", " ");
    WhitespaceSplit and Metaspace; the 100 <extra_id_N>. ``converter="spm"``: as transformers'
    SentencePiece converter writes it today: the charsmap, Strip right, Replace(" {2,}", "▁"),
    a Metaspace alone."""
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    written = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN), model_writer=written, vocab_size=400, hard_vocab_limit=False,
        model_type="unigram", normalization_rule_name="nmt_nfkc", pad_id=0, eos_id=1,
        unk_id=2, bos_id=-1, minloglevel=2,
    )  # fmt: skip
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(written.getvalue())
    vocab = [(p.piece, p.score) for p in proto.pieces]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(99, -1, -1)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    charsmap = proto.normalizer_spec.precompiled_charsmap
    if converter == "spm":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Precompiled(charsmap), normalizers.Strip(left=False, right=True),
             normalizers.Replace(Regex(" {2,}"), "▁")]
        )  # fmt: skip
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        return tok
    tok.normalizer = normalizers.Sequence(
        [normalizers.Precompiled(charsmap), normalizers.Replace(Regex(" {2,}"), " ")]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(prepend_scheme="always")]
    )
    tok.add_special_tokens(["<pad>", "</s>", "<unk>", *(f"<extra_id_{i}>" for i in range(100))])
    return tok


def _tokenizer(shape: str):
    """A trained tokenizer of one of the shapes the backend takes."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    if shape == "t5-sentencepiece":
        return _t5_sentencepiece()
    if shape == "spm-converter":
        return _t5_sentencepiece("spm")
    if shape == "metaspace-collapse":  # runs of spaces collapsed before a Metaspace alone
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Sequence(
            [normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip()]
        )
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        return _train(tok, "unigram")
    if shape.startswith("metaspace-"):  # a Metaspace alone (Gemma-like BPE, Unigram)
        scheme = shape.split("-")[1]
        tok = Tokenizer(models.Unigram() if scheme != "always" else models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.NFKC() if scheme == "first" else None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
        return _train(tok, "unigram" if scheme != "always" else "bpe")
    if shape == "t5":  # T5: NFKC and a Replace, WhitespaceSplit, Metaspace on every word
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Sequence(
            [normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")]
        )
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(prepend_scheme="always")]
        )
        return _train(tok, "unigram")
    if shape == "t5-literal-replace":  # the Replace's pattern a literal string
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Sequence(
            [normalizers.NFKC(), normalizers.Replace(" {2,}", " ")]
        )
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(prepend_scheme="always")]
        )
        return _train(tok, "unigram")
    if shape == "t5-no-split":  # Metaspace that does not split at its marker, no normalizer
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(split=False)]
        )
        return _train(tok, "unigram")
    if shape == "whitespace-wordpiece":  # \w+|[^\w\s]+, lowercased
        tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence(
            [normalizers.NFD(), normalizers.Lowercase(), normalizers.Strip()]
        )
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return _train(tok, "wordpiece")
    if shape == "bert-unigram":  # BERT's normalizer and pre-tokenizer over Unigram
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        return _train(tok, "unigram")
    assert shape == "steps-bpe"  # per-piece steps after the split, no prefix
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
            pre_tokenizers.Metaspace(prepend_scheme="never"),
        ]
    )
    return _train(tok, "bpe")


SHAPES = [
    "t5",
    "t5-sentencepiece",
    "spm-converter",
    "metaspace-always",
    "metaspace-first",
    "metaspace-never",
    "metaspace-collapse",
    "t5-literal-replace",
    "t5-no-split",
    "whitespace-wordpiece",
    "bert-unigram",
    "steps-bpe",
]


@pytest.fixture(scope="module", params=SHAPES)
def tok(request):
    return _tokenizer(request.param)


def _backend(tok) -> SplitWords:
    return SplitWords(json.loads(tok.to_str()), HFBackend(tok))


def test_hard_texts_encode_as_hf(tok):
    """Every whitespace character, the separators HF keeps, the Metaspace marker inside words,
    combining marks after a space, CJK, emoji, long words and runs of whitespace: equal to HF,
    and again from the cache."""
    backend = _backend(tok)
    assert_same_ids_as_hf(tok, backend, HARD)
    assert_same_ids_as_hf(tok, backend, HARD)


def test_random_texts_encode_as_hf(tok):
    """Generated documents, code, and random strings over an alphabet of troublemakers."""
    rng = random.Random(11)
    alphabet = [*"abc XYZ.,!1\t\n", "▁", "é", "ß", "İ", "Σ", "東", "\u0301", "\u00a0", "\x1c", "🙂"]
    texts = [*make_texts(200, seed=8), *CODE]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(500)]
    assert_same_ids_as_hf(tok, _backend(tok), texts)


@pytest.mark.parametrize(
    ("shape", "table"),
    [("t5", True), ("t5-sentencepiece", True), ("t5-no-split", True),
     ("whitespace-wordpiece", True), ("bert-unigram", True), ("t5-literal-replace", False),
     ("metaspace-first", True), ("metaspace-always", True), ("spm-converter", False),
     ("metaspace-collapse", False)],
)  # fmt: skip
def test_ascii_text_is_normalized_by_a_table_only_where_that_is_exact(shape, table):
    """Steps that act per character on ASCII, Strip and a whitespace-run Replace give a table;
    a Replace of a literal string (which may span words) does not, nor do Strip and Replace
    before a Metaspace alone (whose pieces depend on every space); ASCII texts are HF's either
    way (the tests above)."""
    backend = _backend(_tokenizer(shape))
    assert (backend.table is not None) is table


def test_words_split_where_hf_splits():
    """Python's ``str.split`` also splits at U+001C..U+001F; :func:`words` does not. Every
    character Python counts as whitespace is one of the two lists."""
    from shardcache.builder.split_words import HF_SPACES, PYTHON_ONLY_SPACE

    spaces = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    assert sorted(spaces) == sorted(HF_SPACES + PYTHON_ONLY_SPACE)
    assert words("a b\u3000c\n") == ["a", "b", "c"]
    assert words("a\x1cb c\x1f") == ["a\x1cb", "c\x1f"]
    assert words("  ") == [] and words("") == []


def test_added_tokens_in_text_encode_as_hf():
    """A text holding an added token (matched raw, or after normalization) is HF's whole."""
    from tokenizers import AddedToken

    tok = _tokenizer("t5")
    tok.add_special_tokens(["</s>", *(f"<extra_id_{i}>" for i in range(100))])  # as T5
    tok.add_tokens([AddedToken("Hello World", normalized=True)])
    tok.add_tokens([AddedToken("<x>", normalized=False)])
    backend = _backend(tok)
    texts = ["a </s> b</s>c", "fill <extra_id_0> in", "Hello World and ｈｅｌｌｏ", "a<x>b", "<X>"]
    texts += ["<extra_id_57>", "x<extra_id_99>y <extra_id_ 5>", "<extra_id_100> <e<x"]
    texts += ["Ｈｅｌｌｏ Ｗｏｒｌｄ x"]  # NFKC makes the added token
    assert_same_ids_as_hf(tok, backend, texts)
    assert backend.encode_flat(["Hello World"])[0].tolist() == [tok.token_to_id("Hello World")]


@pytest.mark.parametrize(
    ("pre_tokenizer", "message"),
    [
        ({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
         "neither splits at whitespace first nor"),
        (None, "neither splits at whitespace first nor"),
        ({"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True},
        ]}, "first piece"),
        ({"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
             "use_regex": True},
        ]}, "'ByteLevel' may depend on other pieces"),
    ],
)  # fmt: skip
def test_refuses_a_pre_tokenizer_that_does_not_split_at_whitespace_first(pre_tokenizer, message):
    """A Metaspace that does not split (Mistral: a text is one piece), no pre-tokenizer, a
    Metaspace after the split that prepends to the first piece only, or a step it does not
    know: refused at load, so the gate keeps HF."""
    from tokenizers import Tokenizer

    data = json.loads(_tokenizer("t5").to_str())
    data["pre_tokenizer"] = pre_tokenizer
    tok = Tokenizer.from_str(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        _backend(tok)


def test_refuses_bpe_dropout():
    """A model that drops merges at random has no single answer to cache."""
    from tokenizers import Tokenizer

    data = json.loads(_tokenizer("steps-bpe").to_str())
    data["model"]["dropout"] = 0.1
    with pytest.raises(ValueError, match="dropout"):
        _backend(Tokenizer.from_str(json.dumps(data)))

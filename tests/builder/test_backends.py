"""Encoder backends and the gate: the fast backend gives exactly the HF ids, or is not used.

Tokenizers of each family are trained in-process. Tests that need the optional fast backend
``pytest.importorskip`` it (CI installs ``shardcache[fast]``)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from conftest import cache_data_files, make_conversations, make_texts, write_records
from shardcache.builder.ahead import Ahead
from shardcache.builder.backends import FastBackend, select_backend
from shardcache.builder.early_load import (
    EarlyLoad,
    adopt_agreed,
    adopt_early,
    ids_content,
    load_fast_early,
)
from shardcache.builder.hf_backend import flatten_ids
from shardcache.builder.run import build_cache as run_build
from shardcache.builder.sampled_verify import (
    VERIFY_FLOOR_BYTES,
    build_draw_keys,
    first_difference,
    sampled,
    source_salt,
    verify_rate,
)
from shardcache.builder.special_tokens import SpecialTokens
from shardcache.builder.tokenize import TextEncoder
from shardcache.builder.tokenizer_memo import read_resolved
from shardcache.config import TokenizeOptions, build_options_from_mapping
from shardcache.errors import ConfigError, EncoderError, MissingDependencyError
from shardcache.store.cache import open_cache

SPECIALS = ["<eos>", "<pad>", "<bos>", "<|im_start|>", "<|im_end|>"]

#: Hard cases: special/added tokens written in text, CJK, emoji (ZWJ, flags, skin tones),
#: combining marks, long whitespace runs, code, byte-fallback material, empty text.
HARD_TEXTS = [
    "plain words the quick brown fox",
    "<|im_start|>user\nhi<|im_end|><eos>x<bos><pad> <eos> <|im_start|><|im_start|>",
    "東京は日本の首都です。数据处理和机器学习。한국어 텍스트 データ",
    "🙂👍🏽 🇫🇷 👨‍👩‍👧 ✨ 🙂🙂🙂",
    "e\u0301 n\u0303 A\u030a Ω\u0308 क्षि ﬁ Ⅻ caf\u00e9 cafe\u0301",
    "a  b   c\t\td\n\n\ne \u00a0f\u2003g" + " " * 300 + "\n" * 40 + "\t" * 17 + "end",
    "def f(x):\n    return {'k': [x ** 2, x // 3]}  # comment\n\tif a != b:\n        pass\n",
    "for (int i = 0; i < n; ++i) { s += a[i] >> 2; }  /* ok */ <tool_call>",
    "\u0000\u0007 control \u200b zero-width \ufeff bom \U0001f9ea test tube ⍼",
    "",
    " leading space",
    "trailing space ",
    "x" * 3000,
    "Мама мыла раму. Ελληνικά. עברית. العربية",
    # a word-final capital sigma (lowercased per character by HF: σ, not ς), a letter of
    # Unicode 16 and unassigned code points (kept by HF, an [UNK] for WordPiece)
    "ΟΔΥΣΣΕΥΣ [ΛΠΣ] ΣΣ Σ",
    '(0xA7CE, "M", "\ua7cf") \U000e0080 x\U0010fffdy \u0378',
]


def _texts() -> list[str]:
    return [*HARD_TEXTS, *make_texts(120, seed=7, max_words=200)]


def _train_texts() -> list[str]:
    return [*make_texts(400, seed=11), *HARD_TEXTS[2:9]]


def _save(tok, folder: str, **specials: str) -> str:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, **specials).save_pretrained(folder)
    return folder


QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(folder: str, normalized: bool) -> str:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    if normalized:  # Qwen-2 style: NFC + a split regex before the byte-level step
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_train_texts(), trainer)
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    return _save(tok, folder, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>")


def _metaspace_byte_fallback(
    folder: str, pre_tokenizer: bool = False, metaspace_decoder: bool = False
) -> str:
    """Llama-2 style: BPE with byte fallback, the "▁" space marker written by the normalizer
    (Prepend + Replace), <s> added by the post-processor; ``pre_tokenizer``: Mistral / newer
    Llama style, the marker written by a Metaspace pre-tokenizer instead;
    ``metaspace_decoder``: a Metaspace decoder (as some conversions write), which fastokens
    refuses although a decoder never changes ids."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if pre_tokenizer:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    if metaspace_decoder:
        tok.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=200,
        show_progress=False,
    )
    tok.train_from_iterator(_train_texts(), trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):  # the <0xXX> byte tokens, as Llama has them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(data))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.add_special_tokens(["[INST]", "[/INST]"])
    return _save(tok, folder, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _unigram(folder: str, split: bool = True) -> str:
    """Unigram under NFKC and a Metaspace alone (``split``: at its marker)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(split=split)
    trainer = trainers.UnigramTrainer(
        vocab_size=500, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(_train_texts(), trainer)
    return _save(tok, folder, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def _unigram_t5(folder: str) -> str:
    """T5's shape: Unigram under NFKC and a Replace, WhitespaceSplit then a Metaspace that
    prepends to every word, </s> added by the post-processor."""
    from tokenizers import (
        Regex,
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(prepend_scheme="always")]
    )
    trainer = trainers.UnigramTrainer(
        vocab_size=500, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(_train_texts(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    return _save(tok, folder, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def _wordpiece(folder: str, lowercase: bool = False) -> str:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(_train_texts(), trainer)
    tok.post_processor = processors.BertProcessing(
        ("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]"))
    )
    return _save(tok, folder, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]",
                 pad_token="[PAD]")  # fmt: skip


FAMILIES = {
    "byte_level_bpe": lambda folder: _byte_level(folder, normalized=False),
    "byte_level_bpe_nfc_split": lambda folder: _byte_level(folder, normalized=True),
    "metaspace_bpe_byte_fallback": _metaspace_byte_fallback,
    "metaspace_pretokenizer_bpe_byte_fallback": lambda f: _metaspace_byte_fallback(f, True),
    "metaspace_decoder_bpe_byte_fallback": lambda f: _metaspace_byte_fallback(
        f, metaspace_decoder=True
    ),
    "unigram": _unigram,
    "unigram_t5": _unigram_t5,
    "wordpiece": _wordpiece,
    "wordpiece_uncased": lambda folder: _wordpiece(folder, lowercase=True),
}
#: The library that loads each family (fastokens 0.3.5 drops a decoder it does not implement
#: first: a decoder never changes ids); fastokens refuses the Metaspace pre-tokenizer, NFKC and
#: BertNormalizer at load, then gigatoken takes Metaspace BPE and this package's own backends
#: BERT-style WordPiece and Unigram (split at whitespace first, or by a Metaspace alone); a
#: Metaspace that does not split is refused by all, and the gate keeps HF.
FAST_FAMILIES = {
    "byte_level_bpe": "fastokens",
    "byte_level_bpe_nfc_split": "fastokens",
    "metaspace_bpe_byte_fallback": "fastokens",
    "metaspace_decoder_bpe_byte_fallback": "fastokens",
    "metaspace_pretokenizer_bpe_byte_fallback": "gigatoken",
    "unigram": "shardcache-words",
    "unigram_t5": "shardcache-words",
    "wordpiece": "shardcache-wordpiece",
    "wordpiece_uncased": "shardcache-wordpiece",
}
#: The backends of this package (always importable).
OWN_BACKENDS = ("shardcache-wordpiece", "shardcache-words")


def _importorskip(library: str | None) -> None:
    """Skip unless ``library`` (a backend's name; None: fastokens) can be imported; this
    package's own backends always can."""
    if library not in OWN_BACKENDS:
        pytest.importorskip(library or "fastokens")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory) -> tuple[str, str]:
    folder = str(tmp_path_factory.mktemp(f"tok-{request.param}"))
    return request.param, FAMILIES[request.param](folder)


def _fast_encoder(folder: str) -> TextEncoder | None:
    """A TextEncoder on the fast backend, or None when fastokens refuses the tokenizer."""
    encoder = TextEncoder(TokenizeOptions(folder))
    try:
        fast = FastBackend(encoder.backend.to_str())
    except EncoderError:
        return None
    encoder.use_fast(fast, encoder.selection, 1.0)  # verify every document, too
    return encoder


def test_fast_ids_equal_tokenizer_call_for_every_family(family_dir):
    from transformers import AutoTokenizer

    name, folder = family_dir
    _importorskip(FAST_FAMILIES.get(name))
    encoder = _fast_encoder(folder)
    if encoder is None:  # refused at load: the gate keeps HF and says why
        reference = TextEncoder(TokenizeOptions(folder))
        fast, selection = select_backend(
            "auto", reference.backend.to_str(), reference.reference, True, _texts()
        )
        assert fast is None and "cannot load this tokenizer" in selection.reason, name
        return
    tok = AutoTokenizer.from_pretrained(folder)
    texts = _texts()
    flat = encoder.encode_texts(texts)
    assert encoder.take_verify().mismatches == 0
    assert len(flat) == len(texts)
    for i, text in enumerate(texts):
        assert flat[i].tolist() == tok(text)["input_ids"], (name, text[:40])


def test_hf_build_ids_equal_tokenizer_call_for_every_family(family_dir):
    """The HF path encodes with encode_batch_fast (no offsets): the same ids."""
    from transformers import AutoTokenizer

    name, folder = family_dir
    encoder = TextEncoder(TokenizeOptions(folder))
    tok = AutoTokenizer.from_pretrained(folder)
    texts = _texts()
    flat = encoder.encode_texts(texts)
    for i, text in enumerate(texts):
        assert flat[i].tolist() == tok(text)["input_ids"], (name, text[:40])


def test_families_each_library_supports_and_refuses(family_dir):
    """Which library takes each family today: a new release that supports more shows up
    here, and a tokenizer every library refuses is refused at load (so the gate falls back
    to HF instead of failing mid-build)."""
    name, folder = family_dir
    library = FAST_FAMILIES.get(name)
    _importorskip(library)
    encoder = _fast_encoder(folder)
    assert (encoder.fast.name if encoder is not None else None) == library, name


def test_fast_ids_without_special_tokens_equal_the_tokenizer_call(family_dir):
    """``add_special_tokens=False`` (a recipe key): the libraries that add the
    post-processor's tokens themselves must then add none."""
    from transformers import AutoTokenizer

    name, folder = family_dir
    _importorskip(FAST_FAMILIES.get(name))
    if name not in FAST_FAMILIES:
        return  # refused at load: see test_families_each_library_supports_and_refuses
    fast = FastBackend(TextEncoder(TokenizeOptions(folder)).backend.to_str())
    texts = _texts()
    tokens, lengths = fast.encode_flat(texts, False)
    expected = AutoTokenizer.from_pretrained(folder)(texts, add_special_tokens=False)
    for text, got, want in zip(texts, np.split(tokens, np.cumsum(lengths)[:-1]),
                               expected["input_ids"]):  # fmt: skip
        assert got.tolist() == want, (name, text[:40])


@pytest.mark.parametrize(
    ("processor", "before", "after"),
    [
        (None, (), ()),
        ({"type": "ByteLevel", "trim_offsets": True}, (), ()),
        ({"type": "BertProcessing", "sep": ["[SEP]", 3], "cls": ["[CLS]", 2]}, (2,), (3,)),
        ({"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]}, (0,), (2,)),
        (
            {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": "<s>", "type_id": 0}},
                    {"SpecialToken": {"id": "<x>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": "</s>", "type_id": 0}},
                ],
                "special_tokens": {
                    "<s>": {"ids": [1]},
                    "<x>": {"ids": [7, 8]},
                    "</s>": {"ids": [2]},
                },
            },
            (1, 7, 8),
            (2,),
        ),
        (
            {
                "type": "Sequence",
                "processors": [
                    {"type": "ByteLevel"},
                    {
                        "type": "TemplateProcessing",
                        "single": [
                            {"SpecialToken": {"id": "<s>", "type_id": 0}},
                            {"Sequence": {"id": "A", "type_id": 0}},
                        ],
                        "special_tokens": {"<s>": {"ids": [5]}},
                    },
                ],
            },
            (5,),
            (),
        ),
    ],
)
def test_special_tokens_of_a_post_processor_surround_every_sequence(processor, before, after):
    specials = SpecialTokens.of(processor)
    assert (specials.before, specials.after, specials.error) == (before, after, None)
    tokens = np.arange(100, 106, dtype=np.uint32)
    lengths = np.array([2, 0, 4], dtype=np.int64)
    out, out_lengths = specials.add(tokens, lengths)
    pieces = [[100, 101], [], [102, 103, 104, 105]]
    expected = [[*before, *piece, *after] for piece in pieces]
    assert out_lengths.tolist() == [len(e) for e in expected]
    assert out.dtype == np.uint32 and out.tolist() == [i for e in expected for i in e]


def test_an_unmodelled_post_processor_refuses_special_tokens_only():
    specials = SpecialTokens.of({"type": "SomethingNew"})
    assert "SomethingNew" in str(specials.error)
    tokens, lengths = np.arange(3, dtype=np.uint32), np.array([3], dtype=np.int64)
    with pytest.raises(EncoderError, match="cannot add this tokenizer's special tokens"):
        specials.add(tokens, lengths)


def test_flatten_ids():
    tokens, lengths = flatten_ids([[1, 2], [], [3]])
    assert tokens.dtype == np.uint32 and tokens.tolist() == [1, 2, 3]
    assert lengths.tolist() == [2, 0, 1]


def test_the_verification_sample_is_random_and_independent_of_batching():
    """Each record is drawn independently at the rate (so "0 mismatches in N: fewer than 3/N
    differ" holds), from its input and index alone: any batching draws the same records."""
    records = np.arange(200_000, dtype=np.int64)
    salt = source_salt("a.jsonl")
    whole = sampled(records, 0.01, salt)
    assert 1800 < whole.sum() < 2200  # binomial(200000, 0.01): 2000 +- 5 sigma
    batched = np.concatenate([sampled(records[i : i + 97], 0.01, salt)
                              for i in range(0, len(records), 97)])  # fmt: skip
    assert np.array_equal(whole, batched)
    assert not np.array_equal(whole, sampled(records, 0.01, source_salt("b.jsonl")))
    halves = whole.reshape(2, -1).sum(axis=1)  # no drift along the file
    assert abs(int(halves[0]) - int(halves[1])) < 300
    assert sampled(records[:5], 1.0, salt).all() and not sampled(records, 0.0, salt).any()


def test_the_build_draws_by_file_and_record_apart_from_the_audit():
    """A batch joining small files draws each text by its own file and record (the keys
    of the files' own batches), and the build's draw is not ``verify --tokens``' one."""
    a, b = np.arange(3, dtype=np.int64), np.arange(2, dtype=np.int64)
    joined = build_draw_keys(np.concatenate([a, b]), np.array([0, 0, 0, 1, 1]), ("a", "b"))
    apart = np.concatenate([build_draw_keys(a, None, ("a",)), build_draw_keys(b, None, ("b",))])
    assert np.array_equal(joined, apart) and len(set(joined.tolist())) == 5
    records = np.arange(100_000, dtype=np.int64)
    build = sampled(build_draw_keys(records, None, ("a.jsonl",)), 0.01, 0)
    audit = sampled(records, 0.01, source_salt("a.jsonl"))
    assert (build & audit).sum() < 0.1 * build.sum()  # independent draws: about 1% overlap


def test_the_verification_rate_covers_a_floor_of_the_input():
    assert verify_rate(1 / 1000, 10**9) == 1 / 1000
    assert verify_rate(1 / 1000, 10 * VERIFY_FLOOR_BYTES) == 0.1  # a small corpus: more
    assert verify_rate(1 / 1000, VERIFY_FLOOR_BYTES // 2) == 1.0  # a tiny one: whole
    assert verify_rate(0.0, 100) == 0.0  # 0 turns it off


def test_encoding_options_validated():
    base = {"input": "x", "tokenizer": "t", "output": "o"}
    with pytest.raises(ConfigError, match=r"encoder: got 'fastest'"):
        build_options_from_mapping({**base, "encoder": "fastest"})
    with pytest.raises(ConfigError, match="verify_fraction"):
        build_options_from_mapping({**base, "verify_fraction": 2})
    with pytest.raises(ConfigError, match="verify_fraction"):
        build_options_from_mapping({**base, "verify_fraction": "1/0"})
    options = build_options_from_mapping({**base, "verify_fraction": "1/8", "encoder": "hf"})
    assert options.encoding.verify_fraction == 0.125 and options.encoding.encoder == "hf"


# -- builds ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hard_corpus(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("hard-corpus")
    texts = _texts()
    write_records(str(folder / "a.jsonl"), [{"text": t} for t in texts[:70]], "jsonl")
    write_records(str(folder / "b.jsonl.zst"), [{"text": t} for t in texts[70:]], "jsonl.zst")
    return str(folder)


def _build(corpus: str, tokenizer: str, out: str, **options) -> dict:
    values = {"input": corpus, "tokenizer": tokenizer, "output": out, "workers": 1,
              "batch_docs": 16, **options}  # fmt: skip
    run_build(build_options_from_mapping(values))
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


#: Where each code point is written in :func:`test_every_code_point_encodes_as_hf`: inside a
#: word, as a word of its own, and between capital sigmas (a context-sensitive lowercase).
CODE_POINT_CONTEXTS = ("a{}b", "x {} y", "ΣΣ{} Σ")


def _code_points() -> list[int]:
    """The basic plane whole (surrogates aside), every other code point Python's tables
    assign, and every 61st of the rest (unassigned and private use)."""
    import unicodedata

    points = []
    for c in range(1, 0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        if c < 0x10000 or c % 61 == 0 or unicodedata.category(chr(c)) not in ("Cn", "Co"):
            points.append(c)
    return points


@pytest.mark.slow
def test_every_code_point_encodes_as_hf(family_dir):
    """Each library a family builds with gives HF's ids for every assigned code point (and a
    sample of the others) in a few contexts: a difference confined to rare characters passes
    the gate's sample and most of the in-build verification (kitoken drops code points its
    tables lack)."""
    name, folder = family_dir
    if name not in FAST_FAMILIES:
        return  # built with HF
    _importorskip(FAST_FAMILIES[name])
    encoder = TextEncoder(TokenizeOptions(folder))
    fast = FastBackend(encoder.backend.to_str())
    scalars = _code_points()
    for context in CODE_POINT_CONTEXTS:
        for start in range(0, len(scalars), 65536):
            texts = [context.format(chr(c)) for c in scalars[start : start + 65536]]
            want = flatten_ids(encoder.reference.encode_lists(texts, True))
            diff = first_difference(texts, want, fast.encode_flat(texts, True))
            assert diff is None, (name, fast.name, diff)


#: Characters newer than HF's Unicode tables (a letter to gigatoken 0.10, unassigned to HF),
#: each beside a pair the tokenizer of ``rare_dir`` merges: HF splits the pair from the
#: character and gigatoken joins them ([63, 40] against [665] for "\ua7d2[D").
RARE_TEXTS = [
    "\ua7d2[D",
    "plain words then \ua7d2[D and more words",
    "a\U0003334cb [D \ua7d2",
    "\u0378[D x",
]


@pytest.fixture(scope="module")
def rare_dir(tmp_path_factory) -> str:
    """Qwen-2 style byte-level BPE whose merges make "[D" and "að" one token each."""
    from tokenizers import Tokenizer

    folder = _byte_level(str(tmp_path_factory.mktemp("tok-rare")), normalized=True)
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    model, vocab = data["model"], data["model"]["vocab"]
    for a, b in (("[", "D"), ("a", "\u00f0")):  # "\u00f0": byte F0, first of U+3334C
        vocab[a + b] = len(vocab)
        model["merges"].insert(0, [a, b])
    for token in data["added_tokens"]:  # ids stay contiguous
        if token["id"] >= len(vocab) - 2:
            token["id"] = len(vocab)
    return _save(Tokenizer.from_str(json.dumps(data)), folder, eos_token="<eos>")


@pytest.fixture(scope="module")
def rare_corpus(tmp_path_factory) -> str:
    """Ordinary documents with ``RARE_TEXTS`` deep inside, past any gate sample."""
    folder = tmp_path_factory.mktemp("rare-corpus")
    texts = make_texts(1500, seed=5)
    for k, rare in enumerate(RARE_TEXTS):
        texts.insert(1100 + 90 * k, rare)
    write_records(str(folder / "a.jsonl"), [{"text": t} for t in texts[:700]], "jsonl")
    write_records(str(folder / "b.jsonl"), [{"text": t} for t in texts[700:]], "jsonl")
    return str(folder)


@pytest.mark.parametrize(
    ("tokenizer", "library", "missing"),
    [
        ("rare_dir", "fastokens", ()),
        ("rare_dir", "gigatoken", ("fastokens",)),
        ("mistral_dir", "gigatoken", ()),
        ("wordpiece_dir", "shardcache-wordpiece", ("fastokens", "gigatoken")),
        ("t5_dir", "shardcache-words", ("fastokens", "gigatoken")),
    ],
)
def test_rare_characters_deep_in_a_corpus_build_exactly_with_every_backend(
    rare_corpus, tokenizer, library, missing, tmp_path, request, monkeypatch
):
    """Characters newer than a library's or HF's Unicode tables, deep in a corpus, with no
    in-build sample (verify_fraction 0): each backend stores exactly the HF build's bytes,
    every document compared (the issue: gigatoken, used for a Qwen-2 tokenizer when fastokens
    is missing, stored wrong ids the sample missed)."""
    _importorskip(library)
    folder = request.getfixturevalue(tokenizer)
    _build(rare_corpus, folder, str(tmp_path / "hf"), encoder="hf")
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # `import fastokens` raises
    fast = _build(rare_corpus, folder, str(tmp_path / "fast"), encoder="fast", verify_fraction=0)
    assert fast["encoder"]["partitions_by_backend"] == {library: 2}
    assert cache_data_files(str(tmp_path / "fast")) == cache_data_files(str(tmp_path / "hf"))


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> str:
    """Mistral style: BPE with byte fallback under a Metaspace pre-tokenizer, <s> added."""
    return _metaspace_byte_fallback(str(tmp_path_factory.mktemp("tok-mistral")), True)


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory) -> str:
    """T5 style: Unigram, split at whitespace first."""
    return _unigram_t5(str(tmp_path_factory.mktemp("tok-t5")))


@pytest.mark.parametrize(
    ("tokenizer", "library"),
    [
        ("tokenizer_dir", "fastokens"),
        ("mistral_dir", "gigatoken"),
        ("wordpiece_dir", "shardcache-wordpiece"),
        ("t5_dir", "shardcache-words"),
    ],
)
def test_fast_build_equals_hf_build_and_tokenizer_call(hard_corpus, tokenizer, library, tmp_path,
                                                       request):  # fmt: skip
    """Each library's build stores exactly the HF build's bytes."""
    _importorskip(library)
    from transformers import AutoTokenizer

    folder = request.getfixturevalue(tokenizer)
    fast = _build(hard_corpus, folder, str(tmp_path / "fast"), encoder="fast")
    hf = _build(hard_corpus, folder, str(tmp_path / "hf"), encoder="hf")
    assert cache_data_files(str(tmp_path / "fast")) == cache_data_files(str(tmp_path / "hf"))
    assert fast["key"] == hf["key"]  # the key does not depend on the backend
    enc = fast["encoder"]
    assert enc["partitions_by_backend"] == {library: 2}
    assert enc["versions"][0].startswith(f"{library} ")
    assert enc["mismatches"] == 0 and enc["partitions_reencoded"] == []
    # a corpus this small is verified whole (the sample's floor)
    assert enc["verify_fraction"] == 1.0
    assert enc["documents_verified"] == len([t for t in _texts() if t])  # "" is quarantined
    assert enc["tokens_verified"] > enc["documents_verified"]
    assert "ids equal to HF on the gate sample" in enc["gate"][0]
    assert hf["encoder"]["partitions_by_backend"] == {"hf": 2}
    assert hf["encoder"]["gate"] == ["hf: --encoder hf"]
    if library != "fastokens":
        return  # the ids: as the HF build's (above), whose ids the family tests check
    tok = AutoTokenizer.from_pretrained(folder)
    texts = _texts()
    for seq in open_cache(str(tmp_path / "fast")).iter_sequences():
        offset = 0 if seq.provenance.source == "a.jsonl" else 70
        text = texts[offset + seq.provenance.record]
        assert seq.ids.tolist() == [*tok(text)["input_ids"], tok.eos_token_id]


def test_gate_falls_back_when_the_package_is_missing(hard_corpus, tokenizer_dir, tmp_path,
                                                     monkeypatch):  # fmt: skip
    for module in ("fastokens", "gigatoken"):
        monkeypatch.setitem(sys.modules, module, None)  # `import fastokens` raises
    manifest = _build(hard_corpus, tokenizer_dir, str(tmp_path / "auto"))
    assert manifest["encoder"]["partitions_by_backend"] == {"hf": 2}
    [reason] = manifest["encoder"]["gate"]
    assert "not installed" in reason and "pip install 'shardcache[fast]'" in reason
    with pytest.raises(MissingDependencyError, match=r"--encoder fast cannot be used: .*not inst"):
        _build(hard_corpus, tokenizer_dir, str(tmp_path / "fast"), encoder="fast")


def test_gate_falls_back_when_every_library_refuses_the_tokenizer(hard_corpus, tmp_path):
    """fastokens refuses a Unigram tokenizer's NFKC normalizer, and this package's backend its
    pre-tokenizer (a Metaspace that does not split makes a text one piece): the gate keeps HF
    and says why for each."""
    pytest.importorskip("fastokens")
    folder = _unigram(str(tmp_path / "tok-unigram"), split=False)
    manifest = _build(hard_corpus, folder, str(tmp_path / "auto"))
    assert manifest["encoder"]["partitions_by_backend"] == {"hf": 2}
    [reason] = manifest["encoder"]["gate"]
    assert "cannot load this tokenizer" in reason and "fastokens:" in reason
    assert "shardcache.builder.split_words: pre-tokenizer 'Metaspace'" in reason
    # a healthy HF build (issue 51 item 9): no exception type, no advice meant for --encoder fast
    assert "ValueError" not in reason and "--encoder" not in reason
    assert reason.endswith("the Hugging Face tokenizer encodes this build")
    with pytest.raises(EncoderError, match=r"cannot load this tokenizer.*--encoder hf"):
        _build(hard_corpus, folder, str(tmp_path / "fast"), encoder="fast")


@pytest.mark.parametrize("family", ["wordpiece", "unigram_t5"])
def test_own_backends_build_without_the_fast_extra(hard_corpus, family, tmp_path, monkeypatch):
    """The WordPiece and split-at-whitespace backends are this package's: a build takes them
    with no fast library installed, and stores the HF build's bytes."""
    for module in ("fastokens", "gigatoken"):
        monkeypatch.setitem(sys.modules, module, None)  # `import fastokens` raises
    folder = FAMILIES[family](str(tmp_path / "tok"))
    fast = _build(hard_corpus, folder, str(tmp_path / "auto"))
    hf = _build(hard_corpus, folder, str(tmp_path / "hf"), encoder="hf")
    assert fast["encoder"]["partitions_by_backend"] == {FAST_FAMILIES[family]: 2}
    assert hf["encoder"]["partitions_by_backend"] == {"hf": 2}
    assert cache_data_files(str(tmp_path / "auto")) == cache_data_files(str(tmp_path / "hf"))


def test_gigatoken_is_tried_only_when_fastokens_refuses(hard_corpus, mistral_dir, tmp_path,
                                                       monkeypatch):  # fmt: skip
    """Without gigatoken a Mistral-style tokenizer builds with HF, saying what is missing."""
    pytest.importorskip("fastokens")
    monkeypatch.setitem(sys.modules, "gigatoken", None)  # `import gigatoken` raises
    manifest = _build(hard_corpus, mistral_dir, str(tmp_path / "auto"))
    assert manifest["encoder"]["partitions_by_backend"] == {"hf": 2}
    [reason] = manifest["encoder"]["gate"]
    assert "Metaspace" in reason and "not installed: gigatoken" in reason


def _inject_wrong_id(monkeypatch, when) -> None:
    """Make the fast backend return a wrong first id for the texts ``when(text, call)``
    selects (``call``: how many encode_flat calls came before)."""
    real = FastBackend.encode_flat
    calls = [0]

    def wrong(self, texts, add_special_tokens):
        tokens, lengths = real(self, texts, add_special_tokens)
        tokens = tokens.copy()
        starts = np.cumsum(lengths) - lengths
        for i, text in enumerate(texts):
            if lengths[i] and when(text, calls[0]):
                tokens[starts[i]] = (int(tokens[starts[i]]) + 1) % 100
        calls[0] += 1
        return tokens, lengths

    monkeypatch.setattr(FastBackend, "encode_flat", wrong)


def test_gate_falls_back_when_the_backends_disagree(hard_corpus, tokenizer_dir, tmp_path,
                                                    monkeypatch):  # fmt: skip
    pytest.importorskip("fastokens")
    _inject_wrong_id(monkeypatch, lambda text, call: "東京" in text)  # a probe text has it
    manifest = _build(hard_corpus, tokenizer_dir, str(tmp_path / "auto"))
    assert manifest["encoder"]["partitions_by_backend"] == {"hf": 2}
    [reason] = manifest["encoder"]["gate"]
    assert "disagree on the gate sample" in reason and "東京" in reason
    with pytest.raises(EncoderError, match="disagree on the gate sample"):
        _build(hard_corpus, tokenizer_dir, str(tmp_path / "fast"), encoder="fast")


def test_in_build_mismatch_reencodes_the_partition_with_hf(hard_corpus, tokenizer_dir, tmp_path,
                                                           monkeypatch):  # fmt: skip
    """A wrong id the gate does not see (it appears after the gate's call) in a document of
    the verification sample (a corpus this small is verified whole): that partition is
    re-encoded with HF, counted, and the cache is the HF cache byte for byte; under
    --encoder fast the build fails."""
    pytest.importorskip("fastokens")
    hf_out = str(tmp_path / "hf")
    _build(hard_corpus, tokenizer_dir, hf_out, encoder="hf")
    _inject_wrong_id(monkeypatch, lambda text, call: call > 0 and text == "x" * 3000)
    out = str(tmp_path / "auto")
    manifest = _build(hard_corpus, tokenizer_dir, out)
    enc = manifest["encoder"]
    assert enc["partitions_by_backend"] == {"fastokens": 1, "hf": 1}
    assert enc["mismatches"] == 1 and len(enc["partitions_reencoded"]) == 1
    assert "HF gives" in enc["mismatch_detail"][0]
    assert cache_data_files(out) == cache_data_files(hf_out)
    monkeypatch.undo()
    _inject_wrong_id(monkeypatch, lambda text, call: call > 0 and text == "x" * 3000)
    with pytest.raises(EncoderError, match="forbids falling back"):
        _build(hard_corpus, tokenizer_dir, str(tmp_path / "fast"), encoder="fast")


def test_background_verification_counts_up_to_the_first_difference(tokenizer_dir, monkeypatch):
    """The sample is verified in threads, yet the counts are those of an in-line check that
    stopped at the first differing batch, whatever the timing; an HF failure on a sampled
    text is a difference too."""
    pytest.importorskip("fastokens")
    from shardcache.builder.tokenize import EncodingMismatch

    batches = [make_texts(40, seed=s) for s in range(5)]
    records = [np.arange(40 * k, 40 * (k + 1), dtype=np.int64) for k in range(5)]
    records = [build_draw_keys(rec, None, ("a.jsonl",)) for rec in records]  # draw keys
    encoder = _fast_encoder(tokenizer_dir)
    assert encoder is not None
    encoder.verify_fraction = 1 / 4
    for batch, rec in zip(batches, records):
        encoder.encode_texts(batch, rec)
    encoder.check_verified()
    clean = encoder.take_verify()
    expected = [int(sampled(rec, 1 / 4, 0).sum()) for rec in records]
    assert clean.mismatches == 0 and clean.documents == sum(expected) and all(expected)
    assert clean.tokens > clean.documents

    wrong_batch = batches[2]  # a wrong id in every document of it, the sampled ones too
    _inject_wrong_id(monkeypatch, lambda text, call: text in wrong_batch)
    for batch, rec in zip(batches, records):
        encoder.encode_texts(batch, rec)
    with pytest.raises(EncodingMismatch, match="HF gives"):
        encoder.check_verified()
    counts = encoder.take_verify()
    assert counts.documents == sum(expected[:3])  # batches 0..2, none after the difference
    assert counts.mismatches >= 1 and counts.mismatches == len(counts.detail)
    monkeypatch.undo()

    def failing(texts, add_special_tokens):
        raise RuntimeError("HF broke")

    monkeypatch.setattr(encoder.reference, "encode_flat", failing)
    encoder.encode_texts(batches[0], records[0])
    with pytest.raises(EncodingMismatch, match="HF failed on the verification sample"):
        encoder.check_verified()
    assert encoder.take_verify().mismatches == 1


@pytest.mark.parametrize("group_chars", [None, 1])
def test_the_samples_of_many_batches_are_verified_in_few_hf_calls(tokenizer_dir, monkeypatch,
                                                                 group_chars):  # fmt: skip
    """The batches' samples are re-encoded with HF a group at a time (one call for all five
    batches here), with the counts of a check batch by batch; a difference in a batch of a
    group still ends the counts at that batch."""
    pytest.importorskip("fastokens")
    from shardcache.builder import sampled_verify
    from shardcache.builder.tokenize import EncodingMismatch

    if group_chars is not None:  # every batch its own group
        monkeypatch.setattr(sampled_verify, "VERIFY_GROUP_CHARS", group_chars)
    batches = [make_texts(40, seed=s) for s in range(5)]
    records = [build_draw_keys(np.arange(40 * k, 40 * (k + 1)), None, ("a.jsonl",))
               for k in range(5)]  # fmt: skip
    expected = [int(sampled(rec, 1 / 4, 0).sum()) for rec in records]
    encoder = _fast_encoder(tokenizer_dir)
    assert encoder is not None
    encoder.verify_fraction = 1 / 4
    calls = []
    real = encoder.reference.encode_flat

    def counting(texts, add_special_tokens):
        calls.append(len(texts))
        return real(texts, add_special_tokens)

    monkeypatch.setattr(encoder.reference, "encode_flat", counting)
    for batch, rec in zip(batches, records):
        encoder.encode_texts(batch, rec)
    encoder.check_verified()
    clean = encoder.take_verify()
    assert clean.documents == sum(expected) and clean.mismatches == 0
    assert calls == ([sum(expected)] if group_chars is None else expected)
    wrong_batch = batches[3]
    _inject_wrong_id(monkeypatch, lambda text, call: text in wrong_batch)
    for batch, rec in zip(batches, records):
        encoder.encode_texts(batch, rec)
    with pytest.raises(EncodingMismatch, match="of the batch: text 0"):
        encoder.check_verified()
    counts = encoder.take_verify()
    assert counts.documents == sum(expected[:4]) and counts.mismatches == expected[3]


def test_chat_builds_use_hf_and_say_why(tmp_path, chatml_tokenizer_dir):
    convs = make_conversations(30, seed=4)
    convs[0][-1]["content"] += " 東京 🙂 e\u0301  <|im_end|>"
    write_records(str(tmp_path / "c.jsonl"), [{"messages": m} for m in convs], "jsonl")
    auto = _build(str(tmp_path / "c.jsonl"), chatml_tokenizer_dir, str(tmp_path / "auto"),
                  chat=True)  # fmt: skip
    _build(str(tmp_path / "c.jsonl"), chatml_tokenizer_dir, str(tmp_path / "hf"),
           chat=True, encoder="hf")  # fmt: skip
    assert cache_data_files(str(tmp_path / "auto")) == cache_data_files(str(tmp_path / "hf"))
    assert auto["encoder"]["partitions_by_backend"] == {"hf": 1}
    assert "character offsets" in auto["encoder"]["gate"][0]
    with pytest.raises(EncoderError, match="character offsets"):
        _build(str(tmp_path / "c.jsonl"), chatml_tokenizer_dir, str(tmp_path / "fast"),
               chat=True, encoder="fast")  # fmt: skip


def test_fast_build_identical_for_1_and_2_workers(hard_corpus, tokenizer_dir, tmp_path):
    pytest.importorskip("fastokens")
    one = str(tmp_path / "one")
    two = str(tmp_path / "two")
    a = _build(hard_corpus, tokenizer_dir, one, encoder="fast", partition_size="2KiB")
    b = _build(hard_corpus, tokenizer_dir, two, encoder="fast", partition_size="2KiB", workers=2)
    assert a == b and cache_data_files(one) == cache_data_files(two)
    assert set(a["encoder"]["partitions_by_backend"]) == {"fastokens"}


def test_default_workers_shrink_for_the_fast_backend(tokenizer_dir):
    """Unset --workers: one process per FAST_BYTES_PER_WORKER of input with the fast backend
    (a worker's start-up outweighs small inputs); HF and explicit counts are unchanged."""
    pytest.importorskip("fastokens")
    from types import SimpleNamespace

    from shardcache.builder.run import FAST_BYTES_PER_WORKER, fast_workers

    encoder = TextEncoder(TokenizeOptions(tokenizer_dir))
    small = [SimpleNamespace(nbytes=1000)] * 4
    big = [SimpleNamespace(nbytes=FAST_BYTES_PER_WORKER)] * 3
    assert fast_workers(encoder, small, 4) == 4  # HF
    encoder.use_fast(FastBackend(encoder.serialized), encoder.selection, 1 / 64)
    assert fast_workers(encoder, small, 4) == 1
    assert fast_workers(encoder, big, 2) == 2
    assert fast_workers(encoder, big, 8) == 3


def test_a_backend_holding_the_gil_keeps_one_process_per_core(wordpiece_dir, tmp_path):
    """The WordPiece backend encodes in Python: its builds keep the HF worker count and run
    partitions in processes, and 1 and 2 workers store the same bytes."""
    from types import SimpleNamespace

    from shardcache.builder.encoders import encodes_fast
    from shardcache.builder.run import fast_workers

    encoder = TextEncoder(TokenizeOptions(wordpiece_dir))
    encoder.use_fast(FastBackend(encoder.serialized), encoder.selection, 1 / 64)
    assert encoder.fast.name == "shardcache-wordpiece" and not encoder.fast.releases_gil
    assert not encodes_fast(encoder)
    assert fast_workers(encoder, [SimpleNamespace(nbytes=1000)] * 4, 4) == 4
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_records(str(corpus / "a.jsonl"), [{"text": t} for t in _texts()], "jsonl")
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    a = _build(str(corpus), wordpiece_dir, one, partition_size="4KiB", workers=1)
    b = _build(str(corpus), wordpiece_dir, two, partition_size="4KiB", workers=2)
    assert a["encoder"]["partitions_by_backend"] == b["encoder"]["partitions_by_backend"]
    assert set(b["encoder"]["partitions_by_backend"]) == {"shardcache-wordpiece"}
    assert cache_data_files(one) == cache_data_files(two)


def test_ids_content_ignores_only_what_cannot_change_ids():
    base = {
        "model": {"type": "BPE", "vocab": {"a": 0}},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "x"}, "trim_offsets": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False},
        ]},
        "post_processor": {"type": "ByteLevel", "trim_offsets": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False},
        "truncation": None,
        "padding": None,
    }  # fmt: skip
    same = json.loads(json.dumps(base))
    same["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True}
    same["pre_tokenizer"]["pretokenizers"][1]["trim_offsets"] = True
    same["post_processor"]["trim_offsets"] = True
    same["truncation"] = {"max_length": 16}
    assert ids_content(same) == ids_content(base)
    for change in (
        lambda t: t["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        lambda t: t["pre_tokenizer"]["pretokenizers"][0].update(trim_offsets=False),
        lambda t: t["model"]["vocab"].update(b=1),
        lambda t: t.update(normalizer={"type": "NFC"}),
    ):
        other = json.loads(json.dumps(base))
        change(other)
        assert ids_content(other) != ids_content(base)


def test_early_fast_load_is_adopted_only_for_the_same_content(tokenizer_dir, tmp_path):
    """The fast backend loaded from tokenizer.json before transformers ran stands in for the
    one of transformers' JSON when they differ only where ids cannot; else it is reloaded."""
    pytest.importorskip("fastokens")
    encoder = TextEncoder(TokenizeOptions(tokenizer_dir))
    serialized = encoder.serialized
    early = load_fast_early(tokenizer_dir)
    assert early is not None and load_fast_early(str(tmp_path)) is None
    loaded = early.result()
    adopted = adopt_early(early, encoder.backend_json, serialized).result()
    assert adopted is loaded.backend and loaded.text is None  # the file's text is freed
    changed = json.loads(serialized)
    vocab = changed["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # what transformers' JSON would change
    early = load_fast_early(tokenizer_dir)
    reloaded = adopt_early(early, changed, json.dumps(changed)).result()
    assert reloaded is not early.result().backend
    assert reloaded.encode_flat(["a"], False)[0].tolist() == [vocab["a"]]
    # a refusal of the same content is the refusal; an unreadable file is not
    refusal = Ahead(lambda: EarlyLoad(serialized, None, EncoderError("refused")))
    with pytest.raises(EncoderError, match="refused"):
        adopt_early(refusal, encoder.backend_json, serialized).result()

    def unreadable():
        raise OSError("gone")

    fallback = adopt_early(Ahead(unreadable), encoder.backend_json, serialized).result()
    assert isinstance(fallback, FastBackend)
    not_json = Ahead(lambda: EarlyLoad("{not json", None, EncoderError("refused")))
    assert isinstance(adopt_early(not_json, encoder.backend_json, serialized).result(), FastBackend)


def test_early_fast_load_from_given_text_is_adopted_as_agreed(tokenizer_dir):
    """A load started from text the caller read is that text's backend; adopt_agreed hands it
    over as it is (the text freed) or raises its refusal."""
    pytest.importorskip("fastokens")
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        text = f.read()
    changed = json.loads(text)
    vocab = changed["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    early = load_fast_early("/no/such/folder", json.dumps(changed))  # the text, not the file
    assert early is not None and early.result().text is not None
    fast = adopt_agreed(early).result()
    assert fast.encode_flat(["a"], False)[0].tolist() == [vocab["a"]]
    assert early.result().text is None
    refusal = Ahead(lambda: EarlyLoad(text, None, EncoderError("refused")))
    with pytest.raises(EncoderError, match="refused"):
        adopt_agreed(refusal).result()


def test_fast_build_adopts_the_early_load(hard_corpus, tokenizer_dir, tmp_path, monkeypatch):
    """A default build loads the fast backend once, from tokenizer.json, whether transformers
    (no memo) or the memo resolves the tokenizer; its cache equals the HF build's either way."""
    pytest.importorskip("fastokens")
    loads = []
    real = FastBackend.__init__

    def counting(self, serialized):
        loads.append(serialized)
        real(self, serialized)

    monkeypatch.setattr(FastBackend, "__init__", counting)
    hf_out, out = str(tmp_path / "hf"), str(tmp_path / "auto")
    _build(hard_corpus, tokenizer_dir, hf_out, encoder="hf")  # writes the memo
    assert loads == []
    monkeypatch.setenv("SHARDCACHE_NO_MEMO", "1")
    manifest = _build(hard_corpus, tokenizer_dir, out)
    assert manifest["encoder"]["partitions_by_backend"] == {"fastokens": 2}
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        assert loads == [f.read()]
    assert cache_data_files(out) == cache_data_files(hf_out)
    monkeypatch.delenv("SHARDCACHE_NO_MEMO")
    loads.clear()
    _build(hard_corpus, tokenizer_dir, str(tmp_path / "warm"))
    assert read_resolved(tokenizer_dir) is not None  # the memo resolved it
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        assert loads == [f.read()]
    assert cache_data_files(str(tmp_path / "warm")) == cache_data_files(hf_out)

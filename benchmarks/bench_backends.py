"""Encoder backends per tokenizer family: do they load, are their ids exact, how fast (not a test).

    python benchmarks/bench_backends.py --corpus CORPUS --docs 2000 \
        [--tokenizer TOKENIZER_DIR ...] [--families bytelevel,llama,gemma,wordpiece,unigram]

For each tokenizer family, a small tokenizer is trained with ``tokenizers`` on the corpus's
first ``--train-docs`` documents and saved as a transformers fast tokenizer folder (with
``tokenizer.json``) in a temporary folder; every ``--tokenizer`` folder is measured too. The
families:

* ``bytelevel``: byte-level BPE (GPT-2 / Qwen style), chat-style added tokens;
* ``llama``: SentencePiece-style BPE, Metaspace pre-tokenizer, ``byte_fallback`` with the 256
  ``<0xNN>`` tokens in the vocabulary (Llama-2 / Mistral style), a small alphabet so rare
  characters fall back to bytes;
* ``llama-norm``: the same in Llama-2's own layout: no pre-tokenizer, a Prepend + Replace
  normalizer writing the ``▁``;
* ``gemma``: Metaspace BPE without byte fallback (unknown characters become ``<unk>``), the
  nearest to Gemma that ``tokenizers`` trains;
* ``wordpiece``: BERT normalizer, pre-tokenizer and WordPiece;
* ``unigram``: T5-style Unigram: NFKC and ``Replace(" {2,}", " ")`` (T5's converter writes the
  pattern as a regex, after its precompiled charsmap), WhitespaceSplit then Metaspace;
  ``shardcache-words`` takes it, and ``gemma`` (a Metaspace alone that splits).

The texts are the first ``--docs`` documents of ``--corpus`` plus a built-in list of strings
that stress exactness (CJK, emoji and ZWJ sequences, combining marks, long whitespace runs,
code, the tokenizer's added/special tokens written in the text). The reference ids are
transformers' ``tokenizer(texts, add_special_tokens=False)["input_ids"]``. Per family and
backend (``hf``: ``tokenizers`` ``encode_batch_fast`` of the same tokenizer; ``fastokens``,
loaded as shardcache's fast backend; ``gigatoken``; ``kitoken``; ``shardcache-wordpiece``,
shardcache's own BERT-style WordPiece, and ``shardcache-words``, its own backend for
tokenizers that split at whitespace first (one thread each: they hold the GIL);
each from the folder's ``tokenizer.json``, without special tokens added):

* ``load``: whether the backend loads the tokenizer (else the error, or "not installed");
* ``corpus`` / ``stress``: documents whose ids equal the reference, of the total;
* ``MB/s``: UTF-8 megabytes of the corpus texts per second, best of ``--repeat``, encoding in
  batches of ``--batch-docs`` into flat (ids, lengths) arrays, nothing else, every core;
* ``first mismatch``: the first differing document, the id position, and both sides' ids.

``gate`` is what ``shardcache build -i CORPUS -t FOLDER`` (``--encoder auto``) decides today:
the build's own start-up gate (``backend_gate.gate_encoder`` over the build's plan of
``--corpus``), with its reason. Results go to ``benchmarks/results.jsonl``
(``SHARDCACHE_BENCH_RESULTS``: see ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from results import record_result

FAMILIES = ("bytelevel", "llama", "llama-norm", "gemma", "wordpiece", "unigram")
CANDIDATES = ("hf", "fastokens", "gigatoken", "kitoken", "shardcache-wordpiece", "shardcache-words")

#: Texts that tell an exact backend from a nearly exact one; the tokenizer's added and
#: special tokens written in text are appended per tokenizer (:func:`stress_texts`).
STRESS = (
    "日本語の文章には空白がありません。東京都渋谷区で会議を行いました",
    "中文分词测试：我们今天去北京大学，然后吃了烤鸭。",
    "한국어 텍스트와 English mixed 文字 text",
    "emoji 😀😃🙂 family 👨\u200d👩\u200d👧\u200d👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1\ufe0f\u20e3",
    "combining: e\u0301 a\u0300 n\u0303 o\u0308 \u1e9b\u0323 Z\u0351\u0352\u0353 Å vs A\u030a",
    "NFKC: ﬁ ligature, ① circled, ｆｕｌｌｗｉｄｔｈ, ² superscript, Ⅻ roman",
    "spaces:" + " " * 40 + "end\t\t\t\ttabs\n\n\n\n\nnewlines \u00a0\u2003\u3000 odd spaces",
    " leading space, trailing spaces   ",
    "    indented\n        more\n\t mixed \t\n",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\nclass A:\n    pass\n",
    "for (int i = 0; i < n; ++i) { s += a[i]; }  /* C */ => != === >>= <<= ::",
    "URL https://example.com/a/b?c=1&d=%20e#frag and e-mail x.y@z.org",
    "numbers 1234567890 3.14159 1e-10 0x1F 1,000,000 ٣٤٥ ໑໒",
    "RTL: مرحبا بالعالم שלום עולם and Devanagari नमस्ते, Thai สวัสดีครับ",
    "control\x00chars\x01\x7f and \ufeffBOM \u200b zero width \u200c\u200d",
    "Ⓐ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚 astral 𠀀𠀁 private \ue000",
    "<unk> <0x41> [UNK] literal markup <s> </s> <pad> [CLS] [SEP] [MASK]",
    "",
    " ",
    "a",
)


def stress_texts(specials: list[str]) -> list[str]:
    """:data:`STRESS` and, per added/special token, the token written inside text."""
    texts = list(STRESS)
    for s in specials:
        texts += [f"{s}", f"before{s}after", f" {s} spaced {s}{s}", f"x{s}\n{s}y"]
    if specials:
        texts.append("".join(specials) + " " + " ".join(specials))
    return texts


def read_texts(corpus: str, limit: int) -> list[str]:
    """The first ``limit`` documents of ``corpus`` (files in name order)."""
    from shardcache.builder.sources import iter_text_batches, list_inputs

    texts: list[str] = []
    for f in list_inputs([corpus]):
        for batch in iter_text_batches(f, batch_docs=1024):
            texts += batch.texts[: limit - len(texts)]
            if len(texts) >= limit:
                return texts
    return texts


def byte_tokens() -> list[str]:
    return [f"<0x{b:02X}>" for b in range(256)]


def with_byte_fallback_vocab(tok: Any, leading: list[str], normalizer_form: bool) -> Any:
    """``tok`` (a trained BPE) with the 256 ``<0xNN>`` tokens in the model's vocabulary right
    after ``leading`` (the special tokens), as a SentencePiece conversion has them;
    ``normalizer_form``: the Metaspace pre-tokenizer replaced by the Prepend + Replace
    normalizer, no pre-tokenizer and the matching decoder, as Llama-2's own tokenizer.json."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    order = [*leading, *byte_tokens()]
    order += [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in set(order)]
    data["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    for added in data["added_tokens"]:
        added["id"] = data["model"]["vocab"][added["content"]]
    if normalizer_form:
        data["pre_tokenizer"] = None
        data["normalizer"] = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            ],
        }
        data["decoder"] = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        }
    return Tokenizer.from_str(json.dumps(data))


def train_family(family: str, texts: list[str], vocab_size: int, folder: str) -> None:
    """Train a ``family`` tokenizer on ``texts`` and save it as a fast tokenizer folder."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    special: dict[str, str] = {}
    if family == "bytelevel":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            show_progress=False,
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer)
        special = {"eos_token": "<|endoftext|>", "additional_special_tokens": specials[1:]}
    elif family in ("llama", "llama-norm", "gemma"):
        specials = ["<unk>", "<s>", "</s>"]
        fallback = family != "gemma"
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=fallback))
        scheme = "first" if fallback else "always"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=not fallback)
        tok.decoder = decoders.Metaspace(prepend_scheme=scheme, split=not fallback)
        trainer = trainers.BpeTrainer(
            show_progress=False, vocab_size=vocab_size, special_tokens=specials, limit_alphabet=160
        )
        tok.train_from_iterator(texts, trainer)
        if fallback:
            tok = with_byte_fallback_vocab(tok, specials, normalizer_form=family == "llama-norm")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
        special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    elif family == "wordpiece":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            show_progress=False, vocab_size=vocab_size, special_tokens=specials, limit_alphabet=500
        )
        tok.train_from_iterator(texts, trainer)
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
        special = dict(
            unk_token="[UNK]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            pad_token="[PAD]",
            mask_token="[MASK]",
        )
    elif family == "unigram":
        specials = ["<pad>", "</s>", "<unk>"]
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Sequence(
            [normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")]
        )
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()]
        )
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            show_progress=False, vocab_size=vocab_size, special_tokens=specials, unk_token="<unk>"
        )
        tok.train_from_iterator(texts, trainer)
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
        )
        special = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    else:
        raise SystemExit(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder)


def describe(folder: str) -> str:
    """The tokenizer's model, pre-tokenizer and byte fallback, from its tokenizer.json."""
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    model = data.get("model") or {}

    def kinds(node: Any) -> str:
        if not node:
            return "-"
        if node.get("type") == "Sequence":
            inner = node.get("pretokenizers") or node.get("normalizers") or []
            return "+".join(kinds(n) for n in inner)
        return str(node.get("type"))

    fallback = " byte_fallback" if model.get("byte_fallback") else ""
    return (
        f"{model.get('type')}{fallback}, vocab {len(model.get('vocab') or [])}, "
        f"pre {kinds(data.get('pre_tokenizer'))}, norm {kinds(data.get('normalizer'))}"
    )


Encode = Callable[[list[str]], tuple[np.ndarray, np.ndarray]]


def flat(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    from shardcache.builder.hf_backend import flatten_ids

    return flatten_ids(ids)


def load_candidate(name: str, folder: str) -> Encode:
    """An encode function of backend ``name`` over ``folder``'s tokenizer.json, no special
    tokens added. Raises whatever loading raises (ImportError when not installed)."""
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    # as a build encodes: whole documents, no padding (a saved BERT folder truncates at 512)
    data["truncation"] = data["padding"] = None
    serialized = json.dumps(data)
    if name == "hf":
        from tokenizers import Tokenizer

        hf = Tokenizer.from_str(serialized)
        return lambda texts: flat(
            [e.ids for e in hf.encode_batch_fast(texts, add_special_tokens=False)]
        )
    if name == "fastokens":
        from shardcache.builder.backends import FastBackend
        from shardcache.builder.fast_loaders import import_fast_module

        with contextlib.suppress(Exception):
            import_fast_module()
        try:
            fast = FastBackend(serialized)
        except Exception as err:
            if type(err).__name__ == "MissingDependencyError":
                raise ImportError("not installed") from err
            raise
        if fast.name != "fastokens":  # fastokens refused it; the build would use another
            raise ValueError(f"fastokens refuses it (a build uses {fast.name})")
        return lambda texts: fast.encode_flat(texts, False)
    if name == "gigatoken":
        giga = importlib.import_module("gigatoken").Tokenizer.from_json(serialized)

        def encode_giga(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
            layout = giga.encode_batch(texts).layout
            offsets = np.asarray(layout.offsets.data)
            tokens = np.asarray(layout.content.data)[offsets[0] : offsets[-1]]
            return tokens.astype(np.uint32, copy=False), np.diff(offsets).astype(np.int64)

        return encode_giga
    if name == "kitoken":
        kit = importlib.import_module("kitoken").Kitoken.from_tokenizers(serialized.encode())
        return lambda texts: flat(kit.encode_all(texts, True))
    if name == "shardcache-wordpiece":
        from tokenizers import Tokenizer

        from shardcache.builder.hf_backend import HFBackend
        from shardcache.builder.wordpiece import AsciiWordPiece

        wordpiece = AsciiWordPiece(data, HFBackend(Tokenizer.from_str(serialized)))
        return wordpiece.encode_flat
    if name == "shardcache-words":
        from tokenizers import Tokenizer

        from shardcache.builder.hf_backend import HFBackend
        from shardcache.builder.split_words import SplitWords

        return SplitWords(data, HFBackend(Tokenizer.from_str(serialized))).encode_flat
    raise ValueError(name)


def compare(ref: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Per document: True where ``got``'s ids equal ``ref``'s (vectorized, no Python loop)."""
    (rt, rl), (gt, gl) = ref, got
    if len(gl) != len(rl):
        return np.zeros(len(rl), dtype=bool)
    same_len = rl == gl
    rs, gs = np.cumsum(rl) - rl, np.cumsum(gl) - gl
    lens = rl[same_len]
    owner = np.repeat(np.arange(len(lens)), lens)
    within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    ri = np.repeat(rs[same_len], lens) + within
    gi = np.repeat(gs[same_len], lens) + within
    bad = np.bincount(owner, weights=rt[ri] != gt[gi], minlength=len(lens)) > 0
    equal = same_len.copy()
    equal[np.flatnonzero(same_len)[bad]] = False
    return equal


def first_mismatch(
    texts: list[str],
    equal: np.ndarray,
    ref: tuple[np.ndarray, np.ndarray],
    got: tuple[np.ndarray, np.ndarray],
    offset: int = 0,
) -> str:
    """The first unequal document: its start, the id position, both sides' ids there."""
    if equal.all():
        return ""
    i = int(np.flatnonzero(~equal)[0])
    if len(got[1]) != len(ref[1]):
        return f"{len(got[1])} documents returned for {len(ref[1])}"
    a = ref[0][int(ref[1][:i].sum()) :][: int(ref[1][i])]
    b = got[0][int(got[1][:i].sum()) :][: int(got[1][i])]
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    at = int(diff[0]) if len(diff) else n
    return (
        f"doc {offset + i} {texts[i][:40]!r}: id {at}: ref {a[at : at + 3].tolist()} "
        f"(of {len(a)}) vs {b[at : at + 3].tolist()} (of {len(b)})"
    )


def encode_batched(encode: Encode, texts: list[str], batch: int) -> tuple[np.ndarray, np.ndarray]:
    parts = [encode(texts[i : i + batch]) for i in range(0, len(texts), batch)]
    if not parts:
        return np.zeros(0, np.uint32), np.zeros(0, np.int64)
    return (
        np.concatenate([p[0] for p in parts]).astype(np.uint32, copy=False),
        np.concatenate([p[1] for p in parts]).astype(np.int64, copy=False),
    )


def run_gate(folder: str, corpus: str, out: str) -> dict[str, str]:
    """The backend ``shardcache build -i corpus -t folder`` picks today, and why."""
    from shardcache.builder.backend_gate import gate_encoder, start_loading
    from shardcache.builder.build_plan import plan_build
    from shardcache.builder.encoders import make_encoder
    from shardcache.config import BuildOptions, SourceOptions, TokenizeOptions

    options = BuildOptions(
        source=SourceOptions(inputs=(corpus,)),
        tokenize=TokenizeOptions(tokenizer=folder),
        output=out,
    )
    try:
        encoder = make_encoder(options.tokenize, None, preload_fast=True)
        selection = gate_encoder(encoder, plan_build(options), start_loading(encoder, options))
    except Exception as err:  # a benchmark reports a failing gate instead of stopping
        return {"backend": "error", "reason": f"{type(err).__name__}: {err}"}
    return {"backend": selection.backend, "reason": selection.reason}


def short(err: BaseException) -> str:
    """The first line of an error's message, without a Rust backtrace's ``Location``."""
    return " ".join(str(err).split("Location:")[0].split())[:150]


def measure(
    name: str, folder: str, corpus_texts: list[str], args: argparse.Namespace, tmp: str
) -> dict[str, Any]:
    """Every candidate on one tokenizer folder; prints its rows and returns its figures."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # "sequence longer than the model's maximum" is expected
    hf_tok = AutoTokenizer.from_pretrained(folder)
    specials = sorted(set(hf_tok.all_special_tokens) | set(hf_tok.get_added_vocab()))
    stress = stress_texts(specials)
    texts = corpus_texts + stress
    ref = flat(hf_tok(texts, add_special_tokens=False)["input_ids"])
    n_corpus = len(corpus_texts)
    mb = sum(len(t.encode("utf-8")) for t in corpus_texts) / 1e6
    gate = run_gate(folder, args.corpus, os.path.join(tmp, f"gate-{name}"))
    print(f"\n== {name}: {describe(folder)}")
    print(f"   gate (build --encoder auto): {gate['backend']}: {gate['reason'][:160]}")
    rows: dict[str, Any] = {}
    for cand in args.candidates:
        row: dict[str, Any] = {}
        try:
            encode = load_candidate(cand, folder)
        except ImportError as err:
            row["load"] = f"not installed ({err})"
        except BaseException as err:  # a Rust panic is a BaseException
            if isinstance(err, KeyboardInterrupt):
                raise
            row["load"] = f"{type(err).__name__}: {short(err)}"
        else:
            row["load"] = "yes"
            try:
                got = encode_batched(encode, texts, args.batch_docs)
                equal = compare(ref, got)
                row["corpus_equal"] = int(equal[:n_corpus].sum())
                row["stress_equal"] = int(equal[n_corpus:].sum())
                sub_ref = (ref[0], ref[1])
                row["first_mismatch"] = first_mismatch(texts, equal, sub_ref, got)
                best = float("inf")
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    encode_batched(encode, corpus_texts, args.batch_docs)
                    best = min(best, time.perf_counter() - start)
                row["mb_per_s"] = round(mb / best, 2) if best > 0 else None
            except BaseException as err:
                if isinstance(err, KeyboardInterrupt):
                    raise
                row["error"] = f"encode failed: {type(err).__name__}: {short(err)}"
        rows[cand] = row
        if row["load"] != "yes":
            print(f"   {cand:10s} load: {row['load']}")
        elif "error" in row:
            print(f"   {cand:10s} {row['error']}")
        else:
            print(
                f"   {cand:10s} corpus {row['corpus_equal']:>5}/{n_corpus:<5} "
                f"stress {row['stress_equal']:>3}/{len(stress):<3} "
                f"{row['mb_per_s']:>8.2f} MB/s  {row['first_mismatch'][:110]}"
            )
    return {
        "tokenizer": describe(folder),
        "gate": gate,
        "documents": n_corpus,
        "stress_texts": len(stress),
        "corpus_mb": round(mb, 3),
        "backends": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True, help="folder (or file) of .jsonl[.zst] inputs")
    ap.add_argument("--docs", type=int, default=2000, help="corpus documents compared and timed")
    ap.add_argument("--tokenizer", action="append", default=[], help="a tokenizer folder")
    ap.add_argument("--families", default=",".join(FAMILIES), help="families to train ('' none)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help="backends to measure")
    ap.add_argument("--train-docs", type=int, default=500, help="documents to train on")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--batch-docs", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3, help="timed passes (best of)")
    args = ap.parse_args()
    args.candidates = [c for c in args.candidates.split(",") if c]
    families = [f for f in args.families.split(",") if f]
    for f in families:
        if f not in FAMILIES:
            ap.error(f"--families: unknown {f!r}; choose from {', '.join(FAMILIES)}")
    texts = read_texts(args.corpus, max(args.docs, args.train_docs))
    corpus_texts = texts[: args.docs]
    print(
        f"corpus {args.corpus}: {len(corpus_texts):,} documents, "
        f"{sum(len(t.encode('utf-8')) for t in corpus_texts) / 1e6:.1f} MB; reference: "
        "transformers tokenizer(texts, add_special_tokens=False)"
    )
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        # the gate's tokenizer memo goes to this run's folder, not the user's cache
        os.environ.setdefault("SHARDCACHE_CACHE_DIR", os.path.join(tmp, "cache"))
        for family in families:
            folder = os.path.join(tmp, family)
            start = time.perf_counter()
            train_family(family, texts[: args.train_docs], args.vocab_size, folder)
            print(f"(trained {family} in {time.perf_counter() - start:.1f} s)")
            figures[family] = measure(family, folder, corpus_texts, args, tmp)
        for folder in args.tokenizer:
            name = os.path.basename(os.path.normpath(folder))
            figures[name] = measure(name, folder, corpus_texts, args, tmp)
    print("\nexact fast candidates (all corpus and stress documents equal):")
    for name, fig in figures.items():
        exact = [
            c
            for c, row in fig["backends"].items()
            if c != "hf"
            and row.get("corpus_equal") == fig["documents"]
            and row.get("stress_equal") == fig["stress_texts"]
        ]
        print(f"  {name:22s} {', '.join(exact) or '-':30s} gate picks {fig['gate']['backend']}")
    record_result("bench_backends", figures, args)


if __name__ == "__main__":
    main()

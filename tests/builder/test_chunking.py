from __future__ import annotations

import itertools
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer

import shardcache.builder.tokenize as tokenize_module
from conftest import WORDS, cache_data_files, make_texts
from shardcache import open_cache
from shardcache.builder.chunking import chunking_is_exact, encode_in_pieces, split_points


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab \n\t東"), max_size=200), st.integers(3, 40))
def test_cuts_are_single_spaces_between_non_spaces(text, piece):
    cuts = split_points(text, piece)
    if cuts is None:
        return
    for pos in cuts:
        assert text[pos] == " " and not text[pos - 1].isspace() and not text[pos + 1].isspace()
    bounds = [0, *cuts, len(text)]
    assert all(b > a for a, b in itertools.pairwise(bounds)) or not text


def test_no_space_means_no_cut():
    assert split_points("x" * 100, 10) is None
    assert split_points("short", 10) == []


def _long_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    seps = [" "] * 12 + ["\n", "  ", "\t", " \n "]
    return "".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(words))


@pytest.mark.parametrize("fixture", ["tokenizer_dir", "bos_tokenizer_dir", "wordpiece_dir"])
def test_piecewise_ids_equal_whole_text_ids(fixture, request):
    folder = request.getfixturevalue(fixture)
    tok = AutoTokenizer.from_pretrained(folder)
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    wrapping = chunking_is_exact(backend, True)
    assert wrapping is not None
    text = _long_text(1, 3000)
    pieces = encode_in_pieces(backend, text, wrapping, piece_chars=997)
    assert pieces is not None
    assert pieces.tolist() == tok(text)["input_ids"]


def test_a_tokenizer_that_marks_every_input_is_not_chunked():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "▁a": 1, "a": 2}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁")])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert chunking_is_exact(tok, True) is None


def test_huge_document_builds_exactly(monkeypatch, tmp_path, build_cache, tokenizer_dir):
    from conftest import write_records

    monkeypatch.setattr(tokenize_module, "HUGE_CHARS", 5000)
    monkeypatch.setattr("shardcache.builder.chunking.PIECE_CHARS", 700)
    huge = _long_text(7, 4000)
    texts = [*make_texts(3), huge, "tail"]
    path = write_records(str(tmp_path / "h.jsonl"), [{"text": t} for t in texts], "jsonl")
    cache = open_cache(build_cache(path, tokenizer_dir))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    stored = {s.provenance.record: s.ids.tolist() for s in cache.iter_sequences()}
    for i, text in enumerate(texts):
        assert stored[i] == [*tok(text)["input_ids"], tok.eos_token_id]


# issue 13 item 10: huge documents without ASCII spaces (CJK, minified code, base64) are cut
# at pre-tokenizer boundaries, with the same ids as the whole-document encoding.


def _spaceless_texts(seed: int) -> dict[str, str]:
    import base64

    rng = random.Random(seed)
    marks = ["", "", "。", "、"]
    cjk = "".join(rng.choice("東京データ日本語の文章です中文字符") + rng.choice(marks)
                  for _ in range(6000))  # fmt: skip
    code = "".join(f"f{i}=(a,b)=>{{a*={i};return(a+b);}};x{i}=f{i}(1,2);" for i in range(500))
    blob = base64.b64encode(rng.randbytes(9000)).decode()
    return {"cjk": cjk, "code": code, "base64": blob}


@pytest.mark.parametrize("fixture", ["tokenizer_dir", "bos_tokenizer_dir", "wordpiece_dir"])
@pytest.mark.parametrize("kind", ["cjk", "code", "base64"])
def test_text_without_spaces_is_cut_at_pre_tokenizer_boundaries(fixture, kind, request):
    folder = request.getfixturevalue(fixture)
    tok = AutoTokenizer.from_pretrained(folder)
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    wrapping = chunking_is_exact(backend, True)
    assert wrapping is not None
    text = _spaceless_texts(3)[kind]
    assert " " not in text
    pieces = encode_in_pieces(backend, text, wrapping, piece_chars=997)
    assert pieces is not None  # cut, not encoded whole
    assert pieces.tolist() == tok(text)["input_ids"]


def _build_peak_rss_mb(tmp_path, tokenizer: str, encoder: str) -> float:
    """Build the corpus under ``tmp_path / "in"`` in a fresh process; its peak RSS in MB."""
    import subprocess
    import sys

    out = str(tmp_path / f"out-{encoder}")
    script = (
        "import resource\n"
        "from shardcache.builder.run import build_cache\n"
        "from shardcache.config import build_options_from_mapping\n"
        f"build_cache(build_options_from_mapping({{'input': {str(tmp_path / 'in')!r}, "
        f"'tokenizer': {tokenizer!r}, 'output': {out!r}, 'workers': 1, 'encoder': {encoder!r}}}))\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": repo}, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1]) / 1024


def test_a_huge_document_without_spaces_costs_auto_no_more_memory_than_hf(tmp_path, large_bpe_dir):
    """One 5 M-character CJK document (one pre-token: no exact cut exists): the default
    encoder must not take the fast backend's far hungrier whole-document path (in the gate,
    the build or its verification); HF's is the bound."""
    import json

    rng = random.Random(0)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 2000)]
    (tmp_path / "in").mkdir()
    text = "".join(rng.choices(chars, k=5_000_000))
    (tmp_path / "in" / "huge.jsonl").write_text(json.dumps({"text": text}, ensure_ascii=False))
    hf = _build_peak_rss_mb(tmp_path, large_bpe_dir, "hf")
    auto = _build_peak_rss_mb(tmp_path, large_bpe_dir, "auto")
    assert auto <= 1.25 * hf, (auto, hf)
    assert cache_data_files(str(tmp_path / "out-auto")) == cache_data_files(
        str(tmp_path / "out-hf")
    )

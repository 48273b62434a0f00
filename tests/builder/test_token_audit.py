"""``shardcache verify --tokens``: re-tokenize stored documents with HF and compare."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import make_conversations, make_texts, write_records
from shardcache.builder.backends import FastBackend
from shardcache.builder.run import build_cache as run_build
from shardcache.builder.token_audit import audit_tokens
from shardcache.cli import main
from shardcache.config import build_options_from_mapping
from shardcache.errors import CacheKeyMismatch


def _corpus(folder) -> str:
    texts = [*make_texts(60, seed=3), "東京 🙂 e\u0301  \t\n code: x = [1, 2]", ""]
    write_records(str(folder / "a.jsonl"), [{"text": t} for t in texts[:30]], "jsonl")
    write_records(str(folder / "b.jsonl.zst"), [{"text": t} for t in texts[30:]], "jsonl.zst")
    return str(folder)


def _build(inputs: str, tokenizer: str, out: str, **options) -> str:
    values = {"input": inputs, "tokenizer": tokenizer, "output": out, "workers": 1,
              "batch_docs": 8, **options}  # fmt: skip
    run_build(build_options_from_mapping(values))
    return out


def test_a_sample_of_one_record_files_is_a_sample_of_them(tmp_path, tokenizer_dir):
    """The sample hashes the input's name with the record index: of 200 one-record files
    about a quarter are checked at --fraction 1/4 (every record 0 was left out before)."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    for k, text in enumerate(make_texts(200, seed=8, max_words=10)):
        write_records(str(folder / f"f{k:03d}.jsonl"), [{"text": text}], "jsonl")
    out = _build(str(folder), tokenizer_dir, str(tmp_path / "cache"))
    audit = audit_tokens(out, 0.25)
    assert audit.ok and 25 <= audit.documents <= 75, audit.to_json()
    assert audit.sequences == audit.documents
    assert audit_tokens(out, 0.25).to_json() == audit.to_json()  # a fixed sample


@pytest.mark.parametrize("encoder", ["hf", "auto"])
def test_clean_cache_passes(tmp_path, tokenizer_dir, encoder):
    out = _build(_corpus(tmp_path), tokenizer_dir, str(tmp_path / "cache"), encoder=encoder,
                 max_length=8, truncation="split")  # fmt: skip
    audit = audit_tokens(out, 1.0)
    assert audit.ok, audit.to_json()
    assert audit.documents == 61  # the empty text is read (and stores nothing)
    assert audit.sequences > 61  # split pieces compared one by one
    partial = audit_tokens(out, 0.25)
    assert partial.ok and 0 < partial.documents < audit.documents


def test_wrong_ids_that_slipped_through_are_found(tmp_path, tokenizer_dir, monkeypatch):
    """A fast backend bug the in-build sample missed (verification switched off here): the
    checksums are fine, so plain verify passes, and verify --tokens names the record."""
    pytest.importorskip("fastokens")
    real = FastBackend.encode_flat
    calls = [0]

    def wrong(self, texts, add_special_tokens):
        tokens, lengths = real(self, texts, add_special_tokens)
        calls[0] += 1
        if calls[0] > 1 and any("code: x" in t for t in texts):  # after the gate
            tokens = tokens.copy()
            i = next(i for i, t in enumerate(texts) if "code: x" in t)
            tokens[int(np.cumsum(lengths)[i] - lengths[i])] += 1
        return tokens, lengths

    monkeypatch.setattr(FastBackend, "encode_flat", wrong)
    out = _build(_corpus(tmp_path), tokenizer_dir, str(tmp_path / "cache"), encoder="fast",
                 verify_fraction=0)  # fmt: skip
    monkeypatch.undo()
    audit = audit_tokens(out, 1.0)
    assert not audit.ok
    [mismatch] = audit.mismatches
    assert mismatch["source"] == "b.jsonl.zst" and mismatch["record"] == 30
    assert "HF gives" in mismatch["detail"]
    runner = CliRunner()
    plain = runner.invoke(main, ["verify", out])
    assert plain.exit_code == 0, plain.output
    result = runner.invoke(main, ["verify", out, "--tokens", "--fraction", "1"])
    assert result.exit_code == 1
    assert "mismatch     b.jsonl.zst record 30 piece 0: at token 0" in result.output
    data = json.loads(runner.invoke(main, ["verify", out, "--tokens", "--json"]).output)
    assert "tokens" in data and data["tokens"]["fraction"] == 1 / 64


def test_other_tokenizer_is_refused_with_the_changed_fields(tmp_path, tokenizer_dir,
                                                             bos_tokenizer_dir):  # fmt: skip
    out = _build(_corpus(tmp_path), tokenizer_dir, str(tmp_path / "cache"))
    with pytest.raises(CacheKeyMismatch, match="pass --tokenizer"):
        audit_tokens(out, 1.0, tokenizer=bos_tokenizer_dir)
    result = CliRunner().invoke(main, ["verify", out, "--tokens", "-t", bos_tokenizer_dir])
    assert result.exit_code == 1 and "post_processor" in result.output
    bad = CliRunner().invoke(main, ["verify", out, "--tokens", "--fraction", "0"])
    assert bad.exit_code == 2 and "--fraction" in bad.output


def test_moved_or_changed_inputs_are_reported(tmp_path, tokenizer_dir):
    (tmp_path / "c").mkdir()
    corpus = _corpus(tmp_path / "c")
    out = _build(corpus, tokenizer_dir, str(tmp_path / "cache"))
    moved = tmp_path / "moved"
    (tmp_path / "c").rename(moved)
    audit = audit_tokens(out, 1.0)
    assert audit.missing_inputs == ["a.jsonl", "b.jsonl.zst"] and not audit.ok
    with open(moved / "a.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "appended later"}) + "\n")
    audit = audit_tokens(out, 1.0, inputs=(str(moved),))
    assert audit.changed_inputs == ["a.jsonl"] and audit.missing_inputs == []


def test_chat_cache_ids_and_masks(tmp_path, chatml_tokenizer_dir):
    convs = make_conversations(25, seed=9)
    write_records(str(tmp_path / "c.jsonl"), [{"messages": m} for m in convs], "jsonl")
    out = _build(str(tmp_path / "c.jsonl"), chatml_tokenizer_dir, str(tmp_path / "cache"),
                 chat=True)  # fmt: skip
    audit = audit_tokens(out, 1.0)
    assert audit.ok and audit.documents == 25 and audit.sequences == 25


def test_a_sample_says_how_many_documents_may_still_differ(corpus, tokenizer_dir, tmp_path,
                                                          monkeypatch):  # fmt: skip
    """A sample without mismatches bounds, never excludes, differences: the build report,
    ``info`` and ``verify --tokens`` say "fewer than 3/N differ at 95% confidence"."""
    import re

    from shardcache.builder import sampled_verify

    monkeypatch.setattr(sampled_verify, "VERIFY_FLOOR_BYTES", 0)  # sample this small corpus

    from click.testing import CliRunner

    from shardcache.builder.report import format_report
    from shardcache.builder.run import build_cache
    from shardcache.cli import main
    from shardcache.config import build_options_from_mapping

    folder, _ = corpus("jsonl", n_files=2, docs=150)
    out = str(tmp_path / "cache")
    report = build_cache(build_options_from_mapping(
        {"input": folder, "tokenizer": tokenizer_dir, "output": out, "workers": 1,
         "verify_fraction": 0.1}))  # fmt: skip
    verified = report.encoder["documents_verified"]
    assert 0 < verified < 300  # the fast backend encoded, its in-build sample checked
    bound = f"0 mismatches in {verified:,} documents: fewer than 3/{verified:,}"
    assert bound in format_report(report)
    assert bound in CliRunner().invoke(main, ["info", out]).output
    audit = CliRunner().invoke(main, ["verify", out, "--tokens", "--fraction", "0.1"])
    assert audit.exit_code == 0, audit.output
    checked = int(re.search(r"tokens +([\d,]+) documents", audit.output).group(1).replace(",", ""))
    assert 0 < checked < 300
    assert f"0 mismatches in {checked:,} documents: fewer than 3/{checked:,}" in audit.output
    full = CliRunner().invoke(main, ["verify", out, "--tokens", "--fraction", "1"])
    assert "0 mismatches in 300 documents: every document was checked" in full.output


def test_a_sample_too_small_to_bound_says_so():
    """Issue 51 item 9: 2 documents checked read "fewer than 3/2 (150.00%) of documents differ"."""
    from shardcache.store.summary import sample_bound

    for checked in (1, 2, 3):
        text = sample_bound(checked, 0)
        assert "fewer than" not in text and "%" not in text
        assert f"0 mismatches in {checked} documents" in text and "--fraction 1" in text
    assert "fewer than 3/4 (75.00%)" in sample_bound(4, 0)
    assert sample_bound(2, 0, 2).endswith("every document was checked")
    assert sample_bound(2, 1) == ""

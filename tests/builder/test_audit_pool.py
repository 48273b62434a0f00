"""The reference encoding of ``verify --tokens`` on all cores (builder/audit_pool.py): the
same audit for any number of workers, results in order, progress over the inputs' bytes."""

from __future__ import annotations

import json
import os

import numpy as np
from click.testing import CliRunner

from conftest import make_conversations, make_texts, write_records
from shardcache.builder import audit_pool
from shardcache.builder.audit_pool import encode_in_order
from shardcache.builder.encoders import make_encoder
from shardcache.builder.report import Progress
from shardcache.builder.run import build_cache
from shardcache.builder.token_audit import audit_tokens
from shardcache.cli import main
from shardcache.config import TokenizeOptions, build_options_from_mapping


def _build(inputs: str, tokenizer: str, out: str, **options) -> str:
    values = {"input": inputs, "tokenizer": tokenizer, "output": out, "workers": 1,
              "batch_docs": 8, **options}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return out


def _text_cache(tmp_path, tokenizer_dir) -> tuple[str, str]:
    """A cache of two inputs (many batches of 8), then two records of a.jsonl edited."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = make_texts(120, seed=4)
    write_records(str(folder / "a.jsonl"), [{"text": t} for t in texts[:60]], "jsonl")
    write_records(str(folder / "b.jsonl.zst"), [{"text": t} for t in texts[60:]], "jsonl.zst")
    out = _build(str(folder), tokenizer_dir, str(tmp_path / "cache"), max_length=16,
                 truncation="split")  # fmt: skip
    texts[5] = "an edited record " + texts[5]
    texts[41] = texts[41].upper()
    write_records(str(folder / "a.jsonl"), [{"text": t} for t in texts[:60]], "jsonl")
    return out, str(folder)


def test_an_audit_on_two_workers_equals_the_one_of_one(tmp_path, tokenizer_dir):
    out, _ = _text_cache(tmp_path, tokenizer_dir)
    one = audit_tokens(out, 1.0, workers=1)
    two = audit_tokens(out, 1.0, workers=2)
    assert not one.ok
    assert {m["record"] for m in one.mismatches if m["source"] == "a.jsonl"} == {5, 41}
    assert one.changed_inputs == ["a.jsonl"]
    assert one.documents == 120 and one.sequences > 120  # split pieces compared one by one
    assert two.to_json() == one.to_json()
    assert audit_tokens(out, 0.25, workers=2).to_json() == audit_tokens(out, 0.25).to_json()


def test_a_chat_audit_on_two_workers_compares_masks_as_one_does(tmp_path, chatml_tokenizer_dir):
    folder = tmp_path / "chat"
    folder.mkdir()
    conversations = make_conversations(40, seed=2)
    write_records(str(folder / "c.jsonl"), [{"messages": m} for m in conversations], "jsonl")
    out = _build(str(folder), chatml_tokenizer_dir, str(tmp_path / "cache"), chat=True)
    one = audit_tokens(out, 1.0, workers=1)
    assert one.ok and one.documents == 40, one.to_json()
    assert audit_tokens(out, 1.0, workers=2).to_json() == one.to_json()


def test_results_come_back_in_the_order_of_the_jobs(tokenizer_dir):
    options = TokenizeOptions(tokenizer=tokenizer_dir)
    encoder = make_encoder(options, None, audit=True)
    texts = make_texts(50, seed=1)
    jobs = [(k, texts[k : k + 5]) for k in range(0, 50, 5)]
    alone = list(encode_in_order(encoder, jobs, 1, options, None))
    pooled = list(encode_in_order(encoder, iter(jobs), 3, options, None))
    assert [key for key, _ in pooled] == [key for key, _ in jobs]
    for (_, a), (_, b) in zip(alone, pooled):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.lengths, b.lengths)
        assert np.array_equal(a.doc_index, b.doc_index) and np.array_equal(a.piece, b.piece)


def test_a_single_batch_starts_no_process(tokenizer_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process pool was started for one batch")

    monkeypatch.setattr(audit_pool, "ProcessPoolExecutor", refuse)
    options = TokenizeOptions(tokenizer=tokenizer_dir)
    encoder = make_encoder(options, None, audit=True)
    [(key, encoded)] = encode_in_order(encoder, [("only", ["a b c"])], 4, options, None)
    assert key == "only" and len(encoded.lengths) == 1


class _Recorded(Progress):
    def __init__(self) -> None:
        self.total = self.files = self.read = self.documents = self.tokens = 0

    def start(self, total_bytes: int, files: int) -> None:
        self.total, self.files = total_bytes, files

    def advance(self, n_bytes: int) -> None:
        self.read += n_bytes

    def update(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens


def test_progress_covers_the_inputs_bytes_and_the_documents_checked(tmp_path, tokenizer_dir):
    out, folder = _text_cache(tmp_path, tokenizer_dir)
    progress = _Recorded()
    audit = audit_tokens(out, 1.0, workers=2, progress=progress)
    sizes = [os.path.getsize(os.path.join(folder, n)) for n in ("a.jsonl", "b.jsonl.zst")]
    assert progress.files == 2 and progress.total == sum(sizes)
    assert progress.read >= sizes[0]  # compressed inputs count what the reader consumed
    assert progress.documents == audit.documents == 120
    assert progress.tokens > 0


def test_verify_tokens_takes_workers_and_draws_no_bar_off_a_terminal(tmp_path, tokenizer_dir):
    out, _ = _text_cache(tmp_path, tokenizer_dir)
    runner = CliRunner()
    args = ["verify", out, "--tokens", "--fraction", "1", "--json"]
    one = runner.invoke(main, [*args, "--workers", "1"])
    two = runner.invoke(main, [*args, "-w", "2"])
    assert one.exit_code == two.exit_code == 1, one.output
    assert json.loads(two.stdout) == json.loads(one.stdout)
    text = runner.invoke(main, ["verify", out, "--tokens", "--fraction", "1", "-w", "2"])
    assert "verify (" not in text.stderr  # stderr is not a terminal: no bar
    assert "mismatch     a.jsonl record 5" in text.stdout
    bad = runner.invoke(main, [*args, "--workers", "0"])
    assert bad.exit_code == 2

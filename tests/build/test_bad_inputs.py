"""Issue 13 ("Trust II"): every bad input gets a clear answer; no hang, crash or silent empty
cache. Each test drives the real build (real tokenizer, real files) and checks the message."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from conftest import make_texts, write_records
from shardcache import SourceError, open_cache
from shardcache.cli import main


def _records(n: int, field: str = "text", seed: int = 0) -> list[dict]:
    return [{field: t, "id": i} for i, t in enumerate(make_texts(n, seed=seed))]


# --- 1. empty or mostly-bad builds fail ------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_build_that_keeps_no_document_fails_and_names_the_field(
    fmt, tmp_path, build_cache, tokenizer_dir
):
    path = write_records(str(tmp_path / f"d.{fmt}"), _records(20), fmt)
    with pytest.raises(SourceError) as info:
        build_cache(path, tokenizer_dir, text_field="body")
    message = str(info.value)
    assert "no record has field 'body'" in message
    assert "text" in message and "id" in message
    assert "did you mean --text-field text?" in message
    out = str(tmp_path / "cache-0")
    assert not os.path.exists(os.path.join(out, "manifest.json"))


def test_chat_data_built_as_text_suggests_chat(tmp_path, build_cache, tokenizer_dir):
    records = [{"messages": [{"role": "user", "content": "hi"}]} for _ in range(5)]
    path = write_records(str(tmp_path / "c.jsonl"), records, "jsonl")
    with pytest.raises(SourceError, match=r"--chat"):
        build_cache(path, tokenizer_dir)


def test_more_bad_than_max_bad_fraction_fails_unless_allowed(tmp_path, tokenizer_dir):
    lines = [json.dumps(r) for r in _records(16)] + ["not json"] * 4  # 20% bad
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    args = ["build", "-i", str(path), "-t", tokenizer_dir, "-o", out, "-q", "-w", "1"]
    runner = CliRunner()
    result = runner.invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "4 of 20 records" in result.output and "--max-bad-fraction" in result.output
    assert "not_json: 4" in result.output
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    # allowing it commits the partitions already built (the flag is not part of the key)
    result = runner.invoke(main, [*args, "--max-bad-fraction", "0.25"])
    assert result.exit_code == 0, result.output
    assert open_cache(out).manifest["totals"]["documents"] == 16
    bad = runner.invoke(main, [*args, "--max-bad-fraction", "1.5"])
    assert bad.exit_code == 2 and "max-bad-fraction" in bad.output

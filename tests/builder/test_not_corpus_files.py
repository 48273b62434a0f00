"""Issue 51, item 5: a file beside the corpus that holds no corpus record (an ``expected.json``
of a benchmark corpus) is a plan-time finding with the fix, not a count of bad records; the
field hint comes from the corpus files; ``--exclude GLOB`` leaves such a file out."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from conftest import make_texts, write_records
from shardcache import SourceError, open_cache
from shardcache.builder.build_plan import options_json
from shardcache.cli import main
from shardcache.config import build_options_from_mapping

SUMMARY = {"valid_docs": 80, "ids_sha256": "ab" * 32, "chars": 1234, "kind": "text",
           "bad_records": {"not_json": 1}, "format": "jsonl", "seed": 0}  # fmt: skip


def _corpus(tmp_path, indent: int | None = 1) -> str:
    """Two jsonl files of ``{"id", "text"}`` records and an ``expected.json`` beside them."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for f in range(2):
        records = [{"id": f"d{f}-{i}", "text": t} for i, t in enumerate(make_texts(40, seed=f))]
        write_records(str(folder / f"part-{f:05d}.jsonl"), records, "jsonl")
    (folder / "expected.json").write_text(json.dumps(SUMMARY, indent=indent))
    return str(folder)


@pytest.mark.parametrize("indent", [1, None], ids=["indented", "one-line"])
def test_a_file_with_no_corpus_record_is_a_plan_time_finding(
    indent, tmp_path, build_cache, tokenizer_dir
):
    folder = _corpus(tmp_path, indent)
    with pytest.raises(SourceError) as info:
        build_cache(folder, tokenizer_dir)
    message = str(info.value)
    assert "expected.json" in message and "part-00000.jsonl" not in message.split(";")[0]
    assert "--exclude" in message
    assert not os.path.exists(os.path.join(tmp_path, "cache-0", "manifest.json"))
    assert not os.path.exists(os.path.join(tmp_path, "cache-0", "quarantine.jsonl"))


def test_exclude_leaves_the_file_out(tmp_path, build_cache, tokenizer_dir):
    folder = _corpus(tmp_path)
    out = build_cache(folder, tokenizer_dir, exclude=["expected.json"])
    manifest = open_cache(out).manifest
    assert manifest["totals"]["documents"] == 80
    assert [f["relpath"] for f in manifest["inputs"]] == [
        "part-00000.jsonl", "part-00001.jsonl"
    ]  # fmt: skip
    assert manifest["options"]["source"]["exclude"] == ["expected.json"]


def test_exclude_on_the_command_line(tmp_path, tokenizer_dir):
    folder = _corpus(tmp_path)
    out = str(tmp_path / "out")
    args = ["build", "-i", folder, "-t", tokenizer_dir, "-o", out, "-q", "-w", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "expected.json" in result.output, result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, [*args, "--exclude", "*.json", "--exclude", "nothing/*"])
    assert result.exit_code == 0, result.output
    assert open_cache(out).manifest["totals"]["documents"] == 80


def test_the_field_hint_comes_from_the_corpus_files(tmp_path, build_cache, tokenizer_dir):
    folder = _corpus(tmp_path, indent=None)  # one object holding string fields such as 'kind'
    with pytest.raises(SourceError) as info:
        build_cache(folder, tokenizer_dir, text_field="content")
    message = str(info.value)
    assert "did you mean --text-field text?" in message
    assert "kind" not in message and "valid_docs" not in message


def test_a_corpus_file_whose_first_records_are_empty_texts_is_kept(
    tmp_path, build_cache, tokenizer_dir
):
    folder = _corpus(tmp_path)
    os.remove(os.path.join(folder, "expected.json"))
    records = [{"id": i, "text": ""} for i in range(3)] + [{"id": 3, "text": "late text"}]
    write_records(os.path.join(folder, "part-00002.jsonl"), records, "jsonl")
    out = build_cache(folder, tokenizer_dir, max_bad_fraction=0.5)
    assert open_cache(out).manifest["totals"]["documents"] == 81


def test_no_exclude_keeps_recorded_options_as_before(tmp_path):
    values = {"input": str(tmp_path), "tokenizer": "t", "output": str(tmp_path / "o")}
    assert "exclude" not in options_json(build_options_from_mapping(values))["source"]
    given = build_options_from_mapping({**values, "exclude": "*.json"})
    assert given.source.exclude == ("*.json",)
    assert options_json(given)["source"]["exclude"] == ["*.json"]

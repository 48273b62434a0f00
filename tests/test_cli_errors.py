"""Issue 13 item 15: the CLI's messages for common mistakes say what is wrong."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from shardcache.cli import main


def test_info_and_verify_on_a_missing_path_a_file_and_a_non_cache(tmp_path):
    runner = CliRunner()
    for command in ("info", "verify"):
        missing = runner.invoke(main, [command, str(tmp_path / "no" / "such")])
        assert missing.exit_code == 1, missing.output
        assert "does not exist" in missing.output and "manifest.json" not in missing.output
        (tmp_path / "f.txt").write_text("x")
        file = runner.invoke(main, [command, str(tmp_path / "f.txt")])
        assert file.exit_code == 1 and "is a file" in file.output
        folder = runner.invoke(main, [command, str(tmp_path)])
        assert folder.exit_code == 1 and "holds no shardcache cache" in folder.output
        assert "CORRUPT" not in folder.output


def test_a_folder_that_is_not_a_tokenizer_gets_a_short_message(tmp_path, corpus):
    folder, _ = corpus("jsonl", n_files=1, docs=3)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "README.md").write_text("not a tokenizer")
    args = ["build", "-i", folder, "-t", str(tmp_path / "tok"), "-o", str(tmp_path / "o"), "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "tokenizer.json" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "sentencepiece" not in result.output.lower()


@pytest.mark.parametrize("field", ["conversations"])
def test_chat_without_messages_suggests_messages_field(tmp_path, chatml_tokenizer_dir, field):
    path = tmp_path / "c.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path.write_text("".join(json.dumps({field: turns}) + "\n" for _ in range(5)))
    args = ["build", "-i", str(path), "-t", chatml_tokenizer_dir, "-o", str(tmp_path / "o"),
            "--chat", "-q", "-w", "1"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert f"--messages-field {field}" in result.output and "--text-field" not in result.output


def test_info_split_with_a_repeated_name_exits_2(corpus, tokenizer_dir, build_cache):
    """``--split validation=0.05,validation=0.2`` took the last fraction silently."""
    folder, _ = corpus("jsonl", n_files=1, docs=20)
    cache = build_cache(folder, tokenizer_dir)
    result = CliRunner().invoke(main, ["info", cache, "--split",
                                       "validation=0.05,validation=0.2"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "'validation' is given twice" in result.output and "Traceback" not in result.output

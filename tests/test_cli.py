from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from shardcache.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = sorted(main.commands)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0
    assert len(result.output.splitlines()) > 4
    assert main.commands[command].help


def test_quickstart_recipe_builds_and_info(tmp_path):
    out = str(tmp_path / "qs")
    runner = CliRunner()
    result = runner.invoke(
        main, ["build", os.path.join(REPO, "recipes", "quickstart.toml"), "-o", out, "-q"]
    )
    assert result.exit_code == 0, result.output
    assert "documents" in result.output
    info = runner.invoke(main, ["info", out, "--json"])
    assert info.exit_code == 0, info.output
    summary = json.loads(info.output)
    assert summary["totals"]["documents"] > 500 and summary["inputs"] == 3
    assert summary["truncation"] == {"max_length": 512, "strategy": "split"}
    text = runner.invoke(main, ["info", out])
    assert "bucket" in text.output and "tokens" in text.output


def test_flags_override_recipe_and_json_report(tmp_path, corpus, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=1, docs=12)
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'input = "{folder}"\ntokenizer = "{tokenizer_dir}"\noutput = "unused"\nmax_length = 1000\n'
    )
    out = str(tmp_path / "c")
    result = CliRunner().invoke(
        main,
        ["build", str(recipe), "-o", out, "--max-length", "4", "--truncation", "drop", "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["documents"] == 12
    assert report["stats"]["dropped_documents"] + report["sequences"] == 12
    assert not os.path.exists(tmp_path / "unused")


def test_exit_codes(tmp_path, corpus, tokenizer_dir):
    runner = CliRunner()
    folder, _ = corpus("jsonl", n_files=1, docs=3)
    # usage errors: exit 2
    assert runner.invoke(main, ["build", "-i", folder]).exit_code == 2
    args = ["build", "-i", folder, "-t", tokenizer_dir, "-o", str(tmp_path / "o")]
    assert runner.invoke(main, [*args, "--buckets", "9,3"]).exit_code == 2
    bad = tmp_path / "bad.toml"
    bad.write_text("colour = 'blue'\n")
    result = runner.invoke(main, ["build", str(bad)])
    assert result.exit_code == 2 and "unknown key" in result.output
    # failures: exit 1 with the message
    result = runner.invoke(main, ["info", str(tmp_path)])
    assert result.exit_code == 1 and "manifest.json is missing" in result.output
    result = runner.invoke(
        main,
        [
            "build",
            "-i",
            str(tmp_path / "none.jsonl"),
            "-t",
            tokenizer_dir,
            "-o",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 1 and "no such file" in result.output
    out = str(tmp_path / "twice")
    args = ["build", "-i", folder, "-t", tokenizer_dir, "-o", out, "-q"]
    assert runner.invoke(main, args).exit_code == 0
    again = runner.invoke(main, args)  # same options and inputs: up to date (issue 13)
    assert again.exit_code == 0 and "up to date" in again.output
    again = runner.invoke(main, [*args, "--truncation", "drop", "--max-length", "9"])
    assert again.exit_code == 1 and "--force" in again.output
    assert runner.invoke(main, [*args, "--force"]).exit_code == 0


def test_quiet_build_prints_one_line_and_problems(tmp_path, corpus, tokenizer_dir):
    """Issue 51 item 9: ``-q`` printed the whole summary; it prints one line, plus problems."""
    folder, _ = corpus("jsonl", n_files=1, docs=12)
    out = str(tmp_path / "c")
    args = ["build", "-i", folder, "-t", tokenizer_dir, "-o", out, "-w", "1"]
    result = CliRunner().invoke(main, [*args, "-q"])
    assert result.exit_code == 0, result.output
    [line] = result.output.splitlines()
    assert line.startswith(f"built {out}: 12 documents") and "tokens" in line
    full = CliRunner().invoke(main, [*args, "--force"])
    assert "partitions" in full.output and len(full.output.splitlines()) > 5
    with open(os.path.join(folder, "part-00.jsonl"), "a", encoding="utf-8") as f:
        f.write('{"id": 99}\n')
    result = CliRunner().invoke(main, [*args, "-q", "--force"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2 and "no_text_field 1" in lines[1] and "quarantine" in lines[1]

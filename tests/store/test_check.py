"""`shardcache check` / `lock` end to end: every component change is caught and named, and
nothing else raises an alarm."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from shardcache.cli import main


@pytest.fixture()
def setup(tmp_path, corpus, tokenizer_dir):
    """A private tokenizer copy, a corpus, a recipe and a cache built from them."""
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    folder, _ = corpus("jsonl", n_files=2, docs=20)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        f'input = "{folder}"\ntokenizer = "{tok}"\noutput = "{tmp_path / "cache"}"\n'
        'max_length = 32\ntruncation = "split"\n'
    )
    result = CliRunner().invoke(main, ["build", str(recipe), "-q"])
    assert result.exit_code == 0, result.output
    return {"tok": tok, "corpus": folder, "recipe": str(recipe), "cache": str(tmp_path / "cache")}


def _check(*args):
    result = CliRunner().invoke(main, ["check", *args, "--json"])
    report = json.loads(result.stdout) if result.exit_code in (0, 1) else None
    return result.exit_code, report


def _changed(report):
    return {
        (name, d["field"])
        for name, comp in report["components"].items()
        for d in comp["differences"]
        if d["severity"] == "changed"
    }


def _edit_tokenizer(tok, edit):
    path = tok / "tokenizer.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_unchanged_configuration_is_compatible(setup):
    code, report = _check(setup["cache"], setup["recipe"])
    assert code == 0 and report["compatible"]
    assert {c["status"] for c in report["components"].values()} == {"same"}


def test_reformatted_tokenizer_json_and_moved_cache_are_compatible(setup, tmp_path):
    path = setup["tok"] / "tokenizer.json"
    data = json.loads(path.read_text())
    reordered = dict(reversed(list(data.items())))
    path.write_text(json.dumps(reordered, indent=7, sort_keys=False))
    moved = str(tmp_path / "elsewhere" / "cache")
    shutil.move(setup["cache"], moved)
    code, report = _check(moved, setup["recipe"])
    assert code == 0, report


def test_rebuilding_identically_keeps_the_key(setup):
    manifest = os.path.join(setup["cache"], "manifest.json")
    with open(manifest) as f:
        before = json.load(f)["key"]
    result = CliRunner().invoke(main, ["build", setup["recipe"], "-q", "--force"])
    assert result.exit_code == 0
    with open(manifest) as f:
        after = json.load(f)["key"]
    assert before["digest"] == after["digest"]


def _add_token(data):
    data["added_tokens"].append(
        {
            "id": max(t["id"] for t in data["added_tokens"]) + 1000,
            "content": "<new>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )


def _lowercase(data):
    data["normalizer"] = {"type": "Lowercase"}


def _bake_truncation(data):
    data["truncation"] = {
        "direction": "Right",
        "max_length": 64,
        "strategy": "LongestFirst",
        "stride": 0,
    }


@pytest.mark.parametrize(
    "edit,component,field_prefix",
    [
        (_add_token, "tokenizer", "added_tokens"),
        (_lowercase, "tokenizer", "normalizer"),
        (_bake_truncation, "tokenizer", "truncation"),
    ],
)
def test_tokenizer_edits_are_named(setup, edit, component, field_prefix):
    _edit_tokenizer(setup["tok"], edit)
    code, report = _check(setup["cache"], setup["recipe"])
    assert code == 1
    assert any(c == component and f.startswith(field_prefix) for c, f in _changed(report))


def test_a_different_tokenizer_at_the_same_path(setup, wordpiece_dir):
    shutil.rmtree(setup["tok"])
    shutil.copytree(wordpiece_dir, setup["tok"])
    code, report = _check(setup["cache"], setup["recipe"])
    assert code == 1
    changed = _changed(report)
    assert ("tokenizer", "model.sha256") in changed
    assert any(c == "behaviour" for c, _ in changed)


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--max-length", "64"], ("truncation", "max_length")),
        (["--truncation", "drop"], ("truncation", "strategy")),
        (["--no-append-eos"], ("template", "append_eos")),
        (["--add-special-tokens"], None),  # the tokenizer's default: same key
    ],
)
def test_option_changes(setup, flags, expected):
    code, report = _check(setup["cache"], setup["recipe"], *flags)
    if expected is None:
        assert code == 0
    else:
        assert code == 1 and expected in _changed(report)


def test_data_edits_added_and_removed_files(setup):
    corpus = setup["corpus"]
    with open(os.path.join(corpus, "part-00.jsonl"), "a") as f:
        f.write('{"text": "one more"}\n')
    code, report = _check(setup["cache"], setup["recipe"])
    assert code == 1
    assert {f for c, f in _changed(report) if c == "data"} == {
        "files.part-00.jsonl.sha256",
        "files.part-00.jsonl.size",
    }
    shutil.copy(os.path.join(corpus, "part-01.jsonl"), os.path.join(corpus, "part-02.jsonl"))
    os.remove(os.path.join(corpus, "part-01.jsonl"))
    _, report = _check(setup["cache"], setup["recipe"])
    fields = {f for c, f in _changed(report) if c == "data"}
    assert {"files.part-01.jsonl", "files.part-02.jsonl"} <= fields  # removed, added: whole


def test_data_version(setup, tmp_path):
    cache = str(tmp_path / "versioned")
    args = ["build", setup["recipe"], "-q", "-o", cache, "--data-version", "v1"]
    assert CliRunner().invoke(main, args).exit_code == 0
    assert _check(cache, setup["recipe"], "--data-version", "v1")[0] == 0
    code, report = _check(cache, setup["recipe"], "--data-version", "v2")
    assert code == 1 and ("data", "version") in _changed(report)


def test_lock_file_workflow(setup, tmp_path):
    lock = str(tmp_path / "shardcache.lock")
    runner = CliRunner()
    result = runner.invoke(main, ["lock", setup["recipe"], "-o", lock])
    assert result.exit_code == 0, result.output
    assert _check("--lock", lock, setup["recipe"])[0] == 0
    assert _check(setup["cache"], "--lock", lock)[0] == 0  # cache vs lock: no tokenizer needed
    code, report = _check("--lock", lock, setup["recipe"], "--max-length", "16")
    assert code == 1 and ("truncation", "max_length") in _changed(report)
    human = runner.invoke(main, ["check", "--lock", lock, setup["recipe"], "--max-length", "16"])
    assert human.exit_code == 1
    assert "truncation.max_length: 32 -> 16" in human.output


def test_usage_and_io_errors_exit_2(setup, tmp_path):
    runner = CliRunner()
    assert runner.invoke(main, ["check", setup["cache"]]).exit_code == 2  # nothing to compare
    assert runner.invoke(main, ["check", str(tmp_path / "nope"), setup["recipe"]]).exit_code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(main, ["check", str(empty), setup["recipe"]])
    assert result.exit_code == 2 and "manifest.json is missing" in result.output
    assert (
        runner.invoke(
            main,
            [
                "lock",
                setup["recipe"],
                "-o",
                str(tmp_path / "x"),
                "--input",
                str(tmp_path / "absent.jsonl"),
            ],
        ).exit_code
        == 1
    )


def test_the_tokenizers_own_template_as_a_file_is_compatible(tmp_path, chatml_tokenizer_dir):
    """Issue 51 item 8: the same template text, from a file or the tokenizer, is one key."""
    from conftest import CHATML_TEMPLATE, make_conversations, write_records

    folder = tmp_path / "chat"
    folder.mkdir()
    records = [{"messages": m} for m in make_conversations(4)]
    write_records(str(folder / "a.jsonl"), records, "jsonl")
    cache = str(tmp_path / "cache")
    args = ["-i", str(folder), "-t", chatml_tokenizer_dir, "--chat"]
    result = CliRunner().invoke(main, ["build", *args, "-o", cache, "-q", "-w", "1"])
    assert result.exit_code == 0, result.output
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    code, report = _check(cache, *args, "--chat-template", str(template))
    assert code == 0 and report["compatible"], _changed(report)
    template.write_text(CHATML_TEMPLATE.replace("<|im_end|>\n", "<|im_end|>"))
    code, report = _check(cache, *args, "--chat-template", str(template))
    assert code == 1 and ("template", "source") in _changed(report)


def test_an_unchanged_configuration_shows_one_key(setup):
    """Issue 51 item 8: without inputs the data is not compared, and the key shown for the
    current side is the one it has with the cache's data: equal keys, not ``A -> B``."""
    runner = CliRunner()
    result = runner.invoke(main, ["check", setup["cache"], "-t", str(setup["tok"]),
                                  "--max-length", "32", "--truncation", "split"])  # fmt: skip
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert "compatible" in first and "->" not in first and "data not compared" in first
    changed = runner.invoke(main, ["check", setup["cache"], "-t", str(setup["tok"]),
                                   "--max-length", "16", "--truncation", "split"])  # fmt: skip
    assert changed.exit_code == 1 and "->" in changed.output.splitlines()[0]

"""``verify``, ``verify --tokens`` and ``check`` on preference caches (issue 47)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from test_preference_build import make_chat_pairs, make_string_pairs

from conftest import write_records
from shardcache import open_cache
from shardcache.builder.sampled_verify import sampled, source_salt
from shardcache.builder.token_audit import audit_tokens
from shardcache.cli import main
from shardcache.store.verify import verify_cache


def _implicit(records: list[dict]) -> list[dict]:
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
            for r in records]  # fmt: skip


@pytest.fixture()
def pair_caches(tmp_path, build_cache, chatml_tokenizer_dir):
    """Preference caches of string pairs, message-list pairs and implicit-prompt pairs."""
    made = {}
    shapes = {
        "strings": make_string_pairs(30, seed=21),
        "messages": make_chat_pairs(30, seed=22),
        "implicit": _implicit(make_chat_pairs(30, seed=23)),
    }
    for name, records in shapes.items():
        path = write_records(str(tmp_path / f"{name}.jsonl"), records, "jsonl")
        made[name] = (build_cache(path, chatml_tokenizer_dir, kind="preference", max_length=48),
                      path, records)  # fmt: skip
    return made


@pytest.mark.parametrize("shape", ["strings", "messages", "implicit"])
def test_verify_accepts_a_preference_cache(shape, pair_caches):
    """Preference shards hold a loss mask column, as chat shards do: not a structure problem."""
    report = verify_cache(pair_caches[shape][0])
    assert report.ok, report.problems


@pytest.mark.parametrize("shape", ["strings", "messages", "implicit"])
def test_verify_tokens_re_encodes_every_pair(shape, pair_caches):
    out, _, _ = pair_caches[shape]
    audit = audit_tokens(out, 1.0)
    assert audit.ok, audit.mismatches[:3]
    pairs = open_pairs(out)
    assert audit.documents == 30 and audit.sequences == 2 * pairs


def open_pairs(out: str) -> int:
    return open_cache(out).num_sequences // 2


def test_verify_tokens_samples_whole_pairs(pair_caches):
    out, _, _ = pair_caches["messages"]
    audit = audit_tokens(out, 0.5)
    assert audit.ok and 0 < audit.documents < 30
    picked = sampled(np.arange(30), 0.5, source_salt("messages.jsonl"))
    kept = {s.provenance.record for s in open_cache(out).iter_sequences()}
    assert audit.documents == int(picked.sum())
    assert audit.sequences == 2 * len(kept & set(np.flatnonzero(picked).tolist()))


def test_verify_tokens_finds_the_side_that_changed(pair_caches):
    """A rejected completion edited in the input: that side mismatches, its chosen does not."""
    out, path, records = pair_caches["messages"]
    edited = [dict(r) for r in records]
    edited[7]["rejected"] = [{"role": "assistant", "content": "no"}]
    write_records(path, edited, "jsonl")
    audit = audit_tokens(out, 1.0)
    assert not audit.ok and audit.changed_inputs == ["messages.jsonl"]
    assert [(m["record"], m["piece"]) for m in audit.mismatches] == [(7, 1)]


def test_verify_tokens_cli_on_a_preference_cache(pair_caches):
    out, _, _ = pair_caches["implicit"]
    result = CliRunner().invoke(main, ["verify", out, "--tokens", "--fraction", "1", "-w", "1"])
    assert result.exit_code == 0, result.output
    stored = 2 * open_pairs(out)  # the pairs over max_length are dropped whole, by HF too
    assert f"30 documents re-encoded with HF (fraction 1), {stored} stored sequences" in (
        result.output
    )


@pytest.fixture()
def recipe_cache(tmp_path, chatml_tokenizer_dir):
    """A preference cache built from a recipe (message-list pairs, max_length 48)."""
    data = tmp_path / "data"
    data.mkdir()
    write_records(str(data / "pairs.jsonl"), make_chat_pairs(12, seed=24), "jsonl")
    recipe = tmp_path / "dpo.toml"
    recipe.write_text(
        f'input = "{data}"\ntokenizer = "{chatml_tokenizer_dir}"\n'
        f'output = "{tmp_path / "cache"}"\nkind = "preference"\nmax_length = 48\nworkers = 1\n'
    )
    result = CliRunner().invoke(main, ["build", str(recipe), "-q"])
    assert result.exit_code == 0, result.output
    return str(recipe), str(tmp_path / "cache"), data


def open_tokenizer(cache: str) -> str:
    return open_cache(cache).manifest["options"]["tokenize"]["tokenizer"]


def _check(*args: str) -> tuple[int, dict | None]:
    result = CliRunner().invoke(main, ["check", *args, "--json"])
    return result.exit_code, json.loads(result.stdout) if result.exit_code in (0, 1) else None


def _changed(report: dict) -> set[tuple[str, str]]:
    return {(name, d["field"]) for name, comp in report["components"].items()
            for d in comp["differences"] if d["severity"] == "changed"}  # fmt: skip


def test_check_a_preference_cache_against_its_recipe(recipe_cache, tmp_path):
    recipe, cache, data = recipe_cache
    code, report = _check(cache, recipe)
    assert code == 0 and report["compatible"], _changed(report)
    code, report = _check(cache, recipe, "--max-length", "64")
    assert code == 1 and ("truncation", "max_length") in _changed(report)
    code, report = _check(cache, recipe, "--max-prompt-length", "16")
    assert code == 1 and _changed(report) == {("truncation", "max_prompt_length")}
    code, report = _check(cache, recipe, "--truncation", "truncate")
    assert code == 1 and _changed(report) == {("truncation", "strategy")}
    template = tmp_path / "other.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    code, report = _check(cache, recipe, "--chat-template", str(template))
    assert code == 1 and ("template", "source") in _changed(report)
    tokenizer = ["-t", open_tokenizer(cache), "--max-length", "48"]
    code, report = _check(cache, *tokenizer, "--preference")
    assert code == 0, _changed(report)
    code, report = _check(cache, *tokenizer, "--chat")  # chat data is another kind
    assert code == 1 and ("template", "kind") in _changed(report)
    changed = tmp_path / "tok"  # the same tokenizer, lower-casing its input
    shutil.copytree(open_tokenizer(cache), changed)
    spec = json.loads((changed / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (changed / "tokenizer.json").write_text(json.dumps(spec))
    code, report = _check(cache, recipe, "-t", str(changed))
    assert code == 1 and ("tokenizer", "normalizer") in _changed(report)
    write_records(str(data / "pairs.jsonl"), make_chat_pairs(12, seed=25), "jsonl")
    code, report = _check(cache, recipe)
    assert code == 1 and {c for c, _ in _changed(report)} == {"data"}


def test_verify_tokens_on_truncated_pairs(tmp_path, build_cache, chatml_tokenizer_dir):
    path = write_records(str(tmp_path / "p.jsonl"), make_chat_pairs(30, seed=26), "jsonl")
    out = build_cache(path, chatml_tokenizer_dir, kind="preference", truncation="truncate",
                      max_prompt_length=12, max_length=24)  # fmt: skip
    assert open_cache(out).manifest["stats"]["truncated_documents"] > 5
    audit = audit_tokens(out, 1.0)
    assert audit.ok and audit.sequences == 60, audit.mismatches[:3]


def _reseal(cache_dir: str, name: str, table) -> None:
    """Write ``table`` as shard ``name`` and record its size and sha256 in the manifest."""
    import os

    import pyarrow as pa

    from shardcache.store.files import sha256_file

    path = os.path.join(cache_dir, "shards", name)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    manifest_path = os.path.join(cache_dir, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    entry = next(s for s in manifest["shards"] if s["name"] == name)
    manifest["totals"]["shard_bytes"] += os.path.getsize(path) - entry["bytes"]
    entry["bytes"], entry["sha256"] = os.path.getsize(path), sha256_file(path)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def test_verify_finds_rows_that_are_not_pairs(pair_caches):
    """A preference shard whose rows are not (chosen, rejected) of one record is a structure
    problem, even when its checksum matches the manifest."""
    import pyarrow as pa

    out = pair_caches["strings"][0]
    name = open_cache(out).manifest["shards"][0]["name"]
    with open(f"{out}/shards/{name}", "rb") as f:  # in memory: the file is rewritten below
        table = pa.ipc.open_file(pa.BufferReader(f.read())).read_all()
    pieces = table.column("piece").to_numpy().copy()
    pieces[[0, 1]] = pieces[[1, 0]]  # the first pair: rejected first
    _reseal(out, name, table.set_column(2, "piece", pa.array(pieces, table.schema.field(2).type)))
    report = verify_cache(out)
    assert [(p.file, p.kind) for p in report.problems] == [(f"shards/{name}", "structure")]
    assert "rows 0 and 1 are not a pair" in report.problems[0].message

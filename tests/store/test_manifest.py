"""Manifest validation and the name rule (issue 12, items 1-2): a crafted or damaged manifest
is one CacheError naming the field and the value, for every reader, before any file is
opened or written; ``verify`` reports it and never raises."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
import numpy as np
import pytest
from click.testing import CliRunner

from shardcache import CacheError, ShardDataset, open_cache
from shardcache.builder.commit import commit_output
from shardcache.cli import main
from shardcache.store import layout
from shardcache.store.verify import verify_cache


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=30)
    return build_cache(folder, tokenizer_dir, shard_size=4096, buckets="16,64")


def _edit(cache: str, change: Callable[[dict[str, Any]], Any], text: str | None = None) -> None:
    """Rewrite the manifest: ``change`` edits the parsed object; ``text`` replaces the
    placeholder string ``"@@"`` in the dumped JSON (for NaN or deep nesting)."""
    path = os.path.join(cache, "manifest.json")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    change(manifest)
    data = json.dumps(manifest)
    if text is not None:
        data = data.replace('"@@"', text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(data)


def _assert_refused_everywhere(cache: str, *needles: str) -> None:
    """open_cache, ShardDataset and `info` raise a CacheError naming ``needles``; verify
    reports it and does not raise."""
    with pytest.raises(CacheError) as err:
        cache_obj = open_cache(cache)
        for i in range(cache_obj.num_sequences):  # shards are opened lazily
            cache_obj.read(i)
    for needle in needles:
        assert needle in str(err.value)
    with pytest.raises(CacheError):
        dataset = ShardDataset(cache, max_tokens=256, shuffle=False)
        list(dataset)
    result = CliRunner().invoke(main, ["info", cache])
    assert result.exit_code == 1, result.output
    assert not isinstance(result.exception, (KeyError, TypeError, OverflowError, RecursionError))
    for needle in needles:
        assert needle in result.output
    report = verify_cache(cache)
    assert not report.ok
    assert any(all(n in p.message for n in needles) for p in report.problems), report.problems


@pytest.mark.parametrize("name", ["../../elsewhere/x.arrow", "/abs/path.arrow"])
def test_a_shard_name_that_leaves_the_cache_folder_is_refused(cache_dir, tmp_path, name):
    with open(os.path.join(cache_dir, "manifest.json"), encoding="utf-8") as f:
        first = json.load(f)["shards"][0]["name"]
    target = os.path.normpath(os.path.join(cache_dir, "shards", name))
    if not name.startswith("/"):  # the file is really there: today's readers read it
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy(os.path.join(cache_dir, "shards", first), target)

    def rename(m: dict[str, Any]) -> None:
        m["shards"][0]["name"] = name

    _edit(cache_dir, rename)
    _assert_refused_everywhere(cache_dir, "shards[0].name", repr(name))


def _set(*keys: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        obj = m
        for k in keys[:-1]:
            obj = obj[k]
        obj[keys[-1]] = value

    return change


def _drop(*keys: Any) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        obj = m
        for k in keys[:-1]:
            obj = obj[k]
        del obj[keys[-1]]

    return change


DEEP = "[" * 200_000 + "]" * 200_000
MALFORMED = {
    "no shards": (_drop("shards"), None, "shards"),
    "no dtype": (_drop("dtype"), None, "dtype"),
    "no totals": (_drop("totals"), None, "totals"),
    "no pad_id": (_drop("tokenizer", "pad_id"), None, "tokenizer.pad_id"),
    "no shard name": (_drop("shards", 0, "name"), None, "shards[0].name"),
    "no shard rows": (_drop("shards", 0, "rows"), None, "shards[0].rows"),
    "rows 1e30": (_set("shards", 0, "rows", value=1e30), None, "shards[0].rows"),
    "rows NaN": (_set("shards", 0, "rows", value="@@"), "NaN", "NaN"),
    "rows '91'": (_set("shards", 0, "rows", value="91"), None, "shards[0].rows"),
    "rows -1": (_set("shards", 0, "rows", value=-1), None, "shards[0].rows"),
    "dtype float128": (_set("dtype", value="float128"), None, "dtype"),
    "shards an object": (_set("shards", value={"a": 1}), None, "shards"),
    "tokenizer a list": (_set("tokenizer", value=[1, 2]), None, "tokenizer"),
    "shard a list": (_set("shards", 0, value=[1, 2]), None, "shards[0]"),
    "deep nesting": (_set("stats", value="@@"), DEEP, "cannot parse"),
    "bucket 99": (_set("shards", 0, "bucket", value=99), None, "shards[0].bucket"),
    "bucket -1": (_set("shards", 0, "bucket", value=-1), None, "shards[0].bucket"),
    "sha256 a path": (_set("shards", 0, "sha256", value="../../x"), None, "shards[0].sha256"),
    "index name": (_set("index", "lengths", "name", value="../x.npy"), None, "index.lengths"),
    "quarantine": (_set("quarantine", "name", value="/etc/passwd"), None, "quarantine.name"),
    "not an object": (lambda m: None, None, "not an object"),
    "key a list": (_set("key", value=[1]), None, "key"),
    "key digest": (_set("key", "digest", value="../x"), None, "key.digest"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_manifest_is_one_clean_error_everywhere(cache_dir, case):
    change, text, needle = MALFORMED[case]
    if case == "not an object":
        with open(os.path.join(cache_dir, "manifest.json"), "w") as f:
            f.write("[1, 2, 3]")
    else:
        _edit(cache_dir, change, text)
    _assert_refused_everywhere(cache_dir, needle)


def test_the_name_rule():
    check_shard_name, check_relative_name = layout.check_shard_name, layout.check_relative_name
    assert check_shard_name("p00003-b01-00012.arrow") == "p00003-b01-00012.arrow"
    for bad in ["../p00003-b01-00012.arrow", "p00003-b01-00012.arrow/..", "x.arrow", 3, ""]:
        with pytest.raises(CacheError, match="shard name"):
            check_shard_name(bad)
    with pytest.raises(CacheError):
        layout.shard_path("/cache", "../../etc/passwd")
    assert check_relative_name("parts/p00001.json") == "parts/p00001.json"
    assert check_relative_name(".shares/share-0-of-2.json") == ".shares/share-0-of-2.json"
    for bad in ["parts/../../x", "/abs", "a//b", "..", "./x", "a\\b", "a\x00b", ""]:
        with pytest.raises(CacheError):
            check_relative_name(bad)


# ------------------------------------------------------------------------- remote side


@pytest.fixture()
def memory_cache(cache_dir, tmp_path, monkeypatch):
    """The built cache uploaded to fsspec's in-memory object store; yields (fs, url)."""
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(tmp_path / "local" / "cache"))
    fs = fsspec.filesystem("memory")
    root = _upload(fs, cache_dir)
    yield fs, root
    fs.rm(root.rsplit("/", 1)[0], recursive=True)


def _upload(fs: Any, cache_dir: str) -> str:
    root = f"/bucket-{uuid.uuid4().hex}/cache"
    for dirpath, _, files in os.walk(cache_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, cache_dir).replace(os.sep, "/")
            with open(path, "rb") as f:
                fs.pipe_file(f"{root}/{rel}", f.read())
    return root


def _edit_remote(fs: Any, root: str, change: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads(fs.cat_file(f"{root}/manifest.json"))
    change(manifest)
    fs.pipe_file(f"{root}/manifest.json", json.dumps(manifest).encode())


def _files_under(folder: str) -> set[str]:
    return {os.path.join(d, n) for d, _, files in os.walk(folder) for n in files}


def test_a_crafted_remote_digest_creates_no_file_outside_the_object_store(memory_cache, tmp_path):
    fs, root = memory_cache
    _edit_remote(fs, root, _set("shards", 0, "sha256", value="../../../../escaped"))
    before = _files_under(str(tmp_path))
    with pytest.raises(CacheError, match=r"shards\[0\]\.sha256"):
        cache = open_cache(f"memory://{root}")
        cache.read(0)
    created = _files_under(str(tmp_path)) - before
    assert not [p for p in created if "escaped" in p], created


def test_verify_of_a_crafted_remote_manifest_writes_nothing_outside(memory_cache, tmp_path):
    fs, root = memory_cache
    _edit_remote(fs, root, _set("shards", 0, "name", value="../../../../../evil.arrow"))
    report = verify_cache(f"memory://{root}")
    assert not report.ok
    assert any("shards[0].name" in p.message for p in report.problems), report.problems
    assert not [p for p in _files_under(str(tmp_path)) if "evil" in p]


def test_a_remote_commit_refuses_a_listed_key_that_leaves_the_output(
    corpus, build_cache, tokenizer_dir, tmp_path, monkeypatch
):
    """The commit lists ``parts/`` in the store: a key like ``parts/../../evil.txt`` is
    refused by name (never read, deleted or written anywhere), and nothing is committed."""
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(tmp_path / "local" / "cache"))
    # one partition, so its shards are the cache's (nothing merged away at commit)
    folder, _ = corpus("jsonl", n_files=1, docs=30)
    fs = fsspec.filesystem("memory")
    root = _upload(fs, build_cache(folder, tokenizer_dir, shard_size=4096, buckets="16,64"))
    fs.rm_file(f"{root}/manifest.json")  # an uncommitted build of every partition
    fs.pipe_file(f"{root}/parts/../../../../../evil.txt", b"attacker bytes")
    with pytest.raises(CacheError, match=r"evil\.txt"):
        commit_output(f"memory://{root}")
    assert not fs.exists(f"{root}/manifest.json")
    assert not [p for p in _files_under(str(tmp_path)) if p.endswith("evil.txt")]
    fs.rm(root.rsplit("/", 1)[0], recursive=True)


def test_a_valid_remote_cache_still_reads(memory_cache, cache_dir):
    _, root = memory_cache
    remote = open_cache(f"memory://{root}")
    local = open_cache(cache_dir)
    assert remote.num_sequences == local.num_sequences
    assert np.array_equal(remote.read(0), local.read(0))
    assert verify_cache(f"memory://{root}").ok


_ODD_VALUES = [None, True, False, -1, 2**63, 1.0, "1", "", "x" * 64, "A" * 64, "0" * 64, [], {},
               "p00000-b00-00000.arrow", "p00001", 0, 1, 3]  # fmt: skip


@pytest.mark.parametrize("key", ["name", "sha256", "bucket", "rows", "tokens", "bytes",
                                 "partition", "source"])  # fmt: skip
def test_the_one_test_per_shard_fast_path_accepts_only_what_the_field_checks_accept(
    cache_dir, monkeypatch, key
):
    """validate_manifest checks a plain shard entry with one combined test; any entry it lets
    through must pass the field-by-field checks, and every refusal still names the field."""
    from shardcache.store import manifest as manifest_module

    with open(os.path.join(cache_dir, "manifest.json"), encoding="utf-8") as f:
        good = json.load(f)
    # a partition's own shard (merged ones, with ``sources``, never take the fast path)
    at = next(i for i, s in enumerate(good["shards"]) if "sources" not in s)
    for value in [*_ODD_VALUES, "drop"]:
        edited = json.loads(json.dumps(good))
        if value == "drop":
            del edited["shards"][at][key]
        else:
            edited["shards"][at][key] = value
        outcomes = []
        for fast in (True, False):
            if not fast:
                monkeypatch.setattr(manifest_module, "_plain_shard_entry", lambda *_: False)
            try:
                manifest_module.validate_manifest(json.loads(json.dumps(edited)), "m.json")
                outcomes.append("ok")
            except CacheError as err:
                assert f"shards[{at}].{key}" in str(err)
                outcomes.append(str(err))
        monkeypatch.undo()
        assert outcomes[0] == outcomes[1], (key, value)


def test_a_merged_shard_entry_is_checked_run_by_run(cache_dir):
    """A merged shard lists where its rows came from; a damaged list is refused by field,
    and one with a partition's fields added is not taken for a partition's shard."""
    from shardcache.store import manifest as manifest_module

    with open(os.path.join(cache_dir, "manifest.json"), encoding="utf-8") as f:
        good = json.load(f)
    at = next(i for i, s in enumerate(good["shards"]) if "sources" in s)
    assert len(good["shards"][at]["sources"]) >= 2
    manifest_module.validate_manifest(json.loads(json.dumps(good)), "m.json")

    def refused(change: Callable[[dict[str, Any]], Any], field: str) -> None:
        edited = json.loads(json.dumps(good))
        change(edited["shards"][at])
        with pytest.raises(CacheError, match=re.escape(f"shards[{at}].{field}")):
            manifest_module.validate_manifest(edited, "m.json")

    refused(lambda s: s["sources"][0].update(rows=s["sources"][0]["rows"] + 1), "sources")
    refused(lambda s: s["sources"][1].update(partition="../x"), "sources[1].partition")
    refused(lambda s: s["sources"][0].pop("source"), "sources[0].source")
    refused(lambda s: s["sources"][0].update(rows=-1), "sources[0].rows")
    refused(lambda s: s.update(sources=[]), "sources")
    refused(lambda s: s.update(sources="p00000"), "sources")
    # a partition's fields on a merged entry do not make its runs unchecked
    refused(lambda s: (s.update(partition="p00000", source="a"), s["sources"].pop()), "sources")


@pytest.mark.parametrize(
    "field, value",
    [
        ("pad_id", "max+1"),  # every padded row would hold an id the tokenizer never gives
        ("pad_id", 2**40),  # padded with 0 on one path, OverflowError on the other
        ("max_token_id", 2**16),  # ids above what the uint16 shards can hold
    ],
)
def test_tokenizer_ids_the_reader_uses_are_checked_at_open(cache_dir, field, value):
    def change(manifest: dict[str, Any]) -> None:
        tokenizer = manifest["tokenizer"]
        tokenizer[field] = tokenizer["max_token_id"] + 1 if value == "max+1" else value

    _edit(cache_dir, change)
    with pytest.raises(CacheError, match=rf"manifest field tokenizer\.{field} is .*rebuild"):
        open_cache(cache_dir)
    with pytest.raises(CacheError, match=rf"tokenizer\.{field}"):
        ShardDataset(cache_dir, max_tokens=256)
    assert not verify_cache(cache_dir).ok

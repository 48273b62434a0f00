from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from shardcache import CorruptShardError, open_cache
from shardcache.cli import main
from shardcache.store.verify import verify_cache


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    return build_cache(folder, tokenizer_dir, shard_size=4096, buckets="16,64")


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_clean_cache_verifies(cache_dir):
    report = verify_cache(cache_dir)
    assert report.ok, report.problems
    manifest = open_cache(cache_dir).manifest
    # + manifest, length index, content keys, quarantine
    assert report.files_checked == len(manifest["shards"]) + 4
    result = CliRunner().invoke(main, ["verify", cache_dir, "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["ok"] is True


def test_a_flipped_byte_in_a_shard_is_caught_by_verify_and_the_reader(cache_dir):
    cache = open_cache(cache_dir)
    info = max(cache.shards, key=lambda s: s["bytes"])
    path = os.path.join(cache_dir, "shards", info["name"])
    _flip(path, info["bytes"] // 2)  # inside the token values: structure stays valid
    report = verify_cache(cache_dir)
    assert [(p.file, p.kind) for p in report.problems] == [(f"shards/{info['name']}", "checksum")]
    with pytest.raises(CorruptShardError, match=rf"{info['name']}: checksum mismatch"):
        list(open_cache(cache_dir).iter_sequences())
    result = CliRunner().invoke(main, ["verify", cache_dir])
    assert result.exit_code == 1 and info["name"] in result.output


def test_reader_checksums_can_be_switched_off_by_environment(cache_dir, monkeypatch):
    cache = open_cache(cache_dir)
    info = max(cache.shards, key=lambda s: s["bytes"])
    _flip(os.path.join(cache_dir, "shards", info["name"]), info["bytes"] // 2)
    monkeypatch.setenv("SHARDCACHE_SHARD_CHECKSUMS", "0")
    assert len(list(open_cache(cache_dir).iter_sequences())) == cache.num_sequences
    monkeypatch.setenv("SHARDCACHE_SHARD_CHECKSUMS", "1")
    with pytest.raises(CorruptShardError, match="checksum mismatch"):
        list(open_cache(cache_dir).iter_sequences())
    assert not verify_cache(cache_dir).ok  # verify always hashes


def test_missing_files_and_bad_structure_are_each_named(cache_dir):
    cache = open_cache(cache_dir)
    first, second = cache.shards[0], cache.shards[1]
    os.remove(os.path.join(cache_dir, "shards", first["name"]))
    # a structurally wrong shard with a matching manifest entry: row count disagrees
    manifest_path = os.path.join(cache_dir, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["shards"][1]["rows"] += 1
    for run in manifest["shards"][1].get("sources", [])[-1:]:  # a merged shard: its last run
        run["rows"] += 1
    manifest["totals"]["tokens"] += 5
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    np.save(os.path.join(cache_dir, "index", "lengths.npy"), np.zeros(3, dtype=np.uint32))
    report = verify_cache(cache_dir)
    found = {(p.file, p.kind) for p in report.problems}
    assert (f"shards/{first['name']}", "missing") in found
    assert (f"shards/{second['name']}", "structure") in found
    assert ("index/lengths.npy", "size") in found or ("index/lengths.npy", "checksum") in found
    assert ("manifest.json", "totals") in found
    result = CliRunner().invoke(main, ["verify", cache_dir, "--json"])
    assert result.exit_code == 1
    assert {p["file"] for p in json.loads(result.output)["problems"]} >= {
        f"shards/{first['name']}",
        "index/lengths.npy",
    }


def test_no_manifest_is_a_failure_not_a_crash(tmp_path):
    report = verify_cache(str(tmp_path))
    assert not report.ok and report.problems[0].file == "manifest.json"
    assert CliRunner().invoke(main, ["verify", str(tmp_path)]).exit_code == 1

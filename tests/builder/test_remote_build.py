"""Builds with URL inputs and a URL output (``store/storage.py``), fast tier: fsspec's real
``file://`` filesystem stands in for an object store (the slow tier runs the same paths
against a loopback S3 server, tests/store/test_remote.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from conftest import folder_files as tree
from conftest import kill_env
from shardcache.builder.commit import commit_output
from shardcache.builder.engines import EngineOptions, Share
from shardcache.builder.run import build, build_cache
from shardcache.config import build_options_from_mapping
from shardcache.errors import IncompleteBuildError

OPTIONS = {"partition_size": "2KiB", "shard_size": 4096, "buckets": "16,64", "batch_docs": 16}


def _values(inputs: str, tokenizer: str, out: str, **extra) -> dict:
    return {"input": inputs, "tokenizer": tokenizer, "output": out, "workers": 1,
            **OPTIONS, **extra}  # fmt: skip


def _same_cache(got: str, want: str) -> None:
    import json

    a, b = tree(got), tree(want)
    assert set(a) == set(b)
    for name in b:
        if name not in ("manifest.json", "parts/build.json"):  # input names, mtimes
            assert a[name] == b[name], name
    ma, mb = json.loads(a["manifest.json"]), json.loads(b["manifest.json"])
    ma["options"]["source"].pop("inputs")
    mb["options"]["source"].pop("inputs")
    assert ma == mb


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_url_inputs_and_output_equal_a_local_build(fmt, corpus, tokenizer_dir, tmp_path,
                                                   monkeypatch):  # fmt: skip
    # inputs streamed (byte ranges / row groups) and no local cache folder used at all
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(tmp_path / "file" / "unusable"))
    folder, _ = corpus(fmt, n_files=2, docs=80)
    if fmt == "parquet":  # row groups of 10 rows: partitions are runs of row groups
        import pyarrow.parquet as pq

        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            pq.write_table(pq.read_table(path), path, row_group_size=10)
    local = str(tmp_path / "local")
    build_cache(build_options_from_mapping(_values(folder, tokenizer_dir, local)))
    out = tmp_path / "store"
    report = build(build_options_from_mapping(_values(f"file://{folder}", tokenizer_dir,
                                                      f"file://{out}")))  # fmt: skip
    assert report.partitions > 2
    _same_cache(str(out), local)


def test_shares_into_a_url_then_a_full_build_resumes_them(corpus, tokenizer_dir, tmp_path):
    folder, _ = corpus("jsonl", n_files=2, docs=80)
    local = str(tmp_path / "local")
    build_cache(build_options_from_mapping(_values(folder, tokenizer_dir, local)))
    url = f"file://{tmp_path / 'store'}"
    options = build_options_from_mapping(_values(folder, tokenizer_dir, url))
    share = build(options, EngineOptions(share=Share(0, 2)))
    with pytest.raises(IncompleteBuildError, match="share"):
        commit_output(url)
    # the rest by a plain build: the share's partitions are kept, found in the store
    report = build(options)
    assert report.resumed_partitions == share.partitions > 0
    _same_cache(str(tmp_path / "store"), local)
    # committing again is a no-op report
    assert commit_output(url).shards == report.shards


def test_a_url_output_is_refused_or_rebuilt_with_force(corpus, tokenizer_dir, tmp_path):
    from shardcache.errors import CacheError

    folder, _ = corpus("jsonl", n_files=2, docs=40)
    url = f"file://{tmp_path / 'store'}"
    options = build_options_from_mapping(_values(folder, tokenizer_dir, url))
    build(options, EngineOptions(share=Share(0, 2)))  # an unfinished build in the store
    other = build_options_from_mapping(_values(folder, tokenizer_dir, url, batch_docs=8))
    with pytest.raises(CacheError, match="batch_docs"):
        build(other)  # other options: its partitions cannot be reused
    build(options)
    done = tree(str(tmp_path / "store"))
    # as a local output: the same build again is a no-op, other options are refused
    assert build(options).up_to_date
    with pytest.raises(CacheError, match=r"already holds a committed cache.*batch_docs"):
        build(other)
    forced = dataclasses.replace(options, force=True)
    report = build(forced)
    assert report.resumed_partitions == 0
    assert tree(str(tmp_path / "store")) == done


def test_a_url_commit_killed_after_its_manifest_is_finished_by_commit(
    corpus, tokenizer_dir, tmp_path
):
    """As the local case (tests/builder/test_build.py): the partition shards the merged ones
    replace, left in the store by a commit killed after uploading its manifest, are removed
    by the next `shardcache commit`."""
    import json
    import signal
    import subprocess
    import sys

    folder, _ = corpus("jsonl", n_files=3, docs=60)
    local = str(tmp_path / "local")
    build_cache(build_options_from_mapping(_values(folder, tokenizer_dir, local)))
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "shardcache.cli", "build", "-i", folder, "-t", tokenizer_dir,
           "-o", f"file://{store}", "--workers", "1", "--partition-size", "2KiB",
           "--shard-size", "4096", "--buckets", "16,64", "--batch-docs", "16", "-q"]  # fmt: skip
    env = {**os.environ, **kill_env("committed:1")}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    listed = {s["name"] for s in json.loads((store / "manifest.json").read_text())["shards"]}
    assert set(os.listdir(store / "shards")) - listed  # the replaced shards, still there
    assert commit_output(f"file://{store}").up_to_date
    assert set(os.listdir(store / "shards")) == listed
    _same_cache(str(store), local)


def test_a_url_commit_removes_the_scratch_folders_of_dead_commits(
    corpus, tokenizer_dir, tmp_path, monkeypatch
):
    """A URL commit killed on this host leaves its scratch folder (copies of shards) in the
    temporary folder; the next URL commit removes those of dead pids, not a live one's."""
    import subprocess
    import sys
    import tempfile

    from shardcache.builder.commit import COMMIT_SCRATCH_PREFIX

    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    dead = scratch_root / f"{COMMIT_SCRATCH_PREFIX}{gone}-abc"
    live = scratch_root / f"{COMMIT_SCRATCH_PREFIX}{os.getpid()}-def"
    unrelated = scratch_root / "shardcache-commit-notapid"
    for folder in (dead, live, unrelated):
        (folder / "shards").mkdir(parents=True)
        (folder / "shards" / "p00000-b00-00000.arrow").write_bytes(b"x" * 10)
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    build(build_options_from_mapping(_values(folder, tokenizer_dir, f"file://{tmp_path / 's'}")))
    assert not dead.exists()
    assert live.exists() and unrelated.exists()
    assert sorted(p.name for p in scratch_root.iterdir()) == sorted([live.name, unrelated.name])

"""Who closes what: a dataset owns its cache and shard readers and releases every file
descriptor and memory mapping of the cache when closed; no finalizer does it instead."""

from __future__ import annotations

import ast
import os
import pathlib
import shutil

import numpy as np
import pytest

import shardcache
from shardcache import ShardDataset, open_cache

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "epochs")


def _open_files_under(root: str) -> tuple[list[str], list[str]]:
    """The file descriptors and memory mappings of this process on files under ``root``."""
    root = os.path.realpath(root)
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used
            continue
        if target.startswith(root + os.sep):
            fds.append(target)
    with open("/proc/self/maps", encoding="utf-8") as f:
        maps = [line.split()[-1] for line in f if root + os.sep in line]
    return fds, maps


@pytest.fixture()
def caches(tmp_path):
    root = str(tmp_path / "caches")
    shutil.copytree(DATA, root)
    return root


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_thousand_datasets_leave_no_file_open_or_mapped(caches, monkeypatch):
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", os.path.join(caches, "user-cache"))
    modes = [{}, {"mode": "pack", "packing": "concat", "seq_len": 64, "attention": "none"}]
    for i in range(1000):
        name = ("plain", "zstd", "chat")[i % 3]
        options = modes[(i // 3) % 2]
        with ShardDataset(os.path.join(caches, name), max_tokens=2048, seed=i, **options) as ds:
            if i % 4 == 0:  # stopped early: the generator is closed when dropped
                for _ in ds:
                    break
            else:
                assert sum(1 for _ in ds) > 1
            if i < 3:  # while open, the counting sees the shards
                assert _open_files_under(caches)[1], name
    assert _open_files_under(caches) == ([], [])
    # close() without a with block, a dataset used again after close(), and a cache
    datasets = [ShardDataset(os.path.join(caches, "plain"), max_tokens=2048) for _ in range(20)]
    for ds in datasets:
        list(ds)
        ds.close()
    assert _open_files_under(caches) == ([], [])
    again = datasets[0]
    assert len(list(again)) == len(again)
    again.close()
    with open_cache(os.path.join(caches, "zstd")) as cache:
        assert len(cache.read(0))
    assert _open_files_under(caches) == ([], [])
    with pytest.raises(ValueError, match="closed"):
        cache.gather(np.array([0]))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_finished_pass_closes_its_shards(caches):
    """The end of an epoch (a pass read to its end) closes the shard readers; the dataset
    keeps only its length index until close(), and the next pass reads the same batches."""
    shards = os.path.join(caches, "plain", "shards")

    def shards_open() -> bool:
        fds, maps = _open_files_under(caches)
        return any(p.startswith(shards) for p in fds + maps)

    with ShardDataset(os.path.join(caches, "plain"), max_tokens=2048, seed=3) as ds:
        first = iter(ds)
        next(first)
        assert shards_open()
        list(first)
        assert not shards_open()
        again = list(ds)
        assert not shards_open()
        assert len(again) == len(ds)


def test_no_finalizer_in_the_package():
    """Resources are closed by their owner (close(), with), never from __del__: a finalizer
    runs at any allocation, on any thread, and one that took a lock deadlocked a reader."""
    found = []
    for path in pathlib.Path(shardcache.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "__del__":
                found.append(f"{path}:{node.lineno}")
    assert found == []

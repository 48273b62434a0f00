"""The background prefault of mapped shards (shardcache/store/prefault.py)."""

from __future__ import annotations

import mmap
import os
import sys
import threading

import numpy as np
import pytest

from shardcache import ShardDataset
from shardcache.store import prefault as prefault_module
from shardcache.store.prefault import PENDING, PREFAULTER, Prefaulter, prefault

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="counts minor page faults")


@pytest.fixture(autouse=True)
def prefault_on(monkeypatch):
    """Prefaulting is off unless ``SHARDCACHE_PREFAULT`` turns it on: on for these tests."""
    monkeypatch.setenv("SHARDCACHE_PREFAULT", "1")


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    data = np.random.default_rng(0).integers(0, 255, 8 << 20, np.uint8).tobytes()
    with open(path, "wb", buffering=0) as f:  # page by page: the page cache holds small pages
        for at in range(0, len(data), 4096):
            f.write(data[at : at + 4096])
    return str(path)


def _mapped(path: str) -> np.ndarray:
    """A fresh mapping of ``path`` (no page of it mapped in this process yet)."""
    with open(path, "rb") as f:
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(whole, dtype=np.uint8)


def _faults_reading(array: np.ndarray) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    int(array[:: prefault_module.PAGE].max())
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@linux_only
def test_a_prefaulted_mapping_is_read_without_page_faults(data_file):
    cold = _faults_reading(_mapped(data_file))
    if cold < 32:  # 8 MiB at 64 KiB a fault: this file system maps large pages at once
        pytest.skip(f"a fresh mapping of 8 MiB took only {cold} page faults here")
    array = _mapped(data_file)
    assert prefault(array)
    PREFAULTER.wait()
    assert _faults_reading(array) < cold / 4


def test_off_by_default_on_by_the_environment_and_small_arrays_skipped(data_file, monkeypatch):
    monkeypatch.delenv("SHARDCACHE_PREFAULT")
    assert not prefault(_mapped(data_file))  # off by default (measured slower: prefault.py)
    monkeypatch.setenv("SHARDCACHE_PREFAULT", "0")
    assert not prefault(_mapped(data_file))
    monkeypatch.setenv("SHARDCACHE_PREFAULT", "1")
    assert prefault(_mapped(data_file))
    assert not prefault(np.zeros(16, dtype=np.uint8))
    PREFAULTER.wait()


def test_a_cache_maps_its_shards_without_prefaulting_by_default(
    corpus, build_cache, tokenizer_dir, monkeypatch
):
    monkeypatch.delenv("SHARDCACHE_PREFAULT")
    folder, _ = corpus("jsonl", n_files=2, docs=200)
    path = build_cache(folder, tokenizer_dir, shard_size=4096, buckets="1000")
    before = PREFAULTER.touched + PREFAULTER.dropped
    for _ in ShardDataset(path, max_tokens=256, shuffle=False):
        pass
    PREFAULTER.wait()
    assert PREFAULTER.touched + PREFAULTER.dropped == before


def test_the_queue_is_bounded_and_drained(data_file):
    release = threading.Event()

    class Held(Prefaulter):
        def _run(self) -> None:
            release.wait()
            super()._run()

    held = Held()
    array = _mapped(data_file)
    accepted = [held.submit(array) for _ in range(PENDING + 3)]
    assert accepted == [True] * PENDING + [False] * 3 and held.dropped == 3
    release.set()
    held.wait()
    assert held.touched == PENDING


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_prefaults_with_its_own_thread(data_file):
    array = _mapped(data_file)
    prefault(array)
    PREFAULTER.wait()
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here; a new one starts
        code = 1
        try:
            before = PREFAULTER.touched
            ok = prefault(_mapped(data_file))
            PREFAULTER.wait()
            code = 0 if ok and PREFAULTER.touched == before + 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_cache_prefaults_each_shard_it_maps_once(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=200)
    path = build_cache(folder, tokenizer_dir, shard_size=4096, buckets="1000")
    submitted = []
    real = prefault_module.PREFAULTER.submit

    def counting(array: np.ndarray) -> bool:
        submitted.append(array.nbytes)
        return real(array)

    prefault_module.PREFAULTER.submit = counting  # type: ignore[method-assign]
    try:
        ds = ShardDataset(path, max_tokens=256, shuffle=False)
        for _ in range(2):  # the second pass maps nothing new
            for _ in ds:
                pass
    finally:
        del prefault_module.PREFAULTER.submit
    shards = ds._cache.shards
    assert len(shards) >= 2
    assert len(submitted) == len(shards)  # each mapped once: its token buffers' span
    spans = zip(sorted(submitted), sorted(s["tokens"] * 2 for s in shards), strict=True)
    assert all(span >= tokens for span, tokens in spans)

"""The local shard cache of remote caches (``store/remote.py``: ObjectStore), fast tier.

The "remote" is fsspec's real local filesystem; the readers are real separate processes
sharing one ``SHARDCACHE_CACHE_DIR``, as ranks on one machine do. Every wait has a timeout
(a hang guard: a deadlocked process is killed and the test fails).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import textwrap
from typing import ClassVar

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from shardcache.store.remote import ObjectStore

HANG_GUARD_S = 60
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _objects(tmp_path, n: int, size: int = 1000) -> tuple[str, list[dict]]:
    """``n`` remote objects of ``size`` bytes; their manifest-like entries."""
    remote = tmp_path / "remote"
    remote.mkdir()
    infos = []
    for i in range(n):
        data = bytes([i % 251]) * size
        (remote / f"o{i}.arrow").write_bytes(data)
        infos.append({"name": f"o{i}.arrow", "sha256": hashlib.sha256(data).hexdigest(),
                      "bytes": size})  # fmt: skip
    return str(remote), infos


_READER = textwrap.dedent(
    """
    import json, os, sys, time
    import fsspec
    from shardcache.store.remote import ObjectStore

    folder, remote, infos, mine, other, me, peer = sys.argv[1:]
    infos = json.loads(infos)
    fs = fsspec.filesystem("file")
    store = ObjectStore(folder, 1 << 30)

    def acquire(i):
        return store.acquire(fs, os.path.join(remote, infos[i]["name"]), infos[i])

    _, release_mine = acquire(int(mine))          # open (shared lock held, like an LRU entry)
    open(me, "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(peer):               # the peer holds its own shard open now
        assert time.monotonic() < deadline, "peer never started"
        time.sleep(0.01)
    _, release_other = acquire(int(other))        # the shard the peer holds open
    release_other()
    release_mine()
    print("done")
    """
)


def _start_reader(tmp_path, folder, remote, infos, mine, other, me, peer):
    import json

    env = {**os.environ, "PYTHONPATH": ROOT}
    args = [folder, remote, json.dumps(infos), str(mine), str(other), me, peer]
    return subprocess.Popen(
        [sys.executable, "-c", _READER, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("warm", [False, True])
def test_two_readers_holding_each_others_shards_do_not_deadlock(tmp_path, warm):
    remote, infos = _objects(tmp_path, 2)
    folder = str(tmp_path / "objects")
    if warm:  # both objects already downloaded: the reported hang with a warm cache
        store = ObjectStore(folder, 1 << 30)
        fs = fsspec.filesystem("file")
        for info in infos:
            store.acquire(fs, os.path.join(remote, info["name"]), info)[1]()
    a_ready, b_ready = str(tmp_path / "a"), str(tmp_path / "b")
    procs = [
        _start_reader(tmp_path, folder, remote, infos, 0, 1, a_ready, b_ready),
        _start_reader(tmp_path, folder, remote, infos, 1, 0, b_ready, a_ready),
    ]
    outcomes = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=HANG_GUARD_S)
            outcomes.append((proc.returncode, out.strip(), err[-2000:]))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.communicate()
            pytest.fail("deadlock: two readers each waited for the shard the other holds open")
    assert outcomes == [(0, "done", ""), (0, "done", "")]


def test_reader_holding_a_shard_does_not_block_another_process(tmp_path):
    remote, infos = _objects(tmp_path, 1)
    folder = str(tmp_path / "objects")
    store = ObjectStore(folder, 1 << 30)
    fs = fsspec.filesystem("file")
    path, release = store.acquire(fs, os.path.join(remote, infos[0]["name"]), infos[0])
    try:
        # this process holds the object open; another process opens it too and finishes
        marker = str(tmp_path / "peer-ready")
        open(marker, "w").close()
        proc = _start_reader(tmp_path, folder, remote, infos, 0, 0, str(tmp_path / "me"), marker)
        try:
            out, err = proc.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail("a reader waited for a shard another process merely had open")
        assert (proc.returncode, out.strip()) == (0, "done"), err
    finally:
        release()
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == infos[0]["sha256"]


# ------------------------------------------------------------------------- the size bound


class _WatchedFS(LocalFileSystem):
    """The real local filesystem, noting the bytes in the object folder at every download."""

    watched: str = ""
    seen: ClassVar[list[int]] = []

    def _open(self, path, mode="rb", **kwargs):
        self.seen.append(_folder_bytes(self.watched))
        return super()._open(path, mode, **kwargs)


def _folder_bytes(folder: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(folder) if e.name.endswith(".arrow"))


def test_closed_objects_are_evicted_before_a_download_not_after(tmp_path):
    remote, infos = _objects(tmp_path, 6, size=1000)
    folder = str(tmp_path / "objects")
    store = ObjectStore(folder, 2500)  # room for two objects
    fs = _WatchedFS(skip_instance_cache=True)
    fs.watched, fs.seen = folder, []
    for info in infos:
        _, release = store.acquire(fs, os.path.join(remote, info["name"]), info)
        release()
        assert _folder_bytes(folder) <= 2500
    # the folder has room for the new object before its bytes arrive: never above the bound
    assert len(fs.seen) == 6 and max(fs.seen) <= 2500 - 1000


def test_open_objects_over_the_bound_are_reported_once(tmp_path, caplog):
    remote, infos = _objects(tmp_path, 6, size=1000)
    folder = str(tmp_path / "objects")
    store = ObjectStore(folder, 2500)
    fs = fsspec.filesystem("file")
    releases = []
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        for info in infos[:5]:  # all held open: more than fit
            releases.append(store.acquire(fs, os.path.join(remote, info["name"]), info)[1])
    for release in releases:
        release()
    warnings = [r.getMessage() for r in caplog.records if "SHARDCACHE_CACHE_SIZE" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "2500" in warnings[0] and "open" in warnings[0]
    # once closed, the next download evicts back under the bound
    info = infos[5]
    store.acquire(fs, os.path.join(remote, info["name"]), info)[1]()
    assert _folder_bytes(folder) <= 2500


def test_an_object_held_in_one_folder_does_not_pin_it_in_another(tmp_path):
    """Two local object folders (two SHARDCACHE_CACHE_DIRs, or two tests) in one process may
    hold the same shard (same sha256): holding it open in one must not keep the other's
    closed copy from eviction (the slow-tier S3 test kept every object of a bounded folder
    while an earlier, not yet collected cache held the same shards elsewhere)."""
    remote, infos = _objects(tmp_path, 4)
    fs = LocalFileSystem()
    first = ObjectStore(str(tmp_path / "a"), 1 << 30)
    held = first.acquire(fs, os.path.join(remote, infos[0]["name"]), infos[0])[1]
    second = ObjectStore(str(tmp_path / "b"), 2500)  # room for two objects
    for info in infos:
        second.acquire(fs, os.path.join(remote, info["name"]), info)[1]()
    kept = sorted(n for n in os.listdir(tmp_path / "b") if n.endswith(".arrow"))
    assert len(kept) <= 2 and infos[0]["sha256"] + ".arrow" not in kept
    held()

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from shardcache import BuildLockedError
from shardcache.store.build_lock import LOCK_NAME, BuildLock, read_owner


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_is_exclusive_and_released(tmp_path):
    with BuildLock(str(tmp_path)) as lock:
        holder = read_owner(lock.path)
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(BuildLockedError, match=rf"pid {os.getpid()} on this host"):
            BuildLock(str(tmp_path)).acquire()
    assert not os.path.exists(tmp_path / LOCK_NAME)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "started": 0}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    with BuildLock(str(tmp_path)) as lock:
        assert read_owner(lock.path)["pid"] == os.getpid()


def test_foreign_host_and_unreadable_locks_are_refused_with_a_way_out(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 0}))
    with pytest.raises(BuildLockedError, match=r"host 'elsewhere'.*delete"):
        BuildLock(str(tmp_path)).acquire()
    (tmp_path / LOCK_NAME).write_text("{garbage")
    with pytest.raises(BuildLockedError, match="cannot be read"):
        BuildLock(str(tmp_path)).acquire()


def _live_process() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)  # fmt: skip


@pytest.mark.parametrize("after_read", [1, 2])
def test_a_stale_lock_taken_over_in_between_is_never_broken(tmp_path, monkeypatch, after_read):
    """B reads the stale lock; before B acts, A (a live build that bypasses the take-over
    guard, as an older shardcache would) takes it over. B must leave A's lock in place and
    refuse, not move it aside (two holders). ``after_read``: A acts after B's first read of
    the lock (judging it stale) or after the second (the re-read before the rename)."""
    import shardcache.store.build_lock as lock_module

    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "started": 0}
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps(stale))
    a = _live_process()
    a_lock = {"pid": a.pid, "host": socket.gethostname(), "started": 1}
    real_read_owner = lock_module.read_owner
    calls = []

    def read_then_interleave(p: str):
        result = real_read_owner(p)
        calls.append(p)
        if len(calls) == after_read:  # B has just read the stale lock; now A takes it over
            aside = tmp_path / "a-aside"
            os.rename(path, aside)
            os.remove(aside)
            (tmp_path / "a.tmp").write_text(json.dumps(a_lock))
            os.link(tmp_path / "a.tmp", path)
            os.remove(tmp_path / "a.tmp")
        return result

    monkeypatch.setattr(lock_module, "read_owner", read_then_interleave)
    try:
        with pytest.raises(BuildLockedError, match=rf"pid {a.pid}"):
            BuildLock(str(tmp_path)).acquire()
        assert real_read_owner(str(path)) == a_lock  # A still holds it: one holder
        assert not [n for n in os.listdir(tmp_path) if "stale" in n or n.endswith(".tmp")]
    finally:
        a.communicate(b"")


def test_the_stale_lock_take_over_is_serialized(tmp_path, monkeypatch):
    """While one build judges and removes a stale lock, no other build can start a take-over
    (the guard is held); the winner ends up as the only holder."""
    import fcntl

    import shardcache.store.build_lock as lock_module

    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "started": 0}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    real_read_owner = lock_module.read_owner
    guard_free = []

    def read_and_probe(p: str):
        if p.endswith(LOCK_NAME) and os.path.exists(tmp_path / lock_module.TAKEOVER_NAME):
            fd = os.open(tmp_path / lock_module.TAKEOVER_NAME, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                guard_free.append(True)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                guard_free.append(False)
            finally:
                os.close(fd)
        return real_read_owner(p)

    monkeypatch.setattr(lock_module, "read_owner", read_and_probe)
    with BuildLock(str(tmp_path)) as lock:
        assert real_read_owner(lock.path)["pid"] == os.getpid()
    assert False in guard_free  # the re-read of the stale lock happened under the guard


def test_a_reader_of_a_running_build_is_told_it_runs(tmp_path):
    """Issue 51 item 7: ``info`` (and every reader) on a build still running names its pid and
    says to wait, not "never committed; rerun the build"."""
    from click.testing import CliRunner

    from shardcache import CacheNotFoundError, open_cache
    from shardcache.cli import main

    out = tmp_path / "out"
    (out / "parts").mkdir(parents=True)
    (out / "parts" / "build.json").write_text("{}")
    with BuildLock(str(out)):
        with pytest.raises(CacheNotFoundError, match=rf"running.*pid {os.getpid()} on this host"):
            open_cache(str(out))
        result = CliRunner().invoke(main, ["info", str(out)])
        assert result.exit_code == 1
        assert f"pid {os.getpid()}" in result.output and "wait" in result.output
        assert "never committed" not in result.output
    # a job-array share running: wait for the shares, then commit
    share = out / ".shares" / "share-1-of-2"
    share.mkdir(parents=True)
    with (
        BuildLock(str(share)),
        pytest.raises(CacheNotFoundError, match=r"share 1/2.*running.*shardcache commit"),
    ):
        open_cache(str(out))
    # its process gone: the build was interrupted, rerunning it resumes it
    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "started": 0}
    (out / LOCK_NAME).write_text(json.dumps(stale))
    with pytest.raises(CacheNotFoundError, match="never committed") as err:
        open_cache(str(out))
    assert "is running" not in str(err.value)

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from shardcache import BuildLockedError
from shardcache.build.lock import LOCK_NAME, BuildLock, read_owner


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

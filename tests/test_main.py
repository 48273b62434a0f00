"""``python -m shardcache`` is the ``shardcache`` command: same help, same exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "shardcache", *args], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_python_m_shardcache_runs_the_cli():
    out = run("--help")
    assert out.returncode == 0 and "Usage: shardcache" in out.stdout and "build" in out.stdout
    bad = run("no-such-command")
    assert bad.returncode == 2 and "No such command" in bad.stderr

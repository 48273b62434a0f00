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


def test_the_package_is_typed_and_ships_the_marker():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    assert os.path.exists(os.path.join(ROOT, "shardcache", "py.typed"))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["shardcache"]

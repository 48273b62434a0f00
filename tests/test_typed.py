"""The package is typed for its users: the built wheel ships ``py.typed``, and a type checker
sees the real signatures of ``shardcache``'s public names in a user's script."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_SCRIPT = """\
import shardcache

cache = shardcache.open_cache("cache")
count: int = cache.num_sequences
wrong: str = cache.num_sequences
options = shardcache.PlanOptions(max_tokens=16384)
shardcache.verify_cache(1.5)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), ROOT],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    [name] = [n for n in os.listdir(out) if n.endswith(".whl")]
    return str(out / name)


def test_the_wheel_ships_the_marker(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "shardcache/py.typed" in names
    assert "shardcache/__init__.py" in names


def test_a_type_checker_sees_the_package_types(wheel, tmp_path):
    """mypy, pointed at an environment where only the wheel is installed, checks a user's
    script against shardcache's annotations: the two wrong lines are errors, the right ones
    are not. Without ``py.typed`` mypy would skip the package and report neither."""
    pytest.importorskip("mypy")
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel: unpacking installs it
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", str(python), "--no-incremental",
         "--cache-dir", os.devnull, "--ignore-missing-imports", "--no-error-summary",
         "--follow-imports", "silent", str(script)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    lines = {int(line.split(":")[1]) for line in errors}
    assert lines == {5, 7}, out.stdout + out.stderr
    assert "py.typed" not in out.stdout  # "missing library stubs or py.typed marker"
    assert sysconfig.get_paths()["purelib"] != site

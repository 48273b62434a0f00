from __future__ import annotations

import subprocess
import sys

import shardcache


def test_all_is_sorted_and_every_name_resolves():
    assert list(shardcache.__all__) == sorted(shardcache.__all__)
    for name in shardcache.__all__:
        assert getattr(shardcache, name) is not None


def test_no_stray_public_exports():
    public = {n for n in vars(shardcache) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(shardcache, n)).__name__ == "module"}
    assert public - modules - {"annotations", "Any"} <= set(shardcache.__all__)


def test_import_does_not_import_torch():
    code = "import sys, shardcache; shardcache.open_cache; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""The package facade: ``shardcache.__all__`` is sorted, complete and honest."""

from __future__ import annotations

import importlib.metadata
import inspect
import subprocess
import sys
import types

import shardcache
from shardcache import errors


def test_all_is_sorted_without_duplicates():
    assert list(shardcache.__all__) == sorted(set(shardcache.__all__))


def test_every_export_is_the_object_it_names():
    for name in shardcache.__all__:
        value = getattr(shardcache, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            # the real definition, not an alias or a stand-in of another name
            assert value.__name__ == name, f"shardcache.{name} is {value.__qualname__}"
            module = sys.modules[value.__module__]
            assert module.__name__.startswith("shardcache."), (name, module.__name__)
            assert getattr(module, name) is value, f"{name} is not {module.__name__}.{name}"
    assert shardcache.__version__ == importlib.metadata.version("shardcache")
    assert isinstance(shardcache.FORMAT_VERSION, int) and shardcache.FORMAT_VERSION >= 1


def test_the_whole_error_tree_is_exported():
    tree = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, errors.ShardcacheError)
    }
    exported = {n for n in shardcache.__all__ if n in tree}
    assert exported == tree, f"errors not exported: {sorted(tree - exported)}"
    for name in tree:
        assert getattr(shardcache, name) is getattr(errors, name)


def test_no_stray_public_exports():
    def public(names):  # modules and `from __future__ import annotations` are not exports
        return {
            n
            for n in names
            if not n.startswith("_")
            and n != "annotations"
            and not isinstance(getattr(shardcache, n), types.ModuleType)
        }

    assert public(dir(shardcache)) == {n for n in shardcache.__all__ if not n.startswith("_")}
    star: dict[str, object] = {}
    exec("from shardcache import *", star)
    assert set(star) - {"__builtins__"} == set(shardcache.__all__)


def test_import_does_not_import_torch():
    code = "import sys, shardcache; shardcache.open_cache; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

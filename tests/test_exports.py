"""The package facade: ``shardcache.__all__`` is sorted, complete and honest."""

from __future__ import annotations

import importlib.metadata
import inspect
import pathlib
import re
import subprocess
import sys
import types

import pytest

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


def _sections(doc: str) -> dict[str, str]:
    """A Google-style docstring's sections by heading (``Args``, ``Returns``, ...)."""
    found: dict[str, list[str]] = {}
    current = None
    for line in inspect.cleandoc(doc).splitlines():
        match = re.fullmatch(r"(Args|Attributes|Returns|Yields|Raises):", line.strip())
        if match and not line.startswith(" "):
            current = found.setdefault(match.group(1), [])
        elif current is not None:
            current.append(line)
    return {k: "\n".join(v) for k, v in found.items()}


def _contracts() -> list[tuple[str, object, object]]:
    """(name, callable, owner) for every public function, class and public method of __all__."""
    out: list[tuple[str, object, object]] = []
    for name in shardcache.__all__:
        value = getattr(shardcache, name)
        if inspect.isfunction(value):
            out.append((name, value, value))
        elif inspect.isclass(value) and not issubclass(value, BaseException):
            # the class docstring documents __init__ (a Protocol is never constructed)
            init = object.__init__ if getattr(value, "_is_protocol", False) else value.__init__
            out.append((name, init, value))
            for attr, member in vars(value).items():
                if inspect.isfunction(member) and not attr.startswith("_"):
                    out.append((f"{name}.{attr}", member, member))
    return out


@pytest.mark.parametrize(("name", "func", "owner"), _contracts(), ids=lambda v: str(v)[:40])
def test_public_api_states_its_contract(name, func, owner):
    doc = inspect.getdoc(owner) or ""
    assert doc, f"shardcache.{name} has no docstring"
    if func is object.__init__:
        return
    sections = _sections(doc)
    params = [
        p.name for p in inspect.signature(func).parameters.values() if p.name not in {"self", "cls"}
    ]
    if params:
        documented = sections.get("Args", "") + sections.get("Attributes", "")
        missing = [p for p in params if not re.search(rf"^\s*\**{p}\b", documented, re.M)]
        assert not missing, f"shardcache.{name}: Args does not name {missing}"
    returns = inspect.signature(func).return_annotation
    if inspect.isgeneratorfunction(func):
        assert "Yields" in sections, f"shardcache.{name}: no Yields section"
    elif func is not owner or returns in (None, "None", inspect.Signature.empty):
        pass
    elif returns not in ("NoReturn", "Never") and "@property" not in inspect.getsource(func)[:40]:
        assert "Returns" in sections, f"shardcache.{name}: no Returns section"


def test_package_docstrings_have_no_sphinx_roles():
    # the MkDocs site renders Markdown: a role like :func:`x` would show raw
    root = pathlib.Path(shardcache.__file__).parent
    role = re.compile(r":(func|class|meth|mod|attr|data|exc|obj|py:\w+):`")
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if role.search(line)
    ]
    assert not found, f"Sphinx roles in {found[:10]}"

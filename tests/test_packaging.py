"""What ``pip install`` brings: the fast encoders by default where they have wheels, and a
``train`` extra that covers every import of the training recipes (issue 58)."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the 3.10 backport, a dependency there
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]

#: Platforms as pip's markers see them, and the encoders that publish a wheel for each.
WHEELS = {
    ("linux", "x86_64"): {"fastokens", "gigatoken"},
    ("linux", "aarch64"): {"gigatoken"},
    ("darwin", "arm64"): {"fastokens", "gigatoken"},
    ("darwin", "x86_64"): {"fastokens", "gigatoken"},
    ("win32", "AMD64"): {"fastokens", "gigatoken"},
    ("win32", "ARM64"): set(),
    ("linux", "ppc64le"): set(),
}
#: Imports that need a package beside the module they name.
NEEDS = {"torch.utils.tensorboard": "tensorboard"}


def _requirements(entries: list[str]) -> list[Requirement]:
    return [Requirement(entry) for entry in entries]


@pytest.mark.parametrize(("platform", "machine"), sorted(WHEELS))
def test_the_encoders_are_dependencies_exactly_where_they_have_wheels(platform, machine):
    # elsewhere pip would build their sdists, which needs a Rust toolchain: the markers leave
    # them out and the HF tokenizer encodes
    environment = {"sys_platform": platform, "platform_machine": machine}
    chosen = {
        r.name
        for r in _requirements(PROJECT["dependencies"])
        if r.name in {"fastokens", "gigatoken"}
        and (r.marker is None or r.marker.evaluate(environment))
    }
    assert chosen == WHEELS[(platform, machine)]


def _third_party_imports(path: Path) -> set[str]:
    """The modules a file imports (dotted, as written), outside the standard library."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    local = {p.stem for p in path.parent.glob("*.py")}
    return {
        name
        for name in found
        if name.split(".")[0] not in sys.stdlib_module_names | local | {"shardcache"}
    }


def test_the_train_extra_covers_every_import_of_the_recipes():
    distributions = importlib.metadata.packages_distributions()
    installed = {r.name for r in _requirements(PROJECT["dependencies"])}
    train = PROJECT["optional-dependencies"]["train"]
    installed |= {r.name for r in _requirements(train)}
    missing = {}
    recipes = sorted((REPO / "recipes").glob("*.py"))
    assert recipes, "no recipes found"
    for path in recipes:
        for module in _third_party_imports(path):
            needed = {NEEDS[module]} if module in NEEDS else set()
            needed |= set(distributions.get(module.split(".")[0], [module.split(".")[0]]))
            lacking = {n for n in needed if n.lower() not in {i.lower() for i in installed}}
            if lacking:
                missing[f"{path.name}: {module}"] = sorted(lacking)
    assert not missing, f"recipes import what neither the dependencies nor [train] bring: {missing}"


def test_the_test_extra_includes_the_train_extra():
    # the recipes are tested (tests/test_recipes.py), so the test tier installs their extra
    assert "shardcache[train]" in PROJECT["optional-dependencies"]["test"]

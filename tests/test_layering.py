"""The package's import graph: three layers and the integrations above them, imports one way,
no cycles, no private names.

``store`` (the on-disk contract) imports neither ``builder`` nor ``read``; ``read`` never imports
``builder``; ``integrations`` (framework glue: transformers' Trainer, TRL) imports ``store`` and
``read`` and nothing imports it, not even the facade; no module imports another module's
underscore names; no cycles, counting imports inside functions. Only the facade
(``shardcache/__init__.py``) and the CLI may see every layer below the integrations.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

import shardcache

PACKAGE = os.path.dirname(os.path.abspath(shardcache.__file__))
TOP = {"shardcache", "shardcache.cli", "shardcache.__main__"}  # may import every layer


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[_module_name(path)] = path
    return found


MODULES = _modules()


def _imports(path: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import, at any depth."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [alias.name for alias in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES]
            out.append((node.module, [n for n in names if f"{node.module}.{n}" not in MODULES],
                        node.lineno))  # fmt: skip
            out += [(m, [], node.lineno) for m in submodules]
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {m for m, _, _ in _imports(path) if m in MODULES and m != module}
        graph[module] = targets
    return graph


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else None


LAYERS = ("store", "builder", "read", "integrations")


def test_the_graph_sees_every_layer():
    layers = {_layer(m) for m in MODULES}
    assert set(LAYERS) <= layers
    assert sum(len(t) for t in _graph().values()) > 50  # the walker finds imports at all


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if target in TOP:
                continue  # the facade is never imported back by a layer (checked below)
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if state.get(target) is None:
                visit(target)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if state.get(module) is None:
            visit(module)


def test_layers_import_one_way():
    allowed = {
        "store": {"store"},
        "builder": {"store", "builder"},
        "read": {"store", "read"},
        "integrations": {"store", "read", "integrations"},
    }
    bad = []
    for module, path in MODULES.items():
        layer = _layer(module)
        for target, _, line in _imports(path):
            if not target.startswith("shardcache"):
                continue
            if target in TOP and module not in TOP:
                bad.append(f"{module}:{line} imports the facade/CLI {target}")
            other = _layer(target)
            if layer is not None and other is not None and other not in allowed[layer]:
                bad.append(f"{module}:{line} ({layer}) imports {target} ({other})")
            if layer is None and module not in TOP and other is not None:
                bad.append(f"{module}:{line} (top level) imports the layer module {target}")
            if other == "integrations" and layer != "integrations":
                bad.append(f"{module}:{line} imports the integration {target}")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules():
    bad = [
        f"{module}:{line} imports {name} from {target}"
        for module, path in MODULES.items()
        for target, names, line in _imports(path)
        if target.startswith("shardcache") and target != module
        for name in names
        if name.startswith("_") and name != "__version__"
    ]
    assert not bad, "\n".join(bad)


def test_heavy_libraries_stay_in_their_layer():
    """torch only in the reader's front (the dataset, its batches, positions and losses),
    device prefetch and the integrations; tokenizers only in build, transformers in build and
    the integrations; the training frameworks (trl, accelerate, datasets) only in the
    integrations. The pipeline's stages (selection, plan, fetch, samples, collate) are numpy."""
    bad = []
    for module, path in MODULES.items():
        for target, _, line in _imports(path):
            root = target.split(".")[0]
            if root == "torch" and not module.startswith(
                (
                    "shardcache.read.dataset",
                    "shardcache.read.batch",
                    "shardcache.read.position",
                    "shardcache.read.losses",
                    "shardcache.read.device_prefetch",
                    "shardcache.read.loader",
                    "shardcache.integrations",
                )
            ):
                bad.append(f"{module}:{line} imports torch")
            if root in ("tokenizers", "transformers") and _layer(module) in ("store", "read"):
                bad.append(f"{module}:{line} imports {root}")
            if root in FRAMEWORKS and _layer(module) != "integrations":
                bad.append(f"{module}:{line} imports {root}")
    assert not bad, "\n".join(bad)


#: Training frameworks only the integrations layer may import.
FRAMEWORKS = ("trl", "accelerate", "datasets", "lightning")


def test_the_integrations_load_their_framework_only_when_used():
    """``shardcache.integrations.hf`` imports lazily: its chunked losses load neither
    transformers' Trainer nor TRL, and ShardTrainer does not load TRL."""
    loaded = _loaded_after("import shardcache.integrations.hf as h; h.causal_lm_loss")
    assert not {"trl", "accelerate", "transformers", "datasets"} & loaded
    loaded = _loaded_after("import shardcache.integrations.hf as h; h.ShardTrainer")
    assert "transformers.trainer" in loaded and "trl" not in loaded


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_reader_does_not_import_the_builder():
    loaded = _loaded_after("import shardcache.read.dataset; from shardcache import ShardDataset")
    assert "shardcache.read.dataset" in loaded
    builder = sorted(m for m in loaded if m.startswith("shardcache.builder"))
    assert not builder, builder
    assert not {"transformers", "tokenizers"} & loaded


def test_info_does_not_import_the_builder_or_torch():
    loaded = _loaded_after("import shardcache.store.summary, shardcache.store.cache")
    assert not [m for m in loaded if m.startswith(("shardcache.builder", "shardcache.read"))]
    assert not {"torch", "transformers", "tokenizers"} & loaded

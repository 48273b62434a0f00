"""TOML recipes: the build configuration as a file, one key per ``build`` flag (underscored).

Relative paths in a recipe are relative to the recipe's folder, so a recipe and its data move
together; command-line flags override recipe values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from shardcache.config import RECIPE_KEYS, read_toml
from shardcache.errors import ConfigError

PATH_KEYS = ("input", "tokenizer", "output", "chat_template")


def load_recipe(path: str) -> dict[str, Any]:
    """Read a recipe, check its keys and make its relative paths absolute (ConfigError if bad)."""
    data = read_toml(path, "recipe")
    unknown = sorted(set(data) - RECIPE_KEYS)
    if unknown:
        raise ConfigError(
            f"recipe {path!r}: unknown key(s) {unknown}; valid keys are {sorted(RECIPE_KEYS)}"
        )
    base = os.path.dirname(os.path.abspath(path))
    for key in PATH_KEYS:
        if key in data:
            data[key] = _resolve(data[key], base)
    return data


def _resolve(value: Any, base: str) -> Any:
    if isinstance(value, list):
        return [_resolve(v, base) for v in value]
    if isinstance(value, str) and "://" not in value and not os.path.isabs(value):
        return os.path.normpath(os.path.join(base, value))
    return value


def merge(recipe: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Recipe values overridden by every override not None or ``()``; tuples become lists."""
    merged = dict(recipe)
    for key, value in overrides.items():
        if value is None or value == ():
            continue
        merged[key] = list(value) if isinstance(value, tuple) else value
    return merged

"""Mixture recipes: a TOML file with one ``[[source]]`` table per cache (``path`` relative to
the file or a URL, ``weight``, ``max_repetitions``, ``name``) plus the batch options and
``seed``, ``attention``, ``ids_dtype``, ``tokens_per_epoch`` (example: ``recipes/mixture.toml``).
:func:`load_mixture_recipe` checks it into a :class:`MixtureRecipe`, whose
:meth:`~MixtureRecipe.dataset_options` are the keywords of ``ShardDataset(recipe.sources,
...)`` (and of ``shardcache.loader``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from shardcache.config import check_known, read_toml
from shardcache.errors import ConfigError
from shardcache.read.mixture import Source, as_sources
from shardcache.read.plan import PlanOptions

#: Keys of a ``[[source]]`` table.
SOURCE_KEYS = ("path", "weight", "max_repetitions", "name")
#: Top-level keys besides the batch options (``PlanOptions`` fields) and ``source``.
DATASET_KEYS = ("seed", "attention", "ids_dtype", "tokens_per_epoch")


@dataclass(frozen=True)
class MixtureRecipe:
    """A loaded mixture recipe.

    Attributes:
        sources: the ``[[source]]`` tables, paths resolved.
        tokens_per_epoch: the epoch size (None: the largest that fits).
        options: the other ``ShardDataset`` keywords (batch options, ``seed``,
            ``attention``, ``ids_dtype``).
    """

    sources: tuple[Source, ...]
    tokens_per_epoch: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def dataset_options(self) -> dict[str, Any]:
        """The keywords of ``ShardDataset(recipe.sources, **recipe.dataset_options())``.

        Returns:
            ``options`` and ``tokens_per_epoch`` in a new dict.
        """
        return {**self.options, "tokens_per_epoch": self.tokens_per_epoch}


def _resolve(path: Any, base: str, where: str) -> str:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}.path: got {path!r}, expected a cache path or URL")
    if "://" in path or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))


def load_mixture_recipe(path: str | os.PathLike[str]) -> MixtureRecipe:
    """Read and check a mixture recipe (see the module docstring).

    Args:
        path: the TOML file; relative source paths are relative to its folder.

    Returns:
        The recipe.

    Raises:
        ConfigError: the file cannot be read or parsed, a key is unknown, a value is out of
            range, or there is no ``[[source]]``.
    """
    path = os.fspath(path)
    data = read_toml(path, "mixture recipe")
    plan_fields = set(PlanOptions.__dataclass_fields__)
    check_known(
        f"mixture recipe {path!r}", data, {*plan_fields, *DATASET_KEYS, "source"}, noun="key"
    )
    tables = data.pop("source", None)
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(
            f"mixture recipe {path!r}: needs one [[source]] table per cache (path, weight, "
            "max_repetitions, name); found none"
        )
    base = os.path.dirname(os.path.abspath(path))
    entries = []
    for i, table in enumerate(tables):
        where = f"mixture recipe {path!r}: [[source]] #{i + 1}"
        check_known(where, table, SOURCE_KEYS, noun="key")
        entries.append({**table, "path": _resolve(table.get("path"), base, where)})
    sources = as_sources(entries)
    tokens_per_epoch = data.pop("tokens_per_epoch", None)
    if "max_tokens" not in data:
        raise ConfigError(
            f"mixture recipe {path!r}: max_tokens is required (the token budget of a batch)"
        )
    PlanOptions(**{k: v for k, v in data.items() if k in plan_fields})  # checks the values
    return MixtureRecipe(sources, tokens_per_epoch, data)

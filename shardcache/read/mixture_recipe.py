"""Mixture recipes: a TOML of ``[[source]]`` tables and ``ShardDataset`` keywords (see recipes/)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from shardcache.config import check_known, read_toml
from shardcache.errors import ConfigError
from shardcache.read.mixture import Source, as_sources, source_splits
from shardcache.read.plan import PlanOptions
from shardcache.read.splits import as_split, check_split_name

#: Keys of a ``[[source]]`` table.
SOURCE_KEYS = ("path", "weight", "max_repetitions", "name", "splits")
#: Top-level keys besides the batch options (``PlanOptions`` fields) and ``source``.
DATASET_KEYS = ("seed", "attention", "ids_dtype", "tokens_per_epoch", "split", "splits")


@dataclass(frozen=True)
class MixtureRecipe:
    """A loaded mixture recipe: its sources and the other ``ShardDataset`` keywords.

    With held-out fractions (a top-level ``[splits]`` table, or ``splits`` in a ``[[source]]``
    table) the recipe reads its ``split`` side, ``"train"`` unless it names another.
    """

    sources: tuple[Source, ...]
    tokens_per_epoch: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def dataset_options(self, split: str | None = None) -> dict[str, Any]:
        """The keywords of ``ShardDataset(recipe.sources, **recipe.dataset_options())``.

        ``split``: another side of the recipe's splits than its own (``"validation"`` for an
        evaluation pass over the same recipe).
        """
        options = {**self.options, "tokens_per_epoch": self.tokens_per_epoch}
        if split is not None:
            options["split"] = split
        return options


def _resolve(path: Any, base: str, where: str) -> str:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}.path: got {path!r}, expected a cache path or URL")
    if "://" in path or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))


def load_mixture_recipe(path: str | os.PathLike[str]) -> MixtureRecipe:
    """Read and check a mixture recipe (source paths relative to its folder); ConfigError if bad."""
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
    if "splits" in data:
        data["splits"] = as_split(data["splits"], f"mixture recipe {path!r}: [splits]")
    if "split" in data:
        check_split_name(data["split"])
    elif "splits" in data or any(s.splits is not None for s in sources):
        data["split"] = "train"  # the side a training run reads; dataset_options(split=...)
    source_splits(sources, data.get("split"), data.get("splits"))  # every source has one
    tokens_per_epoch = data.pop("tokens_per_epoch", None)
    if "max_tokens" not in data:
        raise ConfigError(
            f"mixture recipe {path!r}: max_tokens is required (the token budget of a batch)"
        )
    PlanOptions(**{k: v for k, v in data.items() if k in plan_fields})  # checks the values
    return MixtureRecipe(sources, tokens_per_epoch, data)

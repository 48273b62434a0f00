"""Mixture recipes: a TOML of ``[[source]]`` tables and ``ShardDataset`` keywords (see recipes/)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from shardcache.config import check_known, read_toml
from shardcache.errors import ConfigError
from shardcache.read.plan.epoch_plan import PlanOptions
from shardcache.read.selection.mixture import Source, as_sources, source_splits
from shardcache.read.selection.schedule import Schedule
from shardcache.read.selection.splits import as_split, check_split_name

#: Keys of a ``[[source]]`` table.
SOURCE_KEYS = ("path", "weight", "max_repetitions", "name", "splits")
#: Top-level keys besides the batch options (``PlanOptions`` fields) and ``source``.
DATASET_KEYS = ("seed", "attention", "ids_dtype", "tokens_per_epoch", "split", "splits")
#: Top-level keys of a schedule besides its ``[[schedule]]`` points (``Schedule`` fields).
SCHEDULE_KEYS = ("schedule_kind", "window_tokens", "total_tokens")


@dataclass(frozen=True)
class MixtureRecipe:
    """A loaded mixture recipe: its sources and the other ``ShardDataset`` keywords.

    Made by [`load_mixture_recipe`][shardcache.load_mixture_recipe]; read it with
    ``ShardDataset(recipe.sources, **recipe.dataset_options())``. ``[[schedule]]`` tables
    (``at_tokens``, ``weights``, and a phase's batch options: ``max_tokens``, ``seq_len``,
    ``mode``, ``packing``) give a [`Schedule`][shardcache.Schedule] (with the top-level
    ``schedule_kind``, ``window_tokens`` and ``total_tokens``). With held-out fractions (a
    top-level ``[splits]`` table, or ``splits`` in a ``[[source]]`` table) the recipe reads
    its ``split`` side, ``"train"`` unless it names another.

    Attributes:
        sources: the ``[[source]]`` tables as [`Source`][shardcache.Source]s, paths resolved
            against the recipe's folder.
        tokens_per_epoch: the recipe's ``tokens_per_epoch`` (None: the largest epoch every
            source's share fits in).
        options: the other ``ShardDataset`` keywords (batch options, ``seed``, ``attention``,
            ``split``, ``splits``, ...).
        schedule: the ``[[schedule]]`` points as a ``Schedule``, or None.
    """

    sources: tuple[Source, ...]
    tokens_per_epoch: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    schedule: Schedule | None = None

    def dataset_options(self, split: str | None = None) -> dict[str, Any]:
        """The keywords of ``ShardDataset(recipe.sources, **recipe.dataset_options())``.

        Args:
            split: another side of the recipe's splits than its own (``"validation"`` for an
                evaluation pass over the same recipe; None: the recipe's).

        Returns:
            The keywords, ``tokens_per_epoch`` and the schedule (if any) included.
        """
        options = {**self.options, "tokens_per_epoch": self.tokens_per_epoch}
        if self.schedule is not None:
            options["schedule"] = self.schedule
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
    """Read and check a mixture recipe, a TOML file (the format: docs/guide/mixtures.md).

    The file holds one ``[[source]]`` table per cache (``path``, ``weight``,
    ``max_repetitions``, ``name``, ``splits``), the batch options (``max_tokens`` is
    required), and optionally ``seed``, ``attention``, ``tokens_per_epoch``, ``split``,
    ``[splits]`` and ``[[schedule]]`` points; ``shardcache mix`` prints what it gives an epoch.

    Args:
        path: the recipe file. Source paths in it are relative to its folder (or URLs).

    Returns:
        The recipe; ``ShardDataset(recipe.sources, **recipe.dataset_options())`` reads it.

    Raises:
        ConfigError: the file cannot be read or parsed, a key is unknown, a value is out of
            range, ``max_tokens`` or the ``[[source]]`` tables are missing, or a source has no
            held-out fractions while others do.
    """
    path = os.fspath(path)
    data = read_toml(path, "mixture recipe")
    plan_fields = set(PlanOptions.__dataclass_fields__)
    check_known(
        f"mixture recipe {path!r}",
        data,
        {*plan_fields, *DATASET_KEYS, *SCHEDULE_KEYS, "source", "schedule"},
        noun="key",
    )
    schedule = _schedule(data, path)
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
    return MixtureRecipe(sources, tokens_per_epoch, data, schedule)


def _schedule(data: dict[str, Any], path: str) -> Schedule | None:
    """The recipe's schedule (its keys taken out of ``data``), or None."""
    points = data.pop("schedule", None)
    extra = {k: data.pop(k) for k in SCHEDULE_KEYS if k in data}
    if points is None:
        if extra:
            raise ConfigError(
                f"mixture recipe {path!r}: {sorted(extra)} configure a schedule but there is "
                "no [[schedule]] table (at_tokens, weights); add the points or drop the keys"
            )
        return None
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise ConfigError(
            f"mixture recipe {path!r}: schedule must be [[schedule]] tables with at_tokens and "
            f"weights, got {points!r}"
        )
    try:
        return Schedule(
            tuple(points),
            extra.get("schedule_kind", "phases"),
            extra.get("window_tokens"),
            extra.get("total_tokens"),
        )
    except ConfigError as err:
        raise ConfigError(f"mixture recipe {path!r}: {err}") from None

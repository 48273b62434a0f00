"""shardcache: pre-tokenize a corpus once into verified shards, stream token-budget batches.

Every public name is imported on first access (PEP 562), so ``import shardcache`` is cheap and
a reader process (``shardcache.ShardDataset``) never imports the builder, transformers or
tokenizers. The layers are ``shardcache.store`` (the on-disk contract), ``shardcache.builder``
(corpus -> cache) and ``shardcache.read`` (cache -> training); this facade and the CLI are the
only modules that see all three.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

from shardcache.store import key as _key
from shardcache.version import __version__

if _typing.TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from collections.abc import Mapping
    from typing import Any

    from shardcache.builder.report import BuildReport
    from shardcache.builder.run import build_cache
    from shardcache.config import BuildOptions, LayoutOptions, SourceOptions, TokenizeOptions
    from shardcache.errors import (
        BadRecordError,
        BuildLockedError,
        CacheError,
        CacheKeyMismatch,
        CacheNotFoundError,
        ConfigError,
        CorruptShardError,
        EncoderError,
        IncompleteBuildError,
        MissingDependencyError,
        ShardcacheError,
        SourceError,
        StateError,
        TokenizerError,
    )
    from shardcache.read.dataset import ShardDataset
    from shardcache.read.device_prefetch import (
        DevicePrefetcher,
        PrefetchOptions,
        PrefetchStats,
        StallMonitor,
    )
    from shardcache.read.fetch.shard_readahead import ReadAheadOptions
    from shardcache.read.loader import ShardLoader, loader
    from shardcache.read.losses import model_inputs, pair_logps, weighted_loss
    from shardcache.read.plan.epoch_plan import EpochPlan, PlanOptions, plan_epoch
    from shardcache.read.rewind import Rewinder, rewind, write_run_record
    from shardcache.read.run_record import RunRecord, read_run_record
    from shardcache.read.samples.chain import Transform
    from shardcache.read.samples.transforms import FIM, SpanMask
    from shardcache.read.selection.mixture import Source
    from shardcache.read.selection.mixture_recipe import MixtureRecipe, load_mixture_recipe
    from shardcache.read.selection.mixture_table import MixtureTable, SourceShare
    from shardcache.read.selection.schedule import Schedule, SchedulePoint, ScheduleTable
    from shardcache.read.selection.splits import Split
    from shardcache.read.trainer_callback import StallMonitorCallback
    from shardcache.store.cache import Cache, Provenance, open_cache
    from shardcache.store.export import ExportOptions, ExportReport, export_cache
    from shardcache.store.layout import FORMAT_VERSION
    from shardcache.store.verify import VerifyReport, verify_cache

_ERRORS = (
    "BadRecordError",
    "BuildLockedError",
    "CacheError",
    "CacheKeyMismatch",
    "CacheNotFoundError",
    "ConfigError",
    "CorruptShardError",
    "EncoderError",
    "IncompleteBuildError",
    "MissingDependencyError",
    "ShardcacheError",
    "SourceError",
    "StateError",
    "TokenizerError",
)
_LAZY: dict[str, str] = {
    **dict.fromkeys(_ERRORS, "shardcache.errors"),
    "BuildOptions": "shardcache.config",
    "BuildReport": "shardcache.builder.report",
    "Cache": "shardcache.store.cache",
    "DevicePrefetcher": "shardcache.read.device_prefetch",
    "EpochPlan": "shardcache.read.plan.epoch_plan",
    "ExportOptions": "shardcache.store.export",
    "ExportReport": "shardcache.store.export",
    "FIM": "shardcache.read.samples.transforms",
    "FORMAT_VERSION": "shardcache.store.layout",
    "LayoutOptions": "shardcache.config",
    "MixtureTable": "shardcache.read.selection.mixture_table",
    "PlanOptions": "shardcache.read.plan.epoch_plan",
    "PrefetchOptions": "shardcache.read.device_prefetch",
    "PrefetchStats": "shardcache.read.device_prefetch",
    "Provenance": "shardcache.store.cache",
    "ReadAheadOptions": "shardcache.read.fetch.shard_readahead",
    "Rewinder": "shardcache.read.rewind",
    "RunRecord": "shardcache.read.run_record",
    "Schedule": "shardcache.read.selection.schedule",
    "SchedulePoint": "shardcache.read.selection.schedule",
    "ScheduleTable": "shardcache.read.selection.schedule",
    "ShardDataset": "shardcache.read.dataset",
    "ShardLoader": "shardcache.read.loader",
    "MixtureRecipe": "shardcache.read.selection.mixture_recipe",
    "Source": "shardcache.read.selection.mixture",
    "SpanMask": "shardcache.read.samples.transforms",
    "Split": "shardcache.read.selection.splits",
    "StallMonitor": "shardcache.read.device_prefetch",
    "StallMonitorCallback": "shardcache.read.trainer_callback",
    "SourceOptions": "shardcache.config",
    "SourceShare": "shardcache.read.selection.mixture_table",
    "TokenizeOptions": "shardcache.config",
    "Transform": "shardcache.read.samples.chain",
    "VerifyReport": "shardcache.store.verify",
    "build_cache": "shardcache.builder.run",
    "export_cache": "shardcache.store.export",
    "load_mixture_recipe": "shardcache.read.selection.mixture_recipe",
    "loader": "shardcache.read.loader",
    "read_run_record": "shardcache.read.run_record",
    "rewind": "shardcache.read.rewind",
    "write_run_record": "shardcache.read.rewind",
    "model_inputs": "shardcache.read.losses",
    "open_cache": "shardcache.store.cache",
    "pair_logps": "shardcache.read.losses",
    "weighted_loss": "shardcache.read.losses",
    "plan_epoch": "shardcache.read.plan.epoch_plan",
    "verify_cache": "shardcache.store.verify",
}

__all__ = [  # noqa: RUF022 - plain sorted order, checked by a test
    "BadRecordError",
    "BuildLockedError",
    "BuildOptions",
    "BuildReport",
    "Cache",
    "CacheError",
    "CacheKeyMismatch",
    "CacheNotFoundError",
    "ConfigError",
    "CorruptShardError",
    "DevicePrefetcher",
    "EncoderError",
    "EpochPlan",
    "ExportOptions",
    "ExportReport",
    "FIM",
    "FORMAT_VERSION",
    "IncompleteBuildError",
    "LayoutOptions",
    "MissingDependencyError",
    "MixtureRecipe",
    "MixtureTable",
    "PlanOptions",
    "PrefetchOptions",
    "PrefetchStats",
    "Provenance",
    "ReadAheadOptions",
    "Rewinder",
    "RunRecord",
    "Schedule",
    "SchedulePoint",
    "ScheduleTable",
    "ShardDataset",
    "ShardLoader",
    "ShardcacheError",
    "Source",
    "SourceError",
    "SourceOptions",
    "SourceShare",
    "SpanMask",
    "Split",
    "StallMonitor",
    "StallMonitorCallback",
    "StateError",
    "TokenizeOptions",
    "TokenizerError",
    "Transform",
    "VerifyReport",
    "__version__",
    "build_cache",
    "export_cache",
    "load_mixture_recipe",
    "loader",
    "model_inputs",
    "open_cache",
    "pair_logps",
    "plan_epoch",
    "read_run_record",
    "rewind",
    "verify_cache",
    "weighted_loss",
    "write_run_record",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardcache' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def _key_of_options(options: Mapping[str, Any]) -> _key.CacheKey:
    """Key that ``ShardDataset(expect={...})`` options build; imports the builder on demand."""
    from shardcache.builder.key_computation import DataHashing, current_key

    return current_key(options, DataHashing())


_key.register_options_resolver(_key_of_options)

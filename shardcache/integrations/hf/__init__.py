"""transformers and TRL fed by shardcache: ``ShardTrainer``, the DPO adapter, chunked losses.

Every name is imported on first access (PEP 562): ``ShardTrainer`` loads transformers'
``Trainer`` (and needs accelerate), ``CachedPairsDPOTrainer`` and ``trl_pairs`` load TRL and
``datasets``, and the ``causal_lm_*`` functions load neither. A missing framework is a
``MissingDependencyError`` naming the ``train`` extra.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from typing import Any

    from shardcache.integrations.hf.lm import (
        causal_lm_loss,
        causal_lm_pair_logps,
        causal_lm_target_logps,
    )
    from shardcache.integrations.hf.trainer import ShardTrainer
    from shardcache.integrations.hf.trl_dpo import CachedPairsDPOTrainer, trl_pairs

_LAZY: dict[str, str] = {
    "CachedPairsDPOTrainer": "shardcache.integrations.hf.trl_dpo",
    "ShardTrainer": "shardcache.integrations.hf.trainer",
    "causal_lm_loss": "shardcache.integrations.hf.lm",
    "causal_lm_pair_logps": "shardcache.integrations.hf.lm",
    "causal_lm_target_logps": "shardcache.integrations.hf.lm",
    "trl_pairs": "shardcache.integrations.hf.trl_dpo",
}

__all__ = [
    "CachedPairsDPOTrainer",
    "ShardTrainer",
    "causal_lm_loss",
    "causal_lm_pair_logps",
    "causal_lm_target_logps",
    "trl_pairs",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardcache.integrations.hf' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
